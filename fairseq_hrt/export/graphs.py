"""The passes of a model as ``nn.Module``s of fixed inputs and outputs, for ``torch.onnx.export``.

Every graph is traced from the planned passes that the lean and CUDA-graph engines run: the
encoder's (:class:`~fairseq_hrt.passes.encoder_pass.EncoderPass`), the decoder layer of
:mod:`fairseq_hrt.passes.layers` over the folded plan of
:class:`~fairseq_hrt.passes.fixed_pass.FixedPass`, the non-causal pass and its choice
(:func:`~fairseq_hrt.passes.fixed_pass.parallel_choice`) and the token choice of
:mod:`fairseq_hrt.passes.token_choice`; only what an exported graph does better differs:

* ONNX Runtime cannot write into an input, so a step takes the past keys/values
  ``(N, H, t, d)`` of every layer and returns them grown by its own position (``present``),
  and the caller feeds them to the next step;
* the queries' scaling is folded into their projection weights, and every reshape has a
  constant shape (``-1`` for the rows): a traced ``view(n, ...)`` costs four shape operators
  per use, which at batch 1 cost as much as the matrix products;
* a step's encoder keys/values come one row per hypothesis (beam search repeats a sentence's
  rows for its beam, once, in numpy), and its position row and relative-key buckets come as
  inputs: arithmetic the caller has anyway;
* the choice ends the graph (:func:`~fairseq_hrt.passes.token_choice.best_allowed`), so only
  ids and scores leave it.

Graphs:

* :class:`EncoderGraph`: source tokens ``(B, S)`` -> the padding bias ``(B, 1, 1, S)`` and every
  decoder layer's encoder keys, then values ``(B, H, S, d)`` (Mask-Predict: and the target
  length's log-probabilities).
* :class:`StepGraph`: one left-to-right step. With ``top = 1`` the best allowed token and its
  log-probability (``scores=False``: its biased logit, no log-softmax); with ``top = K`` (the
  exporter makes K an input) the K best allowed log-probabilities and their rows.
* :class:`ParallelGraph`: one non-causal pass over tokens at given positions (HRT's stage II,
  Mask-Predict's iterations), its last layer computed at the columns read only, and the best
  allowed token and its log-probability for the selected slots only (stage II projects only
  its masks onto the vocabulary).

With ``restricted=True`` a decoder graph takes the output layer's rows (weight ``(V', C)``,
bias ``(V',)``) as inputs: a shortlist's rows, gathered once per batch.
"""

from typing import List

import torch
from torch import Tensor, nn

from fairseq_hrt.passes.attention import step_buckets
from fairseq_hrt.passes.encoder_pass import EncoderPass
from fairseq_hrt.passes.fixed_pass import FixedPass, parallel_choice
from fairseq_hrt.passes.layers import encoder_attention, layer_forward, self_attention, ssru_step
from fairseq_hrt.passes.search_rules import bias_at
from fairseq_hrt.passes.state import EncoderKV
from fairseq_hrt.passes.token_choice import best_allowed, best_biased


class StepGraph(nn.Module):
    """One left-to-right step. Inputs, in order: ``tokens (N,)``, ``position (1,)`` (the row
    of the position table: step x stride), [``buckets (t + 1,)``: the relative-key index of
    every key seen from this step, decoders with relative positions], ``logit_bias (V,)``,
    ``encoder_bias (N, 1, 1, S)``, per layer encoder keys, values ``(N, H, S, d)``, per layer
    past keys, values ``(N, H, t, d)`` (SSRU decoders: per layer the past cell ``(N, C)``), and
    with ``restricted`` the output rows' weight and bias. Outputs: ``score (N,)``, ``token
    (N,)`` (``top`` 1; ``scores`` false: ``logit (N,)``, the biased logit of the token, and
    ``token``) or ``top_scores (N, K)``, ``top_rows (N, K)``; then per layer present
    keys, values ``(N, H, t + 1, d)`` (SSRU: per layer the new cell)."""

    def __init__(
        self,
        model,
        max_positions: int,
        top: int = 1,
        restricted: bool = False,
        blocked: bool = True,
        scores: bool = True,
    ):
        super().__init__()
        if not scores and top != 1:
            raise ValueError("a step without scores chooses one token (top 1)")
        with torch.no_grad():  # the planned weights become constants of the graph
            self.fixed = FixedPass(model, max_positions, restricted, blocked)
        self.plan, self.recurrent, self.window = self.fixed.plan, self.fixed.recurrent, self.fixed.window
        self.top, self.scores = top, scores

    def forward(self, tokens, position, *inputs):
        inputs = list(inputs)
        buckets = inputs.pop(0) if self.window > 0 else None
        logit_bias, encoder_bias = inputs[0], inputs[1]
        n_layers = len(self.plan.layers)
        caches = inputs[2:]
        encoder = EncoderKV(caches[0:n_layers], caches[n_layers : 2 * n_layers], encoder_bias)
        n_past = n_layers if self.recurrent else 2 * n_layers  # SSRU: one cell per layer; else keys, values
        past = caches[2 * n_layers : 2 * n_layers + n_past]
        past_k, past_v = past[:n_layers], past[n_layers:]
        out_rows = caches[2 * n_layers + n_past : 2 * n_layers + n_past + 2]
        x = self.fixed.prologue(tokens, position)
        present_k: List[Tensor] = []
        present_v: List[Tensor] = []

        def recurrent_block(layer, i, h):
            # the SSRU step of the lean pass's recurrence (a new cell: an exported graph writes no input)
            cell = ssru_step(layer.ssru_projections(h), past_k[i])
            present_k.append(cell)
            return torch.relu(cell)

        def self_block(layer, i, h):
            def keys_of(k, v):  # the past grown by this step: an exported graph writes no input
                present_k.append(torch.cat([past_k[i], k], dim=2))
                present_v.append(torch.cat([past_v[i], v], dim=2))
                return present_k[-1], present_v[-1]

            return self_attention(layer, h, None, keys_of, buckets, None)

        def encoder_block(layer, i, h):  # one row per hypothesis: no transpose
            return encoder_attention(layer, h, encoder.keys[i], encoder.values[i], encoder.bias, one_query=True)

        for i, layer in enumerate(self.plan.layers):
            x = layer_forward(layer, i, x, recurrent_block if self.recurrent else self_block, encoder_block)
        logits = self.fixed.logits(x, *out_rows)
        if self.scores:
            chosen = best_allowed(logits, logit_bias, self.top, self.fixed.block)
        else:
            chosen = best_biased(logits, logit_bias, self.fixed.block)
        return (*chosen, *present_k, *present_v)


class GreedyLoopBody(nn.Module):
    """The body of the greedy loop (``greedy.onnx``, :func:`~fairseq_hrt.export.loop.greedy_loop`):
    one :class:`StepGraph` step of the whole greedy search, its rules and its end inside the
    graph, so a sentence's steps are one ONNX Runtime run instead of one run each from Python
    (a run and the search's numpy work around it cost more than a small model's step).

    Inputs (an ONNX ``Loop`` body's): the iteration ``i`` (the step), the loop condition, then
    the carried ``alive (N,)`` (rows without ``</s>`` yet), ``prev (N,)`` (the last tokens) and
    the past keys, values (SSRU:
    cells); the search's settings ``stride``, ``max_len``, ``min_len`` and its three biases
    (:class:`hrt_runtime.search.Rules`: ``usual``, ``early`` before ``min_len``, ``final`` at
    ``max_len``) and the encoder side are read from the loop's graph by name. Outputs: the
    condition (some row has not reached ``</s>``), the carried values, then ``score (N,)`` of
    the step (the step's token is both carried and collected). With ``restricted`` the output
    rows' ``out_weight``, ``out_bias`` and ``out_ids`` are read from the loop's graph too."""

    def __init__(self, model, max_positions: int, eos: int, restricted: bool = False):
        super().__init__()
        # one TopK(1): the loop decodes few rows (``hrt_runtime.model.LOOP_ROWS``)
        self.step = StepGraph(model, max_positions, top=1, restricted=restricted, blocked=False)
        self.eos = eos
        self.window = self.step.window
        self.restricted = restricted
        self.layers = len(self.step.plan.layers)
        self.n_past = self.layers if self.step.recurrent else 2 * self.layers

    def forward(self, i, cond, alive, prev, *rest):
        past = rest[: self.n_past]
        stride, max_len, min_len, usual, early, final, encoder_bias = rest[self.n_past : self.n_past + 7]
        enc = rest[self.n_past + 7 : self.n_past + 7 + 2 * self.layers]
        # restricted: the output rows' weight, bias and ids (a row's token is its id)
        rows = rest[self.n_past + 7 + 2 * self.layers :]
        position = (i * stride).reshape(1)
        bias = bias_at(i, max_len, min_len, usual, early, final)
        buckets = [step_buckets(i, stride, self.window)] if self.window > 0 else []  # hrt_runtime's buckets
        score, token, *present = self.step(prev, position, *buckets, bias, encoder_bias, *enc, *past, *rows[:2])
        if self.restricted:
            token = rows[2].index_select(0, token)
        alive = alive & token.ne(self.eos)  # six operators to the condition (finished.all() takes eight)
        return (alive.any(), alive, token, *present, score)


class ParallelGraph(nn.Module):
    """One non-causal pass (:func:`~fairseq_hrt.passes.fixed_pass.parallel_choice`). Inputs:
    ``tokens (B, T)``, their ``positions (B, T)`` (rows of the position table), ``queries
    (Q,)`` (the columns whose output is read: the last layer computes its keys and values at
    every slot, everything else at these columns only), ``select (M,)`` (the slots to predict,
    flat indices into ``B x Q``), ``logit_bias (V,)``, ``encoder_bias (B, 1, 1, S)``, per
    layer encoder keys, values (and with ``restricted`` the output rows' weight and bias).
    Outputs: ``score (M,)``, ``token (M,)`` (rows of the output layer)."""

    def __init__(self, model, max_positions: int, restricted: bool = False):
        super().__init__()
        with torch.no_grad():  # the planned weights become constants of the graph
            self.fixed = FixedPass(model, max_positions, restricted)
        self.layers = len(self.fixed.plan.layers)

    def forward(self, tokens, positions, queries, select, logit_bias, encoder_bias, *caches):
        n = self.layers
        encoder = EncoderKV(caches[0:n], caches[n : 2 * n], encoder_bias)
        return parallel_choice(self.fixed, tokens, positions, queries, select, logit_bias, encoder, caches[2 * n :])


class EncoderGraph(nn.Module):
    """Source tokens ``(B, S)`` (left-padded, as fairseq batches them) -> ``encoder_bias (B, 1,
    1, S)`` and every decoder layer's encoder keys, then values ``(B, H, S, d)`` (Mask-Predict:
    and the target length's log-probabilities): :class:`~fairseq_hrt.passes.encoder_pass.EncoderPass`."""

    def __init__(self, model, length: bool = False):
        super().__init__()
        with torch.no_grad():
            self.encode = EncoderPass(model, length)

    def forward(self, src_tokens):
        return self.encode(src_tokens)
