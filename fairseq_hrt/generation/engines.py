"""Decoder engines (``--decoder-engine``): who runs left-to-right search and the
non-causal pass, behind one interface and one registry.

An engine declares what it supports (``supports_shortlist``, ``supports_compile``,
``supports_int8``, and :meth:`DecoderEngine.unsupported` for generation options), and builds:

* :meth:`DecoderEngine.left_to_right`: a generator with fairseq's
  ``generate(models, sample, bos_token=...)`` and ``last_encoder_out`` (HRT's stage I and AT
  mode, AT beam / greedy search);
* :meth:`DecoderEngine.two_stage` / :meth:`DecoderEngine.mask_predict`: optionally, HRT's two
  stages or Mask-Predict as one generator of the engine's own backend of the one search
  (:mod:`hrt_runtime.search`).

Registered here: ``lean`` (this plugin's step loop, :mod:`fairseq_hrt.generation.lean`) and
``fairseq`` (fairseq's ``SequenceGenerator``); ``onnxruntime`` in
:mod:`fairseq_hrt.generation.onnx_engine`. A further engine registers with
:func:`register_engine` in its own module and appears in ``--decoder-engine``'s choices.
"""
from typing import Dict, List, Sequence

from fairseq_hrt.generation.options import DecodingOptions, SearchOptions


class DecoderEngine:
    name: str = ""
    supports_shortlist: bool = False
    supports_compile: bool = False
    supports_int8: bool = True
    quantizes_itself: bool = False  # --quantize int8 is the engine's own: the loaded model stays float

    def unsupported(self, options: DecodingOptions) -> List[str]:
        """The options in use that this engine cannot honour (flags, as typed)."""
        return ["--onnx-model"] if options.onnx_model else []  # an exported folder is for onnxruntime only

    def unsupported_model(self, model) -> List[str]:
        """Why this engine cannot decode ``model`` (empty: it can)."""
        return []

    def left_to_right(self, ctx, search: SearchOptions, banned: Sequence[int], keep_encoder_out: bool = False):
        """``keep_encoder_out``: the generator must expose its last batch's encoder output
        (``last_encoder_out``, for HRT's stage II)."""
        raise NotImplementedError

    def mask_predict(self, ctx):
        """A generator that runs Mask-Predict itself, or ``None``: the decoder module runs it
        (:class:`~fairseq_hrt.generation.mask_predict.MaskPredictGenerator`)."""
        return None

    def two_stage(self, ctx, chunk_size):
        """A generator that runs HRT's two stages itself (the one search over the engine's
        backend), or ``None``: :class:`HRTGenerator` composes :meth:`left_to_right` with the
        one search's stage II."""
        return None


ENGINES: Dict[str, DecoderEngine] = {}


def register_engine(name: str):
    def register(cls):
        if name in ENGINES and type(ENGINES[name]) is not cls:
            raise ValueError(f"decoder engine {name!r} is already registered")
        cls.name = name
        ENGINES[name] = cls()
        return cls

    return register


def engine_choices() -> List[str]:
    return list(ENGINES)


def get_engine(name: str) -> DecoderEngine:
    if name not in ENGINES:
        raise ValueError(f"--decoder-engine must be one of {', '.join(ENGINES)}, got {name!r}")
    return ENGINES[name]


@register_engine("lean")
class LeanEngine(DecoderEngine):
    """This plugin's step loop: preallocated caches, finished sentences leave the batch,
    top-k on the logits, lexical shortlists, ``--compile``."""

    supports_shortlist = True
    supports_compile = True

    def unsupported(self, options):
        return list(options.sequence_generator_only) + super().unsupported(options)

    def left_to_right(self, ctx, search, banned, keep_encoder_out=False):
        from fairseq_hrt.generation.lean import LeanSequenceGenerator

        if len(ctx.models) != 1:
            raise ValueError("--decoder-engine lean decodes a single model (no ensembles)")
        return LeanSequenceGenerator(ctx.models[0], ctx.task.target_dictionary, search, banned,
                                     shortlist=ctx.shortlist, compile=ctx.options.compile)

    def two_stage(self, ctx, chunk_size):
        """HRT's two stages in the one search (:mod:`hrt_runtime.search`); the stage-II options
        beyond the papers and ``--print-step`` are :class:`HRTGenerator`'s (``None``)."""
        from fairseq_hrt.generation.lean import LeanSequenceGenerator

        options = ctx.options
        if options.stage2_options_used() or options.print_step:
            return None
        if len(ctx.models) != 1:
            raise ValueError("--decoder-engine lean decodes a single model (no ensembles)")
        task = ctx.task
        return LeanSequenceGenerator(ctx.models[0], task.target_dictionary, options.search, ctx.banned(),
                                     shortlist=ctx.shortlist, compile=options.compile, chunk_start=task.chunk_start_idx,
                                     mask=task.mask_idx, chunk_size=chunk_size, b_nat=options.b_nat)


@register_engine("fairseq")
class FairseqEngine(DecoderEngine):
    """fairseq's ``SequenceGenerator`` (needed for --prefix-size, constraints, sampling,
    alignments), keeping its last encoder output for HRT's stage II."""

    def left_to_right(self, ctx, search, banned, keep_encoder_out=False):
        from fairseq_hrt.generation.hrt_generator import EncoderKeepingSequenceGenerator
        from fairseq_hrt.generation.strategies import with_options

        pad = ctx.task.target_dictionary.pad()
        suppress = [ctx.task.target_dictionary[i] for i in banned if i != pad]  # fairseq bans <pad> itself
        args = ctx.options.fairseq_args
        # the search options win over the command line's (stage I's L / k, a strategy's beam)
        changed = {k: v for k, v in search.fairseq_values().items() if getattr(args, k, None) != v}
        if changed:
            args = with_options(args, **changed)
        if not keep_encoder_out and not suppress:  # the caller's own generator class (fairseq's convention)
            return ctx.fairseq_generator(ctx.models, args)
        return ctx.fairseq_generator(ctx.models, args, seq_gen_cls=EncoderKeepingSequenceGenerator,
                                     extra_gen_cls_kwargs={"tokens_to_suppress": suppress} if suppress else None)
