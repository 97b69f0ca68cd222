"""The one search -- greedy, beam, HRT's two stages, Mask-Predict -- on numpy arrays, over a
backend of a small contract (docs/design.md): :class:`~hrt_runtime.model.ExportedModel`
(``--decoder-engine onnxruntime`` and the deployed runtime) and the lean engine's
``TorchBackend`` (:mod:`fairseq_hrt.generation.lean`) run the same code, so they give the same
tokens. Its rules are fairseq's: maximum length ``min(a x S + b, max positions - 1)`` (``S``: the padded source
width), ``</s>`` banned before ``min_len`` and forced at the maximum length, the banned
symbols, ``unk_penalty``, fairseq's ``BeamSearch`` (2 x beam candidates, ``</s>`` only among
the first beam), finished sentences leaving the batch, scores normalised by
``length ** len_penalty``. The rules reach the exported step as one additive ``logit_bias``
over the output rows (:class:`Rules`); the step returns only the chosen ids and scores.

HRT (:func:`hrt`): stage I is this search from ``<s_k>`` (positions ``0, k, 2k, ..``) for at
most ``L / k`` steps; stage II puts ``k - 1`` masks before every skeleton token
(:func:`stage2_input`, the numpy twin of :func:`fairseq_hrt.chunking.stage2_input`) and fills
them in one non-causal pass, on groups of skeletons of similar length (:func:`length_buckets`).
"""

import functools
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hrt_runtime.backend import Backend, Rows
from hrt_runtime.errors import Refused

Hypothesis = Dict[str, object]  # tokens (T,) int64, score float, positional_scores (T,) float32[, steps]
# The backend contract: hrt_runtime.backend's Backend (pad/eos/unk/mask/bos, vocab_size,
# max_target_positions, chunk_start, stride_of, rows(ids), begin, step, reorder, greedy_loop,
# parallel) and the Rows its rows(ids) returns (ids, position, positions, to_full). The search
# uses nothing else of a backend, and a backend nothing of the search but the arrays it is given.


@dataclass(frozen=True)
class SearchConfig:
    """fairseq's generation options, with its defaults."""

    beam: int = 5
    max_len_a: float = 0.0
    max_len_b: int = 200
    min_len: int = 1
    normalize_scores: bool = True
    len_penalty: float = 1.0
    unk_penalty: float = 0.0
    # False: the caller reads the hypotheses' tokens only, so a greedy search's steps may skip the
    # log-softmax (Backend.step's ``scores``) and its hypotheses' scores are then NaN; beam search
    # ranks by its scores and always has them
    scores: bool = True

    def for_chunk_size(self, k: int) -> "SearchConfig":
        """Stage I of chunk size ``k`` makes at most ``L / k`` steps."""
        if k == 1:
            return self
        return replace(self, max_len_a=self.max_len_a / k, max_len_b=int(self.max_len_b // k))

    def length_limit(self, source_width: int, cap: int) -> int:
        """``max_len_a x`` the source width ``+ max_len_b``, at most ``cap``."""
        return min(int(self.max_len_a * source_width + self.max_len_b), cap)

    def max_len(self, source_width: int, cap: int) -> int:
        """fairseq's maximum output length: ``max_len_a x`` the padded source width ``+
        max_len_b``, at most ``cap`` (the decoder's positions), with fairseq's check of ``min_len``."""
        max_len = self.length_limit(source_width, cap)
        if self.min_len > max_len:
            raise Refused(
                f"min_len cannot be larger than max_len: min_len {self.min_len}, max_len {max_len} (max_len_a "
                f"{self.max_len_a:g} x source width {source_width} + max_len_b {self.max_len_b}, at most {cap}); "
                "lower min_len or raise max_len_b"
            )
        return max_len


class Rules:
    """The search rules as additive logit biases over the output rows ``rows``: the usual
    one, the one before ``min_len`` (``</s>`` banned too) and the one at the maximum length
    (only ``</s>``)."""

    def __init__(self, config: SearchConfig, eos: int, unk: int, banned: Sequence[int], rows: Rows, size: int):
        self.config = config
        eos_row = rows.position(eos)
        if eos_row is None:
            raise Refused("the shortlist's candidates lack </s>")
        usual = np.zeros(size, np.float32)
        usual[rows.positions(banned)] = -np.inf
        if config.unk_penalty and rows.position(unk) is not None:
            usual[rows.position(unk)] -= config.unk_penalty
        early = usual.copy()
        early[eos_row] = -np.inf
        final = np.full(size, -np.inf, np.float32)
        final[eos_row] = 0.0
        self.usual, self.early, self.final = usual, early, final

    @property
    def biases(self):
        """``(usual, before min_len, at the maximum length)``: what a backend's greedy loop takes."""
        return self.usual, self.early, self.final

    def bias(self, step: int, max_len: int) -> np.ndarray:
        if step >= max_len:
            return self.final
        return self.early if step < self.config.min_len else self.usual


class _AllRows:
    """The whole vocabulary as output rows (what ``rows(None)`` of every backend is): row ``t``
    is token ``t``. The rules over it depend on hashable arguments only, so they are made once
    (:func:`_whole_vocabulary_rules`)."""

    ids = None

    def position(self, token: int) -> Optional[int]:
        return token

    def positions(self, tokens: Sequence[int]) -> List[int]:
        return [int(t) for t in tokens]

    def to_full(self, rows: np.ndarray) -> np.ndarray:
        return rows


@functools.lru_cache(maxsize=256)
def _whole_vocabulary_rules(config: SearchConfig, eos: int, unk: int, banned: Tuple[int, ...], size: int) -> Rules:
    return Rules(config, eos, unk, banned, _AllRows(), size)


@functools.lru_cache(maxsize=256)
def _whole_vocabulary_ban(banned: Tuple[int, ...], size: int) -> np.ndarray:
    bias = np.zeros(size, np.float32)
    bias[list(banned)] = -np.inf
    return bias


def rules_of(config: SearchConfig, eos: int, unk: int, banned: Sequence[int], rows: Rows, size: int) -> Rules:
    """:class:`Rules` of a search (those over the whole vocabulary made once per configuration:
    a search of one sentence would spend a tenth of its own time making them)."""
    if rows.ids is not None:  # a shortlist's rows: its own, per batch
        return Rules(config, eos, unk, banned, rows, size)
    return _whole_vocabulary_rules(config, int(eos), int(unk), tuple(int(b) for b in banned), int(size))


def banned_bias_of(banned: Sequence[int], rows: Rows, size: int) -> np.ndarray:
    """The additive bias banning ``banned`` among the output rows (made once over the whole vocabulary)."""
    if rows.ids is None:
        return _whole_vocabulary_ban(tuple(int(b) for b in banned), int(size))
    bias = np.zeros(size, np.float32)
    bias[rows.positions(banned)] = -np.inf
    return bias


def positional_scores(cumulative: np.ndarray) -> np.ndarray:
    scores = cumulative.copy()
    scores[:, 1:] = cumulative[:, 1:] - cumulative[:, :-1]
    return scores


def position_cap(max_positions: int, stride: int) -> int:
    """The most steps a left-to-right search of ``stride`` may make: fairseq's ``max positions
    - 1`` for AT; for Skip-AT with stride k, step t sits at position t k and stage II fills
    positions up to (steps + 1) k, so ``(max positions - 1) // k - 1``."""
    if stride == 1:
        return max_positions - 1
    return (max_positions - 1) // stride - 1


def left_to_right(
    model: Backend,
    encoded,
    source_width: int,
    config: SearchConfig,
    banned: Sequence[int],
    start: Optional[int] = None,
    rows: Optional[Rows] = None,
) -> List[List[Hypothesis]]:
    """Greedy (``config.beam`` 1) or beam search from ``start`` (default ``</s>``; ``<s_k>``:
    Skip-AT with stride k) for every sentence of ``encoded`` (``model``'s encoding of them)."""
    rows = rows or model.rows(None)
    start = model.eos if start is None else start
    max_len = config.max_len(source_width, position_cap(model.max_target_positions, model.stride_of(start)))
    size = model.vocab_size if rows.ids is None else rows.ids.size
    rules = rules_of(config, model.eos, model.unk, banned, rows, size)
    if config.beam < 1:
        raise Refused("beam must be >= 1")
    if config.beam == 1:
        return _greedy(model, encoded, max_len, start, rules, rows, config)
    if 2 * config.beam > size - 1:
        raise Refused(
            f"beam {config.beam} is too large for the {size} output rows of this batch: at most {(size - 1) // 2}"
        )
    return _beam(model, encoded, max_len, start, rules, rows, config)


def _normalised(config: SearchConfig, cumulative, length: int):
    return cumulative / length**config.len_penalty if config.normalize_scores else cumulative


def _finalize(config, finalized, sentences, tokens, cumulative, step):
    scores = _normalised(config, cumulative[:, step], step + 1)
    per_token = positional_scores(cumulative)
    for r, sent in enumerate(sentences):
        finalized[sent].append(
            {"tokens": tokens[r].copy(), "score": float(scores[r]), "positional_scores": per_token[r].copy()}
        )


def _looped(config, eos: int, tokens: np.ndarray, scores: np.ndarray) -> List[List[Hypothesis]]:
    """The hypotheses of a backend's greedy loop (``tokens``, ``scores``: ``(N, T)``, every
    step of every row): each row up to its first ``</s>`` (the loop's last step: the maximum
    length), scored as :func:`_greedy` scores its own steps (the same float32 running sum)."""
    cumulative = np.cumsum(scores, axis=1, dtype=np.float32)
    ended = tokens == eos
    ends = np.where(ended.any(axis=1), ended.argmax(axis=1), tokens.shape[1] - 1)
    finalized: List[List[Hypothesis]] = [[] for _ in range(tokens.shape[0])]
    for r, end in enumerate(ends.tolist()):
        _finalize(config, finalized, [r], tokens[r : r + 1, : end + 1], cumulative[r : r + 1, : end + 1], end)
    return finalized


def _greedy(model: Backend, encoded, max_len, start, rules, rows, config):
    looped = model.greedy_loop(encoded, start, max_len, config.min_len, rules.biases, rows)
    if looped is not None:
        return _looped(config, model.eos, *looped)
    bsz = encoded.size
    tokens = np.empty((bsz, max_len + 1), np.int64)
    cumulative = np.empty((bsz, max_len + 1), np.float32)
    sentence = np.arange(bsz)
    prev = np.full(bsz, start, np.int64)
    state = model.begin(encoded, bsz, max_len + 1, start, rows)
    finalized: List[List[Hypothesis]] = [[] for _ in range(bsz)]
    for step in range(max_len + 1):
        score, row = model.step(state, prev, step, rules.bias(step, max_len), scores=config.scores)
        token = rows.to_full(row)
        tokens[:, step] = token
        if score is None:  # a step without scores (config.scores false)
            cumulative[:, step] = np.nan
        else:
            cumulative[:, step] = score if step == 0 else cumulative[:, step - 1] + score
        done = token == model.eos
        if step < max_len and not done.any():
            prev = token
            continue
        finished = np.flatnonzero(done) if step < max_len else np.arange(token.size)
        _finalize(
            config,
            finalized,
            sentence[finished].tolist(),
            tokens[finished, : step + 1],
            cumulative[finished, : step + 1],
            step,
        )
        keep = np.flatnonzero(~done)
        if step == max_len or keep.size == 0:
            break
        # finished sentences leave the batch
        model.reorder(state, keep, step, sentences=keep)
        tokens, cumulative = tokens[keep], cumulative[keep]
        sentence, prev = sentence[keep], token[keep]
    return finalized


def _top(values: np.ndarray, k: int):
    """``(values, index)`` of the ``k`` largest of every row, best first (ties: lower index first)."""
    index = np.argsort(-values, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(values, index, axis=1), index


def candidates_per_sentence(row_scores: np.ndarray, row_tokens: np.ndarray, rows_per_sentence: int, k: int):
    """The ``k`` best of each sentence's ``rows_per_sentence`` rows of candidates.

    ``row_scores`` / ``row_tokens``: ``(N, c)`` best candidates of every row (``N`` rows,
    sentence-major). Returns ``(scores, tokens, beams)``, each ``(N / rows_per_sentence, k)``,
    ``beams`` the row of the candidate within its sentence -- fairseq's ``BeamSearch.step``
    over the whole vocabulary gives the same, as no row can hold more than ``k`` of them."""
    c = row_scores.shape[1]
    flat = row_scores.reshape(-1, rows_per_sentence * c)
    scores, index = _top(flat, k)
    tokens = np.take_along_axis(row_tokens.reshape(flat.shape[0], -1), index, axis=1)
    return scores, tokens, index // c


def _beam(model: Backend, encoded, max_len, start, rules, rows, config):
    beam = config.beam
    cand_size = 2 * beam
    bsz = encoded.size
    tokens = np.empty((bsz, max_len + 1), np.int64)
    cumulative = np.empty((bsz, max_len + 1), np.float32)
    sentence = np.arange(bsz)
    prev = np.full(bsz, start, np.int64)
    ignore = np.zeros((bsz, beam), bool)
    cand_offsets = np.arange(cand_size)
    finalized: List[List[Hypothesis]] = [[] for _ in range(bsz)]
    # step 0 runs one row per sentence (fairseq's beams are identical there), then `beam`
    state = model.begin(encoded, bsz * beam, max_len + 1, start, rows)
    rows_per_sentence = 1
    for step in range(max_len + 1):
        row_scores, top_rows = model.step(state, prev, step, rules.bias(step, max_len), top=cand_size)
        top_tokens = rows.to_full(top_rows)
        if step > 0:
            row_scores = row_scores + cumulative[:, step - 1 : step]
        cand_scores, cand_tokens, cand_beams = candidates_per_sentence(
            row_scores, top_tokens, rows_per_sentence, cand_size
        )
        n_sent = cand_scores.shape[0]
        cand_rows = cand_beams + (np.arange(n_sent) * rows_per_sentence)[:, None]

        eos_mask = (cand_tokens == model.eos) & (cand_scores != -np.inf)
        eos_mask[:, :beam] &= ~ignore
        eos_top = eos_mask[:, :beam]
        finished_sent = []
        kept = None
        if eos_top.any():
            where = np.argwhere(eos_top)  # row-major, as fairseq
            ended_rows = cand_rows[where[:, 0], where[:, 1]]
            ended = np.concatenate(
                [tokens[ended_rows, :step], np.full((ended_rows.size, 1), model.eos, np.int64)], axis=1
            )
            ended_scores = cand_scores[where[:, 0], where[:, 1]]
            if step > 0:
                ended_cum = np.concatenate([cumulative[ended_rows, :step], ended_scores[:, None]], axis=1)
            else:
                ended_cum = ended_scores[:, None]
            scores = _normalised(config, ended_scores, step + 1)
            per_token = positional_scores(ended_cum)
            for j, s in enumerate(where[:, 0].tolist()):
                sent = int(sentence[s])
                if len(finalized[sent]) < beam:
                    finalized[sent].append(
                        {"tokens": ended[j], "score": float(scores[j]), "positional_scores": per_token[j]}
                    )
                if len(finalized[sent]) == beam or step == max_len:
                    finished_sent.append(s)
        if step == max_len:
            break
        if finished_sent:
            keep = np.ones(n_sent, bool)
            keep[finished_sent] = False
            if not keep.any():
                break
            kept = np.flatnonzero(keep)
            eos_mask, cand_rows, cand_scores, cand_tokens, ignore = (
                a[kept] for a in (eos_mask, cand_rows, cand_scores, cand_tokens, ignore)
            )
            sentence = sentence[kept]
        eos_mask[:, :beam] |= ignore
        active_mask = eos_mask.astype(np.int64) * cand_size + cand_offsets
        active = np.argsort(active_mask, axis=1, kind="stable")[:, :beam]
        ignore = np.take_along_axis(active_mask, active, axis=1) >= cand_size
        active_rows = np.take_along_axis(cand_rows, active, axis=1).reshape(-1)
        prev = np.take_along_axis(cand_tokens, active, axis=1).reshape(-1)
        tokens = tokens[active_rows]
        cumulative = cumulative[active_rows]
        tokens[:, step] = prev
        cumulative[:, step] = np.take_along_axis(cand_scores, active, axis=1).reshape(-1)
        model.reorder(state, active_rows, step, sentences=kept)
        rows_per_sentence = beam
    for hypos in finalized:
        hypos.sort(key=lambda h: h["score"], reverse=True)
    return finalized


# ------------------------------------------------------------------------------- HRT


def stage2_input(skeleton: np.ndarray, k, pad: int, mask: int):
    """``(tokens, positions, target)`` of stage II (SPEC section 3): ``k - 1`` masks before
    every skeleton token (``skeleton`` ``(B, M)`` right-padded; ``k`` an int or one per row);
    positions ``1..m k`` (0 on padding); ``target``: the skeleton spread onto its slots, pad
    elsewhere. The one definition: :func:`fairseq_hrt.chunking.stage2_input` wraps it."""
    bsz, m = skeleton.shape
    if isinstance(k, (int, np.integer)):  # one k: every k-th slot of a (B, M, k) block is a skeleton token
        k = int(k)
        tokens = np.full((bsz, m, k), mask, np.int64)
        tokens[:, :, k - 1] = skeleton
        tokens = tokens.reshape(bsz, m * k)
        if bsz == 1 and m and skeleton[0, -1] != pad:  # one unpadded skeleton (greedy, batch 1): no padding
            positions = np.arange(1, m * k + 1)[None, :]
        else:
            steps = (skeleton != pad).sum(axis=1)
            width = int(steps.max()) * k if bsz else 0
            tokens = tokens[:, :width]
            slot = np.arange(width)
            real = slot < (steps * k)[:, None]
            tokens[~real] = pad
            positions = np.where(real, slot + 1, 0)
        return tokens, positions, np.where(tokens == mask, pad, tokens)
    steps = (skeleton != pad).sum(axis=1)
    k = np.asarray(k, np.int64)[:, None]
    width = int((steps[:, None] * k).max()) if bsz else 0
    slot = np.arange(width)[None, :]
    real = slot < steps[:, None] * k
    final = ((slot + 1) % k == 0) & real
    source_index = np.clip((slot + 1) // k - 1, 0, max(m - 1, 0))
    spread = np.take_along_axis(skeleton, source_index, axis=1) if m else np.full((bsz, width), pad)
    tokens = np.where(final, spread, mask)
    tokens[~real] = pad
    positions = np.where(real, slot + 1, 0)
    return tokens.astype(np.int64), positions.astype(np.int64), np.where(final, spread, pad).astype(np.int64)


def mask_columns(width: int, k: int) -> np.ndarray:
    """The columns of a stage-II input of ``width`` slots that may hold masks: the ``k - 1``
    first of every chunk (every ``k``-th holds a skeleton token). The non-causal pass
    computes its last layer at these columns only."""

    return _mask_columns(int(width), int(k))


@functools.lru_cache(maxsize=256)
def _mask_columns(width: int, k: int) -> np.ndarray:
    column = np.arange(width, dtype=np.int64)
    columns = column[(column + 1) % k != 0]
    columns.flags.writeable = False  # shared by every caller
    return columns


def truncate_at_first_eos(tokens: np.ndarray, eos: int, pad: int) -> np.ndarray:
    is_eos = (tokens == eos).astype(np.int64)
    before = np.cumsum(is_eos, axis=1) - is_eos
    return np.where(before > 0, pad, tokens)


def length_buckets(lengths: List[int], max_padding: float) -> List[List[int]]:
    """Group row indices by length so that no row is padded by more than ``max_padding``
    times its own length (plus one token): sorted by length, a group closes when the next
    row is longer than ``(1 + max_padding) * shortest + 1``. Rows keep no order across
    groups; every row is in exactly one group. Stage II runs per group (here and in the
    PyTorch engines' ``HRTGenerator``), so one long skeleton does not pad a whole batch."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    buckets: List[List[int]] = []
    for r in order:
        if buckets and lengths[r] <= (1 + max_padding) * lengths[buckets[-1][0]] + 1:
            buckets[-1].append(r)
        else:
            buckets.append([r])
    return buckets


def chunk_size_groups(per_row: Sequence[int]):
    """``[(k, rows)]``: the rows of a batch (``rows`` an int64 array) that decode with chunk
    size ``k``, smallest k first (``--decode-chunk-size by-length`` gives each sentence its own)."""
    if len(set(per_row)) == 1:  # the usual case: one k for the batch
        return [(int(per_row[0]), np.arange(len(per_row)))]
    per_row = np.asarray(per_row, np.int64)
    return [(int(k), np.flatnonzero(per_row == k)) for k in np.unique(per_row)]


def _pad_stack(arrays: List[np.ndarray], value, dtype) -> np.ndarray:
    out = np.full((len(arrays), max(a.size for a in arrays)), value, dtype)
    for i, a in enumerate(arrays):
        out[i, : a.size] = a
    return out


def refine_counts(masks, fraction: float) -> np.ndarray:
    """Masks re-predicted per row by the refinement pass: ``ceil(fraction x masks)``."""
    return np.ceil(np.asarray(masks, np.float64) * fraction).astype(np.int64)


def fill_masks(
    model: Backend,
    encoded_rows,
    skeleton: np.ndarray,
    skeleton_scores: np.ndarray,
    k: int,
    banned_bias: np.ndarray,
    rows: Rows,
    refine_fraction: float = 0.0,
):
    """Stage II proper: one non-causal pass over right-padded skeletons ``(B, M)`` (each ending
    in ``</s>``; ``encoded_rows``: one row per skeleton) with ``k - 1`` masks before every
    token, the best allowed token in each mask, the output truncated at its first ``</s>``.

    ``skeleton_scores``: the stage-I log-probabilities of the skeleton tokens (zeros for a
    skeleton that does not come from stage I, e.g. an oracle's). ``refine_fraction`` (beyond
    the papers): then the filled tokens with the lowest probability, this fraction of each
    row's masks rounded up, are masked again and predicted from the rest by one more pass.
    Returns ``(tokens, positions, filled, scores, lengths, confidence)``: stage II's input,
    the filled rows (pad after the first ``</s>``), per-slot log-probabilities (0 on padding;
    their sum is eq. (2)), the kept lengths and stage II's confidence (the mean
    log-probability of the tokens it filled and kept)."""
    pad, mask, eos = model.pad, model.mask, model.eos
    if skeleton.shape[0] == 1 and refine_fraction == 0 and skeleton.shape[1] and skeleton[0, -1] != pad:
        return _fill_one(model, encoded_rows, skeleton, skeleton_scores, k, banned_bias, rows)
    tokens, positions, target = stage2_input(skeleton, k, pad, mask)
    bsz, width = tokens.shape
    # the skeleton's scores spread onto its slots, as its tokens
    scores = np.zeros((bsz, skeleton.shape[1], k), np.float32)
    scores[:, :, k - 1] = skeleton_scores
    scores = scores.reshape(bsz, -1)[:, :width].copy()
    is_mask = tokens == mask
    # the masks sit in the k - 1 first columns of every chunk: the pass's last layer is
    # computed there only, and the output layer projects the masks alone (stage I plus
    # stage II then cost no more output-layer work than AT does)
    queries = mask_columns(width, k)
    select = np.flatnonzero(is_mask[:, queries])  # flat into (B, Q)
    filled = tokens.copy()
    if select.size:
        best, best_rows = model.parallel(encoded_rows, tokens, positions, queries, select, banned_bias, rows)
        filled[is_mask] = rows.to_full(best_rows)
        scores[is_mask] = best
        if refine_fraction > 0:
            remask = lowest_confidence_mask(scores, is_mask, refine_counts(is_mask.sum(axis=1), refine_fraction))
            again = np.flatnonzero(remask[:, queries])
            if again.size:
                best, best_rows = model.parallel(
                    encoded_rows, np.where(remask, mask, filled), positions, queries, again, banned_bias, rows
                )
                filled[remask] = rows.to_full(best_rows)
                scores[remask] = best
    filled = truncate_at_first_eos(filled, eos, pad)
    kept = filled != pad
    scores = np.where(kept, scores, 0.0).astype(np.float32)
    lengths = kept.sum(axis=1)
    filled_slots = is_mask & kept
    confidence = (scores * filled_slots).sum(axis=1) / np.maximum(filled_slots.sum(axis=1), 1)
    return tokens, positions, filled, scores, lengths, confidence


def _fill_one(
    model: Backend,
    encoded_rows,
    skeleton: np.ndarray,
    skeleton_scores: np.ndarray,
    k: int,
    banned_bias: np.ndarray,
    rows: Rows,
):
    """:func:`fill_masks` of one unpadded skeleton (greedy at batch 1, the latency case), in
    half the operations: its masks are exactly the query columns."""
    pad, mask, eos = model.pad, model.mask, model.eos
    width = skeleton.shape[1] * k
    tokens = np.full(width, mask, np.int64)
    tokens[k - 1 :: k] = skeleton[0]
    positions = np.arange(1, width + 1)[None, :]
    queries = mask_columns(width, k)
    best, best_rows = model.parallel(
        encoded_rows, tokens[None, :], positions, queries, np.arange(queries.size), banned_bias, rows
    )
    filled = tokens.copy()
    filled[queries] = rows.to_full(best_rows)
    scores = np.zeros(width, np.float32)
    scores[k - 1 :: k] = skeleton_scores[0]
    scores[queries] = best
    n = int(np.flatnonzero(filled == eos)[0]) + 1 if (filled == eos).any() else width
    filled[n:] = pad
    scores[n:] = 0.0
    filled_slots = np.zeros(width, bool)
    filled_slots[queries[queries < n]] = True
    confidence = (scores * filled_slots).sum() / max(int(filled_slots.sum()), 1)  # as fill_masks sums a row
    return tokens[None, :], positions, filled[None, :], scores[None, :], np.array([n]), np.array([confidence])


def fill_skeletons(
    model: Backend,
    encoded,
    skeletons: List[Hypothesis],
    sentence_of_row: List[int],
    k: int,
    banned_bias: np.ndarray,
    len_penalty: float,
    rows: Rows,
    refine_fraction: float = 0.0,
) -> List[Hypothesis]:
    """Stage II over one group of skeletons (each ending in ``</s>``; ``sentence_of_row``:
    the sentence of ``encoded`` each belongs to): their hypotheses, in order."""
    if len(skeletons) == 1:
        skeleton = np.asarray(skeletons[0]["tokens"], np.int64)[None, :]
        skeleton_scores = np.asarray(skeletons[0]["positional_scores"], np.float32)[None, :]
    else:
        skeleton = _pad_stack([np.asarray(h["tokens"], np.int64) for h in skeletons], model.pad, np.int64)
        skeleton_scores = _pad_stack(
            [np.asarray(h["positional_scores"], np.float32) for h in skeletons], 0.0, np.float32
        )
    if list(sentence_of_row) == list(range(encoded.size)):
        rows_encoded = encoded  # one skeleton per sentence, in order (greedy): no copy
    else:
        rows_encoded = encoded.select(np.asarray(sentence_of_row, np.int64))
    tokens, _, filled, scores, lengths, confidence = fill_masks(
        model, rows_encoded, skeleton, skeleton_scores, k, banned_bias, rows, refine_fraction
    )
    final = scores.sum(axis=1) / lengths.astype(np.float32) ** len_penalty
    out = []
    for r in range(len(skeletons)):
        n = int(lengths[r])
        out.append(
            {
                "tokens": filled[r, :n].copy(),
                "score": float(final[r]),
                "positional_scores": scores[r, :n].copy(),
                "steps": int(np.asarray(skeletons[r]["tokens"]).size),
                "stage2_confidence": float(confidence[r]),
            }
        )
    return out


def check_b_nat(b_at: int, b_nat: int):
    """The one check of HRT's beams: ``1 <= b_nat <= b_at``."""
    if b_nat < 1:
        raise Refused(f"--b-nat must be >= 1, got {b_nat}")
    if b_nat > b_at:
        raise Refused(
            f"HRT decoding needs b_at >= b_nat, got --beam {b_at} < --b-nat {b_nat}: "
            "stage II fills the top b_nat Skip-AT hypotheses"
        )


def stage2(
    model: Backend,
    encoded,
    skeletons: List[List[Hypothesis]],
    k: int,
    banned: Sequence[int],
    b_nat: int,
    len_penalty: float,
    rows: Rows,
    bucket_padding: float = 0.25,
    refine_fraction: float = 0.0,
) -> List[List[Hypothesis]]:
    """HRT's stage II: the top ``b_nat`` skeletons of every sentence (stage I's hypotheses,
    best first) filled, on groups of skeletons of similar length (:func:`length_buckets`), so
    that one long skeleton does not make the whole batch pay for its padding; each sentence's
    hypotheses best first (eq. (2) over ``length ** len_penalty``)."""
    size = model.vocab_size if rows.ids is None else rows.ids.size
    banned_bias = banned_bias_of(banned, rows, size)
    flat, sentence_of_row = [], []
    for sent, hypos in enumerate(skeletons):
        for hypo in hypos[:b_nat]:
            flat.append(hypo)
            sentence_of_row.append(sent)
    out: List[List[Hypothesis]] = [[] for _ in skeletons]
    buckets = [[0]] if len(flat) == 1 else length_buckets([np.asarray(h["tokens"]).size for h in flat], bucket_padding)
    for bucket in buckets:
        filled = fill_skeletons(
            model,
            encoded,
            [flat[r] for r in bucket],
            [sentence_of_row[r] for r in bucket],
            k,
            banned_bias,
            len_penalty,
            rows,
            refine_fraction,
        )
        for r, hypo in zip(bucket, filled):
            out[sentence_of_row[r]].append(hypo)
    for hypos in out:
        if len(hypos) > 1:
            hypos.sort(key=lambda h: h["score"], reverse=True)
    return out


def hrt(
    model: Backend,
    encoded,
    source_width: int,
    config: SearchConfig,
    k: int,
    banned: Sequence[int],
    b_nat: int = 1,
    bucket_padding: float = 0.25,
    rows: Optional[Rows] = None,
) -> List[List[Hypothesis]]:
    """Hybrid-regressive decoding with chunk size ``k`` (1: AT mode) and beam ``config.beam``
    (``b_at``) in stage I, ``b_nat`` skeletons per sentence filled by stage II."""
    check_b_nat(config.beam, b_nat)
    rows = rows or model.rows(None)
    if k == 1:
        return left_to_right(model, encoded, source_width, config, banned, rows=rows)
    if k not in model.chunk_start:
        raise Refused(f"chunk size {k}: this model has start symbols for {sorted(model.chunk_start)} only")
    stage1 = config.for_chunk_size(k)
    skeletons = left_to_right(model, encoded, source_width, stage1, banned, start=model.chunk_start[k], rows=rows)
    return stage2(model, encoded, skeletons, k, banned, b_nat, config.len_penalty, rows, bucket_padding)


# ----------------------------------------------------------------------- Mask-Predict


def remask_counts(lengths: np.ndarray, t: int, iterations: int) -> np.ndarray:
    """Tokens re-masked before iteration ``t + 1`` (``t = 1..I-1``): ``floor(N (I - t) / I)``,
    in integers (exact at multiples of ``I``)."""
    if not 1 <= t < iterations:
        raise Refused(f"re-masking happens for t = 1..{iterations - 1}, got t = {t}")
    return lengths * (iterations - t) // iterations


def lowest_confidence_mask(scores: np.ndarray, eligible: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """True at the ``counts[r]`` eligible slots of row ``r`` with the lowest scores (ties: leftmost)."""
    ranked = np.where(eligible, scores, np.inf)
    ranks = np.argsort(np.argsort(ranked, axis=1, kind="stable"), axis=1, kind="stable")
    return (ranks < counts[:, None]) & eligible


def length_candidates(length_lprobs: np.ndarray, beam: int, max_lengths: np.ndarray):
    """The ``beam`` most probable target lengths per sentence within ``1..max_lengths[b]``.

    ``length_lprobs``: ``(B, C)`` log-probabilities of lengths ``0..C-1``. Lengths outside the
    allowed range are never candidates (clamping them would duplicate a candidate); a sentence
    with fewer than ``beam`` allowed lengths repeats its best one. Returns ``(lengths,
    lprobs)``, both ``(B, beam)``, best first (ties: the shorter length)."""
    classes = length_lprobs.shape[-1]
    if beam > classes:
        raise Refused(f"length beam {beam} exceeds the {classes} length classes")
    length = np.arange(classes)[None, :]
    allowed = (length >= 1) & (length <= max_lengths[:, None])
    masked = np.where(allowed, length_lprobs, -np.inf)
    top = np.argsort(-masked, axis=1, kind="stable")[:, :beam]
    top_lprobs = np.take_along_axis(masked, top, axis=1)
    missing = np.isinf(top_lprobs)
    return np.where(missing, top[:, :1], top), np.where(missing, top_lprobs[:, :1], top_lprobs)


def initial_input(lengths: np.ndarray, mask: int, eos: int, pad: int):
    """``<mask> x N </s>`` per row at positions ``1..N+1``, right-padded (positions 0 there)."""
    width = int(lengths.max()) + 1 if lengths.size else 0
    slot = np.arange(width)[None, :]
    n = lengths[:, None]
    tokens = np.where(slot < n, mask, np.where(slot == n, eos, pad)).astype(np.int64)
    return tokens, np.where(slot <= n, slot + 1, 0).astype(np.int64)


def check_mask_predict(iterations: int, length_beam: int):
    """The one check of Mask-Predict's settings: ``I >= 1`` and ``l >= 1``."""
    if iterations < 1:
        raise Refused(f"--iter-decode-max-iter (Mask-Predict's I) must be >= 1, got {iterations}")
    if length_beam < 1:
        raise Refused(f"--iter-decode-with-beam (Mask-Predict's length beam l) must be >= 1, got {length_beam}")


def mask_predict(
    model: Backend,
    encoded,
    src_tokens: np.ndarray,
    iterations: int,
    length_beam: int,
    max_len_a: float,
    max_len_b: int,
    banned: Sequence[int],
    rows: Optional[Rows] = None,
    on_iteration=None,
) -> List[List[Hypothesis]]:
    """Mask-Predict (Ghazvininejad et al. 2019; :mod:`fairseq_hrt.generation.mask_predict`):
    ``length_beam`` lengths per sentence (``encoded.length_lprobs``), ``iterations``
    non-causal passes each re-predicting the least confident tokens; the candidate with the
    best average log-probability first. Every sentence gets exactly ``iterations`` passes (a
    pass whose schedule re-masks nothing still runs: MP(I) costs what its name says).
    ``on_iteration(t, before, after)``: called with the first row's tokens of every pass."""
    check_mask_predict(iterations, length_beam)
    rows = rows or model.rows(None)
    pad, eos, mask = model.pad, model.eos, model.mask
    classes = encoded.length_lprobs.shape[-1]
    src_len = ((src_tokens != model.source_eos) & (src_tokens != model.source_pad)).sum(axis=1)
    limit = (max_len_a * src_len.astype(np.float64) + max_len_b).astype(np.int64)
    max_lengths = np.clip(limit, 1, min(classes - 1, model.max_target_positions - 1))
    bsz = src_tokens.shape[0]
    lengths = length_candidates(encoded.length_lprobs, length_beam, max_lengths)[0].reshape(-1)
    sentence_of_row = np.repeat(np.arange(bsz), length_beam)
    encoded_rows = encoded.select(sentence_of_row)
    tokens, positions = initial_input(lengths, mask, eos, pad)
    slots = tokens == mask
    scores = np.zeros(tokens.shape, np.float32)
    size = model.vocab_size if rows.ids is None else rows.ids.size
    bias = banned_bias_of(sorted({mask, pad, eos, model.bos, *banned}), rows, size)
    for t in range(iterations):
        if t > 0:
            tokens[lowest_confidence_mask(scores, slots, remask_counts(lengths, t, iterations))] = mask
        masked = tokens == mask
        queries = np.flatnonzero(masked.any(axis=0))  # the columns holding masks
        if not queries.size:  # nothing re-masked in any row: the pass runs, and changes nothing
            queries = np.arange(min(1, tokens.shape[1]), dtype=np.int64)
        before = tokens[0].copy() if on_iteration is not None else None
        best_scores, best_rows = model.parallel(
            encoded_rows, tokens, positions, queries, np.flatnonzero(masked[:, queries]), bias, rows
        )
        tokens[masked] = rows.to_full(best_rows)
        scores[masked] = best_scores
        if on_iteration is not None:
            on_iteration(t, before, tokens[0])
    average = scores.sum(axis=1) / lengths.astype(np.float32)
    order = np.argsort(-average.reshape(bsz, length_beam), axis=1, kind="stable")
    out = []
    for b in range(bsz):
        hypos = []
        for j in order[b].tolist():
            r = b * length_beam + j
            n = int(lengths[r]) + 1
            hypos.append(
                {
                    "tokens": tokens[r, :n].copy(),
                    "score": float(average[r]),
                    "positional_scores": scores[r, :n].copy(),
                    "steps": iterations,
                }
            )
        out.append(hypos)
    return out
