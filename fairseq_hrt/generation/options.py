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
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from hrt_runtime.search import SearchConfig

# the task options of decoding, with their defaults: the names of HRTTranslationConfig's
# fields and of DecodingOptions' (one name each)
TASK_DECODING_DEFAULTS = {
    "decoding": "auto",
    "decoder_engine": "lean",
    "quantize": "none",
    "compile": False,
    "shortlist": None,
    "decode_chunk_size": "auto-trained",
    "b_nat": 1,
    "jacobi_block_size": None,
    "jacobi_parallel_length": 0,
    "hrt_refine_fraction": 0.0,
    "hrt_fallback_threshold": None,
    "hrt_rescore": False,
    "onnx_model": None,
}

QUANTIZE_CHOICES = ("none", "int8")

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


@dataclass(frozen=True)
class SearchOptions(SearchConfig):
    """Left-to-right search options, with fairseq's own defaults
    (``FairseqTask.build_generator``), so every engine obeys the same values: the exported
    runtime's :class:`hrt_runtime.search.SearchConfig` (``for_chunk_size``, ``max_len``) and
    ``--temperature``, which only the PyTorch engines apply."""

    temperature: float = 1.0

    @classmethod
    def from_args(cls, args) -> "SearchOptions":
        return cls(
            beam=getattr(args, "beam", 5),
            max_len_a=getattr(args, "max_len_a", 0),
            max_len_b=getattr(args, "max_len_b", 200),
            min_len=getattr(args, "min_len", 1),
            normalize_scores=not getattr(args, "unnormalized", False),
            len_penalty=getattr(args, "lenpen", 1),
            unk_penalty=getattr(args, "unkpen", 0),
            temperature=getattr(args, "temperature", 1.0),
        )

    def fairseq_values(self) -> dict:
        """These options under fairseq's generation option names."""
        return {"beam": self.beam, "max_len_a": self.max_len_a, "max_len_b": self.max_len_b, "min_len": self.min_len,
                "unnormalized": not self.normalize_scores, "lenpen": self.len_penalty, "unkpen": self.unk_penalty,
                "temperature": self.temperature}


@dataclass(frozen=True)
class DecodingOptions:
    """Everything a decoding strategy may read. ``fairseq_args``: the generation options as
    fairseq gave them, for fairseq's own ``SequenceGenerator`` (``--decoder-engine fairseq``);
    ``sequence_generator_only`` / ``iterative_only``: the flags of those options in use that
    only fairseq's generators implement (strategies that cannot honour them refuse them)."""

    decoding: str = "auto"
    decoder_engine: str = "lean"
    quantize: str = "none"
    compile: bool = False
    shortlist: Optional[str] = None
    decode_chunk_size: str = "auto-trained"
    b_nat: int = 1
    jacobi_block_size: Optional[int] = None
    jacobi_parallel_length: int = 0
    hrt_refine_fraction: float = 0.0
    hrt_fallback_threshold: Optional[float] = None
    hrt_rescore: bool = False
    onnx_model: Optional[str] = None
    search: SearchOptions = field(default_factory=SearchOptions)
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
        for name, default in TASK_DECODING_DEFAULTS.items():
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
            search=SearchOptions.from_args(args),
            print_step=bool(getattr(args, "print_step", False)),
            iter_decode_max_iter=getattr(args, "iter_decode_max_iter", 10),
            iter_decode_with_beam=getattr(args, "iter_decode_with_beam", 1),
            sequence_generator_only=flags_in_use(args, SEQUENCE_GENERATOR_ONLY),
            iterative_only=flags_in_use(args, ITERATIVE_REFINEMENT_ONLY),
            fairseq_args=gen_args,
        )

    def replace(self, **changes) -> "DecodingOptions":
        """A copy with some options changed; search options by their own names
        (``beam=1``, ``max_len_b=50``)."""
        search = {k: changes.pop(k) for k in list(changes) if k in SearchOptions.__dataclass_fields__}
        unknown = [k for k in changes if k not in DecodingOptions.__dataclass_fields__]
        if unknown:
            raise ValueError(f"unknown decoding option(s): {', '.join(unknown)}")
        if search:
            changes["search"] = dataclasses.replace(changes.get("search", self.search), **search)
        return dataclasses.replace(self, **changes)

    def stage2_options_used(self) -> Tuple[str, ...]:
        """The flags of HRT's stage-II options in use (only two-stage HRT decoding has them)."""
        return tuple("--" + name.replace("_", "-") for name in STAGE2_OPTIONS
                     if getattr(self, name) != TASK_DECODING_DEFAULTS[name])

    @property
    def is_default_hrt_decoding(self) -> bool:
        """Whether the HRT-only options keep their defaults (other models must not set them)."""
        return not self.stage2_options_used() and all(
            getattr(self, name) == TASK_DECODING_DEFAULTS[name] for name in ("decode_chunk_size", "b_nat"))


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
