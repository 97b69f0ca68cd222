"""The one search (hrt_runtime.search) on its own, with backends that do no arithmetic: what
every engine shares must not depend on how a batch is formed."""

import numpy as np
import pytest

from hrt_runtime import search
from hrt_runtime.model import OutputRows

PAD, EOS, MASK = 1, 2, 4


class Arithmetic:
    """A backend whose non-causal pass predicts, for every selected slot, a token and a score
    that depend on the slot's column, its row's tokens and the query columns it was given (so
    a slot read from the wrong place, or a wrong select, changes the output)."""

    pad, eos, mask = PAD, EOS, MASK

    def __init__(self, eos_at=None):
        self.eos_at = eos_at  # a column at which the pass predicts </s>

    def parallel(self, encoded, tokens, positions, queries, select, bias, rows):
        row, column = np.divmod(select, queries.size)
        column = queries[column]
        context = tokens.sum(axis=1)[row]
        token = 10 + (column * 7 + context) % 50
        if self.eos_at is not None:
            token = np.where(column == self.eos_at, EOS, token)
        score = -((column + 1) * 0.013 + (context % 5) * 0.1).astype(np.float32)
        assert (positions.reshape(-1)[select // queries.size * tokens.shape[1] + column] == column + 1).all()
        return score, token


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("eos_at", [None, 2, 7])
def test_one_skeleton_equals_its_row_in_a_batch(k, eos_at):
    """fill_masks of one unpadded skeleton (the batch-1 path) gives what the same skeleton
    gives as a row of a padded batch (the general path), tokens, scores, length and
    confidence alike, with and without a </s> predicted inside it."""
    backend = Arithmetic(eos_at)
    bias, rows = np.zeros(60, np.float32), OutputRows(None)
    one = np.array([[11, 13, 17, 19, 23, EOS]])
    other = np.array([[29, 31, EOS, PAD, PAD, PAD]])
    one_scores = -np.linspace(0.1, 0.6, 6, dtype=np.float32)[None, :]
    alone = search.fill_masks(backend, None, one, one_scores, k, bias, rows)
    batch = search.fill_masks(
        backend,
        None,
        np.concatenate([one, other]),
        np.concatenate([one_scores, np.zeros((1, 6), np.float32)]),
        k,
        bias,
        rows,
    )
    tokens, positions, filled, scores, lengths, confidence = alone
    assert tokens.tolist() == batch[0][:1].tolist() and positions.tolist() == batch[1][:1].tolist()
    assert filled.tolist() == batch[2][:1].tolist()
    assert scores.tolist() == batch[3][:1].tolist()
    assert lengths.tolist() == batch[4][:1].tolist() and confidence[0] == batch[5][0]
    assert filled[0, lengths[0] - 1] == EOS and (filled[0, lengths[0] :] == PAD).all()
    if eos_at is not None and eos_at % k != k - 1:
        assert lengths[0] == eos_at + 1  # stage II's own </s> ends the output


def test_chunk_size_groups():
    assert [(k, rows.tolist()) for k, rows in search.chunk_size_groups([2, 2, 2])] == [(2, [0, 1, 2])]
    assert [(k, rows.tolist()) for k, rows in search.chunk_size_groups([2, 1, 2, 1])] == [(1, [1, 3]), (2, [0, 2])]


def test_mask_columns_hold_every_mask_of_stage_two():
    skeleton = np.array([[11, 12, 13, EOS], [14, EOS, PAD, PAD]])
    for k in (2, 3, 4):
        tokens, _, _ = search.stage2_input(skeleton, k, PAD, MASK)
        columns = search.mask_columns(tokens.shape[1], k)
        assert set(np.flatnonzero((tokens == MASK).any(axis=0))) <= set(columns.tolist())
        assert not (tokens[:, columns] != MASK)[tokens[:, columns] != PAD].any()


class NeverEnds:
    """A left-to-right backend that never predicts </s> and records every position it runs."""

    pad, eos, unk, bos, mask = PAD, EOS, 3, 0, MASK
    vocab_size, max_target_positions, chunk_start = 60, 24, {2: 5, 3: 6}

    def __init__(self):
        self.positions = []

    def stride_of(self, start):
        return {5: 2, 6: 3}.get(start, 1)

    def begin(self, encoded, rows, steps, start, out_rows):
        return self.stride_of(start)

    def step(self, stride, tokens, step, bias, top=1, scores=True):
        self.positions.append(step * stride)
        token = np.full(tokens.shape[0], 10, np.int64)
        token[bias[token] == -np.inf] = EOS  # forced </s> at the maximum length
        return np.full(tokens.shape[0], -0.1, np.float32), token

    def greedy_loop(self, encoded, start, max_len, min_len, biases, rows):
        return None

    def rows(self, ids):
        return OutputRows(ids)

    def reorder(self, state, index, step, sentences=None):
        pass


@pytest.mark.parametrize("start,k", [(None, 1), (5, 2), (6, 3)])
def test_skip_at_stays_within_the_decoders_positions(start, k):
    """A runaway Skip-AT skeleton of stride k stops before its steps (positions t k) or its
    stage-II input (positions 1..m k) pass the decoder's positions."""

    class Encoded:
        size = 1

    backend = NeverEnds()
    config = search.SearchConfig(beam=1, max_len_a=0.0, max_len_b=1000)
    ((hypo,),) = search.left_to_right(backend, Encoded(), 5, config, [PAD], start=start)
    m = hypo["tokens"].size
    assert max(backend.positions) < backend.max_target_positions
    if k > 1:  # stage II's positions 1..m k
        assert m * k <= backend.max_target_positions - 1
    assert m == search.position_cap(backend.max_target_positions, k) + 1  # it ran to the cap


class Scripted:
    """A left-to-right backend whose row r emits ``script[r]`` (then token 9 for ever), with
    scores -0.1 x (step + 1); ``loop``: it also offers the whole search as one loop, which goes
    on for rows that ended until every row has."""

    pad, eos, unk, bos, mask = PAD, EOS, 3, 0, MASK
    vocab_size, max_target_positions, chunk_start = 60, 64, {}

    def __init__(self, script, loop):
        self.script, self.loop, self.looped = script, loop, 0

    def stride_of(self, start):
        return 1

    def token(self, row, step, bias):
        script = self.script[row]
        token = script[step] if step < len(script) else 9
        return EOS if bias[token] == -np.inf else token

    def begin(self, encoded, rows, steps, start, out_rows):
        return list(range(rows))  # the state: which script each row follows

    def step(self, rows, tokens, step, bias, top=1, scores=True):
        token = np.array([self.token(r, step, bias) for r in rows], np.int64)
        return np.full(len(rows), -0.1 * (step + 1), np.float32), token

    def reorder(self, rows, index, step, sentences=None):
        rows[:] = [rows[i] for i in index]

    def rows(self, ids):
        return OutputRows(ids)

    def greedy_loop(self, encoded, start, max_len, min_len, biases, rows):
        if not self.loop:
            return None
        self.looped += 1
        tokens, scores, finished, step = [], [], np.zeros(encoded.size, bool), 0
        while step <= max_len and not finished.all():
            bias = biases[2] if step >= max_len else biases[1] if step < min_len else biases[0]  # the search's rule
            token = np.array([self.token(r, step, bias) for r in range(encoded.size)], np.int64)
            tokens.append(token)
            scores.append(np.full(encoded.size, -0.1 * (step + 1), np.float32))
            finished |= token == EOS
            step += 1
        return np.stack(tokens, axis=1), np.stack(scores, axis=1)


def test_a_greedy_loop_gives_the_searchs_hypotheses():
    """A backend's greedy loop (every step of every row, rows that ended going on) gives the
    hypotheses of the search's own steps: each row cut at its first </s>, the maximum length
    forcing </s>, the same scores."""

    class Encoded:
        size = 3

    script = [[11, 12, EOS], [13, EOS], [14, 15, 16, 17, 18, 19, 20, 21]]  # the last one runs to max_len
    config = search.SearchConfig(beam=1, max_len_a=0.0, max_len_b=5, len_penalty=0.7)
    ours = Scripted(script, loop=True)
    looped = search.left_to_right(ours, Encoded(), 4, config, [PAD])
    stepped = search.left_to_right(Scripted(script, loop=False), Encoded(), 4, config, [PAD])
    assert ours.looped == 1
    assert [h[0]["tokens"].tolist() for h in looped] == [[11, 12, EOS], [13, EOS], [14, 15, 16, 17, 18, EOS]]
    for (a,), (b,) in zip(looped, stepped):
        assert a["tokens"].tolist() == b["tokens"].tolist() and a["score"] == b["score"]
        assert np.array_equal(a["positional_scores"], b["positional_scores"])
