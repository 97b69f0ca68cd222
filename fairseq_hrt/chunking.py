"""Pure tensor functions for HRT's training samples and decoding inputs (SPEC sections 2-3).

Conventions (shared by every function here and by the decoder):

* A target row is ``y_1 ... y_N </s>`` right-padded with ``<pad>`` (fairseq's ``target``).
* The *original position* of ``y_j`` is ``j`` (1-based); the start symbol has position 0.
  AT inputs are ``<start> y_1 .. y_N`` at positions ``0..N``; NAT inputs are the target slots
  at positions ``1..``. Skip-AT keeps original positions (``0, k, 2k, ...``), so the relative
  distances in the decoder's self-attention are those of the full sentence.
* The AT start symbol is fairseq's: ``</s>`` (``SequenceGenerator`` starts from eos), so that
  the AT mode of an HRT model, fairseq's transformer and fairseq's beam search agree.
* Positions of padding slots are 0; the decoder gives padding the padding embedding anyway.

Every function accepts a per-row chunk size (``k`` an int or a ``(B,)`` tensor) so one batch
can mix chunk sizes.
"""

import zlib
from typing import Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions
from hrt_runtime import search

IntOrTensor = Union[int, Tensor]


class DecoderSample(NamedTuple):
    """One decoder-side training sample: input tokens, their original positions, targets.

    ``target`` holds ``pad`` where no loss is taken ([P] in the SPEC table).
    """

    tokens: Tensor
    positions: Tensor
    target: Tensor


def curriculum_p_k(num_updates: int, total_updates: int, curriculum_lambda: float = 1.0) -> float:
    """Share of a batch trained with chunk size k: ``p_k = (t / T) ** lambda``, clipped to [0, 1]."""
    if total_updates <= 0:
        raise RefusedOptions("the chunk curriculum needs the total number of updates (--max-update > 0)")
    if curriculum_lambda <= 0:
        raise RefusedOptions(f"--curriculum-lambda must be > 0, got {curriculum_lambda}")
    ratio = min(max(num_updates / total_updates, 0.0), 1.0)
    return ratio**curriculum_lambda


def num_chunked(batch_size: int, p_k: float) -> int:
    """``round(n * p_k)`` pairs of a batch give chunked samples (Algorithm 1)."""
    return int(round(batch_size * p_k))


def choose_chunked_rows(batch_size: int, p_k: float, generator=None, device=None):
    """Which ``round(n * p_k)`` rows of a batch are chunked: a uniformly random subset.

    Algorithm 1 takes "the first" pairs of a batch, but fairseq's batches are sorted by
    length, so the first rows are always the longest sentences: short sentences would never
    be chunked until ``p_k`` is large. A random subset gives every length the same share.
    Reproducible: the draw comes from ``generator`` (the global RNG by default; training
    passes one seeded by the seed, the update and the batch, see
    :func:`chunked_rows_generator`). Returns ``(chunked_rows, plain_rows)``,
    each sorted.
    """
    n_chunked = num_chunked(batch_size, p_k)
    if n_chunked in (0, batch_size):  # nothing to choose: draw nothing from the RNG
        rows = torch.arange(batch_size, device=device)
        return (rows, rows[:0]) if n_chunked else (rows[:0], rows)
    order = torch.randperm(batch_size, generator=generator).to(device)
    return order[:n_chunked].sort().values, order[n_chunked:].sort().values


def target_lengths(target: Tensor, pad: int) -> Tensor:
    """Length of every row including its ``</s>`` (``N + 1``)."""
    return target.ne(pad).long().sum(dim=1)


def _row_chunk_sizes(k: IntOrTensor, batch_size: int, device) -> Tensor:
    if isinstance(k, Tensor):
        k = k.to(device=device, dtype=torch.long)
        if k.dim() != 1 or k.numel() != batch_size:
            raise ValueError(f"per-row chunk sizes must have shape ({batch_size},), got {tuple(k.shape)}")
    else:
        k = torch.full((batch_size,), int(k), dtype=torch.long, device=device)
    if batch_size and k.min().item() < 1:
        raise ValueError(f"chunk size must be >= 1, got {k.min().item()}")
    return k


def pad_to_chunk_multiple(target: Tensor, k: IntOrTensor, pad: int, eos: int) -> Tensor:
    """Pad every row with extra ``</s>`` up to a length that is a multiple of its chunk size.

    ``y_1 .. y_N </s>`` becomes ``y_1 .. y_N </s> .. </s>`` of length ``ceil((N+1)/k) * k``;
    the result is right-padded with ``pad`` to the longest row.
    """
    bsz = target.size(0)
    k = _row_chunk_sizes(k, bsz, target.device)
    lengths = target_lengths(target, pad)
    padded_lengths = (lengths + k - 1) // k * k
    width = int(padded_lengths.max().item()) if bsz else 0
    out = target.new_full((bsz, width), pad)
    copy = min(width, target.size(1))
    out[:, :copy] = target[:, :copy]
    slot = torch.arange(width, device=target.device).unsqueeze(0)
    extra_eos = (slot >= lengths.unsqueeze(1)) & (slot < padded_lengths.unsqueeze(1))
    out[extra_eos] = eos
    return out


def at_sample(target: Tensor, pad: int, eos: int, start: Optional[int] = None) -> DecoderSample:
    """AT: input ``<start> y_1 .. y_N`` at positions ``0..N``, targets ``y_1 .. y_N </s>``."""
    start = eos if start is None else start
    lengths = target_lengths(target, pad)
    tokens = target.new_full(target.shape, pad)
    tokens[:, 0] = start
    tokens[:, 1:] = target[:, :-1]
    slot = torch.arange(target.size(1), device=target.device).unsqueeze(0)
    valid = slot < lengths.unsqueeze(1)
    tokens = tokens.masked_fill(~valid, pad)
    positions = slot.expand_as(target).masked_fill(~valid, 0)
    return DecoderSample(tokens, positions, target.clone())


def skip_at_sample(target: Tensor, k: IntOrTensor, pad: int, eos: int, start_symbols: Tensor) -> DecoderSample:
    """Skip-AT: input ``<s_k> y_k y_2k ..`` at positions ``0, k, 2k, ..``, targets ``y_k y_2k .. y_M``.

    ``start_symbols`` is a ``(B,)`` tensor with each row's ``<s_k>`` index. ``M`` is the
    length padded to a multiple of k, so the last target is ``</s>`` (SPEC table).
    """
    bsz = target.size(0)
    k = _row_chunk_sizes(k, bsz, target.device)
    padded = pad_to_chunk_multiple(target, k, pad, eos)
    steps = padded.ne(pad).long().sum(dim=1) // k  # M / k per row
    width = int(steps.max().item()) if bsz else 0
    i = torch.arange(width, device=target.device).unsqueeze(0)  # step index
    valid = i < steps.unsqueeze(1)
    # target of step i is y_{(i+1)k}, i.e. slot (i+1)k - 1 of the padded row
    target_slot = ((i + 1) * k.unsqueeze(1) - 1).clamp(max=max(padded.size(1) - 1, 0))
    skip_target = padded.gather(1, target_slot).masked_fill(~valid, pad)
    # input of step i is the previous step's target (y_{ik}), step 0 reads <s_k>
    tokens = torch.cat([start_symbols.view(-1, 1).to(target), skip_target[:, :-1]], dim=1)
    tokens = tokens.masked_fill(~valid, pad)
    positions = (i * k.unsqueeze(1)).masked_fill(~valid, 0)
    return DecoderSample(tokens, positions, skip_target)


def skip_at_teacher_slots(skip_target: Tensor, k: IntOrTensor, target_lengths_: Tensor, pad: int):
    """Where AT mode's teacher-forced predictions match Skip-AT's targets (self-distillation).

    Skip-AT step ``i`` predicts ``y_{(i+1)k}``; AT mode predicts the same token at output slot
    ``(i+1)k - 1`` of the AT sample over the same target, from the full prefix. Returns
    ``(slots, valid)``, both ``(B, W)`` like ``skip_target``: ``valid`` is False at padding and
    at the extra ``</s>`` that pad a target to a multiple of k, which AT mode never predicts
    (``target_lengths_`` counts ``y_1 .. y_N </s>``, see :func:`target_lengths`).
    """
    bsz, width = skip_target.shape
    k = _row_chunk_sizes(k, bsz, skip_target.device)
    i = torch.arange(width, device=skip_target.device).unsqueeze(0)
    slots = (i + 1) * k.unsqueeze(1) - 1
    valid = skip_target.ne(pad) & (slots < target_lengths_.to(slots.device).unsqueeze(1))
    return slots.masked_fill(~valid, 0), valid


def chunk_final_mask(width: int, k: IntOrTensor, batch_size: int, device) -> Tensor:
    """``(B, width)`` bool: True at the slots that end a chunk (positions k, 2k, ...)."""
    k = _row_chunk_sizes(k, batch_size, device)
    positions = torch.arange(1, width + 1, device=device).unsqueeze(0)
    return positions % k.unsqueeze(1) == 0


def skip_cmlm_sample(target: Tensor, k: IntOrTensor, pad: int, eos: int, mask: int) -> DecoderSample:
    """Skip-CMLM: the padded target with every non-final token of each chunk masked.

    Input ``<m> y_2 <m> y_4 <m> </s>`` (k = 2) at positions ``1..M``; targets are the masked
    tokens only (``y_1 [P] y_3 [P] </s> [P]``). Deterministic: no randomness.
    """
    bsz = target.size(0)
    padded = pad_to_chunk_multiple(target, k, pad, eos)
    real = padded.ne(pad)
    keep = chunk_final_mask(padded.size(1), k, bsz, target.device) & real
    masked = real & ~keep
    tokens = padded.masked_fill(masked, mask)
    skip_target = padded.masked_fill(~masked, pad)
    positions = nat_positions(real)
    return DecoderSample(tokens, positions, skip_target)


def nat_positions(real: Tensor) -> Tensor:
    """Positions ``1..M`` for the real slots of a NAT input, 0 for padding."""
    slot = torch.arange(1, real.size(1) + 1, device=real.device).unsqueeze(0)
    return slot.expand_as(real).masked_fill(~real, 0)


def cmlm_sample(
    target: Tensor, pad: int, eos: int, mask: int, generator: Optional[torch.Generator] = None
) -> DecoderSample:
    """CMLM (Mask-Predict's uniform masking): mask ``n ~ U{1..N}`` random tokens of ``y_1..y_N``.

    ``</s>`` stays visible (it tells the model the length, as the length predictor's output
    does at inference). Targets are the masked tokens only. A row with no token (N = 0) has
    nothing to mask and contributes no loss.
    """
    real = target.ne(pad)
    maskable = real & target.ne(eos)
    n_tokens = maskable.long().sum(dim=1)
    scores = torch.rand(target.shape, device=target.device, generator=generator)
    scores = scores.masked_fill(~maskable, 2.0)  # never chosen
    # n ~ U{1..N} per row
    n_mask = (torch.rand(n_tokens.shape, device=target.device, generator=generator) * n_tokens.float()).long() + 1
    n_mask = torch.minimum(n_mask, n_tokens)
    ranks = scores.argsort(dim=1).argsort(dim=1)
    masked = ranks < n_mask.unsqueeze(1)
    tokens = target.masked_fill(masked, mask)
    cmlm_target = target.masked_fill(~masked, pad)
    return DecoderSample(tokens, nat_positions(real), cmlm_target)


def merge_rows(first: DecoderSample, second: DecoderSample, pad: int) -> DecoderSample:
    """Stack the rows of two samples (chunked rows first), padding to the wider one."""
    width = max(first.tokens.size(1), second.tokens.size(1))

    def widen(t: Tensor, value: int) -> Tensor:
        if t.size(1) == width:
            return t
        return torch.cat([t, t.new_full((t.size(0), width - t.size(1)), value)], dim=1)

    return DecoderSample(
        torch.cat([widen(first.tokens, pad), widen(second.tokens, pad)]),
        torch.cat([widen(first.positions, 0), widen(second.positions, 0)]),
        torch.cat([widen(first.target, pad), widen(second.target, pad)]),
    )


def mix_targets(raw: Tensor, distilled: Tensor, p_raw: Union[float, Tensor], pad: int, generator=None):
    """MixDistill: each row takes its raw target with probability ``p_raw``, else the distilled one.

    ``p_raw`` is one probability or a ``(B,)`` tensor of per-row probabilities (chunked pairs
    may use another share, ``--p-raw-chunked``). Returns ``(targets, use_raw)``. ``p_raw = 1``
    gives exactly the raw targets, ``p_raw = 0`` exactly the distilled ones.
    """
    p = torch.as_tensor(p_raw, dtype=torch.float, device=raw.device)
    if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):
        raise RefusedOptions(f"--p-raw must be in [0, 1], got {p_raw}")
    if p.dim() > 0 and p.shape != (raw.size(0),):
        raise ValueError(f"per-row p_raw must have shape ({raw.size(0)},), got {tuple(p.shape)}")
    if raw.size(0) != distilled.size(0):
        raise ValueError("raw and distilled targets have different batch sizes")
    use_raw = torch.rand(raw.size(0), device=raw.device, generator=generator) < p
    width = max(raw.size(1), distilled.size(1))

    def widen(t):
        return torch.cat([t, t.new_full((t.size(0), width - t.size(1)), pad)], dim=1) if t.size(1) < width else t

    mixed = torch.where(use_raw.unsqueeze(1), widen(raw), widen(distilled))
    # drop columns that are padding in every row
    keep = int(mixed.ne(pad).long().sum(dim=1).max().item()) if mixed.numel() else 0
    return mixed[:, :keep], use_raw


def chunked_rows_generator(sentence_ids, seed: int, num_updates: int) -> torch.Generator:
    """The RNG that picks a batch's chunked pairs, seeded by ``--seed``, the update and the
    batch's sentence ids (``sentence_ids``: fairseq's ``sample['id']``). The same batch at the
    same update gets the same pairs whatever drew random numbers before it (dropout, earlier
    micro-batches of ``--update-freq``, another rank), so a resumed run, a run over several
    ranks and one with ``--update-freq`` choose alike."""
    ids = torch.as_tensor(sentence_ids).cpu().numpy().astype(np.int64)
    batch = zlib.crc32(ids.tobytes())
    value = (int(seed) * 1_000_003 + int(num_updates)) * 2_654_435_761 + batch
    return torch.Generator().manual_seed(value % (2**63 - 1))


def row_chunk_sizes(n_chunked: int, chunk_sizes: Sequence[int], device=None) -> Tensor:
    """The k of each chunked row: the trained chunk sizes assigned to the rows in turn."""
    return torch.tensor([chunk_sizes[i % len(chunk_sizes)] for i in range(n_chunked)], dtype=torch.long, device=device)


def batch_decoder_samples(
    target: Tensor,
    mode: str,
    p_k: Optional[float],
    *,
    pad: int,
    eos: int,
    mask: int,
    chunk_sizes: Sequence[int] = (2,),
    chunk_start: Optional[Mapping[int, int]] = None,
    distilled: Optional[Tensor] = None,
    p_raw: float = 0.5,
    p_raw_chunked: Optional[float] = None,
    generator=None,
    rows_generator=None,
):
    """The decoder samples of SPEC section 2 for one batch of targets.

    ``mode``: ``'hrt'`` ({AT, CMLM} for the plain rows, {Skip-AT, Skip-CMLM} for
    ``round(n * p_k)`` random rows), ``'at'`` or ``'cmlm'`` (``p_k`` ignored). ``p_k=None``
    (validation) makes every row both chunked and plain. ``chunk_start`` maps k to the id of
    ``<s_k>``. With ``distilled`` (MixDistill), each row's target is drawn from the raw one
    with probability ``p_raw`` (``p_raw_chunked`` for chunked rows when given, training only).
    ``rows_generator`` draws the chunked rows (``generator`` when absent), ``generator`` the
    CMLM masks and the MixDistill choice.

    Returns ``(target, hrt)``: the (possibly mixed) target and the dict the criterion reads as
    ``sample['hrt']``: ``ar`` / ``nar`` (:class:`DecoderSample` or ``None``), the batch rows
    they come from (``ar_rows`` / ``nar_rows``), ``n_chunked`` (the first rows of ``ar`` /
    ``nar``), ``chunk_sizes`` (their k) and ``p_k`` (``-1.0`` for none).
    """
    n = target.size(0)
    device = target.device
    rows = torch.arange(n, device=device)
    chunked_rows = plain_rows = None
    if mode == "hrt":
        if p_k is None:  # validation: all rows chunked and all rows plain
            chunked_rows, plain_rows = rows, rows
        else:
            chunked_rows, plain_rows = choose_chunked_rows(
                n, p_k, rows_generator if rows_generator is not None else generator, device
            )
    if distilled is not None:
        p = p_raw
        if p_raw_chunked is not None and p_k is not None and chunked_rows is not None:
            p = torch.full((n,), p_raw, device=device)
            p[chunked_rows] = p_raw_chunked
        target, _ = mix_targets(target, distilled.to(target), p, pad, generator)
    ar = nar = None
    ar_rows = nar_rows = rows
    n_chunked = 0
    ks = target.new_zeros(0)
    if mode == "at":
        ar = at_sample(target, pad, eos)
    elif mode == "cmlm":
        nar = cmlm_sample(target, pad, eos, mask, generator)
    else:
        n_chunked = chunked_rows.numel()
        ks = row_chunk_sizes(n_chunked, chunk_sizes, device)
        starts = torch.tensor([chunk_start[int(k)] for k in ks.tolist()], dtype=torch.long, device=device)
        chunked, plain = target[chunked_rows], target[plain_rows]
        ar = merge_rows(skip_at_sample(chunked, ks, pad, eos, starts), at_sample(plain, pad, eos), pad)
        nar = merge_rows(
            skip_cmlm_sample(chunked, ks, pad, eos, mask), cmlm_sample(plain, pad, eos, mask, generator), pad
        )
        ar_rows = nar_rows = torch.cat([chunked_rows, plain_rows])
    return target, {
        "ar": ar,
        "nar": nar,
        "ar_rows": ar_rows,
        "nar_rows": nar_rows,
        "n_chunked": n_chunked,
        "chunk_sizes": ks,  # k of each chunked row (the first n_chunked rows of ar / nar)
        "p_k": p_k if p_k is not None else -1.0,
    }


# ---------------------------------------------------------------------------------------
# decoding (SPEC section 3)
# ---------------------------------------------------------------------------------------


def stage2_input(skeleton: Tensor, k: IntOrTensor, pad: int, mask: int) -> DecoderSample:
    """Stage II input: ``k - 1`` masks before every stage-I token ``z_i`` (``z`` right-padded).

    Returns tokens/positions ``1..m*k`` for the non-causal pass; ``target`` is the
    skeleton spread onto its slots (pad elsewhere) so callers can check it is kept. The
    decoding search's own definition (:func:`hrt_runtime.search.stage2_input`), on tensors.
    """
    rows_k = _row_chunk_sizes(k, skeleton.size(0), skeleton.device)  # checked
    k = rows_k.cpu().numpy() if torch.is_tensor(k) else int(k)
    tokens, positions, target = search.stage2_input(skeleton.cpu().numpy(), k, pad, mask)
    device = skeleton.device
    return DecoderSample(*(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (tokens, positions, target)))


def truncate_at_first_eos(tokens: Tensor, eos: int, pad: int) -> Tensor:
    """Keep everything up to and including the first ``</s>`` of each row; pad the rest (a
    row without ``</s>`` is kept whole): :func:`hrt_runtime.search.truncate_at_first_eos`."""
    return torch.from_numpy(search.truncate_at_first_eos(tokens.cpu().numpy(), eos, pad)).to(tokens.device)
