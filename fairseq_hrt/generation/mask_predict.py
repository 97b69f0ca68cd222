"""Mask-Predict decoding (Ghazvininejad et al. 2019; SPEC section 4) for ``cmlm_*`` models.

The paper's algorithm, not fairseq's adaptive iterative refinement:

1. the length predictor proposes the ``l`` most probable target lengths (length beam); every
   candidate length N becomes the decoder input ``<mask> x N </s>`` at positions ``1..N+1``
   (the layout of the CMLM training samples, ``chunking.cmlm_sample``);
2. iteration 1 predicts every token (argmax) and records its probability;
3. iterations ``t = 1..I-1`` re-mask the ``n = floor(N * (I - t) / I)`` tokens of lowest
   probability and predict only those again, updating their probabilities;
4. among the ``l`` candidates of a sentence the one with the highest average log-probability
   of its N tokens wins.

Every sentence gets exactly ``I`` decoder passes -- no early stop, so no mask can survive and
MP(I) always costs what its name says (a pass whose schedule re-masks nothing for any row
still runs). Special symbols (``<mask>``, ``<pad>``, ``<s>``, ``<s2>``..``<s8>`` and ``</s>``,
which only the last, given slot holds) can never be predicted. The whole batch times the length
beam is one tensor; scores are computed in float, so the generator runs under ``model.half()``.

The algorithm is the one search's (:func:`hrt_runtime.search.mask_predict`, with its pure
functions :func:`~hrt_runtime.search.remask_counts`,
:func:`~hrt_runtime.search.lowest_confidence_mask`,
:func:`~hrt_runtime.search.length_candidates`, :func:`~hrt_runtime.search.initial_input`),
run here over the engine's backend (:meth:`DecoderEngine.backend`: the model's
:class:`~fairseq_hrt.generation.lean.TorchBackend` for ``lean`` and ``fairseq``) and on ONNX
Runtime by ``--decoder-engine onnxruntime``.
"""

import logging
from typing import Iterable

import numpy as np
import torch

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.search_generator import SearchGenerator
from fairseq_hrt.generation.strategies import DecodingContext, DecodingStrategy, register_decoding
from fairseq_hrt.models.kinds import family_of
from hrt_runtime.search import SearchConfig, check_mask_predict

logger = logging.getLogger(__name__)


class MaskPredictGenerator(SearchGenerator):
    """Mask-Predict with ``iterations`` (I) decoder passes and a length beam of ``length_beam`` (l),
    the one search's (:class:`SearchGenerator`) over ``backend``.

    Args:
        models: one ``cmlm_*`` model (no ensembles)
        backend: the backend of the one search over it (``encode_fairseq`` and ``parallel``)
        banned: extra symbols that may never be predicted (the task's ``<mask>`` and
            ``<s2>``..``<s8>``); ``<pad>``, ``<s>`` and ``</s>`` are always banned
        max_len_a, max_len_b: a sentence's length is at most ``a * src_len + b`` (fairseq's
            ``--max-len-a/b``; L = 200 in the papers), and at most what the length predictor
            and the decoder's positions allow
        shortlist: a lexical shortlist (:mod:`fairseq_hrt.shortlist`): every pass computes the
            output layer for the batch's candidates only (log-probabilities over them)
    """

    engine = "lean"
    what = "Mask-Predict decoding"

    def __init__(
        self,
        models,
        backend,
        tgt_dict,
        mask: int,
        banned: Iterable[int] = (),
        iterations: int = 10,
        length_beam: int = 1,
        max_len_a: float = 0.0,
        max_len_b: int = 200,
        print_steps: bool = False,
        shortlist=None,
    ):
        if len(models) != 1:
            raise RefusedOptions("Mask-Predict decoding supports a single model (no ensembles)")
        if not family_of(models[0]).length_predictor:
            raise RefusedOptions("Mask-Predict decoding needs a model with a length predictor (--arch cmlm_*)")
        check_mask_predict(iterations, length_beam)
        self.model = models[0]
        super().__init__(
            backend,
            tgt_dict,
            SearchConfig(beam=1, max_len_a=max_len_a, max_len_b=max_len_b),
            banned,
            shortlist,
            iterations=iterations,
            length_beam=length_beam,
        )
        self.tgt_dict = tgt_dict
        self.mask = mask
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.print_steps = print_steps
        if print_steps:
            self.on_iteration = self._log_step

    def encode(self, net_input):
        encoded = self.backend.encode_fairseq(net_input)
        encoded.length_lprobs = self.model.forward_length(encoded.encoder_out).float().cpu().numpy()
        return encoded

    def _log_step(self, t: int, before: np.ndarray, after: np.ndarray):
        keep = before != self.pad
        logger.info(
            "Mask-Predict iteration %d/%d (sentence 1, top length): %s -> %s",
            t + 1,
            self.iterations,
            self.tgt_dict.string(torch.from_numpy(before[keep])),
            self.tgt_dict.string(torch.from_numpy(after[keep])),
        )


@register_decoding("mask-predict")
class MaskPredictDecoding(DecodingStrategy):
    """Mask-Predict for ``cmlm_*`` models (fairseq's iterative-refinement options)."""

    supports_shortlist = True

    @classmethod
    def supports(cls, model):
        if not family_of(model).length_predictor:
            return "Mask-Predict needs a model with a length predictor (--arch cmlm_*)"
        return None

    @classmethod
    def is_default_for(cls, model):
        return family_of(model).length_predictor

    @classmethod
    def uses_engine(cls, engine):
        # every engine: one that runs Mask-Predict itself (onnxruntime) builds the generator,
        # the others give the backend its passes run on (engine.backend), so the engine's
        # checks apply
        return True

    @classmethod
    def engine_supports_shortlist(cls, engine):
        return engine.supports_shortlist if engine.runs_mask_predict else engine.backend_shortlists

    @classmethod
    def unsupported(cls, options):
        # fairseq's left-to-right SequenceGenerator implements these; Mask-Predict never runs
        # it, whichever engine gives it its passes
        return list(options.sequence_generator_only)

    @classmethod
    def build(cls, ctx: DecodingContext):
        options = ctx.options
        if not options.is_default_hrt_decoding:
            raise RefusedOptions(
                "--decode-chunk-size, --b-nat and --hrt-* are HRT decoding options; a Mask-Predict "
                "(cmlm_*) model decodes with --iter-decode-max-iter I and --iter-decode-with-beam l"
            )
        if options.iterative_only:
            raise RefusedOptions(
                f"{', '.join(options.iterative_only)} belong(s) to fairseq's iterative refinement "
                "generator; Mask-Predict decoding does not support it"
            )
        if ctx.engine.runs_mask_predict:
            logger.info(
                "Mask-Predict decoding: I = %d iterations, length beam l = %d, %s engine",
                options.iter_decode_max_iter,
                options.iter_decode_with_beam,
                ctx.engine.name,
            )
            return ctx.engine.mask_predict(ctx)
        generator = MaskPredictGenerator(
            ctx.models,
            ctx.engine.backend(ctx),
            ctx.task.target_dictionary,
            mask=ctx.task.mask_idx,
            banned=ctx.banned(),
            iterations=options.iter_decode_max_iter,
            length_beam=options.iter_decode_with_beam,
            max_len_a=options.search_config.max_len_a,
            max_len_b=options.search_config.max_len_b,
            print_steps=options.print_step,
            shortlist=ctx.shortlist,
        )
        logger.info(
            "Mask-Predict decoding: I = %d iterations, length beam l = %d (--beam is not used)",
            generator.iterations,
            generator.length_beam,
        )
        return generator
