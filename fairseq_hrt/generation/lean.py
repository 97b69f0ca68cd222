"""The lean left-to-right engine (``--decoder-engine lean``): greedy and beam search over a
Transformer decoder with fairseq's hypotheses at a fraction of fairseq's Python cost.

fairseq's ``SequenceGenerator`` pays, at every step, for the generality of its incremental
state (dictionaries of cached tensors grown with ``torch.cat``, reordered by name), a full
log-softmax over the vocabulary and the bookkeeping of every search strategy. After Amun
(Junczys-Dowmunt et al. 2016), this engine instead:

* runs its own step function over the decoder's modules (the very modules, so
  ``--quantize int8`` and ``model.half()`` apply; the step mode of the decoder's one
  :class:`~fairseq_hrt.generation.decoder_pass.DecoderPass`): self-attention keys/values live in
  buffers preallocated for the maximum length and written in place; the encoder-side
  keys/values are projected once per sentence and shared by its beam;
* drops finished sentences from the active batch and compacts the rest in place;
* never normalises the whole vocabulary: greedy takes the argmax of the logits, beam search
  the k best logits per row, and only those are turned into log-probabilities (with one
  log-sum-exp per row); banned symbols are masked on the logits;
* with a lexical shortlist (``--shortlist``, :mod:`fairseq_hrt.shortlist`) computes the
  output layer only for the batch's candidate tokens (the weight rows are sliced once per
  batch); scores are then log-probabilities over those candidates.

It reproduces ``SequenceGenerator`` (tokens; scores to float rounding): the maximum length
``min(max_len_a * src_len + max_len_b, max positions - 1)`` with ``src_len`` the padded
source width, ``</s>`` forced at the maximum length and banned before ``--min-len``, the
candidate/EOS rules of fairseq's ``BeamSearch`` (2 x beam candidates, EOS only among the
first beam), cumulative scores normalised by ``len ** lenpen``. It supports fairseq's
``transformer`` decoder, the HRT decoder (relative self-attention, positions
``0, k, 2k, ..`` from ``<s_k>``) and the SSRU decoder (``*_ssru``: the recurrence's state is
one ``(rows, C)`` cell per layer, updated in place); with ``--decoder-tie-layers`` the tied
layers share one set of fused weights.
"""
import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from fairseq_hrt.generation.decoder_pass import decoder_pass, profiled
from fairseq_hrt.generation.options import SearchOptions
from fairseq_hrt.generation.output_vocab import OutputVocabulary
from fairseq_hrt.generation.search_rules import SearchRules, greedy_choice  # noqa: F401  (greedy_choice: re-exported)
from fairseq_hrt.generation.strategies import hypothesis, reject_unsupported_inputs

# ------------------------------------------------------------------------- pure functions


def positional_scores(cumulative: Tensor) -> Tensor:
    """Cumulative scores ``(R, T)`` -> per-token scores, as fairseq's ``finalize_hypos``."""
    scores = cumulative.clone()
    scores[:, 1:] = cumulative[:, 1:] - cumulative[:, :-1]
    return scores


def candidates_per_sentence(row_scores: Tensor, row_tokens: Tensor, rows_per_sentence: int, k: int):
    """The ``k`` best of each sentence's ``rows_per_sentence`` rows of candidates.

    ``row_scores`` / ``row_tokens``: ``(N, c)`` best candidates of every row (``N`` rows,
    sentence-major). Returns ``(scores, tokens, beams)``, each ``(N / rows_per_sentence, k)``,
    ``beams`` the row of the candidate within its sentence -- fairseq's ``BeamSearch.step``
    over the whole vocabulary gives the same, as no row can hold more than ``k`` of them.
    """
    c = row_scores.size(1)
    flat_scores = row_scores.view(-1, rows_per_sentence * c)
    scores, index = flat_scores.topk(k, dim=1)
    tokens = row_tokens.view(-1, rows_per_sentence * c).gather(1, index)
    return scores, tokens, torch.div(index, c, rounding_mode="floor")


# ----------------------------------------------------------------------------- generator


class LeanSequenceGenerator:
    """fairseq's ``SequenceGenerator`` interface (``generate(models, sample, bos_token=...)``)
    over the model decoder's :class:`~fairseq_hrt.generation.decoder_pass.DecoderPass`, for one model. ``banned``: symbols never generated (``<pad>``
    always). ``shortlist``: each batch decodes over the candidates of its source tokens only
    (:meth:`Shortlist.candidates`, kept as ``last_vocab``)."""

    def __init__(self, model, tgt_dict, options: SearchOptions, banned: Sequence[int] = (),
                 shortlist=None, compile: bool = False):
        if options.beam < 1:
            raise ValueError("--beam must be >= 1")
        self.model = model
        self.rules = SearchRules(options, tgt_dict, banned)
        # the decoder's one pass (shared with every engine of the model); --compile: this
        # engine's own compiled static step
        self.decoder_pass = decoder_pass(model.decoder)
        self.compile = compile
        self._compiled_step = self.decoder_pass.compiled_step() if compile else None
        self.options = options
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.vocab_size = len(tgt_dict)
        self.max_len_cap = model.max_decoder_positions() - 1
        self.last_encoder_out = None
        self.last_encoder_kv = None  # the last batch's encoder keys/values (HRT's stage II reuses them)
        self.shortlist = shortlist
        self.last_vocab: Optional[Tensor] = None

    def max_len(self, src_tokens: Tensor) -> int:
        return self.options.max_len(src_tokens.size(1), self.max_len_cap)

    @torch.no_grad()
    def generate(self, models, sample, bos_token: Optional[int] = None, **kwargs) -> List[List[Dict[str, Tensor]]]:
        reject_unsupported_inputs("--decoder-engine lean", **kwargs)
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        encoder_out = self._encode(net_input)
        self.last_encoder_out = encoder_out
        start = self.eos if bos_token is None else bos_token
        max_len = self.max_len(src_tokens)
        out = self.rules.full_vocab
        if self.shortlist is not None:
            out = OutputVocabulary(self.shortlist.candidates(src_tokens, self.pad), self.vocab_size, self.eos, self.unk)
        self.last_vocab = out.ids
        if self.options.beam == 1:
            return self._greedy(encoder_out, src_tokens.size(0), max_len, start, out)
        return self._beam(encoder_out, src_tokens.size(0), max_len, start, out)

    @profiled("hrt.encoder")
    def _encode(self, net_input):
        return self.model.encoder.forward_torchscript(net_input)

    def _begin(self, encoder_out, rows: int, max_len: int, start: int, out: OutputVocabulary):
        state = self.decoder_pass.begin(encoder_out, rows, max_len + 1, start, vocab=out.ids, zeroed=self.compile)
        self.last_encoder_kv = state.encoder
        return state

    def _logits(self, state, tokens: Tensor, step: int) -> Tensor:
        if self._compiled_step is None:
            logits = self.decoder_pass.step(state, tokens, step)
        else:
            logits = self._compiled_step(state, tokens, step)
        return self.rules.logits(logits)

    def _normalised(self, cumulative: Tensor, length: int) -> Tensor:
        if self.options.normalize_scores:
            return cumulative / length**self.options.len_penalty
        return cumulative

    def _greedy(self, encoder_out, bsz: int, max_len: int, start: int, out: OutputVocabulary):
        device = encoder_out["encoder_out"][0].device
        state = self._begin(encoder_out, bsz, max_len, start, out)
        tokens = torch.empty(bsz, max_len + 1, dtype=torch.long, device=device)
        cumulative = torch.empty(bsz, max_len + 1, dtype=torch.float32, device=device)
        sentence = torch.arange(bsz, device=device)  # original sentence of each active row
        prev = torch.full((bsz,), start, dtype=torch.long, device=device)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        for step in range(max_len + 1):
            logits = self._logits(state, prev, step)
            score, token = self.rules.greedy(logits, step, max_len, out)
            token = out.to_full(token)
            tokens[:, step] = token
            cumulative[:, step] = score if step == 0 else cumulative[:, step - 1] + score
            done = token.eq(self.eos)
            if step < max_len and not bool(done.any()):
                prev = token
                continue
            finished = done.nonzero().view(-1) if step < max_len else torch.arange(token.numel(), device=device)
            self._finalize(finalized, sentence[finished].tolist(), tokens[finished, : step + 1], cumulative[finished, : step + 1], step)
            keep = (~done).nonzero().view(-1)
            if step == max_len or keep.numel() == 0:
                break
            # finished sentences leave the batch: the rest move to the front of every buffer
            state.reorder_rows(keep, step)
            state.select_sentences(keep)
            tokens[: keep.numel(), : step + 1] = tokens.index_select(0, keep)[:, : step + 1]
            cumulative[: keep.numel(), : step + 1] = cumulative.index_select(0, keep)[:, : step + 1]
            tokens, cumulative = tokens[: keep.numel()], cumulative[: keep.numel()]
            sentence, prev = sentence[keep], token[keep]
        return finalized

    def _finalize(self, finalized, sentences: List[int], tokens: Tensor, cumulative: Tensor, step: int):
        scores = self._normalised(cumulative[:, step], step + 1)
        per_token = positional_scores(cumulative)
        for r, sent in enumerate(sentences):
            finalized[sent].append(hypothesis(tokens[r], scores[r], per_token[r]))

    def _beam(self, encoder_out, bsz: int, max_len: int, start: int, out: OutputVocabulary):
        beam = self.options.beam
        cand_size = 2 * beam
        if cand_size > out.size - 1:
            what = f"a vocabulary of {self.vocab_size}" if out.ids is None else f"the shortlist's {out.size} candidates of this batch"
            raise ValueError(f"--beam {beam} is too large for {what}")
        device = encoder_out["encoder_out"][0].device
        # step 0 runs one row per sentence (fairseq's beams are identical there); from step 1
        # on every sentence has `beam` rows
        state = self._begin(encoder_out, bsz * beam, max_len, start, out)
        tokens = torch.empty(bsz, max_len + 1, dtype=torch.long, device=device)
        cumulative = torch.empty(bsz, max_len + 1, dtype=torch.float32, device=device)
        sentence = torch.arange(bsz, device=device)
        prev = torch.full((bsz,), start, dtype=torch.long, device=device)
        ignore = torch.zeros(bsz, beam, dtype=torch.bool, device=device)
        cand_offsets = torch.arange(cand_size, device=device)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        rows_per_sentence = 1
        for step in range(max_len + 1):
            logits = self._logits(state, prev, step)
            top_logits, top_tokens = self.rules.masked(logits, step, max_len, out).topk(cand_size, dim=1)
            top_tokens = out.to_full(top_tokens)
            row_scores = top_logits - torch.logsumexp(logits, dim=1, keepdim=True)
            if step > 0:
                row_scores = row_scores + cumulative[:, step - 1 : step]
            cand_scores, cand_tokens, cand_beams = candidates_per_sentence(row_scores, top_tokens, rows_per_sentence, cand_size)
            n_sent = cand_scores.size(0)
            cand_rows = cand_beams + torch.arange(n_sent, device=device).unsqueeze(1) * rows_per_sentence

            # finalize hypotheses that end in </s> among the first `beam` candidates
            eos_mask = cand_tokens.eq(self.eos) & cand_scores.ne(-math.inf)
            eos_mask[:, :beam] &= ~ignore
            eos_top = eos_mask[:, :beam]
            finished_sent = []
            if bool(eos_top.any()):
                where = eos_top.nonzero()  # row-major, as fairseq's masked_select
                rows = cand_rows[where[:, 0], where[:, 1]]
                ended = torch.cat([tokens.index_select(0, rows)[:, :step], rows.new_full((rows.numel(), 1), self.eos)], dim=1)
                ended_scores = cand_scores[where[:, 0], where[:, 1]]
                if step > 0:
                    ended_cum = torch.cat([cumulative.index_select(0, rows)[:, :step], ended_scores.unsqueeze(1)], dim=1)
                else:
                    ended_cum = ended_scores.unsqueeze(1)
                scores = self._normalised(ended_scores, step + 1)
                per_token = positional_scores(ended_cum)
                for j, s in enumerate(where[:, 0].tolist()):
                    sent = int(sentence[s])
                    if len(finalized[sent]) < beam:
                        finalized[sent].append(hypothesis(ended[j], scores[j], per_token[j]))
                    if len(finalized[sent]) == beam or step == max_len:
                        finished_sent.append(s)
            if step == max_len:
                break
            if finished_sent:
                keep = torch.ones(n_sent, dtype=torch.bool, device=device)
                keep[finished_sent] = False
                if not bool(keep.any()):
                    break
                kept = keep.nonzero().view(-1)
                eos_mask, cand_rows, cand_scores, cand_tokens, ignore = (
                    t.index_select(0, kept) for t in (eos_mask, cand_rows, cand_scores, cand_tokens, ignore)
                )
                sentence = sentence[kept]
                state.select_sentences(kept)

            # the first `beam` candidates that do not end in </s> continue
            eos_mask[:, :beam] |= ignore
            active_mask = eos_mask.long() * cand_size + cand_offsets
            new_ignore, active = active_mask.topk(beam, dim=1, largest=False)
            ignore = new_ignore.ge(cand_size)
            active_rows = cand_rows.gather(1, active).view(-1)
            prev = cand_tokens.gather(1, active).view(-1)
            tokens = tokens.index_select(0, active_rows)
            cumulative = cumulative.index_select(0, active_rows)
            tokens[:, step] = prev
            cumulative[:, step] = cand_scores.gather(1, active).view(-1)
            state.reorder_rows(active_rows, step)
            rows_per_sentence = beam
        for hypos in finalized:
            hypos.sort(key=lambda h: float(h["score"]), reverse=True)
        return finalized
