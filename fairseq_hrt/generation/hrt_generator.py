"""Two-stage HRT decoding (SPEC section 3).

Stage I (Skip-AT) is fairseq's own :class:`SequenceGenerator` started from ``<s_k>``: the HRT
decoder derives positions ``0, k, 2k, ..`` from that start symbol, so beam search, length
penalty, incremental state and the removal of finished sentences from the active batch are
exactly fairseq's (and exactly what the AT baseline it is compared with uses). Stage II is one
bidirectional pass over the top ``b_nat`` skeletons with ``k - 1`` masks before every ``z_i``.
"""
import logging
import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from torch import Tensor

from fairseq_hrt import chunking

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
        stage1: fairseq ``SequenceGenerator`` with ``beam_size = b_at`` and fairseq's options
        chunk_start: ``{k: index of <s_k>}``
        b_nat: skeletons per sentence filled by stage II (``<= b_at``)
        chunk_size: ``k`` for every sentence, or a function ``src_lengths -> (B,) chunk sizes``
    """

    def __init__(
        self,
        stage1: SequenceGenerator,
        tgt_dict,
        chunk_start: Dict[int, int],
        mask: int,
        chunk_size,
        b_nat: int = 1,
        print_steps: bool = False,
    ):
        b_at = stage1.beam_size
        if b_nat < 1:
            raise ValueError(f"--b-nat must be >= 1, got {b_nat}")
        if b_nat > b_at:
            raise ValueError(
                f"HRT decoding needs b_at >= b_nat, got --beam {b_at} < --b-nat {b_nat}: "
                "stage II fills the top b_nat Skip-AT hypotheses"
            )
        if len(stage1.model.models) != 1:
            raise ValueError("HRT decoding supports a single model (no ensembles)")
        self.stage1 = stage1
        # keep the encoder output of stage I for stage II (never run the encoder twice)
        self.stage1.model = _EncoderCachingEnsemble(stage1.model.models)
        self.model = self.stage1.model.models[0]
        self.tgt_dict = tgt_dict
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.mask = mask
        self.chunk_start = chunk_start
        self.chunk_size = chunk_size
        self.b_nat = b_nat
        self.print_steps = print_steps
        self.max_len_a, self.max_len_b = stage1.max_len_a, stage1.max_len_b
        # symbols no stage may produce: <mask>, the start symbols <s>, <s_k> (and <pad>)
        banned = [self.mask, tgt_dict.bos()] + list(chunk_start.values())
        if stage1.token_indices_to_suppress is not None:
            banned += stage1.token_indices_to_suppress.tolist()
        stage1.token_indices_to_suppress = torch.tensor(sorted(set(banned)), dtype=torch.long)
        self.banned = torch.tensor(sorted(set(banned + [self.pad])), dtype=torch.long)

    def cuda(self):
        self.stage1.cuda()
        return self

    # fairseq's generate loop calls generator.generate(models, sample, prefix_tokens=..., ...)
    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], **kwargs) -> List[List[Dict[str, Tensor]]]:
        if kwargs.get("prefix_tokens") is not None:
            raise ValueError("HRT decoding does not support --prefix-size")
        if kwargs.get("constraints") is not None:
            raise ValueError("HRT decoding does not support lexical constraints")
        net_input = sample["net_input"]
        src_lengths = net_input["src_tokens"].ne(self.pad).long().sum(dim=1)
        if callable(self.chunk_size):
            per_row = self.chunk_size(src_lengths).tolist()
        else:
            per_row = [int(self.chunk_size)] * src_lengths.numel()
        results: List[Optional[List[Dict[str, Tensor]]]] = [None] * len(per_row)
        for k in sorted(set(per_row)):
            rows = [i for i, kk in enumerate(per_row) if kk == k]
            sub = sample if len(rows) == len(per_row) else _select_rows(sample, rows)
            for i, hypos in zip(rows, self._generate_k(sub, k)):
                results[i] = hypos
        return results

    def _generate_k(self, sample, k: int):
        seq_gen = self.stage1
        # stage I makes at most L / k steps (L = max_len_a * src_len + max_len_b)
        seq_gen.max_len_a, seq_gen.max_len_b = self.max_len_a / k, int(self.max_len_b // k)
        try:
            skeletons = seq_gen._generate(sample, bos_token=None if k == 1 else self.chunk_start[k])
        finally:
            seq_gen.max_len_a, seq_gen.max_len_b = self.max_len_a, self.max_len_b
        if k == 1:
            return skeletons  # AT mode: no stage II
        return self._stage2(skeletons, k, seq_gen.model.last_encoder_outs[0])

    def _stage2(self, skeletons, k: int, encoder_out):
        device = encoder_out["encoder_out"][0].device
        rows, sentence_of_row = [], []
        for sent, hypos in enumerate(skeletons):
            for hypo in hypos[: self.b_nat]:
                rows.append(hypo)
                sentence_of_row.append(sent)
        skeleton = _pad_stack([h["tokens"] for h in rows], self.pad).to(device)
        skeleton_scores = _pad_stack([h["positional_scores"].float() for h in rows], 0.0).to(device)
        stage2 = chunking.stage2_input(skeleton, k, self.pad, self.mask)
        spread_scores = skeleton_scores.new_zeros(stage2.tokens.shape)
        final = stage2.target.ne(self.pad)
        spread_scores[final] = skeleton_scores[skeleton.ne(self.pad)]

        enc = self.model.encoder.reorder_encoder_out(
            encoder_out, torch.tensor(sentence_of_row, dtype=torch.long, device=device)
        )
        features, _ = self.model.decoder(
            stage2.tokens, encoder_out=enc, positions=stage2.positions, causal=False, features_only=True
        )
        # only the k - 1 masks of every chunk are predicted: projecting just them onto the
        # vocabulary keeps stage II's output layer at (k - 1) / k of a full pass, so stage I
        # plus stage II cost no more output-layer work than AT decoding does
        logits = self.model.decoder.output_layer(features[stage2.tokens.eq(self.mask)])
        lprobs = F.log_softmax(logits.float(), dim=-1)
        lprobs[:, self.banned.to(device)] = -math.inf
        mask_lprobs, mask_tokens = lprobs.max(dim=-1)
        tokens, pos_scores, lengths = stage2_fill(
            mask_tokens, mask_lprobs, stage2, spread_scores, self.mask, self.eos, self.pad
        )
        lenpen = self.stage1.len_penalty
        final_scores = pos_scores.sum(dim=1) / lengths.float().pow(lenpen)

        out: List[List[Dict[str, Tensor]]] = [[] for _ in skeletons]
        for r, sent in enumerate(sentence_of_row):
            n = int(lengths[r])
            hypo = {
                "tokens": tokens[r, :n],
                "score": final_scores[r],
                "positional_scores": pos_scores[r, :n],
                "attention": None,
                "alignment": None,
                "steps": int(rows[r]["tokens"].numel()),
            }
            out[sent].append(hypo)
            if self.print_steps:
                logger.info(
                    "HRT k=%d stage I: %s | stage II: %s",
                    k,
                    self.tgt_dict.string(stage2.tokens[r][stage2.tokens[r].ne(self.pad)]),
                    self.tgt_dict.string(tokens[r, :n]),
                )
        for hypos in out:
            hypos.sort(key=lambda h: float(h["score"]), reverse=True)
        return out


def _pad_stack(tensors: List[Tensor], value) -> Tensor:
    width = max(t.numel() for t in tensors)
    out = tensors[0].new_full((len(tensors), width), value)
    for i, t in enumerate(tensors):
        out[i, : t.numel()] = t
    return out


def _select_rows(sample, rows: List[int]):
    """The sub-batch of ``sample`` with the given rows (net_input and per-row entries)."""
    index = torch.tensor(rows, dtype=torch.long, device=sample["net_input"]["src_tokens"].device)
    bsz = sample["net_input"]["src_tokens"].size(0)

    def select(value):
        if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) == bsz:
            return value.index_select(0, index)
        if isinstance(value, dict):
            return {k: select(v) for k, v in value.items()}
        return value

    return {k: select(v) for k, v in sample.items()}
