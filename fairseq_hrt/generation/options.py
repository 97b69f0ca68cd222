"""Decoding options as data: built once, passed down, never written back.

fairseq hands a task two configurations: the task's own (``--decoding``,
``--decoder-engine``, ``--decode-chunk-size``, ...: :class:`HRTTranslationConfig`) and the
generation options (``--beam``, ``--max-len-a``, ...: fairseq's ``GenerationConfig``). A
:class:`DecodingOptions` is made from both once (:meth:`DecodingOptions.from_fairseq`), by the
task's ``build_generator``, the Python API (``hub.translate``'s keywords) or a benchmark row
(:meth:`DecodingOptions.replace`), and every strategy and engine reads it. The task options a
call changes travel in the generation options under the task option's own name (fairseq's
hub copies its keywords there), so nothing sets and restores a shared configuration.

Each option has one name: the task option's (``decoder_engine`` for ``--decoder-engine``).
"""

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from fairseq_hrt.cli_logging import RefusedOptions
from hrt_runtime.search import SearchConfig

QUANTIZE_CHOICES = ("none", "int8")

# --decoder-engine's default, named once: the engines' registry lists it first, a benchmark
# row without an engine suffix decodes with it
DEFAULT_DECODER_ENGINE = "lean"

# the options of HRT's stage II beyond the papers (only two-stage HRT decoding has them)
STAGE2_OPTIONS = ("hrt_refine_fraction", "hrt_fallback_threshold", "hrt_rescore")

# fairseq generation options only fairseq's SequenceGenerator implements, with the value
# that means "off"
SEQUENCE_GENERATOR_ONLY = {
    "sampling": False,
    "diverse_beam_groups": -1,
    "diversity_rate": -1,
    "match_source_len": False,
    "no_repeat_ngram_size": 0,
    "constraints": None,
    "prefix_size": 0,
    "print_alignment": None,
    "score_reference": False,
    "prefix_allowed_tokens_fn": None,
}

# options of fairseq's iterative refinement generator that Mask-Predict does not implement
ITERATIVE_REFINEMENT_ONLY = {
    "iter_decode_eos_penalty": 0.0,
    "iter_decode_with_external_reranker": False,
    "retain_iter_history": False,
}


def flags_in_use(args, table) -> Tuple[str, ...]:
    """The command-line flags of ``table`` that ``args`` sets to something but "off"."""
    used = []
    for name, off in table.items():
        value = getattr(args, name, off)
        if value is not None and value != off:
            used.append("--" + name.replace("_", "-"))
    return tuple(used)


# fairseq's generation option of each search setting (``--unnormalized`` is the negation
# of ``normalize_scores``): the one table search_config and fairseq_values read
FAIRSEQ_NAMES = {
    "beam": "beam",
    "max_len_a": "max_len_a",
    "max_len_b": "max_len_b",
    "min_len": "min_len",
    "normalize_scores": "unnormalized",
    "len_penalty": "lenpen",
    "unk_penalty": "unkpen",
}
NEGATED = ("normalize_scores",)


def search_config(args) -> SearchConfig:
    """The search settings (:class:`hrt_runtime.search.SearchConfig`, the one search's, with
    fairseq's defaults: ``tests/test_model_families.py`` compares them) of fairseq's generation
    options ``args``."""
    values = {}
    for name, flag in FAIRSEQ_NAMES.items():
        default = SearchConfig.__dataclass_fields__[name].default
        values[name] = (not getattr(args, flag, not default)) if name in NEGATED else getattr(args, flag, default)
    return SearchConfig(**values)


def fairseq_values(config: SearchConfig, temperature: float) -> dict:
    """The search settings and ``--temperature`` under fairseq's generation option names."""
    values = {
        flag: (not getattr(config, name)) if name in NEGATED else getattr(config, name)
        for name, flag in FAIRSEQ_NAMES.items()
    }
    return dict(values, temperature=temperature)


def task_option(help: str, default=None):
    """A field of :class:`DecodingOptions` that is also a task option (``--decoding``, ...):
    its default and help are the task's (:func:`task_field`), written here once."""
    return field(default=default, metadata={"help": help, "task": True})


@dataclass(frozen=True)
class DecodingOptions:
    """Everything a decoding strategy may read. ``fairseq_args``: the generation options as
    fairseq gave them, for fairseq's own ``SequenceGenerator`` (``--decoder-engine fairseq``);
    ``sequence_generator_only`` / ``iterative_only``: the flags of those options in use that
    only fairseq's generators implement (strategies that cannot honour them refuse them)."""

    decoding: str = task_option(
        "decoding strategy: 'auto' = the model's default; a registered strategy by name", "auto"
    )
    decoder_engine: str = task_option(
        "engine of left-to-right search (AT beam/greedy, HRT stage I and AT mode), of HRT's two stages and "
        "Mask-Predict where it runs them",
        DEFAULT_DECODER_ENGINE,
    )
    quantize: str = task_option(
        "'int8' = dynamic int8 quantization of the linear layers for CPU decoding, applied when the model is loaded",
        "none",
    )
    compile: bool = task_option(
        "compile the lean engine's decoder step with torch.compile (one graph for every step and "
        "batch: self-attention over the whole preallocated cache, future masked; a CUDA graph on a GPU); "
        "for --decoding beam/hrt with --decoder-engine lean, not with --quantize. The first batch pays "
        "the compilation (tens of seconds; a C++ compiler is needed on CPU)",
        False,
    )
    shortlist: Optional[str] = task_option(
        "lexical shortlist file (built by fairseq-hrt-shortlist from this data directory): the "
        "output layer of every batch is computed only for the shortlists of its source tokens plus "
        "the frequent target tokens, and scores are log-probabilities over those candidates; for "
        "--decoding beam/hrt (AT search, HRT stage I and II) and --decoding mask-predict, with "
        "--decoder-engine lean or onnxruntime"
    )
    decode_chunk_size: str = task_option(
        "HRT decoding chunk size: an integer k the model was trained for, 1 = AT "
        "mode (the HRT model decodes causally from </s>, like an AT model), "
        "'auto-trained' = the smallest k the model was trained for, "
        "'by-length' = chosen per sentence from the source length (docs/how-it-works.md)",
        "auto-trained",
    )
    b_nat: int = task_option("HRT: number of Skip-AT hypotheses (of --beam = b_at) filled by stage II", 1)
    jacobi_block_size: Optional[int] = task_option(
        "block size b of --decoding pgj / hgj (default 3, the paper's best) and the "
        "number of drafted tokens per verifying pass of --decoding hrt-spec (default 4); "
        "pj decodes the whole sentence as one block"
    )
    jacobi_parallel_length: int = task_option(
        "--decoding hgj: target positions decoded by GS-Jacobi blocks before it "
        "continues one token per pass; 0 = 1.1 x the source length",
        0,
    )
    # HRT decoding beyond the papers (each off by default)
    hrt_refine_fraction: float = task_option(
        "HRT: after stage II, mask again this fraction of each sentence's filled tokens (those "
        "of lowest probability, rounded up) and predict them by one more non-causal pass; 0 = off",
        0.0,
    )
    hrt_fallback_threshold: Optional[float] = task_option(
        "HRT: decode a sentence again in AT mode when the mean log-probability of the tokens "
        "stage II filled is below this (e.g. -1.5); default: never"
    )
    hrt_rescore: bool = task_option(
        "HRT: score every stage-II candidate (b_nat per sentence) by the model in AT mode in one "
        "teacher-forced pass and rank them by that exact score (useful with --b-nat > 1)",
        False,
    )
    onnx_model: Optional[str] = task_option(
        "--decoder-engine onnxruntime: decode this folder written by fairseq-hrt-export instead of "
        "exporting the loaded model into the cache ($FAIRSEQ_HRT_ONNX_CACHE, default ~/.cache/fairseq-hrt/onnx); "
        "it must be the export of the same checkpoint (its parameters' SHA-256 is checked)"
    )
    search_config: SearchConfig = field(default_factory=SearchConfig)
    temperature: float = 1.0  # --temperature: only the PyTorch engines apply it
    print_step: bool = False
    iter_decode_max_iter: int = 10
    iter_decode_with_beam: int = 1
    sequence_generator_only: Tuple[str, ...] = ()
    iterative_only: Tuple[str, ...] = ()
    fairseq_args: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_fairseq(cls, task_cfg=None, gen_args=None) -> "DecodingOptions":
        """From the task's configuration and fairseq's generation options; a task option
        present in ``gen_args`` (a per-call value, e.g. from ``hub.translate``) wins."""
        values = {}
        for name, default in task_defaults().items():
            value = getattr(task_cfg, name, default) if task_cfg is not None else default
            if gen_args is not None and _has(gen_args, name):
                value = getattr(gen_args, name)
            values[name] = _plain(value)
        values["decode_chunk_size"] = str(values["decode_chunk_size"])
        values["compile"] = bool(values["compile"])
        values["hrt_rescore"] = bool(values["hrt_rescore"])
        args = gen_args if gen_args is not None else object()
        return cls(
            **values,
            search_config=search_config(args),
            temperature=getattr(args, "temperature", cls.temperature),
            print_step=bool(getattr(args, "print_step", False)),
            iter_decode_max_iter=getattr(args, "iter_decode_max_iter", cls.iter_decode_max_iter),
            iter_decode_with_beam=getattr(args, "iter_decode_with_beam", cls.iter_decode_with_beam),
            sequence_generator_only=flags_in_use(args, SEQUENCE_GENERATOR_ONLY),
            iterative_only=flags_in_use(args, ITERATIVE_REFINEMENT_ONLY),
            fairseq_args=gen_args,
        )

    def replace(self, **changes) -> "DecodingOptions":
        """A copy with some options changed; search settings by their own names
        (``beam=1``, ``max_len_b=50``)."""
        search = {k: changes.pop(k) for k in list(changes) if k in SearchConfig.__dataclass_fields__}
        unknown = [k for k in changes if k not in DecodingOptions.__dataclass_fields__]
        if unknown:
            raise RefusedOptions(f"unknown decoding option(s): {', '.join(unknown)}")
        if search:
            changes["search_config"] = dataclasses.replace(changes.get("search_config", self.search_config), **search)
        return dataclasses.replace(self, **changes)

    def stage2_options_used(self) -> Tuple[str, ...]:
        """The flags of HRT's stage-II options in use (only two-stage HRT decoding has them)."""
        return tuple(
            "--" + name.replace("_", "-") for name in STAGE2_OPTIONS if getattr(self, name) != task_defaults()[name]
        )

    @property
    def is_default_hrt_decoding(self) -> bool:
        """Whether the HRT-only options keep their defaults (other models must not set them)."""
        return not self.stage2_options_used() and all(
            getattr(self, name) == task_defaults()[name] for name in ("decode_chunk_size", "b_nat")
        )


def task_defaults() -> dict:
    """The task options of decoding (the fields of :class:`DecodingOptions` made with
    :func:`task_option`), with their defaults."""
    return {f.name: f.default for f in dataclasses.fields(DecodingOptions) if f.metadata.get("task")}


def task_field(name: str, help: Optional[str] = None):
    """``HRTTranslationConfig``'s field of the task option ``name``: the default and help of
    :class:`DecodingOptions`' field (``help``: a help made from a registry instead)."""
    own = DecodingOptions.__dataclass_fields__[name]
    return field(default=own.default, metadata={"help": help or own.metadata["help"]})


def _has(args, name: str) -> bool:
    """Whether ``args`` (Namespace, dataclass or DictConfig) holds ``name`` (not as a default
    of another class)."""
    try:
        return name in args  # DictConfig, dict
    except TypeError:
        return hasattr(args, name)


def _plain(value):
    """A config value as a plain Python value (fairseq's ChoiceEnum members are str
    subclasses that compare by value; keep the str)."""
    if isinstance(value, str):
        return str(value)
    return value


def with_options(args, **overrides):
    """A copy of fairseq's generation options (Namespace, dataclass or DictConfig) with some
    values replaced; the caller's options stay as they are."""
    args = copy.deepcopy(args)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args
