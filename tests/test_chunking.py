"""Exact sample construction of fairseq_hrt.chunking against SPEC section 2 (and 3).

Symbolic ids: ``P`` = pad, ``E`` = ``</s>``, ``M`` = ``<mask>``, ``S2``/``S3``/``S4`` the chunk
start symbols and ``y(j)`` = 10 + j the j-th target token. Every expected tensor is written
out by hand from the SPEC table (N = 4, k = 2:
Skip-AT ``<s2> y2 y4`` at ``0 2 4`` -> ``y2 y4 </s>``;
Skip-CMLM ``<m> y2 <m> y4 <m> </s>`` at ``1..6`` -> ``y1 [P] y3 [P] </s> [P]``).
"""

import pytest
import torch

from fairseq_hrt import chunking
from fairseq_hrt.chunking import (
    at_sample,
    batch_decoder_samples,
    choose_chunked_rows,
    chunk_final_mask,
    chunked_rows_generator,
    cmlm_sample,
    curriculum_p_k,
    merge_rows,
    mix_targets,
    num_chunked,
    pad_to_chunk_multiple,
    skip_at_sample,
    skip_cmlm_sample,
    stage2_input,
    truncate_at_first_eos,
)

P, E, M = 1, 2, 3
S = {2: 4, 3: 5, 4: 6}
S2, S3, S4 = S[2], S[3], S[4]


def y(j):
    return 10 + j


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


def target(n, width=None):
    """``y1 .. yN </s>`` right-padded to ``width``."""
    row = [y(j) for j in range(1, n + 1)] + [E]
    width = len(row) if width is None else width
    return row + [P] * (width - len(row))


def batch(*ns):
    width = max(ns) + 1
    return T([target(n, width) for n in ns])


def starts(k, bsz):
    if isinstance(k, int):
        return torch.full((bsz,), S[k], dtype=torch.long)
    return T([S[int(x)] for x in k])


def assert_sample(sample, tokens, positions, tgt):
    assert torch.equal(sample.tokens, T(tokens)), (sample.tokens, tokens)
    assert torch.equal(sample.positions, T(positions)), (sample.positions, positions)
    assert torch.equal(sample.target, T(tgt)), (sample.target, tgt)


# --------------------------------------------------------------------- single-row cases
# (N, k) -> padded target, Skip-AT (tokens, positions, target), Skip-CMLM (tokens, positions, target)
CASES = {
    # the SPEC table: N = 4, k = 2
    (4, 2): (
        [y(1), y(2), y(3), y(4), E, E],
        ([S2, y(2), y(4)], [0, 2, 4], [y(2), y(4), E]),
        ([M, y(2), M, y(4), M, E], [1, 2, 3, 4, 5, 6], [y(1), P, y(3), P, E, P]),
    ),
    (4, 3): (
        [y(1), y(2), y(3), y(4), E, E],
        ([S3, y(3)], [0, 3], [y(3), E]),
        ([M, M, y(3), M, M, E], [1, 2, 3, 4, 5, 6], [y(1), y(2), P, y(4), E, P]),
    ),
    (4, 4): (
        [y(1), y(2), y(3), y(4), E, E, E, E],
        ([S4, y(4)], [0, 4], [y(4), E]),
        ([M, M, M, y(4), M, M, M, E], [1, 2, 3, 4, 5, 6, 7, 8], [y(1), y(2), y(3), P, E, E, E, P]),
    ),
    # N a multiple of k
    (3, 3): (
        [y(1), y(2), y(3), E, E, E],
        ([S3, y(3)], [0, 3], [y(3), E]),
        ([M, M, y(3), M, M, E], [1, 2, 3, 4, 5, 6], [y(1), y(2), P, E, E, P]),
    ),
    (8, 4): (
        [y(1), y(2), y(3), y(4), y(5), y(6), y(7), y(8), E, E, E, E],
        ([S4, y(4), y(8)], [0, 4, 8], [y(4), y(8), E]),
        (
            [M, M, M, y(4), M, M, M, y(8), M, M, M, E],
            list(range(1, 13)),
            [y(1), y(2), y(3), P, y(5), y(6), y(7), P, E, E, E, P],
        ),
    ),
    # N + 1 a multiple of k: no extra </s>
    (3, 2): (
        [y(1), y(2), y(3), E],
        ([S2, y(2)], [0, 2], [y(2), E]),
        ([M, y(2), M, E], [1, 2, 3, 4], [y(1), P, y(3), P]),
    ),
    (5, 3): (
        [y(1), y(2), y(3), y(4), y(5), E],
        ([S3, y(3)], [0, 3], [y(3), E]),
        ([M, M, y(3), M, M, E], [1, 2, 3, 4, 5, 6], [y(1), y(2), P, y(4), y(5), P]),
    ),
    (3, 4): (
        [y(1), y(2), y(3), E],
        ([S4], [0], [E]),
        ([M, M, M, E], [1, 2, 3, 4], [y(1), y(2), y(3), P]),
    ),
    # N < k
    (1, 3): (
        [y(1), E, E],
        ([S3], [0], [E]),
        ([M, M, E], [1, 2, 3], [y(1), E, P]),
    ),
    (2, 4): (
        [y(1), y(2), E, E],
        ([S4], [0], [E]),
        ([M, M, M, E], [1, 2, 3, 4], [y(1), y(2), E, P]),
    ),
    # a one-token target
    (1, 2): (
        [y(1), E],
        ([S2], [0], [E]),
        ([M, E], [1, 2], [y(1), P]),
    ),
    (1, 4): (
        [y(1), E, E, E],
        ([S4], [0], [E]),
        ([M, M, M, E], [1, 2, 3, 4], [y(1), E, E, P]),
    ),
    # an empty target (only </s>)
    (0, 2): (
        [E, E],
        ([S2], [0], [E]),
        ([M, E], [1, 2], [E, P]),
    ),
    (0, 3): (
        [E, E, E],
        ([S3], [0], [E]),
        ([M, M, E], [1, 2, 3], [E, E, P]),
    ),
    (0, 4): (
        [E, E, E, E],
        ([S4], [0], [E]),
        ([M, M, M, E], [1, 2, 3, 4], [E, E, E, P]),
    ),
}


@pytest.mark.parametrize("n,k", sorted(CASES))
def test_pad_to_chunk_multiple(n, k):
    padded, _, _ = CASES[(n, k)]
    out = pad_to_chunk_multiple(T([target(n)]), k, P, E)
    assert out.tolist() == [padded]
    assert out.size(1) % k == 0


@pytest.mark.parametrize("n,k", sorted(CASES))
def test_skip_at_sample(n, k):
    _, (tokens, positions, tgt), _ = CASES[(n, k)]
    sample = skip_at_sample(T([target(n)]), k, P, E, starts(k, 1))
    assert_sample(sample, [tokens], [positions], [tgt])


@pytest.mark.parametrize("n,k", sorted(CASES))
def test_skip_cmlm_sample(n, k):
    _, _, (tokens, positions, tgt) = CASES[(n, k)]
    sample = skip_cmlm_sample(T([target(n)]), k, P, E, M)
    assert_sample(sample, [tokens], [positions], [tgt])


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_at_sample_single_row(n):
    sample = at_sample(T([target(n)]), P, E)
    tokens = [E] + [y(j) for j in range(1, n + 1)]
    assert_sample(sample, [tokens], [list(range(n + 1))], [target(n)])


def test_at_sample_table_and_explicit_start():
    # SPEC table: AT input <s> y1 y2 y3 y4 at 0..4, targets y1 y2 y3 y4 </s>
    sample = at_sample(T([target(4)]), P, E)
    assert_sample(sample, [[E, y(1), y(2), y(3), y(4)]], [[0, 1, 2, 3, 4]], [[y(1), y(2), y(3), y(4), E]])
    sample = at_sample(T([target(2)]), P, E, start=99)
    assert_sample(sample, [[99, y(1), y(2)]], [[0, 1, 2]], [[y(1), y(2), E]])


def test_skip_at_with_k1_is_at_with_that_start():
    tgt = batch(4, 1, 0)
    skip = skip_at_sample(tgt, 1, P, E, torch.full((3,), 77))
    at = at_sample(tgt, P, E, start=77)
    for a, b in zip(skip, at):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- batched cases


def test_batch_mixed_lengths_right_padding_k2():
    tgt = batch(4, 1, 0)
    assert tgt.tolist() == [
        [y(1), y(2), y(3), y(4), E],
        [y(1), E, P, P, P],
        [E, P, P, P, P],
    ]
    assert pad_to_chunk_multiple(tgt, 2, P, E).tolist() == [
        [y(1), y(2), y(3), y(4), E, E],
        [y(1), E, P, P, P, P],
        [E, E, P, P, P, P],
    ]
    assert_sample(
        at_sample(tgt, P, E),
        [[E, y(1), y(2), y(3), y(4)], [E, y(1), P, P, P], [E, P, P, P, P]],
        [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]],
        [[y(1), y(2), y(3), y(4), E], [y(1), E, P, P, P], [E, P, P, P, P]],
    )
    assert_sample(
        skip_at_sample(tgt, 2, P, E, starts(2, 3)),
        [[S2, y(2), y(4)], [S2, P, P], [S2, P, P]],
        [[0, 2, 4], [0, 0, 0], [0, 0, 0]],
        [[y(2), y(4), E], [E, P, P], [E, P, P]],
    )
    assert_sample(
        skip_cmlm_sample(tgt, 2, P, E, M),
        [[M, y(2), M, y(4), M, E], [M, E, P, P, P, P], [M, E, P, P, P, P]],
        [[1, 2, 3, 4, 5, 6], [1, 2, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0]],
        [[y(1), P, y(3), P, E, P], [y(1), P, P, P, P, P], [E, P, P, P, P, P]],
    )


def test_batch_mixed_lengths_k3_with_extra_padding_columns():
    # a collated target may be wider than its longest row: the extra columns are ignored
    tgt = T([target(5, 8), target(2, 8), target(3, 8)])
    assert pad_to_chunk_multiple(tgt, 3, P, E).tolist() == [
        [y(1), y(2), y(3), y(4), y(5), E],
        [y(1), y(2), E, P, P, P],
        [y(1), y(2), y(3), E, E, E],
    ]
    assert_sample(
        skip_at_sample(tgt, 3, P, E, starts(3, 3)),
        [[S3, y(3)], [S3, P], [S3, y(3)]],
        [[0, 3], [0, 0], [0, 3]],
        [[y(3), E], [E, P], [y(3), E]],
    )
    assert_sample(
        skip_cmlm_sample(tgt, 3, P, E, M),
        [[M, M, y(3), M, M, E], [M, M, E, P, P, P], [M, M, y(3), M, M, E]],
        [[1, 2, 3, 4, 5, 6], [1, 2, 3, 0, 0, 0], [1, 2, 3, 4, 5, 6]],
        [[y(1), y(2), P, y(4), y(5), P], [y(1), y(2), P, P, P, P], [y(1), y(2), P, E, E, P]],
    )


def test_per_row_chunk_sizes_in_one_batch():
    tgt = batch(4, 4, 2, 5, 0)
    ks = T([2, 3, 4, 3, 4])
    assert pad_to_chunk_multiple(tgt, ks, P, E).tolist() == [
        [y(1), y(2), y(3), y(4), E, E],
        [y(1), y(2), y(3), y(4), E, E],
        [y(1), y(2), E, E, P, P],
        [y(1), y(2), y(3), y(4), y(5), E],
        [E, E, E, E, P, P],
    ]
    assert_sample(
        skip_at_sample(tgt, ks, P, E, starts(ks.tolist(), 5)),
        [[S2, y(2), y(4)], [S3, y(3), P], [S4, P, P], [S3, y(3), P], [S4, P, P]],
        [[0, 2, 4], [0, 3, 0], [0, 0, 0], [0, 3, 0], [0, 0, 0]],
        [[y(2), y(4), E], [y(3), E, P], [E, P, P], [y(3), E, P], [E, P, P]],
    )
    assert_sample(
        skip_cmlm_sample(tgt, ks, P, E, M),
        [
            [M, y(2), M, y(4), M, E],
            [M, M, y(3), M, M, E],
            [M, M, M, E, P, P],
            [M, M, y(3), M, M, E],
            [M, M, M, E, P, P],
        ],
        [
            [1, 2, 3, 4, 5, 6],
            [1, 2, 3, 4, 5, 6],
            [1, 2, 3, 4, 0, 0],
            [1, 2, 3, 4, 5, 6],
            [1, 2, 3, 4, 0, 0],
        ],
        [
            [y(1), P, y(3), P, E, P],
            [y(1), y(2), P, y(4), E, P],
            [y(1), y(2), E, P, P, P],
            [y(1), y(2), P, y(4), y(5), P],
            [E, E, E, P, P, P],
        ],
    )


def test_per_row_chunk_sizes_equal_row_by_row_construction():
    tgt = batch(7, 0, 3, 6, 1, 2)
    ks = T([2, 3, 4, 2, 3, 4])
    at = skip_at_sample(tgt, ks, P, E, starts(ks.tolist(), 6))
    nat = skip_cmlm_sample(tgt, ks, P, E, M)
    for i, k in enumerate(ks.tolist()):
        row = tgt[i : i + 1]
        single_at = skip_at_sample(row, k, P, E, starts(k, 1))
        single_nat = skip_cmlm_sample(row, k, P, E, M)
        for batched, single in ((at, single_at), (nat, single_nat)):
            for b, s in zip(batched, single):
                w = s.size(1)
                assert torch.equal(b[i, :w], s[0])
                assert b[i, w:].eq(P if b is not batched.positions else 0).all()


def test_skip_cmlm_targets_exactly_the_masked_tokens():
    tgt = batch(9, 5, 0, 2)
    for k in (2, 3, 4):
        sample = skip_cmlm_sample(tgt, k, P, E, M)
        padded = pad_to_chunk_multiple(tgt, k, P, E)
        masked = sample.tokens.eq(M)
        assert torch.equal(sample.target, padded.masked_fill(~masked, P))
        assert torch.equal(sample.tokens.masked_fill(masked, 0), padded.masked_fill(masked, 0))
        # the kept tokens are exactly the Skip-AT targets, in order
        skip = skip_at_sample(tgt, k, P, E, starts(k, 4))
        for i in range(4):
            kept = sample.tokens[i][sample.tokens[i].ne(M) & sample.tokens[i].ne(P)]
            assert torch.equal(kept, skip.target[i][skip.target[i].ne(P)])


def test_chunk_final_mask():
    assert chunk_final_mask(6, 2, 1, "cpu").tolist() == [[False, True, False, True, False, True]]
    assert chunk_final_mask(6, T([3, 4]), 2, "cpu").tolist() == [
        [False, False, True, False, False, True],
        [False, False, False, True, False, False],
    ]


@pytest.mark.parametrize(
    "fn",
    [
        lambda t, k: pad_to_chunk_multiple(t, k, P, E),
        lambda t, k: skip_at_sample(t, k, P, E, torch.full((t.size(0),), S2)),
        lambda t, k: skip_cmlm_sample(t, k, P, E, M),
        lambda t, k: stage2_input(t, k, P, M),
        lambda t, k: chunk_final_mask(4, k, t.size(0), "cpu"),
    ],
)
def test_bad_chunk_sizes_raise(fn):
    tgt = batch(3, 1)
    for bad in (0, -1, T([2, 0])):
        with pytest.raises(ValueError, match="chunk size"):
            fn(tgt, bad)
    with pytest.raises(ValueError, match="shape"):
        fn(tgt, T([2, 2, 2]))


def test_merge_rows_pads_to_the_wider_sample():
    first = skip_at_sample(batch(4), 2, P, E, starts(2, 1))
    second = at_sample(batch(4, 0), P, E)
    merged = merge_rows(first, second, P)
    assert_sample(
        merged,
        [[S2, y(2), y(4), P, P], [E, y(1), y(2), y(3), y(4)], [E, P, P, P, P]],
        [[0, 2, 4, 0, 0], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]],
        [[y(2), y(4), E, P, P], [y(1), y(2), y(3), y(4), E], [E, P, P, P, P]],
    )


# ---------------------------------------------------------------------------------- CMLM


def test_cmlm_invariants_over_many_seeds():
    tgt = batch(6, 1, 0, 3, 9)
    real = tgt.ne(P)
    n_tokens = (real & tgt.ne(E)).sum(dim=1)
    seen_counts = {i: set() for i in range(tgt.size(0))}
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        sample = cmlm_sample(tgt, P, E, M, generator=g)
        masked = sample.tokens.eq(M)
        # positions 1..N+1 on real slots, 0 on padding
        assert torch.equal(sample.positions, chunking.nat_positions(real))
        # pad untouched, </s> never masked, only y tokens are replaced
        assert torch.equal(sample.tokens[~real], tgt[~real])
        assert not masked[tgt.eq(E)].any()
        assert torch.equal(sample.tokens[~masked], tgt[~masked])
        # targets exactly the masked tokens
        assert torch.equal(sample.target, tgt.masked_fill(~masked, P))
        counts = masked.sum(dim=1)
        for i in range(tgt.size(0)):
            n = int(n_tokens[i])
            if n == 0:
                assert counts[i] == 0  # nothing to mask
                assert sample.target[i].eq(P).all()
            else:
                assert 1 <= counts[i] <= n
            seen_counts[i].add(int(counts[i]))
    # n ~ U{1..N}: every count appears over 300 draws
    assert seen_counts[0] == set(range(1, 7))
    assert seen_counts[1] == {1}
    assert seen_counts[3] == {1, 2, 3}
    assert seen_counts[4] == set(range(1, 10))


def test_cmlm_reproducible_with_seeded_generator():
    tgt = batch(8, 5, 2)
    a = cmlm_sample(tgt, P, E, M, generator=torch.Generator().manual_seed(123))
    b = cmlm_sample(tgt, P, E, M, generator=torch.Generator().manual_seed(123))
    for x, z in zip(a, b):
        assert torch.equal(x, z)
    different = [
        not torch.equal(a.tokens, cmlm_sample(tgt, P, E, M, generator=torch.Generator().manual_seed(s)).tokens)
        for s in range(124, 134)
    ]
    assert any(different)


def test_cmlm_masked_positions_spread_over_the_sentence():
    tgt = batch(5)
    hits = torch.zeros(tgt.size(1))
    for seed in range(200):
        s = cmlm_sample(tgt, P, E, M, generator=torch.Generator().manual_seed(seed))
        hits += s.tokens.eq(M)[0].float()
    assert (hits[:5] > 0).all()  # every y_j gets masked sometimes
    assert hits[5] == 0  # </s> never


# ---------------------------------------------------------------------------- curriculum


def test_curriculum_p_k():
    assert curriculum_p_k(0, 100) == 0.0
    assert curriculum_p_k(50, 100) == pytest.approx(0.5)
    assert curriculum_p_k(100, 100) == 1.0
    assert curriculum_p_k(250, 100) == 1.0  # beyond T: clipped
    assert curriculum_p_k(-5, 100) == 0.0
    assert curriculum_p_k(0, 100, 2.0) == 0.0
    assert curriculum_p_k(50, 100, 2.0) == pytest.approx(0.25)
    assert curriculum_p_k(100, 100, 2.0) == 1.0
    assert curriculum_p_k(1000, 100, 2.0) == 1.0
    assert curriculum_p_k(25, 100, 0.5) == pytest.approx(0.5)


@pytest.mark.parametrize("total", [0, -10])
def test_curriculum_needs_total_updates(total):
    with pytest.raises(ValueError, match="max-update"):
        curriculum_p_k(1, total)


@pytest.mark.parametrize("lam", [0.0, -1.0])
def test_curriculum_bad_lambda(lam):
    with pytest.raises(ValueError, match="curriculum-lambda"):
        curriculum_p_k(1, 10, lam)


def test_chunked_rows_are_a_random_subset_not_the_longest_rows():
    """round(n * p_k) rows, disjoint from the plain rows; drawn at random, so in a
    length-sorted batch short sentences are chunked as often as long ones (Algorithm 1's
    "first rows" of a sorted batch would always be the longest)."""
    n, p_k = 10, 0.3
    counts = torch.zeros(n)
    first_rows_every_time = True
    for seed in range(200):
        chunked, plain = choose_chunked_rows(n, p_k, torch.Generator().manual_seed(seed))
        assert chunked.numel() == num_chunked(n, p_k) == 3
        assert sorted(chunked.tolist() + plain.tolist()) == list(range(n))
        assert chunked.tolist() == sorted(chunked.tolist()) and plain.tolist() == sorted(plain.tolist())
        counts[chunked] += 1
        first_rows_every_time &= chunked.tolist() == [0, 1, 2]
    assert not first_rows_every_time
    assert counts.min() > 200 * 0.3 * 0.5  # every row chunked about 30% of the time


def test_chunked_rows_are_reproducible_from_the_seed():
    """The same seed (fairseq reseeds the global RNG from --seed and the update count
    before every update, so a resumed run too) draws the same rows; p_k = 0 or 1 draw
    nothing from the RNG."""
    torch.manual_seed(5)
    a = choose_chunked_rows(16, 0.5)
    torch.manual_seed(5)
    b = choose_chunked_rows(16, 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    torch.manual_seed(5)
    state = torch.get_rng_state()
    assert choose_chunked_rows(16, 0.0)[0].numel() == 0
    assert choose_chunked_rows(16, 1.0)[1].numel() == 0
    assert torch.equal(torch.get_rng_state(), state)


def test_num_chunked_rounding():
    assert num_chunked(10, 0.0) == 0
    assert num_chunked(10, 1.0) == 10
    assert num_chunked(10, 0.34) == 3
    assert num_chunked(10, 0.36) == 4
    assert num_chunked(7, 0.1) == 1  # round(0.7)
    assert num_chunked(7, 0.05) == 0  # round(0.35)
    assert num_chunked(3, 0.9) == 3  # round(2.7)
    assert num_chunked(0, 0.7) == 0
    assert isinstance(num_chunked(5, 0.5), int)
    # monotone in p and within [0, n]
    values = [num_chunked(13, p / 100) for p in range(101)]
    assert values == sorted(values) and values[0] == 0 and values[-1] == 13


# ----------------------------------------------------------------------------- MixDistill


def _raw_and_distilled():
    raw = T([[21, 22, 23, E], [24, E, P, P], [25, 26, E, P]])  # width 4
    distilled = T([[31, E, P, P, P, P], [32, 33, 34, 35, 36, E], [37, E, P, P, P, P]])  # width 6
    return raw, distilled


def test_mix_targets_p_raw_one_is_raw():
    raw, distilled = _raw_and_distilled()
    for seed in range(5):
        mixed, use_raw = mix_targets(raw, distilled, 1.0, P, torch.Generator().manual_seed(seed))
        assert torch.equal(mixed, raw)
        assert use_raw.all()


def test_mix_targets_p_raw_zero_is_distilled():
    raw, distilled = _raw_and_distilled()
    for seed in range(5):
        mixed, use_raw = mix_targets(raw, distilled, 0.0, P, torch.Generator().manual_seed(seed))
        assert torch.equal(mixed, distilled)
        assert not use_raw.any()
    # distilled narrower than raw
    mixed, _ = mix_targets(distilled, raw, 0.0, P)
    assert torch.equal(mixed, raw)


def test_mix_targets_mixes_rows_and_trims_padding_columns():
    raw, distilled = _raw_and_distilled()
    seen = set()
    for seed in range(40):
        mixed, use_raw = mix_targets(raw, distilled, 0.5, P, torch.Generator().manual_seed(seed))
        expected_rows = []
        for i in range(3):
            src = raw[i] if use_raw[i] else distilled[i]
            expected_rows.append(src[src.ne(P)].tolist())
        width = max(len(r) for r in expected_rows)
        expected = T([r + [P] * (width - len(r)) for r in expected_rows])
        assert torch.equal(mixed, expected)
        seen.add(tuple(use_raw.tolist()))
    assert len(seen) > 2  # rows are drawn independently
    a = mix_targets(raw, distilled, 0.5, P, torch.Generator().manual_seed(7))
    b = mix_targets(raw, distilled, 0.5, P, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("p_raw", [-0.1, 1.1, 2.0])
def test_mix_targets_bad_p_raw(p_raw):
    raw, distilled = _raw_and_distilled()
    with pytest.raises(ValueError, match="p-raw"):
        mix_targets(raw, distilled, p_raw, P)


def test_mix_targets_per_row_p_raw():
    """``--p-raw-chunked``: each row its own probability; 1 and 0 are exact whatever the draw."""
    raw, distilled = _raw_and_distilled()
    for seed in range(10):
        mixed, use_raw = mix_targets(raw, distilled, T([1, 0, 1]).float(), P, torch.Generator().manual_seed(seed))
        assert use_raw.tolist() == [True, False, True]
        assert mixed[0].tolist()[:4] == raw[0].tolist() and mixed[1].tolist() == distilled[1].tolist()
    with pytest.raises(ValueError, match="shape"):
        mix_targets(raw, distilled, torch.tensor([0.5, 0.5]), P)
    with pytest.raises(ValueError, match="p-raw"):
        mix_targets(raw, distilled, torch.tensor([0.5, 1.5, 0.0]), P)


def test_mix_targets_batch_size_mismatch():
    raw, distilled = _raw_and_distilled()
    with pytest.raises(ValueError, match="batch sizes"):
        mix_targets(raw, distilled[:2], 0.5, P)


# ------------------------------------------------------------------------------ decoding


def z(i):
    return 50 + i


def test_stage2_input_k2_with_padding_rows():
    skeleton = T([[z(1), z(2), E], [z(1), E, P], [E, P, P]])
    sample = stage2_input(skeleton, 2, P, M)
    assert_sample(
        sample,
        [[M, z(1), M, z(2), M, E], [M, z(1), M, E, P, P], [M, E, P, P, P, P]],
        [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 0, 0], [1, 2, 0, 0, 0, 0]],
        [[P, z(1), P, z(2), P, E], [P, z(1), P, E, P, P], [P, E, P, P, P, P]],
    )


def test_stage2_input_k3_and_k4():
    skeleton = T([[z(1), z(2), E], [z(1), E, P]])
    assert_sample(
        stage2_input(skeleton, 3, P, M),
        [[M, M, z(1), M, M, z(2), M, M, E], [M, M, z(1), M, M, E, P, P, P]],
        [list(range(1, 10)), [1, 2, 3, 4, 5, 6, 0, 0, 0]],
        [[P, P, z(1), P, P, z(2), P, P, E], [P, P, z(1), P, P, E, P, P, P]],
    )
    assert_sample(
        stage2_input(T([[z(1), E]]), 4, P, M),
        [[M, M, M, z(1), M, M, M, E]],
        [list(range(1, 9))],
        [[P, P, P, z(1), P, P, P, E]],
    )


def test_stage2_input_per_row_k_and_k1():
    skeleton = T([[z(1), E], [z(2), E], [E, P]])
    assert_sample(
        stage2_input(skeleton, T([2, 3, 4]), P, M),
        [[M, z(1), M, E, P, P], [M, M, z(2), M, M, E], [M, M, M, E, P, P]],
        [[1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 0, 0]],
        [[P, z(1), P, E, P, P], [P, P, z(2), P, P, E], [P, P, P, E, P, P]],
    )
    same = stage2_input(skeleton, 1, P, M)
    assert torch.equal(same.tokens, skeleton)
    assert same.positions.tolist() == [[1, 2], [1, 2], [1, 0]]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_stage2_input_of_skip_at_targets_is_the_skip_cmlm_input(k):
    """Decoding consistency: feeding the gold Skip-AT output to stage II gives the Skip-CMLM
    training input (same tokens, same positions)."""
    tgt = batch(7, 0, 3, 4, 1, 5)
    skip = skip_at_sample(tgt, k, P, E, starts(k, tgt.size(0)))
    s2 = stage2_input(skip.target, k, P, M)
    nat = skip_cmlm_sample(tgt, k, P, E, M)
    assert torch.equal(s2.tokens, nat.tokens)
    assert torch.equal(s2.positions, nat.positions)


def test_truncate_at_first_eos():
    tokens = T(
        [
            [7, 8, E, 9, E, E],
            [7, E, E, E, P, P],
            [E, 7, 8, 9, E, P],
            [7, 8, 9, 10, 11, 12],  # no </s>: kept whole
            [7, 8, 9, E, P, P],
        ]
    )
    assert truncate_at_first_eos(tokens, E, P).tolist() == [
        [7, 8, E, P, P, P],
        [7, E, P, P, P, P],
        [E, P, P, P, P, P],
        [7, 8, 9, 10, 11, 12],
        [7, 8, 9, E, P, P],
    ]


def test_empty_row_selection_early_and_late_in_the_curriculum():
    """p_k = 0 selects no chunked rows and p_k = 1 no plain rows: every builder must accept a
    (0, W) target, and merging with an empty sample keeps the other one unchanged."""
    tgt = batch(4, 1)
    none = tgt[:0]
    no_k = torch.zeros(0, dtype=torch.long)
    empty_at = skip_at_sample(none, no_k, P, E, no_k)
    empty_nat = skip_cmlm_sample(none, no_k, P, E, M)
    for s in (empty_at, empty_nat, at_sample(none, P, E), cmlm_sample(none, P, E, M)):
        assert all(t.size(0) == 0 for t in s)
    plain_at = at_sample(tgt, P, E)
    plain_nat = cmlm_sample(tgt, P, E, M, generator=torch.Generator().manual_seed(0))
    for merged, plain in (
        (merge_rows(empty_at, plain_at, P), plain_at),
        (merge_rows(empty_nat, plain_nat, P), plain_nat),
    ):
        for a, b in zip(merged, plain):
            assert torch.equal(a, b)
    chunked = skip_at_sample(tgt, 2, P, E, starts(2, 2))
    merged = merge_rows(chunked, at_sample(none, P, E), P)
    for a, b in zip(merged, chunked):
        assert torch.equal(a[:, : b.size(1)], b)


# ---------------------------------------------------------------- Skip-AT self-distillation


def test_skip_at_teacher_slots_table():
    """SPEC table, N = 4, k = 2: Skip-AT targets ``y2 y4 </s>`` are AT slots 1 and 3; the
    last ``</s>`` pads to a multiple of k and has no AT prediction. N = 3: ``y2 </s>`` at 1, 3."""
    tgt = batch(4, 3)
    skip = skip_at_sample(tgt, 2, P, E, starts(2, 2)).target
    slots, valid = chunking.skip_at_teacher_slots(skip, 2, chunking.target_lengths(tgt, P), P)
    assert valid.tolist() == [[True, True, False], [True, True, False]]
    assert slots.tolist() == [[1, 3, 0], [1, 3, 0]]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_skip_at_teacher_slots_point_at_the_same_tokens(k):
    """Wherever valid, the AT sample's target at the slot is the Skip-AT target, for ragged
    batches and per-row chunk sizes; every AT-predictable Skip-AT target is valid."""
    tgt = batch(1, 2, 5, 7, 8, 11)
    ks = T([k, 2, k, 3, k, 4])
    skip = skip_at_sample(tgt, ks, P, E, starts(ks, 6)).target
    at = chunking.at_sample(tgt, P, E).target
    lengths = chunking.target_lengths(tgt, P)
    slots, valid = chunking.skip_at_teacher_slots(skip, ks, lengths, P)
    assert torch.equal(at.gather(1, slots)[valid], skip[valid])
    for r in range(6):
        n_valid = int(valid[r].sum())
        # y_k, y_2k, .. within y_1 .. y_N </s>: floor((N + 1) / k) of them
        assert n_valid == int(lengths[r]) // int(ks[r])


def test_batch_decoder_samples_without_a_task():
    """chunking.batch_decoder_samples: the per-batch samples of SPEC section 2 from tensors and
    settings only (the task's build_decoder_samples calls it)."""
    pad, eos, mask = 1, 2, 3
    target = torch.tensor([[10, 11, 12, 13, eos], [14, 15, eos, pad, pad], [16, eos, pad, pad, pad]])
    kw = dict(pad=pad, eos=eos, mask=mask, chunk_sizes=[2], chunk_start={2: 5})
    _, hrt = batch_decoder_samples(target, "hrt", None, **kw)  # validation: every row both ways
    assert hrt["n_chunked"] == 3 and hrt["ar"].tokens.size(0) == 6 and hrt["p_k"] == -1.0
    assert hrt["ar"].tokens[0].tolist()[:3] == [5, 11, 13]  # <s2> y2 y4
    assert hrt["ar_rows"].tolist() == [0, 1, 2, 0, 1, 2]
    _, hrt = batch_decoder_samples(target, "hrt", 0.0, **kw)
    assert hrt["n_chunked"] == 0 and hrt["ar"].tokens[:, 0].tolist() == [eos] * 3
    _, hrt = batch_decoder_samples(target, "at", 0.5, **kw)
    assert hrt["nar"] is None and hrt["ar"].target.tolist() == target.tolist()
    gen = chunked_rows_generator(torch.tensor([4, 7, 9]), seed=1, num_updates=10)
    again = chunked_rows_generator(torch.tensor([4, 7, 9]), seed=1, num_updates=10)
    assert torch.randperm(10, generator=gen).tolist() == torch.randperm(10, generator=again).tolist()
    distilled = torch.tensor([[20, eos], [21, eos], [22, eos]])
    mixed, _ = batch_decoder_samples(target, "at", None, distilled=distilled, p_raw=0.0, **kw)
    assert mixed.tolist() == distilled.tolist()
