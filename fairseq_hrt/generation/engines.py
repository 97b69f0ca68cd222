"""Decoder engines (``--decoder-engine``): who runs left-to-right search and the
non-causal pass, behind one interface and one registry.

An engine declares what it supports (``supports_shortlist``, ``supports_compile``,
``quantizes_itself``, ``runs_mask_predict``, and :meth:`DecoderEngine.unsupported` for
generation options), and builds:

* :meth:`DecoderEngine.left_to_right`: a generator with fairseq's
  ``generate(models, sample, bos_token=...)`` (AT beam / greedy search, HRT's AT mode);
  :meth:`DecoderEngine.stage1`: the same, keeping its last batch's encoding for HRT's stage II;
* :meth:`DecoderEngine.backend`: the engine's backend of the one search over the model, on
  which :class:`~fairseq_hrt.generation.hrt_generator.HRTGenerator` runs stage II and
  :class:`~fairseq_hrt.generation.mask_predict.MaskPredictGenerator` Mask-Predict;
* :meth:`DecoderEngine.two_stage` / :meth:`DecoderEngine.mask_predict`: optionally, HRT's two
  stages or Mask-Predict as one generator of the engine's own backend of the one search
  (:mod:`hrt_runtime.search`).

Each engine registers in its own module, which :data:`ENGINE_CATALOG` names with the engine's
help line: the module is imported when a run first asks for the engine (:func:`get_engine`), so
``--decoder-engine lean`` never loads ONNX or CUDA graphs. A further engine registers with
:func:`register_engine` in its own module (imported before it is asked for) and appears in
``--decoder-engine``'s choices and help, and in the benchmark's rows. This module imports no
engine.
"""

from typing import List, Optional, Sequence, Tuple

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.options import DecodingOptions, task_defaults
from fairseq_hrt.generation.registry import Entry, Registry
from hrt_runtime.search import SearchConfig


class DecoderEngine:
    name: str = ""
    summary: str = ""  # one line of --decoder-engine's help
    supports_shortlist: bool = False
    supports_compile: bool = False
    quantizes_itself: bool = False  # --quantize int8 is the engine's own: the loaded model stays float
    runs_mask_predict: bool = False  # mask_predict() builds the generator (else Mask-Predict runs on backend())
    # whether backend() -- the one search's backend, which HRT's stage II and Mask-Predict run on --
    # restricts the output layer to a shortlist's rows; None: as supports_shortlist
    backend_supports_shortlist: Optional[bool] = None
    # its first pass over new batch shapes costs more than later passes (cuda-graph captures a
    # graph per shape): a benchmark warms it up on a whole pass, not on one batch
    warms_up_per_shape: bool = False
    # the task options only this engine reads (DecodingOptions fields, e.g. onnxruntime's
    # onnx_model): set, every other engine refuses them, and so does a strategy that decodes
    # without an engine
    own_options: Tuple[str, ...] = ()

    @property
    def backend_shortlists(self) -> bool:
        """:attr:`backend_supports_shortlist`, ``None`` read as :attr:`supports_shortlist`."""
        return self.supports_shortlist if self.backend_supports_shortlist is None else self.backend_supports_shortlist

    def unsupported(self, options: DecodingOptions) -> List[str]:
        """The options in use that this engine cannot honour (flags, as typed): by default,
        the other engines' own options (:attr:`own_options`)."""
        return engine_options_in_use(options, but=self.name)

    def unsupported_model(self, model) -> List[str]:
        """Why this engine cannot decode ``model`` (empty: it can)."""
        return []

    def left_to_right(self, ctx, config: SearchConfig, banned: Sequence[int]):
        """A left-to-right generator of ``search`` that never produces ``banned``."""
        raise NotImplementedError

    def stage1(self, ctx, config: SearchConfig, banned: Sequence[int]):
        """HRT's stage I (or AT mode) for :class:`HRTGenerator`: a :meth:`left_to_right`
        generator that also keeps its last batch's encoding in :meth:`backend`'s form
        (``last_encoded``) and its shortlist rows (``last_vocab``, ``None`` without one)."""
        return self.left_to_right(ctx, config, banned)

    def backend(self, ctx):
        """The engine's backend of the one search (:mod:`hrt_runtime.search`) over
        ``ctx.model``, with the task's ``<s_k>`` and ``<mask>``: stage II of
        :class:`HRTGenerator` and Mask-Predict run on it."""
        raise NotImplementedError(f"--decoder-engine {self.name} has no backend of the one search")

    def mask_predict(self, ctx):
        """The generator of Mask-Predict on this engine (``runs_mask_predict``); on the other
        engines Mask-Predict (:class:`~fairseq_hrt.generation.mask_predict.MaskPredictGenerator`)
        runs on :meth:`backend`."""
        raise NotImplementedError

    def two_stage(self, ctx, chunk_size):
        """A generator that runs HRT's two stages itself (the one search over the engine's
        backend), or ``None``: :class:`HRTGenerator` composes :meth:`left_to_right` with the
        one search's stage II."""
        return None


ENGINE_CATALOG = {
    "cuda-graph": Entry(
        "fairseq_hrt.generation.cuda_graph",
        "the lean engine with its decoder step, encoder and non-causal pass captured as CUDA graphs (one per "
        "padded shape) and replayed, on a GPU only: one launch a pass instead of hundreds; no --shortlist, "
        "no --compile",
    ),
    "fairseq": Entry(
        "fairseq_hrt.generation.fairseq_engine",
        "fairseq's SequenceGenerator, the same hypotheses as lean (needed for --prefix-size, constraints, "
        "sampling, alignments)",
    ),
    "lean": Entry(
        "fairseq_hrt.generation.lean",
        "this plugin's step loop (preallocated caches, finished sentences leave the batch, top-k on the "
        "logits; --shortlist, --compile, --quantize int8), HRT's two stages included",
    ),
    "onnxruntime": Entry(
        "fairseq_hrt.generation.onnx_engine",
        "the model exported to ONNX (on first use, cached; see --onnx-model) and decoded by ONNX Runtime, "
        "HRT's two stages and Mask-Predict included",
        own_options=("onnx_model",),
    ),
}

# the default engine (DecodingOptions' decoder_engine) first, the others by name
ENGINES: Registry = Registry(
    "decoder engine", ENGINE_CATALOG, order=lambda name: (name != DecodingOptions.decoder_engine, name)
)


def register_engine(name: str):
    """Register an engine under ``name`` (an instance of the decorated class)."""

    def register(cls):
        known = ENGINES.registered(name)
        if known is not None and type(known) is not cls:
            raise ValueError(f"decoder engine {name!r} is already registered")
        cls.name = name
        ENGINES.register(name, cls, cls())
        return cls

    return register


def engine_options_in_use(options: DecodingOptions, but: str = "") -> List[str]:
    """The flags of the engines' own options (:attr:`DecoderEngine.own_options`) set in
    ``options``, those of the engine ``but`` left out."""
    defaults = task_defaults()
    return [
        "--" + name.replace("_", "-")
        for engine_name in ENGINES
        if engine_name != but
        for name in ENGINES.declared(engine_name, "own_options")
        if getattr(options, name) != defaults[name]
    ]


def engine_choices() -> List[str]:
    return list(ENGINES)


def engines_help() -> str:
    """``--decoder-engine``'s help, from the registry."""
    return (
        "engine of left-to-right search (AT beam/greedy, HRT stage I and AT mode), and of HRT's two stages "
        "and Mask-Predict where it runs them: "
        + "; ".join(f"'{name}' = {ENGINES.declared(name, 'summary')}" for name in ENGINES)
    )


def get_engine(name: str) -> DecoderEngine:
    if name not in ENGINES:
        raise RefusedOptions(f"--decoder-engine must be one of {', '.join(ENGINES)}, got {name!r}")
    return ENGINES[name]
