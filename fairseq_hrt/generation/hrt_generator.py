"""Two-stage HRT decoding (SPEC section 3) and the left-to-right strategies ``beam`` / ``hrt``.

Both stages are the one search's (:func:`hrt_runtime.search.hrt`): stage I (Skip-AT) a
left-to-right search started from ``<s_k>`` (the HRT decoder derives positions ``0, k, 2k, ..``
from that start symbol), stage II one non-causal pass over the top ``b_nat`` skeletons with
``k - 1`` masks before every ``z_i``, on groups of skeletons of similar length. The ``lean``
and ``onnxruntime`` engines run them inside their generators; :class:`HRTGenerator` composes
stage I of another engine (fairseq's ``SequenceGenerator``) or the options beyond the papers
with the same stage II.
"""

import logging
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.chunk_size import decode_by_chunk_size, resolve_decode_chunk_size
from fairseq_hrt.generation.hypotheses import reject_unsupported_inputs, select_rows, to_fairseq
from fairseq_hrt.generation.strategies import DecodingContext, DecodingStrategy, LeftToRightDecoding, register_decoding
from fairseq_hrt.models.kinds import family_of
from fairseq_hrt.passes.search_rules import banned_symbols_of
from hrt_runtime.search import check_b_nat, stage2

logger = logging.getLogger(__name__)


class HRTGenerator:
    """Hybrid-regressive decoding composed from an engine's left-to-right generator (stage I)
    and the one search's stage II (:func:`hrt_runtime.search.stage2` over the engine's backend,
    :meth:`DecoderEngine.backend`), with the options beyond the papers.
    The plain two stages of the ``lean`` and ``onnxruntime`` engines run inside their
    generators; this one serves ``--decoder-engine fairseq`` (fairseq's ``SequenceGenerator``
    in stage I) and the options below.

    Args:
        stage1: ``k -> `` left-to-right generator for chunk size ``k`` (``generate(models,
            sample, bos_token=...)``, its last batch's encoding ``last_encoded`` in ``backend``'s
            form and shortlist rows ``last_vocab``: :meth:`DecoderEngine.stage1`), with beam
            ``b_at`` and at most ``L / k`` steps
        backend: the backend of the one search that runs stage II (``parallel``)
        chunk_start: ``{k: index of <s_k>}``
        b_nat: skeletons per sentence filled by stage II (``<= b_at``)
        chunk_size: ``k`` for every sentence, or a function ``src_lengths -> (B,) chunk sizes``
        bucket_padding: stage II runs on groups of skeletons in which no skeleton is padded
            by more than this fraction of its length plus one token (:func:`length_buckets`)
        shortlist: a lexical shortlist (:mod:`fairseq_hrt.shortlist`): stage II predicts the
            masks among the batch's candidates, the same ones stage I searched over

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
        refine_fraction: float = 0.0,
        fallback_threshold: Optional[float] = None,
        rescore: bool = False,
        *,
        backend,
    ):
        check_hrt_options(refine_fraction, fallback_threshold)
        check_b_nat(b_at, b_nat)
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
        self.refine_fraction = refine_fraction
        self.fallback_threshold = fallback_threshold
        self.rescore = rescore
        self.backend = backend  # stage II's arithmetic
        self.banned = banned_symbols_of(family_of(model), tgt_dict, mask, chunk_start)

    # fairseq's generate loop calls generator.generate(models, sample, prefix_tokens=..., ...)
    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], **kwargs) -> List[List[Dict[str, Tensor]]]:
        reject_unsupported_inputs("HRT decoding", **kwargs)
        src_tokens = sample["net_input"]["src_tokens"]

        def decode(k: int, rows):
            sub = sample if rows.size == src_tokens.size(0) else select_rows(sample, rows.tolist())
            return self._generate_k(sub, k)

        return decode_by_chunk_size(self.chunk_size, src_tokens, self.pad, decode)

    def _generate_k(self, sample, k: int):
        stage1 = self.stage1(k)
        skeletons = stage1.generate([self.model], sample, bos_token=None if k == 1 else self.chunk_start[k])
        if k == 1:
            return skeletons  # AT mode: no stage II
        vocab = None
        if self.shortlist is not None:
            vocab = stage1.last_vocab
            if vocab is None:
                vocab = self.shortlist.candidates(sample["net_input"]["src_tokens"], self.pad)
        encoded = stage1.last_encoded
        results = self._stage2(skeletons, k, encoded, vocab)
        if self.rescore:
            results = self._rescore(results, encoded.encoder_out)
        if self.fallback_threshold is not None:
            low = [
                i for i, hypos in enumerate(results) if float(hypos[0]["stage2_confidence"]) < self.fallback_threshold
            ]
            if low:
                for i, hypos in zip(low, self._generate_k(select_rows(sample, low), 1)):
                    results[i] = hypos
        return results

    def _rescore(self, results, encoder_out):
        """Every sentence's candidates scored by the model in AT mode (one teacher-forced pass
        over all of them) and ranked by that score."""
        candidates = [(sent, hypo) for sent, hypos in enumerate(results) for hypo in hypos]
        device = encoder_out["encoder_out"][0].device
        index = torch.tensor([sent for sent, _ in candidates], dtype=torch.long, device=device)
        scores, per_token = at_mode_scores(
            self.model,
            self.model.encoder.reorder_encoder_out(encoder_out, index),
            [hypo["tokens"] for _, hypo in candidates],
            self.eos,
            self.pad,
            self.len_penalty,
        )
        for j, (_, hypo) in enumerate(candidates):
            n = hypo["tokens"].numel()
            hypo["score"], hypo["positional_scores"] = scores[j], per_token[j, :n]
        for hypos in results:
            hypos.sort(key=lambda h: float(h["score"]), reverse=True)
        return results

    def _stage2(self, skeletons, k: int, encoded, vocab: Optional[Tensor] = None):
        device = encoded.kv.bias.device
        found = [
            [
                {"tokens": h["tokens"].cpu().numpy(), "positional_scores": h["positional_scores"].float().cpu().numpy()}
                for h in hypos
            ]
            for hypos in skeletons
        ]
        rows = self.backend.rows(None if vocab is None else vocab.cpu().numpy())
        filled = stage2(
            self.backend,
            encoded,
            found,
            k,
            self.banned,
            self.b_nat,
            self.len_penalty,
            rows,
            self.bucket_padding,
            self.refine_fraction,
        )
        if self.print_steps:
            for skeleton, hypos in zip(skeletons, filled):
                logger.info(
                    "HRT k=%d stage I: %s | stage II: %s",
                    k,
                    self.tgt_dict.string(skeleton[0]["tokens"]),
                    self.tgt_dict.string(torch.from_numpy(hypos[0]["tokens"])),
                )
        return to_fairseq(filled, device)


def at_mode_scores(model, encoder_out, candidates: List[Tensor], eos: int, pad: int, len_penalty: float):
    """Exact AT-mode scores of ``candidates`` (token rows ending in ``</s>``; ``encoder_out``
    has one row per candidate): one teacher-forced causal pass from ``</s>``, as AT-mode
    greedy/beam search scores its outputs. Returns ``(scores, per-token log-probabilities)``:
    the sum divided by ``length ** len_penalty``, and ``(N, T)`` padded with 0."""
    target = torch.nn.utils.rnn.pad_sequence(candidates, batch_first=True, padding_value=pad)
    target = target.to(encoder_out["encoder_out"][0].device)
    prev = torch.cat([target.new_full((target.size(0), 1), eos), target[:, :-1]], dim=1).masked_fill(
        target.eq(pad), pad
    )
    logits, _ = model.decoder(prev, encoder_out=encoder_out)
    lprobs = torch.log_softmax(logits.float(), dim=-1).gather(2, target.unsqueeze(2)).squeeze(2)
    lprobs = lprobs.masked_fill(target.eq(pad), 0.0)
    lengths = target.ne(pad).sum(dim=1).float()
    return lprobs.sum(dim=1) / lengths.pow(len_penalty), lprobs


def check_hrt_options(refine_fraction: float, fallback_threshold: Optional[float]):
    """One clear error for impossible values of the options beyond the papers."""
    if not 0.0 <= refine_fraction <= 1.0:
        raise RefusedOptions(f"--hrt-refine-fraction must be in [0, 1] (0 = no refinement pass), got {refine_fraction}")
    if fallback_threshold is not None and fallback_threshold > 0:
        raise RefusedOptions(f"--hrt-fallback-threshold is a mean log-probability (<= 0), got {fallback_threshold}")


# ------------------------------------------------------------------------ strategies


def stage1_generators(ctx: DecodingContext, banned: List[int]) -> Callable[[int], object]:
    """``k -> `` the engine's generator of HRT's stage I (:meth:`DecoderEngine.stage1`) for at
    most ``L / k`` steps (``L = max_len_a * src_len + max_len_b``), never producing ``banned``;
    built once per k."""
    built: Dict[int, object] = {}

    def generator(k: int):
        if k not in built:
            built[k] = ctx.engine.stage1(ctx, ctx.options.search_config.for_chunk_size(k), banned)
        return built[k]

    return generator


def build_hrt_generator(ctx: DecodingContext, chunk_size) -> HRTGenerator:
    task, model, options = ctx.task, ctx.model, ctx.options
    b_at = options.search_config.beam
    if b_at < 1:
        raise RefusedOptions("--beam (b_at) must be >= 1")
    if len(ctx.models) != 1:
        raise RefusedOptions("HRT decoding supports a single model (no ensembles)")
    generator = ctx.engine.two_stage(ctx, chunk_size)
    if generator is not None:
        logger.info(
            "HRT decoding: chunk size %s, b_at %d, b_nat %d, %s engine",
            chunk_size,
            b_at,
            options.b_nat,
            ctx.engine.name,
        )
        return generator
    generator = HRTGenerator(
        stage1_generators(ctx, ctx.banned()),
        model,
        task.target_dictionary,
        chunk_start=task.chunk_start_idx,
        mask=task.mask_idx,
        chunk_size=chunk_size,
        b_at=b_at,
        len_penalty=options.search_config.len_penalty,
        b_nat=options.b_nat,
        print_steps=options.print_step,
        shortlist=ctx.shortlist,
        refine_fraction=options.hrt_refine_fraction,
        fallback_threshold=options.hrt_fallback_threshold,
        rescore=options.hrt_rescore,
        backend=ctx.engine.backend(ctx),
    )
    if chunk_size == 1 and options.b_nat == 1:
        logger.info("HRT decoding in AT mode (chunk size 1) from </s>, %s engine", ctx.engine.name)
    else:
        logger.info(
            "HRT decoding: chunk size %s, b_at %d, b_nat %d, %s engine",
            chunk_size,
            b_at,
            options.b_nat,
            ctx.engine.name,
        )
    return generator


def check_at_mode(ctx: DecodingContext, what: str):
    """Strategies that decode left to right from ``</s>`` (an HRT model in its AT mode)
    refuse another chunk size and stage II's options."""
    if family_of(ctx.model).chunk_sizes and ctx.options.decode_chunk_size not in ("auto-trained", "1"):
        raise RefusedOptions(f"{what} decodes an HRT model in AT mode; drop --decode-chunk-size or use --decoding hrt")
    used = ctx.options.stage2_options_used()
    if used:
        raise RefusedOptions(f"{what} has no stage II: {', '.join(used)} apply to --decoding hrt with a chunk size > 1")


@register_decoding("beam")
class BeamDecoding(LeftToRightDecoding):
    """Left-to-right beam search (greedy at --beam 1) from ``</s>``: the default of AT models;
    an HRT model decodes so in its AT mode (chunk size 1)."""

    supports_shortlist = True
    supports_compile = True

    @classmethod
    def is_default_for(cls, model):
        return family_of(model).left_to_right

    @classmethod
    def build(cls, ctx: DecodingContext):
        check_at_mode(ctx, "--decoding beam")
        if family_of(ctx.model).chunk_sizes:
            return build_hrt_generator(ctx, 1)
        logger.info("left-to-right decoding (beam %s), %s engine", ctx.options.search_config.beam, ctx.engine.name)
        return ctx.engine.left_to_right(ctx, ctx.options.search_config, ctx.banned())


@register_decoding("hrt")
class HRTDecoding(DecodingStrategy):
    """Two-stage hybrid-regressive decoding (``--decode-chunk-size``, ``--b-nat``)."""

    priority = 1  # above beam's claim of every left-to-right model
    supports_shortlist = True
    supports_compile = True  # stage I and AT mode; stage II is one pass

    @classmethod
    def supports(cls, model):
        family = family_of(model)
        if not (family.chunk_sizes and family.non_causal):
            return f"HRT decoding needs an HRT model (--arch hrt_*), not a {type(model).__name__}"
        return None

    @classmethod
    def is_default_for(cls, model):
        return cls.supports(model) is None

    @classmethod
    def build(cls, ctx: DecodingContext):
        chunk_size = resolve_decode_chunk_size(ctx.options.decode_chunk_size, ctx.model.get_trained_chunk_sizes())
        return build_hrt_generator(ctx, chunk_size)
