"""Two-stage HRT decoding (SPEC section 3) and the left-to-right strategies ``beam`` / ``hrt``.

Stage I (Skip-AT) is a left-to-right search started from ``<s_k>``: the HRT decoder derives
positions ``0, k, 2k, ..`` from that start symbol. Its engine is ``--decoder-engine``: the
lean engine (:mod:`fairseq_hrt.generation.lean`) or fairseq's own ``SequenceGenerator``; both
give the same hypotheses, with fairseq's beam search, length penalty and removal of finished
sentences from the active batch (exactly what the AT baseline it is compared with uses).
Stage II is one bidirectional pass over the top ``b_nat`` skeletons with ``k - 1`` masks
before every ``z_i``, run on groups of skeletons of similar length (:func:`length_buckets`)
so that one long skeleton does not make the whole batch pay for its padding.
"""
import logging
from typing import Callable, Dict, List, Optional

import torch
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from torch import Tensor

from fairseq_hrt import chunking
from fairseq_hrt.generation.chunk_size import resolve_decode_chunk_size
from fairseq_hrt.generation.decoder_pass import profiled
from fairseq_hrt.generation.mask_predict import lowest_confidence_mask
from fairseq_hrt.generation.output_vocab import OutputLayer
from fairseq_hrt.generation.search_rules import banned_symbols_of
from fairseq_hrt.generation.strategies import (
    DecodingContext,
    DecodingStrategy,
    LeftToRightDecoding,
    hypothesis,
    register_decoding,
    reject_unsupported_inputs,
    select_rows,
)
from fairseq_hrt.models.kinds import AT, HRT, is_hrt, model_kind
from hrt_runtime.search import length_buckets, mask_columns  # noqa: F401  (the runtime's, pure; length_buckets re-exported)

logger = logging.getLogger(__name__)


class _EncoderCachingEnsemble(EnsembleModel):
    """fairseq's ensemble wrapper that keeps the last encoder output for stage II."""

    def __init__(self, models):
        super().__init__(models)
        self.last_encoder_outs = None

    @torch.jit.unused
    def forward_encoder(self, net_input: Dict[str, Tensor]):
        self.last_encoder_outs = super().forward_encoder(net_input)
        return self.last_encoder_outs


class EncoderKeepingSequenceGenerator(SequenceGenerator):
    """fairseq's ``SequenceGenerator`` that keeps the encoder output of its last batch."""

    def __init__(self, models, tgt_dict, **kwargs):
        super().__init__(_EncoderCachingEnsemble(models), tgt_dict, **kwargs)

    @property
    def last_encoder_out(self):
        return self.model.last_encoder_outs[0]


def stage2_fill(
    mask_tokens: Tensor, mask_lprobs: Tensor, stage2: chunking.DecoderSample, skeleton_scores: Tensor, mask: int, eos: int, pad: int
):
    """Put the stage-II predictions into the masks, truncate at the first ``</s>``, score by eq. (2).

    ``mask_tokens`` / ``mask_lprobs``: the argmax token and its log-probability for every
    ``<mask>`` of ``stage2.tokens``, in row-major order (``stage2.tokens[stage2.tokens == mask]``);
    ``skeleton_scores``: ``(B, M)`` stage-I log-probabilities spread onto the skeleton slots.
    Returns ``(tokens, positional_scores, lengths)`` with everything after the first ``</s>``
    set to pad / 0; the sum of ``positional_scores`` is eq. (2) over the kept tokens.
    """
    is_mask = stage2.tokens.eq(mask)
    tokens = stage2.tokens.masked_scatter(is_mask, mask_tokens.to(stage2.tokens))
    scores = skeleton_scores.masked_scatter(is_mask, mask_lprobs.to(skeleton_scores))
    tokens = chunking.truncate_at_first_eos(tokens, eos, pad)
    kept = tokens.ne(pad)
    return tokens, scores.masked_fill(~kept, 0.0), kept.long().sum(dim=1)


class HRTGenerator:
    """Hybrid-regressive decoding with chunk size ``k`` (``k = 1``: plain AT decoding).

    Args:
        stage1: ``k -> `` left-to-right generator for chunk size ``k`` (``generate(models,
            sample, bos_token=...)`` and ``last_encoder_out``), with beam ``b_at`` and at most
            ``L / k`` steps
        chunk_start: ``{k: index of <s_k>}``
        b_nat: skeletons per sentence filled by stage II (``<= b_at``)
        chunk_size: ``k`` for every sentence, or a function ``src_lengths -> (B,) chunk sizes``
        bucket_padding: stage II runs on groups of skeletons in which no skeleton is padded
            by more than this fraction of its length plus one token (:func:`length_buckets`)
        shortlist: a lexical shortlist (:mod:`fairseq_hrt.shortlist`): stage II predicts the
            masks among the batch's candidates, the same ones stage I searched over
        bidirectional: stage II's decoder pass, the lean engine's
            :class:`~fairseq_hrt.generation.decoder_pass.DecoderPass` of the model (its
            encoder keys/values are made once per batch, or taken from a lean stage I);
            default the decoder module

    Beyond the papers (each off by default):

        refine_fraction: after stage II, the filled tokens with the lowest probability (this
            fraction of each row's masks, rounded up) are masked again and predicted by one
            more non-causal pass (Mask-Predict's second iteration)
        fallback_threshold: a sentence whose best stage-II fill has a mean log-probability
            of its filled tokens below this is decoded again in AT mode (k = 1)
        rescore: every candidate (``b_nat`` per sentence) is scored by the same model in AT
            mode, in one teacher-forced pass (exact log-probabilities, length-normalised as
            beam search's), and the candidates are ranked by that score
    """

    def __init__(
        self,
        stage1: Callable[[int], object],
        model,
        tgt_dict,
        chunk_start: Dict[int, int],
        mask: int,
        chunk_size,
        b_at: int,
        len_penalty: float,
        b_nat: int = 1,
        print_steps: bool = False,
        bucket_padding: float = 0.25,
        shortlist=None,
        bidirectional: Optional[Callable] = None,
        refine_fraction: float = 0.0,
        fallback_threshold: Optional[float] = None,
        rescore: bool = False,
    ):
        check_hrt_options(refine_fraction, fallback_threshold)
        if b_nat < 1:
            raise ValueError(f"--b-nat must be >= 1, got {b_nat}")
        if b_nat > b_at:
            raise ValueError(
                f"HRT decoding needs b_at >= b_nat, got --beam {b_at} < --b-nat {b_nat}: "
                "stage II fills the top b_nat Skip-AT hypotheses"
            )
        self.stage1 = stage1
        self.model = model
        self.tgt_dict = tgt_dict
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.mask = mask
        self.chunk_start = chunk_start
        self.chunk_size = chunk_size
        self.b_nat = b_nat
        self.len_penalty = len_penalty
        self.print_steps = print_steps
        self.bucket_padding = bucket_padding
        self.shortlist = shortlist
        self.bidirectional = bidirectional
        self.refine_fraction = refine_fraction
        self.fallback_threshold = fallback_threshold
        self.rescore = rescore
        self.banned = torch.tensor(banned_symbols_of(HRT, tgt_dict, mask, chunk_start))
        # sentences decoded with stage II, and those of them that fell back to AT mode
        self.stage2_stats = {"sentences": 0, "fallbacks": 0}

    # fairseq's generate loop calls generator.generate(models, sample, prefix_tokens=..., ...)
    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], **kwargs) -> List[List[Dict[str, Tensor]]]:
        reject_unsupported_inputs("HRT decoding", **kwargs)
        net_input = sample["net_input"]
        src_lengths = net_input["src_tokens"].ne(self.pad).long().sum(dim=1)
        if callable(self.chunk_size):
            per_row = self.chunk_size(src_lengths).tolist()
        else:
            per_row = [int(self.chunk_size)] * src_lengths.numel()
        results: List[Optional[List[Dict[str, Tensor]]]] = [None] * len(per_row)
        for k in sorted(set(per_row)):
            rows = [i for i, kk in enumerate(per_row) if kk == k]
            sub = sample if len(rows) == len(per_row) else select_rows(sample, rows)
            for i, hypos in zip(rows, self._generate_k(sub, k)):
                results[i] = hypos
        return results

    def _generate_k(self, sample, k: int):
        stage1 = self.stage1(k)
        skeletons = stage1.generate([self.model], sample, bos_token=None if k == 1 else self.chunk_start[k])
        if k == 1:
            return skeletons  # AT mode: no stage II
        vocab = None
        if self.shortlist is not None:
            vocab = getattr(stage1, "last_vocab", None)
            if vocab is None:
                vocab = self.shortlist.candidates(sample["net_input"]["src_tokens"], self.pad)
        encoder_kv = None
        if self.bidirectional is not None and getattr(stage1, "decoder_pass", None) is self.bidirectional:
            encoder_kv = stage1.last_encoder_kv  # stage I's projections of this batch
        encoder_out = stage1.last_encoder_out
        results = self._stage2(skeletons, k, encoder_out, vocab, encoder_kv)
        if self.rescore:
            results = self._rescore(results, encoder_out)
        self.stage2_stats["sentences"] += len(results)
        if self.fallback_threshold is not None:
            low = [i for i, hypos in enumerate(results) if float(hypos[0]["stage2_confidence"]) < self.fallback_threshold]
            if low:
                self.stage2_stats["fallbacks"] += len(low)
                for i, hypos in zip(low, self._generate_k(select_rows(sample, low), 1)):
                    results[i] = hypos
        return results

    def _rescore(self, results, encoder_out):
        """Every sentence's candidates scored by the model in AT mode (one teacher-forced pass
        over all of them) and ranked by that score."""
        candidates = [(sent, hypo) for sent, hypos in enumerate(results) for hypo in hypos]
        device = encoder_out["encoder_out"][0].device
        index = torch.tensor([sent for sent, _ in candidates], dtype=torch.long, device=device)
        scores, per_token = at_mode_scores(self.model, self.model.encoder.reorder_encoder_out(encoder_out, index),
                                           [hypo["tokens"] for _, hypo in candidates], self.eos, self.pad, self.len_penalty)
        for j, (_, hypo) in enumerate(candidates):
            n = hypo["tokens"].numel()
            hypo["score"], hypo["positional_scores"] = scores[j], per_token[j, :n]
        for hypos in results:
            hypos.sort(key=lambda h: float(h["score"]), reverse=True)
        return results

    @profiled("hrt.stage2")
    def _stage2(self, skeletons, k: int, encoder_out, vocab: Optional[Tensor] = None, encoder_kv=None):
        if self.bidirectional is not None and encoder_kv is None:
            encoder_kv = self.bidirectional.encoder(encoder_out)  # once per batch
        rows, sentence_of_row = [], []
        for sent, hypos in enumerate(skeletons):
            for hypo in hypos[: self.b_nat]:
                rows.append(hypo)
                sentence_of_row.append(sent)
        out: List[List[Dict[str, Tensor]]] = [[] for _ in skeletons]
        lengths = [int(h["tokens"].numel()) for h in rows]
        for bucket in length_buckets(lengths, self.bucket_padding):
            filled = self._fill([rows[r] for r in bucket], [sentence_of_row[r] for r in bucket], k, encoder_out, vocab, encoder_kv)
            for r, hypo in zip(bucket, filled):
                out[sentence_of_row[r]].append(hypo)
        for hypos in out:
            hypos.sort(key=lambda h: float(h["score"]), reverse=True)
        return out

    def _fill(self, rows, sentence_of_row: List[int], k: int, encoder_out, vocab: Optional[Tensor] = None, encoder_kv=None):
        """Stage II on one group of skeletons: their hypotheses, in the order given.
        ``encoder_kv``: the batch's encoder keys/values for the lean pass."""
        device = encoder_out["encoder_out"][0].device
        skeleton = _pad_stack([h["tokens"] for h in rows], self.pad).to(device)
        skeleton_scores = _pad_stack([h["positional_scores"].float() for h in rows], 0.0).to(device)
        index = torch.tensor(sentence_of_row, dtype=torch.long, device=device)
        if self.bidirectional is not None:
            enc, bidirectional = encoder_kv.select(index), self.bidirectional.bidirectional
        else:
            enc, bidirectional = self.model.encoder.reorder_encoder_out(encoder_out, index), None
        stage2, tokens, pos_scores, lengths = fill_skeletons(
            self.model, skeleton, skeleton_scores, k, enc, self.banned, self.mask, self.eos, self.pad, vocab,
            bidirectional=bidirectional, refine_fraction=self.refine_fraction,
        )
        final_scores = pos_scores.sum(dim=1) / lengths.float().pow(self.len_penalty)
        # stage II's confidence: the mean log-probability of the tokens it filled (kept ones)
        filled_slots = stage2.tokens.eq(self.mask) & tokens.ne(self.pad)
        confidence = (pos_scores * filled_slots).sum(dim=1) / filled_slots.sum(dim=1).clamp(min=1)

        filled = []
        for r in range(len(rows)):
            n = int(lengths[r])
            hypo = hypothesis(tokens[r, :n], final_scores[r], pos_scores[r, :n], steps=int(rows[r]["tokens"].numel()))
            hypo["stage2_confidence"] = confidence[r]
            filled.append(hypo)
            if self.print_steps:
                logger.info(
                    "HRT k=%d stage I: %s | stage II: %s",
                    k,
                    self.tgt_dict.string(stage2.tokens[r][stage2.tokens[r].ne(self.pad)]),
                    self.tgt_dict.string(tokens[r, :n]),
                )
        return filled


def fill_skeletons(model, skeleton: Tensor, skeleton_scores: Tensor, k: int, encoder_out, banned: Tensor,
                   mask: int, eos: int, pad: int, vocab: Optional[Tensor] = None, bidirectional: Optional[Callable] = None,
                   refine_fraction: float = 0.0):
    """Stage II proper: one bidirectional pass over right-padded skeletons ``(B, M)`` (each
    ending in ``</s>``) with ``k - 1`` masks before every token, argmax in the masks.
    ``vocab``: the sorted target ids the masks may take (a shortlist's candidates; their
    log-probabilities are normalised over these ids), default all. ``bidirectional``: the
    decoder pass ``(encoder, tokens, positions) -> features`` (the lean
    :meth:`DecoderPass.bidirectional`, ``encoder_out`` then its encoder keys/values; default:
    the decoder module).

    ``skeleton_scores`` are the stage-I log-probabilities of the skeleton tokens (zeros when
    a skeleton does not come from stage I, e.g. an oracle's); ``encoder_out`` has one row per
    skeleton. Returns ``(stage2 input, tokens, positional_scores, lengths)`` as
    :func:`stage2_fill`. ``refine_fraction``: see :class:`HRTGenerator` (one more pass).
    """
    stage2 = chunking.stage2_input(skeleton, k, pad, mask)
    spread_scores = skeleton_scores.new_zeros(stage2.tokens.shape)
    spread_scores[stage2.target.ne(pad)] = skeleton_scores[skeleton.ne(pad)]

    # the masks sit in the k - 1 first columns of every chunk: the pass's last layer computes
    # its output there only (keys and values at every slot), and the output layer projects
    # the masks alone, so stage I plus stage II cost no more output-layer work than AT does
    queries = torch.from_numpy(mask_columns(stage2.tokens.size(1), k)).to(stage2.tokens.device)

    def features_of(tokens):
        if bidirectional is not None:
            return bidirectional(encoder_out, tokens, stage2.positions, queries)
        return model.decoder(tokens, encoder_out=encoder_out, positions=stage2.positions, causal=False,
                             features_only=True)[0].index_select(1, queries)

    output = OutputLayer(model.decoder, banned, vocab)
    is_mask = stage2.tokens.eq(mask)
    mask_lprobs, mask_tokens = output.best(features_of(stage2.tokens)[is_mask.index_select(1, queries)])
    if refine_fraction > 0:
        mask_tokens, mask_lprobs = refine_fill(stage2.tokens, is_mask, mask_tokens, mask_lprobs, refine_fraction,
                                               features_of, output, mask, queries)
    tokens, pos_scores, lengths = stage2_fill(mask_tokens, mask_lprobs, stage2, spread_scores, mask, eos, pad)
    return stage2, tokens, pos_scores, lengths


def refine_counts(masks: Tensor, fraction: float) -> Tensor:
    """Masks re-predicted per row by the refinement pass: ``ceil(fraction x masks)``."""
    return torch.ceil(masks.double() * fraction).long()


def refine_fill(tokens: Tensor, is_mask: Tensor, mask_tokens: Tensor, mask_lprobs: Tensor, fraction: float,
                features_of: Callable[[Tensor], Tensor], output: OutputLayer, mask: int, queries: Tensor):
    """One refinement pass over a stage-II fill: the :func:`refine_counts` filled tokens of
    each row with the lowest probability are masked again and predicted from the rest (one
    non-causal pass; ``features_of`` gives the features at the columns ``queries``, which
    hold every mask). Returns the new ``(mask_tokens, mask_lprobs)``, in the order of
    ``tokens[is_mask]``."""
    filled = tokens.masked_scatter(is_mask, mask_tokens.to(tokens))
    scores = torch.zeros(tokens.shape, dtype=mask_lprobs.dtype, device=tokens.device).masked_scatter(is_mask, mask_lprobs)
    remask = lowest_confidence_mask(scores, is_mask, refine_counts(is_mask.sum(dim=1), fraction))
    if not bool(remask.any()):
        return mask_tokens, mask_lprobs
    lprobs, best = output.best(features_of(filled.masked_fill(remask, mask))[remask.index_select(1, queries)])
    filled = filled.masked_scatter(remask, best.to(filled))
    scores = scores.masked_scatter(remask, lprobs.to(scores))
    return filled[is_mask], scores[is_mask]


def at_mode_scores(model, encoder_out, candidates: List[Tensor], eos: int, pad: int, len_penalty: float):
    """Exact AT-mode scores of ``candidates`` (token rows ending in ``</s>``; ``encoder_out``
    has one row per candidate): one teacher-forced causal pass from ``</s>``, as AT-mode
    greedy/beam search scores its outputs. Returns ``(scores, per-token log-probabilities)``:
    the sum divided by ``length ** len_penalty``, and ``(N, T)`` padded with 0."""
    target = _pad_stack(candidates, pad).to(encoder_out["encoder_out"][0].device)
    prev = torch.cat([target.new_full((target.size(0), 1), eos), target[:, :-1]], dim=1).masked_fill(target.eq(pad), pad)
    logits, _ = model.decoder(prev, encoder_out=encoder_out)
    lprobs = torch.log_softmax(logits.float(), dim=-1).gather(2, target.unsqueeze(2)).squeeze(2)
    lprobs = lprobs.masked_fill(target.eq(pad), 0.0)
    lengths = target.ne(pad).sum(dim=1).float()
    return lprobs.sum(dim=1) / lengths.pow(len_penalty), lprobs


def check_hrt_options(refine_fraction: float, fallback_threshold: Optional[float]):
    """One clear error for impossible values of the options beyond the papers."""
    if not 0.0 <= refine_fraction <= 1.0:
        raise ValueError(f"--hrt-refine-fraction must be in [0, 1] (0 = no refinement pass), got {refine_fraction}")
    if fallback_threshold is not None and fallback_threshold > 0:
        raise ValueError(f"--hrt-fallback-threshold is a mean log-probability (<= 0), got {fallback_threshold}")


def _pad_stack(tensors: List[Tensor], value) -> Tensor:
    width = max(t.numel() for t in tensors)
    out = tensors[0].new_full((len(tensors), width), value)
    for i, t in enumerate(tensors):
        out[i, : t.numel()] = t
    return out




# ------------------------------------------------------------------------ strategies


def left_to_right_generators(ctx: DecodingContext, banned: List[int], keep_encoder_out: bool = True) -> Callable[[int], object]:
    """``k -> `` the engine's left-to-right generator for at most ``L / k`` steps
    (``L = max_len_a * src_len + max_len_b``), never producing ``banned``; built once per k."""
    built: Dict[int, object] = {}

    def generator(k: int):
        if k not in built:
            built[k] = ctx.engine.left_to_right(ctx, ctx.options.search.for_chunk_size(k), banned, keep_encoder_out)
        return built[k]

    return generator


def build_hrt_generator(ctx: DecodingContext, chunk_size) -> HRTGenerator:
    task, model, options = ctx.task, ctx.model, ctx.options
    b_at = options.search.beam
    if b_at < 1:
        raise ValueError("--beam (b_at) must be >= 1")
    if len(ctx.models) != 1:
        raise ValueError("HRT decoding supports a single model (no ensembles)")
    generator = ctx.engine.two_stage(ctx, chunk_size)
    if generator is not None:
        logger.info("HRT decoding: chunk size %s, b_at %d, b_nat %d, %s engine", chunk_size, b_at, options.b_nat, ctx.engine.name)
        return generator
    generator = HRTGenerator(
        left_to_right_generators(ctx, ctx.banned()),
        model,
        task.target_dictionary,
        chunk_start=task.chunk_start_idx,
        mask=task.mask_idx,
        chunk_size=chunk_size,
        b_at=b_at,
        len_penalty=options.search.len_penalty,
        b_nat=options.b_nat,
        print_steps=options.print_step,
        shortlist=ctx.shortlist,
        bidirectional=ctx.engine.bidirectional(model),
        refine_fraction=options.hrt_refine_fraction,
        fallback_threshold=options.hrt_fallback_threshold,
        rescore=options.hrt_rescore,
    )
    if chunk_size == 1 and options.b_nat == 1:
        logger.info("HRT decoding in AT mode (chunk size 1) from </s>, %s engine", ctx.engine.name)
    else:
        logger.info("HRT decoding: chunk size %s, b_at %d, b_nat %d, %s engine", chunk_size, b_at, options.b_nat,
                    ctx.engine.name)
    return generator


def check_at_mode(ctx: DecodingContext, what: str):
    """Strategies that decode left to right from ``</s>`` (an HRT model in its AT mode)
    refuse another chunk size and stage II's options."""
    if is_hrt(ctx.model) and ctx.options.decode_chunk_size not in ("auto-trained", "1"):
        raise ValueError(f"{what} decodes an HRT model in AT mode; drop --decode-chunk-size or use --decoding hrt")
    used = ctx.options.stage2_options_used()
    if used:
        raise ValueError(f"{what} has no stage II: {', '.join(used)} apply to --decoding hrt with a chunk size > 1")


@register_decoding("beam")
class BeamDecoding(LeftToRightDecoding):
    """Left-to-right beam search (greedy at --beam 1) from ``</s>``: the default of AT models;
    an HRT model decodes so in its AT mode (chunk size 1)."""

    supports_shortlist = True
    supports_compile = True

    @classmethod
    def is_default_for(cls, model):
        return model_kind(model) == AT

    @classmethod
    def build(cls, ctx: DecodingContext):
        check_at_mode(ctx, "--decoding beam")
        if is_hrt(ctx.model):
            return build_hrt_generator(ctx, 1)
        logger.info("left-to-right decoding (beam %s), %s engine", ctx.options.search.beam, ctx.engine.name)
        return left_to_right_generators(ctx, ctx.banned(), keep_encoder_out=False)(1)


@register_decoding("hrt")
class HRTDecoding(DecodingStrategy):
    """Two-stage hybrid-regressive decoding (``--decode-chunk-size``, ``--b-nat``)."""

    supports_shortlist = True
    supports_compile = True  # stage I and AT mode; stage II is one pass

    @classmethod
    def supports(cls, model):
        if not is_hrt(model):
            return f"HRT decoding needs an HRT model (--arch hrt_*), not a {type(model).__name__}"
        return None

    @classmethod
    def is_default_for(cls, model):
        return is_hrt(model)

    @classmethod
    def build(cls, ctx: DecodingContext):
        chunk_size = resolve_decode_chunk_size(ctx.options.decode_chunk_size, ctx.model.get_trained_chunk_sizes())
        return build_hrt_generator(ctx, chunk_size)
