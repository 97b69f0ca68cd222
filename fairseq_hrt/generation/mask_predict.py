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

The tricky parts are pure functions (:func:`remask_counts`, :func:`lowest_confidence_mask`,
:func:`length_candidates`, :func:`initial_input`) that the tests call directly.
"""
import logging
import math
from typing import Dict, Iterable, List, Tuple

import torch
from torch import Tensor

from fairseq_hrt import chunking
from fairseq_hrt.generation.output_vocab import OutputLayer
from fairseq_hrt.generation.strategies import (
    DecodingContext,
    DecodingStrategy,
    hypothesis,
    register_decoding,
    reject_unsupported_inputs,
)
from fairseq_hrt.models.kinds import is_mask_predict

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------- pure functions


def remask_counts(lengths: Tensor, t: int, iterations: int) -> Tensor:
    """Tokens re-masked before iteration ``t + 1`` (``t = 1..I-1``): ``floor(N * (I - t) / I)``.

    Integer arithmetic, so the count is exact (no float rounding at multiples of ``I``).
    """
    if not 1 <= t < iterations:
        raise ValueError(f"re-masking happens for t = 1..{iterations - 1}, got t = {t}")
    return lengths * (iterations - t) // iterations


def lowest_confidence_mask(scores: Tensor, eligible: Tensor, counts: Tensor) -> Tensor:
    """``(R, T)`` bool: True at the ``counts[r]`` eligible slots of row ``r`` with the lowest
    ``scores`` (ties: the leftmost slot first). Ineligible slots are never chosen."""
    ranked = scores.masked_fill(~eligible, math.inf)
    order = ranked.argsort(dim=1, stable=True)
    ranks = order.argsort(dim=1)
    return (ranks < counts.unsqueeze(1)) & eligible


def length_candidates(length_lprobs: Tensor, beam: int, max_lengths: Tensor):
    """The ``beam`` most probable target lengths per sentence within ``1..max_lengths[b]``.

    ``length_lprobs``: ``(B, C)`` log-probabilities of lengths ``0..C-1``. Lengths outside the
    allowed range are never candidates (clamping them would duplicate a candidate); a
    sentence with fewer than ``beam`` allowed lengths repeats its best one. Returns
    ``(lengths, lprobs)``, both ``(B, beam)``, best first.
    """
    classes = length_lprobs.size(-1)
    if beam > classes:
        raise ValueError(f"length beam {beam} exceeds the {classes} length classes")
    length = torch.arange(classes, device=length_lprobs.device).unsqueeze(0)
    allowed = (length >= 1) & (length <= max_lengths.unsqueeze(1))
    top_lprobs, top_lengths = length_lprobs.float().masked_fill(~allowed, -math.inf).topk(beam, dim=-1)
    missing = torch.isinf(top_lprobs)
    top_lengths = torch.where(missing, top_lengths[:, :1], top_lengths)
    top_lprobs = torch.where(missing, top_lprobs[:, :1], top_lprobs)
    return top_lengths, top_lprobs


def initial_input(lengths: Tensor, mask: int, eos: int, pad: int) -> Tuple[Tensor, Tensor]:
    """``(tokens, positions)``: ``<mask> x N </s>`` per row at positions ``1..N+1``, right-padded
    (positions 0 on padding)."""
    width = int(lengths.max().item()) + 1 if lengths.numel() else 0
    slot = torch.arange(width, device=lengths.device).unsqueeze(0)
    n = lengths.unsqueeze(1)
    tokens = torch.full((lengths.numel(), width), pad, dtype=torch.long, device=lengths.device)
    tokens = tokens.masked_fill(slot < n, mask).masked_fill(slot == n, eos)
    return tokens, chunking.nat_positions(slot <= n)


# ----------------------------------------------------------------------------- generator


class MaskPredictGenerator:
    """Mask-Predict with ``iterations`` (I) decoder passes and a length beam of ``length_beam`` (l).

    Args:
        models: one ``cmlm_*`` model (no ensembles)
        banned: extra symbols that may never be predicted (the task's ``<mask>`` and
            ``<s2>``..``<s8>``); ``<pad>``, ``<s>`` and ``</s>`` are always banned
        max_len_a, max_len_b: a sentence's length is at most ``a * src_len + b`` (fairseq's
            ``--max-len-a/b``; L = 200 in the papers), and at most what the length predictor
            and the decoder's positions allow
        shortlist: a lexical shortlist (:mod:`fairseq_hrt.shortlist`): every pass computes the
            output layer for the batch's candidates only (log-probabilities over them)
    """

    def __init__(
        self,
        models,
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
            raise ValueError("Mask-Predict decoding supports a single model (no ensembles)")
        if not is_mask_predict(models[0]):
            raise ValueError("Mask-Predict decoding needs a model with a length predictor (--arch cmlm_*)")
        if iterations < 1:
            raise ValueError(f"--iter-decode-max-iter (Mask-Predict's I) must be >= 1, got {iterations}")
        if length_beam < 1:
            raise ValueError(f"--iter-decode-with-beam (Mask-Predict's length beam l) must be >= 1, got {length_beam}")
        self.model = models[0]
        self.tgt_dict = tgt_dict
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()
        self.mask = mask
        self.iterations = iterations
        self.length_beam = length_beam
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.print_steps = print_steps
        self.shortlist = shortlist
        specials = {mask, self.pad, self.eos, tgt_dict.bos(), *banned}
        self.banned = torch.tensor(sorted(specials), dtype=torch.long)

    def max_lengths(self, src_tokens: Tensor, classes: int) -> Tensor:
        """Per-sentence maximum target length N (tokens without ``</s>``)."""
        src_len = (src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(dim=1)
        limit = (self.max_len_a * src_len.double() + self.max_len_b).long()
        # N + 1 positions must exist; N must be a class of the length predictor
        cap = min(classes - 1, self.model.max_decoder_positions() - 1)
        return limit.clamp(min=1, max=cap)

    # fairseq's generate loop calls generator.generate(models, sample, prefix_tokens=..., ...);
    # like fairseq's SequenceGenerator it decodes with the model it was built with
    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], **kwargs) -> List[List[Dict[str, Tensor]]]:
        reject_unsupported_inputs("Mask-Predict decoding", **kwargs)
        model = self.model
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, beam = src_tokens.size(0), self.length_beam
        encoder_out = model.encoder(src_tokens, src_lengths=net_input["src_lengths"])
        length_lprobs = model.forward_length(encoder_out)
        lengths, _ = length_candidates(length_lprobs, beam, self.max_lengths(src_tokens, length_lprobs.size(-1)))
        lengths = lengths.view(-1)  # row r = sentence r // l, candidate r % l
        sentence_of_row = torch.arange(bsz, device=src_tokens.device).repeat_interleave(beam)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, sentence_of_row)

        tokens, positions = initial_input(lengths, self.mask, self.eos, self.pad)
        slots = tokens.eq(self.mask)  # the N target slots of every row
        scores = torch.zeros(tokens.shape, dtype=torch.float, device=tokens.device)
        vocab = self.shortlist.candidates(src_tokens, self.pad) if self.shortlist is not None else None
        output = OutputLayer(model.decoder, self.banned.to(tokens.device), vocab)
        for t in range(self.iterations):
            if t > 0:
                remask = lowest_confidence_mask(scores, slots, remask_counts(lengths, t, self.iterations))
                tokens = tokens.masked_fill(remask, self.mask)
            masked = tokens.eq(self.mask)
            features, _ = model.decoder(tokens, encoder_out=encoder_out, positions=positions, causal=False, features_only=True)
            best_lprobs, best = output.best(features)
            if self.print_steps:
                self._log_step(t, tokens[0], torch.where(masked[0], best[0], tokens[0]))
            tokens = torch.where(masked, best, tokens)
            scores = torch.where(masked, best_lprobs, scores)

        average = scores.sum(dim=1) / lengths.float()  # </s> and padding score 0
        order = average.view(bsz, beam).sort(dim=1, descending=True, stable=True).indices
        finalized: List[List[Dict[str, Tensor]]] = []
        for b in range(bsz):
            hypos = []
            for j in order[b].tolist():
                r = b * beam + j
                n = int(lengths[r]) + 1  # with </s>
                # </s> is given, not predicted: positional score 0
                hypos.append(hypothesis(tokens[r, :n], average[r], scores[r, :n], steps=self.iterations))
            finalized.append(hypos)
        return finalized

    def _log_step(self, t: int, before: Tensor, after: Tensor):
        keep = before.ne(self.pad)
        logger.info(
            "Mask-Predict iteration %d/%d (sentence 1, top length): %s -> %s",
            t + 1,
            self.iterations,
            self.tgt_dict.string(before[keep]),
            self.tgt_dict.string(after[keep]),
        )


@register_decoding("mask-predict")
class MaskPredictDecoding(DecodingStrategy):
    """Mask-Predict for ``cmlm_*`` models (fairseq's iterative-refinement options)."""

    supports_shortlist = True
    # no left-to-right search: --decoder-engine applies only to an engine that runs Mask-Predict
    # itself (onnxruntime); the others decode with the model's own decoder
    uses_decoder_engine = False

    @classmethod
    def supports(cls, model):
        if not is_mask_predict(model):
            return "Mask-Predict needs a model with a length predictor (--arch cmlm_*)"
        return None

    @classmethod
    def is_default_for(cls, model):
        return is_mask_predict(model)

    @classmethod
    def build(cls, ctx: DecodingContext):
        options = ctx.options
        if not options.is_default_hrt_decoding:
            raise ValueError(
                "--decode-chunk-size, --b-nat and --hrt-* are HRT decoding options; a Mask-Predict "
                "(cmlm_*) model decodes with --iter-decode-max-iter I and --iter-decode-with-beam l"
            )
        if options.iterative_only:
            raise ValueError(
                f"{', '.join(options.iterative_only)} belong(s) to fairseq's iterative refinement "
                "generator; Mask-Predict decoding does not support it"
            )
        own = ctx.engine.mask_predict(ctx)
        if own is not None:
            logger.info("Mask-Predict decoding: I = %d iterations, length beam l = %d, %s engine",
                        options.iter_decode_max_iter, options.iter_decode_with_beam, ctx.engine.name)
            return own
        generator = MaskPredictGenerator(
            ctx.models, ctx.task.target_dictionary, mask=ctx.task.mask_idx, banned=ctx.banned(),
            iterations=options.iter_decode_max_iter, length_beam=options.iter_decode_with_beam,
            max_len_a=options.search.max_len_a, max_len_b=options.search.max_len_b,
            print_steps=options.print_step, shortlist=ctx.shortlist,
        )
        logger.info(
            "Mask-Predict decoding: I = %d iterations, length beam l = %d (--beam is not used)",
            generator.iterations,
            generator.length_beam,
        )
        return generator
