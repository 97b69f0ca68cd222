"""The one way this project measures decoding: load a checkpoint, batch the test set the way
fairseq does, decode it (timing the model only), detokenise, and count decoder passes.

``benchmark.py`` (the table, JSON and Pareto plot) and ``hrt_quality.py`` (where HRT loses
quality) both decode through this module. Each *system family* -- AT, the CTranslate2
reference, HRT, Mask-Predict and the exact parallel strategies (Jacobi, hrt-spec) -- is one
:class:`RowAdapter`: it says which rows the command line asks for and builds a
:class:`Runner` per row. The measuring loop only talks to runners, so a new family or
strategy is a new adapter, never a new branch in the loop.
"""

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import sentencepiece as spm
import torch
from fairseq import checkpoint_utils, utils
from fairseq.dataclass.configs import GenerationConfig

import fairseq_hrt  # noqa: F401  (registers the plugin and the checkpoint types it loads safely)
from benchmarks import ct2_reference
from benchmarks.timing import time_runs
from fairseq_hrt.generation.engines import ENGINES, engine_choices, get_engine
from fairseq_hrt.generation.jacobi import JACOBI_METHODS, SPEC_METHOD
from fairseq_hrt.generation.options import DEFAULT_DECODER_ENGINE, DecodingOptions, task_defaults
from fairseq_hrt.generation.quantize import engine_quantizes_itself, prepare_for_decoding
from fairseq_hrt.generation.strategies import DECODING_STRATEGIES
from fairseq_hrt.models.kinds import AT, HRT
from fairseq_hrt.models.kinds import FAMILIES as MODEL_FAMILIES
from hrt_runtime import text_input
from hrt_runtime.search import SearchConfig

logger = logging.getLogger("measure")

BASELINE = "AT greedy"
CT2_FAMILY = "CT2"


@dataclass
class System:
    """One row of the benchmark: a checkpoint and how it is decoded."""

    name: str
    family: str  # "AT", "CT2" (the AT checkpoint in CTranslate2), "HRT" or "MP"
    checkpoint: str
    decoding: Dict[str, object]  # what the runner needs, also written to the report
    baseline_candidate: bool = False  # a float AT greedy row: may be the baseline of the ratios
    passes_per_sentence: Optional[float] = None  # decoder passes (greedy and parallel rows)
    accepted_per_verify_pass: Optional[float] = None  # hrt-spec: tokens made final per AT pass
    bleu: Optional[float] = None
    chrf: Optional[float] = None
    length_ratio: Optional[float] = None  # hypothesis / reference length (sacreBLEU's tokens)
    brevity_penalty: Optional[float] = None
    comet: Optional[float] = None
    speed: Dict[str, dict] = field(default_factory=dict)  # batch size -> measurements


# --------------------------------------------------------------------------- text and models


_SHAPES: Dict[str, dict] = {}


def model_shape(checkpoint: str) -> dict:
    """What a checkpoint is: its arch, embedding dimension, encoder and decoder layers and
    parameters (each tensor once: shared embeddings count once); read once per checkpoint."""
    if checkpoint not in _SHAPES:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)  # the plugin allows what fairseq pickles
        cfg = state.get("cfg") or {}
        model_cfg = (cfg.get("model") if hasattr(cfg, "get") else None) or state.get("args")
        tensors = {t.data_ptr(): t.numel() for t in state["model"].values() if torch.is_tensor(t)}
        _SHAPES[checkpoint] = {
            "arch": getattr(model_cfg, "arch", None),
            "embed_dim": getattr(model_cfg, "encoder_embed_dim", None),
            "encoder_layers": getattr(model_cfg, "encoder_layers", None),
            "decoder_layers": getattr(model_cfg, "decoder_layers", None),
            "parameters": sum(tensors.values()),
        }
    return _SHAPES[checkpoint]


def add_data_arguments(parser, data_help: str = "binarized data dir (the models' dictionaries)", max_sentences=True):
    """The test-data flags of the measuring scripts (``benchmark.py``, ``hrt_quality.py``,
    ``shortlist_sweep.py``): ``--data``, ``--src``, ``--raw-src``, ``--raw-ref``, ``--spm`` and
    (``max_sentences``) ``--max-sentences``."""
    parser.add_argument("--data", required=True, help=data_help)
    parser.add_argument("--src", required=True, help="test source as the models read it (SentencePiece pieces)")
    parser.add_argument(
        "--raw-src", required=True, help="raw test source (words counted here; length buckets; COMET input)"
    )
    parser.add_argument("--raw-ref", required=True, help="raw test reference (sacreBLEU, COMET)")
    parser.add_argument("--spm", required=True, help="SentencePiece model, to detokenise hypotheses")
    if max_sentences:
        parser.add_argument("--max-sentences", type=int, default=0, help="use the first N test sentences (0 = all)")


def read_lines(path, limit=0) -> List[str]:
    """Input text as every entry point reads it (hrt_runtime.text_input: bad bytes replaced
    with a warning naming file and line, lines split at \\n only)."""
    lines = text_input.read_lines(path)
    return lines[:limit] if limit else lines


def load(path, data, use_cuda=False, fp16=False):
    """``(model, task)`` of one checkpoint, in eval mode, with ``data``'s dictionaries."""
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})
    model = models[0]
    model.eval()
    if fp16:
        model.half()
    if use_cuda:
        model.cuda()
    return model, task


def make_batches(task, model, lines: List[str], batch_size: int, use_cuda: bool):
    """fairseq's inference batches (length-sorted, as fairseq-generate makes them) of
    SentencePiece-piece lines."""
    d = task.source_dictionary
    tokens = [d.encode_line(line, add_if_not_exist=False).long() for line in lines]
    dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False,
    ).next_epoch_itr(shuffle=False)
    return [utils.move_to_cuda(sample) if use_cuda else sample for sample in itr]


def build_generator(task, model, gen_args: dict, options: dict):
    """The task's generator for one configuration: fairseq's generation options ``gen_args``
    and the row's decoding ``options`` (:class:`DecodingOptions` names: ``decoder_engine``,
    ``decode_chunk_size``, ``shortlist``, ...), passed down as data; the task and the model are
    not changed, so one loaded model serves many rows (``quantize="int8"`` rows load their own
    quantized copy, :meth:`Context.model`)."""
    decoding = DecodingOptions.from_fairseq(task.cfg, GenerationConfig(**gen_args)).replace(**options)
    return task.build_decoding([model], decoding)


def generate(task, model, generator, batches) -> Dict[int, torch.Tensor]:
    """``{sentence id: output tokens}`` of decoding ``batches`` (untimed)."""
    hyps = {}
    with torch.no_grad():
        for sample in batches:
            out = task.inference_step(generator, [model], sample)
            for i, sid in enumerate(sample["id"].tolist()):
                hyps[sid] = out[i][0]["tokens"]
    return hyps


def cuda_sync(use_cuda: bool):
    """The ``sync`` of :func:`benchmarks.timing.time_runs` for a device (None on CPU)."""
    return torch.cuda.synchronize if use_cuda else None


def decode(task, model, generator, batches, use_cuda=False) -> Tuple[Dict[int, torch.Tensor], float]:
    """``({sentence id: output tokens}, seconds)`` of decoding ``batches`` once; the time covers
    the model (encoder, every search step), not text reading or detokenisation."""
    timing = time_runs(lambda: generate(task, model, generator, batches), sync=cuda_sync(use_cuda))
    return timing.value, timing.seconds[0]


def sentencepiece(spm_model: str):
    return spm.SentencePieceProcessor(model_file=spm_model)


def detok(task, hyps, spm_model, n) -> List[str]:
    """Raw text of the first ``n`` hypotheses (output tokens -> pieces -> SentencePiece decode)."""
    sp = sentencepiece(spm_model)
    d = task.target_dictionary
    return [sp.decode(d.string(hyps[i].cpu(), extra_symbols_to_ignore={d.eos()}).split()) for i in range(n)]


# --------------------------------------------------------------------------- runners


class Context:
    """What the runners of one measuring run share: loaded models (one copy per checkpoint
    and precision) and prepared batches (one set per checkpoint, test subset and size)."""

    def __init__(
        self,
        data: str,
        spm: str,
        out_dir: str,
        use_cuda=False,
        fp16=False,
        threads=1,
        max_len_b=200,
        lenpen=1.0,
        max_len_a=0.0,
    ):
        self.data, self.spm, self.out_dir = data, spm, out_dir
        self.use_cuda, self.fp16, self.threads = use_cuda, fp16, threads
        # the maximum output length of every system: max_len_a x source length + max_len_b
        self.max_len_a, self.max_len_b, self.lenpen = max_len_a, max_len_b, lenpen
        self._models, self._batches = {}, {}

    def model(self, checkpoint: str, quantize: str = "none", engine: str = DEFAULT_DECODER_ENGINE):
        """The checkpoint loaded as ``--decoder-engine engine --quantize quantize`` loads it: an
        int8 copy for the PyTorch engines, the float model for an engine that quantizes its own
        graphs (ONNX Runtime)."""
        if engine_quantizes_itself(engine):
            quantize = "none"
        key = (checkpoint, quantize)
        if key not in self._models:
            logger.info("loading %s%s", checkpoint, " (int8 copy)" if quantize != "none" else "")
            model, task = load(checkpoint, self.data, self.use_cuda, self.fp16)
            self._models[key] = (prepare_for_decoding(model, quantize), task)
        return self._models[key]

    def batches(
        self, checkpoint: str, quantize: str, lines: List[str], batch_size: int, engine: str = DEFAULT_DECODER_ENGINE
    ):
        key = (checkpoint, quantize, engine, len(lines), batch_size, hash(tuple(lines)))
        if key not in self._batches:
            model, task = self.model(checkpoint, quantize, engine)
            self._batches[key] = make_batches(task, model, lines, batch_size, self.use_cuda)
        return self._batches[key]


class Runner:
    """Decodes one system: ``prepare`` (untimed) then ``decode`` (timed)."""

    def prepare(self, lines: List[str], batch_size: int):
        raise NotImplementedError

    sync = None  # called before and after a timed pass (torch.cuda.synchronize on GPU)

    def run(self, prepared, warm_up: bool = False) -> Dict[int, object]:
        """``{sentence index: output}`` (untimed: :func:`benchmarks.timing.time_runs` times
        it); ``warm_up`` decodes only a first batch."""
        raise NotImplementedError

    def decode(self, prepared, warm_up: bool = False) -> Tuple[Dict[int, object], float]:
        """``({sentence index: output}, seconds)`` of one timed :meth:`run`."""
        timing = time_runs(lambda: self.run(prepared, warm_up), sync=self.sync)
        return timing.value, timing.seconds[0]

    def texts(self, hyps: Dict[int, object], n: int) -> List[str]:
        raise NotImplementedError

    def counters(self) -> dict:
        """The decoder's pass counters now (parallel strategies count theirs), to diff."""
        return {}

    def passes(self, hyps: Dict[int, object], before: dict) -> Tuple[Optional[float], Optional[float]]:
        """(decoder passes per sentence, accepted tokens per verifying pass) of the one
        decoding of ``hyps`` since ``before`` (None where the row has no such count)."""
        return None, None


class FairseqRunner(Runner):
    """A system decoded by a generator that this plugin's task builds (every family but CT2)."""

    def __init__(self, system: System, ctx: Context, gen_args: dict, task_options: dict, greedy: bool):
        self.system, self.ctx, self.greedy = system, ctx, greedy
        self.quantize = task_options.get("quantize", "none")
        self.engine = task_options.get("decoder_engine", DEFAULT_DECODER_ENGINE)
        self.model, self.task = ctx.model(system.checkpoint, self.quantize, self.engine)
        gen_args = dict(gen_args, max_len_a=ctx.max_len_a, max_len_b=ctx.max_len_b)
        self.generator = build_generator(self.task, self.model, gen_args, task_options)
        self.sync = cuda_sync(ctx.use_cuda)
        self.whole_warm_up = get_engine(self.engine).warms_up_per_shape

    def prepare(self, lines, batch_size):
        return self.ctx.batches(self.system.checkpoint, self.quantize, lines, batch_size, self.engine)

    def run(self, prepared, warm_up=False):
        first_only = warm_up and not self.whole_warm_up
        return generate(self.task, self.model, self.generator, prepared[:1] if first_only else prepared)

    def texts(self, hyps, n):
        return detok(self.task, hyps, self.ctx.spm, n)

    def counters(self):
        return dict(getattr(self.generator, "stats", None) or {})

    def passes(self, hyps, before):
        stats = getattr(self.generator, "stats", None)
        if stats is not None and stats["sentences"] > before.get("sentences", 0):
            sentences = stats["sentences"] - before.get("sentences", 0)
            passes = stats["passes"] - before.get("passes", 0)
            accepted = None
            if stats.get("draft_passes", 0) > before.get("draft_passes", 0):
                verify = passes - (stats["draft_passes"] - before.get("draft_passes", 0))
                accepted = (stats["tokens"] - before.get("tokens", 0)) / verify
            return passes / sentences, accepted
        if self.greedy:  # left-to-right greedy search: one decoder pass per output token
            return sum(len(h) for h in hyps.values()) / max(1, len(hyps)), None
        return None, None


class CT2Runner(Runner):
    """The AT checkpoint converted to CTranslate2 and decoded by its C++ engine from pieces.
    A row with a ``shortlist`` decodes with CTranslate2's vocabulary map (``use_vmap``) made
    from that shortlist (:func:`benchmarks.ct2_reference.write_vmap`): the same candidates per
    source token and the same frequent tokens as the lean and ONNX Runtime "+shortlist" rows."""

    def __init__(self, system: System, ctx: Context, translators: dict):
        self.system, self.ctx, self.ct2 = system, ctx, ct2_reference
        _, task = ctx.model(system.checkpoint)
        shortlist = system.decoding.get("shortlist")
        compute_type = system.decoding.get("compute_type")
        key = (system.checkpoint, shortlist, compute_type)
        if key not in translators:
            model_dir = ct2_reference.convert(
                system.checkpoint, ctx.data, ctx.out_dir, task.cfg.source_lang, task.cfg.target_lang
            )
            logger.info("CTranslate2 model of %s: %s", system.checkpoint, model_dir)
            if shortlist:  # CTranslate2 reads the map when it loads the model: written first
                path = ct2_reference.write_vmap(
                    model_dir, task.load_shortlist(shortlist), task.source_dictionary, task.target_dictionary
                )
                logger.info("CTranslate2 vocabulary map of %s: %s", shortlist, path)
            translators[key] = ct2_reference.load(model_dir, ctx.use_cuda, ctx.fp16, ctx.threads, compute_type)
        self.translator = translators[key]
        self.use_vmap = bool(shortlist)
        # the map's keys are source symbols: a piece outside the dictionary is looked up as
        # <unk>, the token fairseq reads it as (the model reads <unk> for it either way)
        self.source_symbols = set(task.source_dictionary.symbols) if shortlist else None
        self.unk = task.source_dictionary.unk_word
        self.suppress = ct2_reference.suppressed(task.target_dictionary.symbols)

    def prepare(self, lines, batch_size):
        pieces = [line.split() for line in lines]
        if self.source_symbols is not None:
            pieces = [[p if p in self.source_symbols else self.unk for p in sentence] for sentence in pieces]
        return pieces, batch_size

    def run(self, prepared, warm_up=False):
        pieces, bs = prepared
        return self.ct2.translate(
            self.translator,
            pieces[:bs] if warm_up else pieces,
            bs,
            self.system.decoding["beam"],
            self.ctx.max_len_b,
            self.suppress,
            max_len_a=self.ctx.max_len_a,
            use_vmap=self.use_vmap,
        )

    def texts(self, hyps, n):
        sp = sentencepiece(self.ctx.spm)
        return [sp.decode(hyps[i]) for i in range(n)]

    def passes(self, hyps, before):
        if self.system.decoding["beam"] == 1:
            return sum(len(h) + 1 for h in hyps.values()) / max(1, len(hyps)), None  # + </s>
        return None, None


# --------------------------------------------------------------------------- families


def parse_ints(text: str) -> List[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


# --------------------------------------------------------------- rows from the registries
# Engines and strategies are the plugin's registries': a registered engine gets its rows by
# its name (--engines), an engine-free strategy by its name (--parallel).


ROW_NAMES = {"fairseq": "fairseq engine"}  # how a row names an engine: "(fairseq)" would read as fairseq itself


def default_engine() -> str:
    return DEFAULT_DECODER_ENGINE


def engine_suffix(engine: str) -> str:
    """A row's name suffix for ``--decoder-engine engine``: none for the default engine
    (lean), else the engine's name in parentheses (its :data:`ROW_NAMES` entry where it has one)."""
    return "" if engine == default_engine() else f" ({ROW_NAMES.get(engine, engine)})"


def engine_suffixes() -> List[str]:
    """The suffixes of every registered engine but the default."""
    return [engine_suffix(e) for e in engine_choices() if e != default_engine()]


def parse_engines(text: str) -> List[str]:
    engines = [e.strip() for e in str(text).split(",") if e.strip()]
    bad = [e for e in engines if e not in engine_choices()]
    if bad or not engines:
        raise ValueError(f"--engines {text!r}: a comma-separated list of {', '.join(engine_choices())}")
    return engines


def int8_engines(engines: Sequence[str]) -> List[str]:
    """The engines of ``engines`` with an int8 row each (``--int8``): every engine that quantizes
    its own graphs (``quantizes_itself``: onnxruntime), and the default engine for PyTorch's
    dynamic quantization, which the other engines decode alike (one row of it is enough)."""
    return [e for e in engines if get_engine(e).quantizes_itself or e == default_engine()] or [default_engine()]


def compiled_engines(engines: Sequence[str]) -> List[str]:
    """The engines of ``engines`` that compile their step (``supports_compile``), else the default."""
    return [e for e in engines if get_engine(e).supports_compile] or [default_engine()]


def parallel_methods() -> List[str]:
    """The strategies that decode with their own passes, on no engine (Jacobi decoding,
    hrt-spec): a row each, not one per engine."""
    return [n for n, s in DECODING_STRATEGIES.items() if not any(s.uses_engine(e) for e in ENGINES.values())]


def row_defaults() -> dict:
    """What a row decodes with where it says nothing: every task option of decoding at its
    default (a row states its whole decoding, whatever the checkpoint's saved task options
    are), AT mode for HRT checkpoints (chunk size 1) unless the row says otherwise."""
    return dict(task_defaults(), decode_chunk_size=1)


def engine_supports_shortlist(engine: str) -> bool:
    """Whether ``--decoder-engine engine`` restricts the output layer to a shortlist (the
    engine registry says: lean and onnxruntime)."""
    return get_engine(engine).supports_shortlist


def engine_refuses(engine: str, decoding: dict) -> List[str]:
    """The options of a row's ``decoding`` that ``--decoder-engine engine`` cannot honour
    (e.g. HRT's stage-II options in ONNX Runtime), as the engine names them; empty: none."""
    options = dict(row_defaults(), **dict(decoding, decoder_engine=engine))
    options["decode_chunk_size"] = str(options["decode_chunk_size"])
    return list(get_engine(engine).unsupported(DecodingOptions().replace(**options)))


def parse_beam_pairs(text: str) -> List[Tuple[int, int]]:
    """``"1/1,5/1"`` -> ``[(1, 1), (5, 1)]`` (b_at/b_nat)."""
    pairs = []
    for item in str(text).split(","):
        b_at, _, b_nat = item.strip().partition("/")
        pair = (int(b_at), int(b_nat or 1))
        if not 1 <= pair[1] <= pair[0]:
            raise ValueError(f"--hrt-beams {item!r}: need 1 <= b_nat <= b_at")
        pairs.append(pair)
    return pairs


def parse_named_checkpoints(
    items: Sequence[str], flag: str = "--at-extra", value: str = "CHECKPOINT"
) -> List[Tuple[str, str]]:
    """``["ssru=a.pt", "ssru-tied=b.pt"]`` -> ``[("ssru", "a.pt"), ...]`` (``--at-extra``,
    ``--hrt-extra``)."""
    out = []
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"{flag} {item!r}: expected NAME={value}")
        out.append((name.strip(), path.strip()))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} names must differ: {names}")
    return out


class RowAdapter:
    """The rows of one kind of system and how to decode them."""

    name = ""

    def systems(self, args) -> List[System]:
        raise NotImplementedError

    def skipped(self, args) -> Optional[str]:
        """Why the family has no row (no checkpoint given), or None."""
        return None

    def runner(self, system: System, ctx: Context, shared: dict) -> Runner:
        raise NotImplementedError

    def refused(self, system: System, ctx: Context) -> Optional[str]:
        """Why this row cannot be decoded after all (its engine refuses its options or its
        checkpoint), or None; the benchmark leaves such a row out and says why."""
        return None


class _FairseqAdapter(RowAdapter):
    """Families decoded by the plugin's generators, with one row per ``--engines`` value, an
    int8 row (``--int8``), a shortlist row (``--shortlist``) and a compiled row (``--compile``,
    left-to-right families only) per configuration."""

    engine_rows = True
    compile_rows = True

    def variants(self, args, name, checkpoint, decoding, baseline_candidate=False) -> List[System]:
        """The rows of one configuration: one per ``--engines`` value, ``int8`` rows
        (:func:`int8_engines`), one ``+shortlist`` row per engine of ``--engines`` that restricts
        the output layer (the engine's suffix before "+shortlist"; the default engine when none
        of them does), with ``--int8`` also ``int8 +shortlist`` rows, and ``compiled`` rows
        (:func:`compiled_engines`). A row whose engine cannot decode it is left out when
        measuring (:meth:`refused`)."""
        # a family without engine rows (Mask-Predict) decodes with its own generator: one row
        default = default_engine()
        engines = parse_engines(getattr(args, "engines", default)) if self.engine_rows else [default]

        def suffix(engine):
            return engine_suffix(engine) if self.engine_rows else ""

        out = []
        for engine in engines:
            out.append(
                System(
                    name + suffix(engine),
                    self.name,
                    checkpoint,
                    dict(decoding, decoder_engine=engine),
                    baseline_candidate=baseline_candidate,
                )
            )
        if getattr(args, "int8", "no") == "yes":
            for engine in int8_engines(engines):  # int8 compared with int8 on each engine
                out.append(
                    System(
                        name + suffix(engine) + " int8",
                        self.name,
                        checkpoint,
                        dict(decoding, decoder_engine=engine, quantize="int8"),
                    )
                )
        if getattr(args, "shortlist", None):
            shortlisted = [e for e in engines if engine_supports_shortlist(e)] if self.engine_rows else []
            for engine in shortlisted or [default]:
                out.append(
                    System(
                        name + suffix(engine) + " +shortlist",
                        self.name,
                        checkpoint,
                        dict(decoding, decoder_engine=engine, shortlist=args.shortlist),
                    )
                )
            if getattr(args, "int8", "no") == "yes":  # beside CTranslate2's int8 +vmap: int8 with the shortlist
                for engine in int8_engines(shortlisted or [default]):
                    out.append(
                        System(
                            name + suffix(engine) + " int8 +shortlist",
                            self.name,
                            checkpoint,
                            dict(decoding, decoder_engine=engine, quantize="int8", shortlist=args.shortlist),
                        )
                    )
        if getattr(args, "compile", "no") == "yes" and self.compile_rows:
            # a float row of the same search: an AT greedy one may be the run's baseline
            for engine in compiled_engines(engines):
                out.append(
                    System(
                        name + suffix(engine) + " compiled",
                        self.name,
                        checkpoint,
                        dict(decoding, decoder_engine=engine, compile=True),
                        baseline_candidate=baseline_candidate,
                    )
                )
        return out

    def refused(self, system: System, ctx: "Context") -> Optional[str]:
        """Why the row's engine cannot decode it: options the engine does not honour (ONNX
        Runtime: HRT's stage-II options of ``--hrt-options`` rows) or a checkpoint it cannot
        take (``DecoderEngine.unsupported_model``; ONNX Runtime: one the exporter refuses);
        None: it can."""
        engine = system.decoding.get("decoder_engine")
        if not self.engine_rows or engine is None:
            return None
        used = engine_refuses(engine, system.decoding)
        if used:
            return f"--decoder-engine {engine} does not support {', '.join(used)}"
        model, _ = ctx.model(system.checkpoint, system.decoding.get("quantize", "none"), engine)
        reasons = get_engine(engine).unsupported_model(model)
        if reasons:
            return f"--decoder-engine {engine} cannot decode this checkpoint: " + "; ".join(reasons)
        return None

    def generation(self, system: System) -> Tuple[dict, dict]:
        """(GenerationConfig arguments, the row's :class:`DecodingOptions` changes): a row's
        ``decoding`` holds decoding options by their one name (``decoder_engine``,
        ``decode_chunk_size``, ``jacobi_block_size``, ``beam``, ...)."""
        options = dict(row_defaults(), **system.decoding)
        options["decode_chunk_size"] = str(options["decode_chunk_size"])
        return {"beam": options.pop("beam")}, options

    def greedy(self, system: System) -> bool:
        return system.decoding.get("beam") == 1 and system.decoding.get("decode_chunk_size", 1) == 1

    def runner(self, system, ctx, shared):
        gen_args, options = self.generation(system)
        return FairseqRunner(system, ctx, dict(gen_args, lenpen=ctx.lenpen), options, self.greedy(system))


class ATAdapter(_FairseqAdapter):
    """``--at`` (greedy is the speed baseline) and ``--at-extra NAME=CKPT`` students (e.g. SSRU):
    greedy and each ``--at-beams`` beam."""

    name = "AT"

    def systems(self, args):
        out = []
        checkpoints = ([("", args.at)] if args.at else []) + parse_named_checkpoints(getattr(args, "at_extra", None))
        for label, checkpoint in checkpoints:
            prefix = f"AT[{label}]" if label else "AT"
            for beam in parse_ints(args.at_beams):
                name = f"{prefix} greedy" if beam == 1 else f"{prefix} beam {beam}"
                out += self.variants(args, name, checkpoint, {"beam": beam}, baseline_candidate=beam == 1)
        return out

    def skipped(self, args):
        return None if args.at else "no --at checkpoint given (speed ratios need AT greedy)"


class CT2Adapter(RowAdapter):
    """Every AT checkpoint (``--at``, ``--at-extra``) in CTranslate2: the outside reference for
    AT speed (rows ``CTranslate2 AT greedy``, ``CTranslate2 AT[NAME] greedy``, ...); with
    ``--int8`` also CTranslate2's own int8, with ``--shortlist`` also a "+vmap" row per beam
    (and precision), CTranslate2 with its vocabulary map of the same shortlist. A checkpoint its converter
    cannot take (an SSRU student, tied decoder layers) has no row, and the report says why."""

    name = CT2_FAMILY

    def checkpoints(self, args) -> List[Tuple[str, str]]:
        """``(row prefix, checkpoint)`` of every AT checkpoint of the run."""
        if not args.at or getattr(args, "ctranslate2", "auto") == "no":
            return []
        extra = parse_named_checkpoints(getattr(args, "at_extra", None))
        return [("CTranslate2 AT", args.at)] + [(f"CTranslate2 AT[{label}]", path) for label, path in extra]

    def systems(self, args):
        out = []
        for prefix, checkpoint in self.checkpoints(args):
            if self.unsupported(checkpoint):
                continue
            for beam in parse_ints(args.at_beams):
                name = f"{prefix} " + ("greedy" if beam == 1 else f"beam {beam}")
                out.append(System(name, CT2_FAMILY, checkpoint, {"beam": beam}))
                if getattr(args, "int8", "no") == "yes":  # beside the int8 rows: CTranslate2's own int8
                    out.append(System(name + " int8", CT2_FAMILY, checkpoint, {"beam": beam, "compute_type": "int8"}))
                if getattr(args, "shortlist", None):  # beside the "+shortlist" rows: its vocabulary map
                    decoding = {"beam": beam, "shortlist": args.shortlist}
                    out.append(System(name + " +vmap", CT2_FAMILY, checkpoint, decoding))
                    if getattr(args, "int8", "no") == "yes":
                        decoding = dict(decoding, compute_type="int8")
                        out.append(System(name + " int8 +vmap", CT2_FAMILY, checkpoint, decoding))
        return out

    @staticmethod
    def unsupported(checkpoint: str) -> Optional[str]:
        return ct2_reference.unsupported_checkpoint_reason(checkpoint)

    def skipped(self, args):
        """The AT checkpoints CTranslate2's converter cannot take, with the reason, so the
        report says why they have no CTranslate2 row."""
        reasons = [
            f"{prefix}: {reason}"
            for prefix, checkpoint in self.checkpoints(args)
            for reason in [self.unsupported(checkpoint)]
            if reason
        ]
        return "; ".join(reasons) or None

    def runner(self, system, ctx, shared):
        return CT2Runner(system, ctx, shared.setdefault("ct2_translators", {}))


class HRTAdapter(_FairseqAdapter):
    """``--hrt``: AT mode (C_d = 1) with each b_at, and every chunk size with each b_at/b_nat;
    the same for every ``--hrt-extra NAME=CKPT`` (e.g. another seed: rows ``HRT[NAME] ...``)."""

    name = "HRT"

    def systems(self, args):
        if not args.hrt:
            return []
        beams = parse_beam_pairs(args.hrt_beams)
        out = []
        checkpoints = [("", args.hrt)] + parse_named_checkpoints(getattr(args, "hrt_extra", None), "--hrt-extra")
        for label, checkpoint in checkpoints:
            prefix = f"HRT[{label}]" if label else "HRT"
            at_mode_beams = sorted({b for b, _ in beams}) if getattr(args, "hrt_at_mode", "yes") == "yes" else []
            for b_at in at_mode_beams:
                out += self.variants(
                    args, f"{prefix} AT-mode b={b_at}", checkpoint, {"decode_chunk_size": 1, "beam": b_at, "b_nat": 1}
                )
            for k in parse_ints(args.hrt_chunk_sizes):
                for b_at, b_nat in beams:
                    out += self.variants(
                        args,
                        f"{prefix} k={k} b_at={b_at} b_nat={b_nat}",
                        checkpoint,
                        {"decode_chunk_size": k, "beam": b_at, "b_nat": b_nat},
                    )
        k, (b_at, b_nat) = parse_ints(args.hrt_chunk_sizes)[0], beams[0]
        for name, options in parse_row_options(getattr(args, "hrt_options", None) or []).items():
            row = dict({"decode_chunk_size": k, "beam": b_at, "b_nat": b_nat}, **options)
            out += self.variants(
                args, f"HRT k={row['decode_chunk_size']} b_at={row['beam']} b_nat={row['b_nat']} {name}", args.hrt, row
            )
        return out

    def skipped(self, args):
        return None if args.hrt else "no --hrt checkpoint given"


def parse_row_options(items: List[str]) -> Dict[str, dict]:
    """``NAME:OPTION=VALUE,OPTION=VALUE`` rows (decoding options by their one name, e.g.
    ``refine20:hrt_refine_fraction=0.2`` or ``rescore:hrt_rescore=true,beam=5,b_nat=5``)."""
    known = set(DecodingOptions.__dataclass_fields__) | set(SearchConfig.__dataclass_fields__)
    rows = {}
    for item in items:
        name, sep, text = item.partition(":")
        if not sep or not name or not text:
            raise ValueError(f"{item!r}: expected NAME:OPTION=VALUE[,OPTION=VALUE...]")
        options = {}
        for pair in text.split(","):
            key, eq, value = pair.partition("=")
            if not eq or key not in known:
                raise ValueError(f"{item!r}: {key!r} is not a decoding option ({', '.join(sorted(known))})")
            options[key] = _option_value(value)
        rows[name] = options
    return rows


def _option_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class MPAdapter(_FairseqAdapter):
    """``--mp``: Mask-Predict with each iteration count I and length beam l (no left-to-right
    search, so no engine rows)."""

    name = "MP"
    engine_rows = False
    compile_rows = False

    def systems(self, args):
        if not args.mp:
            return []
        return sum(
            (
                self.variants(
                    args,
                    f"MP I={it} l={args.mp_length_beam}",
                    args.mp,
                    {"iter_decode_max_iter": it, "iter_decode_with_beam": args.mp_length_beam},
                )
                for it in parse_ints(args.mp_iterations)
            ),
            [],
        )

    def skipped(self, args):
        return None if args.mp else "no --mp checkpoint given"

    def generation(self, system):
        d = system.decoding
        options = {"quantize": d.get("quantize", "none"), "shortlist": d.get("shortlist")}
        return {
            "iter_decode_max_iter": d["iter_decode_max_iter"],
            "iter_decode_with_beam": d["iter_decode_with_beam"],
        }, options

    def runner(self, system, ctx, shared):
        gen_args, options = self.generation(system)
        return FairseqRunner(system, ctx, gen_args, options, greedy=False)


class ParallelAdapter(_FairseqAdapter):
    """``--parallel``: the strategies that decode with their own passes (:func:`parallel_methods`:
    Jacobi decoding PJ / PGJ / HGJ, hrt-spec), each on the first checkpoint kind it decodes:
    ``--at``, else ``--hrt`` (in AT mode)."""

    name = "parallel"

    def systems(self, args):
        methods = [m.strip() for m in str(getattr(args, "parallel", "")).split(",") if m.strip()]
        known = parallel_methods()
        bad = [m for m in methods if m not in known]
        if bad:
            raise ValueError(f"--parallel {bad}: choose among {', '.join(known)}")
        # a checkpoint kind stands for the model classes that declare it (models/kinds.py)
        declared = {family.kind: cls for cls, family in reversed(list(MODEL_FAMILIES.items()))}
        kinds = (("AT", args.at, declared[AT]), ("HRT", args.hrt, declared[HRT]))
        out = []
        for m in methods:
            family, checkpoint = next(
                ((k, path) for k, path, cls in kinds if DECODING_STRATEGIES[m].supports(cls) is None), (None, None)
            )
            if not checkpoint:
                continue
            if m == "pj":  # one block of the whole sentence
                block = None
            else:
                block = (
                    getattr(args, "spec_block_size", 4) if m == SPEC_METHOD else getattr(args, "jacobi_block_size", 3)
                )
            name = f"{family} {m.upper() if m in JACOBI_METHODS else m}" + (f" b={block}" if block else "")
            decoding = {"beam": 1, "decoding": m, "jacobi_block_size": block}
            if family == "HRT":
                decoding.update(decode_chunk_size=1, b_nat=1)
            out.append(System(name, family, checkpoint, decoding))
        return out


# in row order: AT first (the baseline), the outside reference next to it
ROW_ADAPTERS: Tuple[RowAdapter, ...] = (ATAdapter(), CT2Adapter(), HRTAdapter(), MPAdapter(), ParallelAdapter())
ADAPTERS: Dict[str, RowAdapter] = {family.name: family for family in ROW_ADAPTERS}


def systems_from_args(args) -> Tuple[List[System], List[dict]]:
    """The systems to measure and the families skipped (no checkpoint given)."""
    systems, skipped = [], []
    for family in ROW_ADAPTERS:
        systems += family.systems(args)
        reason = family.skipped(args)
        if reason:
            skipped.append({"family": family.name, "reason": reason})
    return systems, skipped


def adapter_of(system: System) -> RowAdapter:
    """The adapter that decodes ``system`` (parallel rows carry their strategy in ``decoding``)."""
    if system.decoding.get("decoding") in parallel_methods():
        return ADAPTERS[ParallelAdapter.name]
    return ADAPTERS[system.family]


def fastest_baseline(systems: Sequence[System], batch_sizes: Sequence[str]) -> Dict[str, str]:
    """Per batch size, the fastest float AT greedy row of the run (whichever engine or AT
    checkpoint): never an int8, shortlist or parallel row."""
    candidates = [s for s in systems if s.baseline_candidate]
    out = {}
    for b in batch_sizes:
        measured = [s for s in candidates if b in s.speed]
        if measured:
            out[b] = max(measured, key=lambda s: s.speed[b]["words_per_second"]).name
    return out
