"""Attention and its inputs, written once for every pass and for the plugin's training
attention (:class:`~fairseq_hrt.modules.relative_attention.RelativeSelfAttention`)."""

import contextlib
import math
import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# The kernels attention runs on in this thread: None, written out (two products and a float32
# softmax, what every pass and export has always computed); "fused", PyTorch's
# scaled_dot_product_attention (one kernel on a GPU where it has one) for every call without
# dropout. Chosen per captured graph by the CUDA-graph engine (CudaGraphBackend.attention_kernel).
_choice = threading.local()
ATTENTION_KERNELS = (None, "fused")


@contextlib.contextmanager
def attention_kernel(kind: Optional[str]):
    """Attention inside the block runs on ``kind``'s kernels (:data:`ATTENTION_KERNELS`)."""
    if kind not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kind!r}: one of {ATTENTION_KERNELS}")
    before = getattr(_choice, "kind", None)
    _choice.kind = kind
    try:
        yield
    finally:
        _choice.kind = before


def relative_bucket(query_positions: Tensor, key_positions: Tensor, window: int) -> Tensor:
    """``clip(p_key - p_query, -w, w) + w``: index into the ``2w + 1`` relative embeddings.

    ``query_positions`` is ``(B, T)``, ``key_positions`` ``(B, S)``; returns ``(B, T, S)``.
    """
    return distance_bucket(key_positions.unsqueeze(1) - query_positions.unsqueeze(2), window)


def distance_bucket(distance: Tensor, window: int) -> Tensor:
    """``clip(distance, -w, w) + w`` (``distance``: key position less query position): the
    bucket of every relative key, in training and in every decoding pass."""
    return distance.clamp(-window, window) + window


def attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    relative_keys: Optional[Tensor] = None,
    buckets: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    dropout=None,
) -> Tensor:
    """Scaled dot-product attention ``(N, H, W, d)`` of queries ``q`` ``(N, H, W, d)`` (already
    scaled) over ``keys``/``values`` ``(N, H, K, d)``, softmax in float32.

    ``relative_keys`` ``(d, R)``: key-only relative positions, the logit of key ``j`` gains
    ``q . relative_keys[:, bucket]`` with ``buckets`` either ``(K,)`` (the same for every
    query) or ``(N, H, W, K)``. ``bias``: an additive float mask broadcast to the scores
    (``-inf``: not seen), or ``None``. ``dropout``: training's, on the probabilities."""
    if dropout is None and getattr(_choice, "kind", None) == "fused":
        return fused_attention(q, keys, values, relative_keys, buckets, bias)
    scores = torch.matmul(q, keys.transpose(2, 3))  # (N, H, W, K)
    if relative_keys is not None:
        q_rel = torch.matmul(q, relative_keys)  # (N, H, W, R)
        scores = scores + (q_rel.index_select(3, buckets) if buckets.dim() == 1 else q_rel.gather(3, buckets))
    if bias is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        # float32 by promotion inside the addition: half scores take no cast kernel of their own
        probs = torch.softmax((scores + bias.float()).float(), dim=-1)
    probs = probs.type_as(scores)
    return torch.matmul(probs if dropout is None else dropout(probs), values)


def fused_attention(q, keys, values, relative_keys=None, buckets=None, bias=None) -> Tensor:
    """:func:`attention` (no dropout) as one ``scaled_dot_product_attention``: the relative
    keys' logits and the bias are its additive mask, in the queries' dtype (the bias is 0 or
    ``-inf``, exact in any float)."""
    mask = None
    if relative_keys is not None:
        q_rel = torch.matmul(q, relative_keys)  # (N, H, W, R)
        mask = q_rel.index_select(3, buckets) if buckets.dim() == 1 else q_rel.gather(3, buckets)
    if bias is not None:
        bias = bias.to(q.dtype)
        mask = bias if mask is None else mask + bias
    if mask is not None and mask.dim() == 1:  # a static step's (K,): the kernel wants (.., W, K)
        mask = mask.unsqueeze(0)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)


def relative_buckets(steps: int, stride: int, window: int) -> Tensor:
    """``(steps, steps)``: row ``t`` holds the relative-key index of keys ``0..t`` seen from
    query step ``t`` when step ``j`` sits at position ``j * stride``."""
    positions = (torch.arange(steps) * stride).unsqueeze(0)
    return relative_bucket(positions, positions, window)[0]


def step_buckets(step: Tensor, stride: Tensor, window: int) -> Tensor:
    """``(step + 1,)``: row ``step`` of :func:`relative_buckets`, for a ``step`` known only as a
    tensor (the exported greedy loop's iteration)."""
    return distance_bucket((torch.arange(step + 1, dtype=torch.int64) - step) * stride, window)


def pair_buckets(positions: Tensor, window: int, heads: int) -> Tensor:
    """``(B, H, T, T)``: the relative-key index of every pair of ``positions`` ``(B, T)`` (a
    non-causal pass's queries and keys)."""
    return relative_bucket(positions, positions, window).unsqueeze(1).expand(-1, heads, -1, -1)


def padding_bias(padding_mask: Optional[Tensor], length: int, rows: int, dtype, device) -> Tensor:
    """Additive attention bias ``(rows, 1, 1, length)``: ``-inf`` on padding, else 0."""
    bias = torch.zeros(rows, 1, 1, length, dtype=dtype, device=device)
    if padding_mask is not None:
        bias.masked_fill_(padding_mask.view(rows, 1, 1, length), -math.inf)
    return bias


def encoder_padding_bias(encoder_out) -> Tensor:
    """:func:`padding_bias` of a fairseq encoder output's padding, ``(B, 1, 1, S)``."""
    enc = encoder_out["encoder_out"][0]
    pad_mask = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) > 0 else None
    return padding_bias(pad_mask, enc.size(0), enc.size(1), torch.float32, enc.device)
