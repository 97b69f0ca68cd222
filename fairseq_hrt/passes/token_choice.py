"""The choice of a decoding step's tokens, written once for every engine: the best allowed
rows of ``log_softmax(logits) + bias`` (``bias``: ``-inf`` on banned rows, ``--unkpen`` on
``<unk>``: the rules of :class:`hrt_runtime.search.Rules`).

Two arithmetic forms of that one choice, each kept where its outputs are compared bit for
bit: :func:`choose` (the lean and CUDA-graph steps: the best of ``logits + bias``, less the
logits' ``logsumexp``) and :func:`best_allowed` (the exported graphs and the non-causal
passes: ``log_softmax`` first, which ONNX Runtime runs far faster than ``ReduceLogSumExp``).
They pick the same rows and differ in the scores' last bits only. :func:`best_biased` picks
them without a score (the exported greedy step of a search that reads none)."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def choose(logits: Tensor, bias: Tensor, top: int, temperature: float = 1.0):
    """``(scores, rows)`` on the logits' device: the ``top`` best of ``log_softmax(logits /
    temperature) + bias``, ``(N,)`` each for ``top`` 1, else ``(N, top)``."""
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.float()
    allowed = logits + bias
    if top == 1:
        best, row = allowed.max(dim=1)
        return best - torch.logsumexp(logits, dim=1), row
    best, row = allowed.topk(top, dim=1)
    return best - torch.logsumexp(logits, dim=1, keepdim=True), row


def argmax_block(size: int) -> int:
    """The block of :func:`blocked_max` for ``size`` rows: the divisor of ``size`` nearest to
    its square root (1: no blocks)."""
    divisors = [g for g in range(1, size + 1) if size % g == 0]
    return min(divisors, key=lambda g: (abs(g - math.sqrt(size)), g))


def blocked_max(x: Tensor, block: int):
    """``(max, argmax)`` of the last axis of ``x`` ``(N, V)`` (the first index of the maximum,
    as ``max``), over blocks of ``block`` columns: the block maxima, the best block, then the
    best column in it. ONNX Runtime's ``ArgMax`` over a long axis is much slower than its
    ``ReduceMax``, and this close to the latter (benchmarks/results/runtime-step-cost-cpu/README.md)."""
    if block <= 1:
        return x.max(dim=-1)
    blocks = x.reshape(-1, x.size(-1) // block, block)
    best, b = blocks.amax(dim=-1).max(dim=-1)
    inner = blocks.gather(1, b.view(-1, 1, 1).expand(-1, 1, block)).reshape(-1, block)
    return best, b * block + inner.argmax(dim=-1)


def best_biased(logits: Tensor, logit_bias: Tensor, block: int = 1):
    """``(biased logits, rows)`` of the best rows of ``logits + logit_bias``: the rows of
    :func:`best_allowed` with ``top`` 1 (``log_softmax`` moves a row's logits by one constant)
    without the log-softmax, whose exponentials over the vocabulary a search that reads no
    scores does not need (CTranslate2's greedy search without ``return_scores``). ``block``: as
    :func:`best_allowed`'s."""
    return best_one(logits.float() + logit_bias, block)


def best_one(allowed: Tensor, block: int):
    """``(values, rows)`` ``(N,)`` of the best of each row of ``allowed``: one ``TopK(1)``
    (``block`` 0), else :func:`blocked_max` (no TopK(1), slower, and no squeeze, an ``If`` node
    when traced)."""
    if block == 0:
        best, row = allowed.topk(1, dim=-1)
        return best.reshape(-1), row.reshape(-1)
    return blocked_max(allowed, block)


def best_allowed(logits: Tensor, logit_bias: Tensor, top: int = 1, block: int = 1):
    """``(log-probabilities, rows)`` of the ``top`` best rows of ``log_softmax(logits) +
    logit_bias``. ``block``: see :func:`blocked_max` (``top`` 1; a number of rows known at
    export, so not for restricted output rows; 1: a plain ``max``); 0: one ``TopK(1)`` (a graph
    for few rows: at batch 1 faster than ``ArgMax`` and ``ReduceMax`` or the blocks' operators,
    benchmarks/results/runtime-step-cost-cpu/README.md)."""
    allowed = F.log_softmax(logits.float(), dim=-1) + logit_bias
    if top == 1:
        return best_one(allowed, block)
    return allowed.topk(top, dim=-1)
