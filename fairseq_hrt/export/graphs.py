"""The passes of a model as ``nn.Module``s of fixed inputs and outputs, for ``torch.onnx.export``.

The decoder graphs run the decoder's one planned pass
(:class:`~fairseq_hrt.passes.decoder_pass.StepPlan`, the layer structure of
:func:`~fairseq_hrt.passes.decoder_pass.layer_forward`, :func:`attention`); only what an
exported graph does better differs:

* ONNX Runtime cannot write into an input, so a step takes the past keys/values
  ``(N, H, t, d)`` of every layer and returns them grown by its own position (``present``),
  and the caller feeds them to the next step;
* the queries' scaling is folded into their projection weights, and every reshape has a
  constant shape (``-1`` for the rows): a traced ``view(n, ...)`` costs four shape operators
  per use, which at batch 1 cost as much as the matrix products;
* a step's encoder keys/values come one row per hypothesis (beam search repeats a sentence's
  rows for its beam, once, in numpy), and its position row and relative-key buckets come as
  inputs: arithmetic the caller has anyway;
* the choice ends the graph: ``log_softmax`` then ``TopK`` of ``log_probs + logit_bias``
  (``-inf``: banned; the rules of :class:`hrt_runtime.search.Rules`),
  so only ids and scores leave it (ONNX Runtime's ``ReduceLogSumExp`` costs a large share of a
  step at batch 128, its ``LogSoftmax`` far less: benchmarks/results/runtime-step-cost-cpu/README.md), the argmax over
  blocks of the vocabulary (:func:`blocked_max`).

Graphs:

* :class:`EncoderGraph`: source tokens ``(B, S)`` -> the padding bias ``(B, 1, 1, S)`` and every
  decoder layer's encoder keys, then values ``(B, H, S, d)`` (Mask-Predict: and the target
  length's log-probabilities).
* :class:`StepGraph`: one left-to-right step. With ``top = 1`` the best allowed token and its
  log-probability; with ``top = K`` (the exporter makes K an input) the K best allowed
  log-probabilities and their rows.
* :class:`ParallelGraph`: one non-causal pass over tokens at given positions (HRT's stage II,
  Mask-Predict's iterations), its last layer computed at the columns read only, and the best
  allowed token and its log-probability for the selected slots only (stage II projects only
  its masks onto the vocabulary).

With ``restricted=True`` a decoder graph takes the output layer's rows (weight ``(V', C)``,
bias ``(V',)``) as inputs: a shortlist's rows, gathered once per batch.
"""

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_hrt.modules.relative_attention import relative_bucket
from fairseq_hrt.passes.decoder_pass import DecoderPass, StepPlan, attention, decoder_pass, layer_forward, ssru_step
from fairseq_hrt.passes.search_rules import bias_at


def scaled_projections(attn, with_kv: bool):
    """``(weight, bias)`` of the fused q (scaled by the attention's scaling) [, k, v]
    projections of a fairseq ``MultiheadAttention``."""
    s = attn.scaling
    weights = [attn.q_proj.weight * s] + ([attn.k_proj.weight, attn.v_proj.weight] if with_kv else [])
    biases = [attn.q_proj.bias * s] + ([attn.k_proj.bias, attn.v_proj.bias] if with_kv else [])
    return torch.cat(weights).detach(), torch.cat(biases).detach()


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


def best_allowed(logits: Tensor, logit_bias: Tensor, top: int = 1, block: int = 1):
    """``(log-probabilities, rows)`` of the ``top`` best rows of ``log_softmax(logits) +
    logit_bias``: the choice of :class:`SearchRules` (banned rows at ``-inf``, ``--unkpen``
    taken off ``<unk>``'s score, normalised over every row). ``block``: see :func:`blocked_max`
    (``top`` 1; a number of rows known at export, so not for restricted output rows); 0: one
    ``TopK(1)`` (a graph for few rows: at batch 1 faster than ``ArgMax`` and ``ReduceMax`` or the
    blocks' operators, benchmarks/results/runtime-step-cost-cpu/README.md)."""
    allowed = F.log_softmax(logits.float(), dim=-1) + logit_bias
    if top == 1 and block == 0:
        best, row = allowed.topk(1, dim=-1)
        return best.reshape(-1), row.reshape(-1)
    if top == 1:  # no TopK(1) (slower) and no squeeze (an If node when traced)
        return blocked_max(allowed, block)
    return allowed.topk(top, dim=-1)


class _DecoderGraph(nn.Module):
    """What every decoder graph holds: the planned pass, the fused and scaled projections,
    the position table, the output rows."""

    def __init__(self, model, max_positions: int, restricted: bool = False, blocked: bool = True):
        super().__init__()
        decoder = model.decoder
        pass_ = decoder_pass(decoder)
        self.recurrent = pass_.recurrent  # SSRU layers: a cell per layer instead of keys/values
        with torch.no_grad():  # the planned weights become constants of the graph
            self.plan = StepPlan(decoder)
            self.self_qkv = [
                None if self.recurrent else scaled_projections(layer.self_attn, True) for layer in decoder.layers
            ]
            self.encoder_q = [scaled_projections(layer.encoder_attn, False) for layer in decoder.layers]
        self.heads, self.head_dim = pass_.heads, pass_.head_dim
        self.dim = self.heads * self.head_dim
        table = pass_.position_table(max_positions, 1, decoder.dictionary.eos(), decoder.embed_tokens.weight.device)
        self.positions = table.detach() if table is not None else None
        self.window = pass_.window
        self.restricted = restricted
        # the greedy choice's blocks over the whole output layer (restricted rows: their number
        # varies; ``blocked`` False: a graph for few rows, one TopK: see best_allowed)
        self.block = 0 if not blocked else 1 if restricted else argmax_block(decoder.output_projection.weight.size(0))

    def prologue(self, tokens: Tensor, position_rows: Optional[Tensor]) -> Tensor:
        return DecoderPass._prologue(self.plan, tokens, position_rows)

    def encoder_block(self, enc_k: List[Tensor], enc_v: List[Tensor], encoder_bias: Tensor, queries: int):
        """Encoder attention over ``(B, H, S, d)`` keys/values for ``x`` ``(B x queries, C)``:
        the graphs keep activations two-dimensional, so that every projection is one ``Gemm``
        with its bias (a three-dimensional ``MatMul`` + ``Add`` costs two operators)."""

        def block(layer, i, x):
            q = F.linear(x, *self.encoder_q[i])
            if queries == 1:  # (N, 1, H, d) and (N, H, 1, d) are one layout: no Transpose (a copy) either way
                out = attention(
                    q.reshape(-1, self.heads, 1, self.head_dim), enc_k[i], enc_v[i], None, None, encoder_bias
                )
            else:
                q = q.reshape(-1, queries, self.heads, self.head_dim).transpose(1, 2)
                out = attention(q, enc_k[i], enc_v[i], None, None, encoder_bias).transpose(1, 2)
            return layer.encoder_out(out.reshape(-1, self.dim))

        return block

    def logits(self, x: Tensor, out_weight: Optional[Tensor], out_bias: Optional[Tensor]) -> Tensor:
        if not self.restricted:
            return self.plan.output(x)
        return F.linear(self.plan.features(x), out_weight, out_bias)


class StepGraph(_DecoderGraph):
    """One left-to-right step. Inputs, in order: ``tokens (N,)``, ``position (1,)`` (the row
    of the position table: step x stride), [``buckets (t + 1,)``: the relative-key index of
    every key seen from this step, decoders with relative positions], ``logit_bias (V,)``,
    ``encoder_bias (N, 1, 1, S)``, per layer encoder keys, values ``(N, H, S, d)``, per layer
    past keys, values ``(N, H, t, d)`` (SSRU decoders: per layer the past cell ``(N, C)``), and
    with ``restricted`` the output rows' weight and bias. Outputs: ``score (N,)``, ``token
    (N,)`` (``top`` 1) or ``top_scores (N, K)``, ``top_rows (N, K)``; then per layer present
    keys, values ``(N, H, t + 1, d)`` (SSRU: per layer the new cell)."""

    def __init__(self, model, max_positions: int, top: int = 1, restricted: bool = False, blocked: bool = True):
        super().__init__(model, max_positions, restricted, blocked)
        self.top = top

    def forward(self, tokens, position, *inputs):
        inputs = list(inputs)
        buckets = inputs.pop(0) if self.window > 0 else None
        logit_bias, encoder_bias = inputs[0], inputs[1]
        n_layers = len(self.plan.layers)
        caches = inputs[2:]
        enc_k, enc_v = caches[0:n_layers], caches[n_layers : 2 * n_layers]
        n_past = n_layers if self.recurrent else 2 * n_layers  # SSRU: one cell per layer; else keys, values
        past = caches[2 * n_layers : 2 * n_layers + n_past]
        past_k, past_v = past[:n_layers], past[n_layers:]
        out_weight = out_bias = None
        if self.restricted:
            out_weight, out_bias = caches[2 * n_layers + n_past], caches[2 * n_layers + n_past + 1]
        x = self.prologue(tokens, None if self.positions is None else self.positions.index_select(0, position))
        present_k: List[Tensor] = []
        present_v: List[Tensor] = []

        def recurrent_block(layer, i, h):
            # the SSRU step of DecoderPass._recurrence (a new cell: an exported graph writes no input)
            cell = ssru_step(layer.ssru_projections(h), past_k[i])
            present_k.append(cell)
            return torch.relu(cell)

        def self_block(layer, i, h):
            q, k, v = F.linear(h, *self.self_qkv[i]).split(self.dim, dim=-1)
            shape = (-1, self.heads, 1, self.head_dim)
            keys = torch.cat([past_k[i], k.reshape(shape)], dim=2)
            values = torch.cat([past_v[i], v.reshape(shape)], dim=2)
            present_k.append(keys)
            present_v.append(values)
            out = attention(q.reshape(shape), keys, values, layer.relative_keys, buckets, None)
            return layer.self_out(out.reshape(-1, self.dim))

        encoder_block = self.encoder_block(enc_k, enc_v, encoder_bias, 1)
        for i, layer in enumerate(self.plan.layers):
            x = layer_forward(layer, i, x, recurrent_block if self.recurrent else self_block, encoder_block)
        return (
            *best_allowed(self.logits(x, out_weight, out_bias), logit_bias, self.top, self.block),
            *present_k,
            *present_v,
        )


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
        buckets = []
        if self.window > 0:  # hrt_runtime.model.ExportedModel.buckets
            keys = torch.arange(i + 1, dtype=torch.int64)
            buckets = [((keys - i) * stride).clamp(-self.window, self.window) + self.window]
        score, token, *present = self.step(prev, position, *buckets, bias, encoder_bias, *enc, *past, *rows[:2])
        if self.restricted:
            token = rows[2].index_select(0, token)
        alive = alive & token.ne(self.eos)  # six operators to the condition (finished.all() takes eight)
        return (alive.any(), alive, token, *present, score)


class ParallelGraph(_DecoderGraph):
    """One non-causal pass. Inputs: ``tokens (B, T)``, their ``positions (B, T)`` (rows of the
    position table), ``queries (Q,)`` (the columns whose output is read: the last layer
    computes its keys and values at every slot, everything else at these columns only),
    ``select (M,)`` (the slots to predict, flat indices into ``B x Q``), ``logit_bias (V,)``,
    ``encoder_bias (B, 1, 1, S)``, per layer encoder keys, values (and with ``restricted`` the
    output rows' weight and bias). Outputs: ``score (M,)``, ``token (M,)`` (rows of the
    output layer)."""

    def __init__(self, model, max_positions: int, restricted: bool = False):
        super().__init__(model, max_positions, restricted)
        self.padding_idx = model.decoder.padding_idx

    def forward(self, tokens, positions, queries, select, logit_bias, encoder_bias, *caches):
        n_layers = len(self.plan.layers)
        enc_k, enc_v = caches[0:n_layers], caches[n_layers : 2 * n_layers]
        out_weight = out_bias = None
        if self.restricted:
            out_weight, out_bias = caches[2 * n_layers], caches[2 * n_layers + 1]
        n, t = tokens.shape
        x = self.prologue(tokens, None if self.positions is None else self.positions[positions]).reshape(-1, self.dim)
        bias = torch.zeros(n, 1, 1, t, dtype=torch.float32, device=tokens.device).masked_fill(
            tokens.eq(self.padding_idx).view(n, 1, 1, t), -math.inf
        )
        buckets = None
        if self.window > 0:
            buckets = relative_bucket(positions, positions, self.window).unsqueeze(1).expand(n, self.heads, t, t)

        shape = (n, -1, self.heads, self.head_dim)

        def self_block(layer, i, h, pick=None):
            q, k, v = F.linear(h, *self.self_qkv[i]).split(self.dim, dim=-1)
            if pick is not None:
                q = pick(q)
            q, k, v = (y.reshape(shape).transpose(1, 2) for y in (q, k, v))
            picked = buckets
            if pick is not None and buckets is not None:
                picked = buckets.index_select(2, queries)
            out = attention(q, k, v, layer.relative_keys, picked, bias)
            return layer.self_out(out.transpose(1, 2).reshape(-1, self.dim))

        def pick(y):  # (B x T, C) -> (B x Q, C)
            return y.reshape(n, t, self.dim).index_select(1, queries).reshape(-1, self.dim)

        last = len(self.plan.layers) - 1
        for i, layer in enumerate(self.plan.layers):
            if i < last:
                x = layer_forward(layer, i, x, self_block, self.encoder_block(enc_k, enc_v, encoder_bias, t))
            else:
                x = layer_forward(
                    layer,
                    i,
                    x,
                    lambda layer, i, h: self_block(layer, i, h, pick),
                    self.encoder_block(enc_k, enc_v, encoder_bias, queries.shape[0]),
                    pick,
                )
        selected = x.index_select(0, select)
        return best_allowed(self.logits(selected, out_weight, out_bias), logit_bias, 1, self.block)


class EncoderGraph(nn.Module):
    """Source tokens ``(B, S)`` (left-padded, as fairseq batches them) -> ``encoder_bias (B, 1,
    1, S)`` and every decoder layer's encoder keys, then values ``(B, H, S, d)``. fairseq's
    encoder (``TransformerEncoderBase``: scaled embeddings plus its positions, pre- or post-norm
    layers, padding zeroed) written over its modules with fused, scaled projections: the
    traced module would carry several hundred shape operators."""

    def __init__(self, model, length: bool = False):
        super().__init__()
        encoder, decoder = model.encoder, model.decoder
        # Mask-Predict: the length predictor's log-probabilities (CMLMTransformerModel.forward_length)
        self.embed_length = model.embed_length.weight.detach() if length else None
        pass_ = decoder_pass(decoder)
        self.embed_tokens, self.embed_positions = encoder.embed_tokens, encoder.embed_positions
        self.embed_scale = encoder.embed_scale
        self.layernorm_embedding, self.layer_norm = encoder.layernorm_embedding, encoder.layer_norm
        self.padding_idx = encoder.padding_idx
        layer0 = encoder.layers[0]
        self.heads = layer0.self_attn.num_heads
        self.dim = layer0.self_attn.embed_dim
        self.head_dim = self.dim // self.heads
        with torch.no_grad():
            self.layers = [(layer, scaled_projections(layer.self_attn, True)) for layer in encoder.layers]
            self.decoder_kv = [
                (
                    torch.cat([layer.encoder_attn.k_proj.weight, layer.encoder_attn.v_proj.weight]).detach(),
                    torch.cat([layer.encoder_attn.k_proj.bias, layer.encoder_attn.v_proj.bias]).detach(),
                )
                for layer in decoder.layers
            ]
        self.decoder_heads, self.decoder_head_dim = pass_.heads, pass_.head_dim

    def forward(self, src_tokens):
        b, s = src_tokens.shape
        padding = src_tokens.eq(self.padding_idx)
        x = self.embed_scale * self.embed_tokens(src_tokens)
        if self.embed_positions is not None:
            x = x + self.embed_positions(src_tokens)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = (x * (~padding).unsqueeze(-1).type_as(x)).reshape(-1, self.dim)  # (B x S, C): projections are Gemms
        bias = torch.zeros(b, 1, 1, s, dtype=torch.float32, device=src_tokens.device).masked_fill(
            padding.view(b, 1, 1, s), -math.inf
        )
        shape = (b, s, self.heads, self.head_dim)
        for layer, qkv in self.layers:
            residual = x
            h = layer.self_attn_layer_norm(x) if layer.normalize_before else x
            q, k, v = (y.reshape(shape).transpose(1, 2) for y in F.linear(h, *qkv).split(self.dim, dim=-1))
            out = attention(q, k, v, None, None, bias).transpose(1, 2).reshape(-1, self.dim)
            x = residual + layer.self_attn.out_proj(out)
            if not layer.normalize_before:
                x = layer.self_attn_layer_norm(x)
            residual = x
            h = layer.final_layer_norm(x) if layer.normalize_before else x
            x = residual + layer.fc2(layer.activation_fn(layer.fc1(h)))
            if not layer.normalize_before:
                x = layer.final_layer_norm(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        keys, values = [], []
        kv_shape = (b, s, self.decoder_heads, self.decoder_head_dim)
        for weight, kv_bias in self.decoder_kv:
            k, v = F.linear(x, weight, kv_bias).split(self.decoder_heads * self.decoder_head_dim, dim=-1)
            keys.append(k.reshape(kv_shape).transpose(1, 2))
            values.append(v.reshape(kv_shape).transpose(1, 2))
        if self.embed_length is None:
            return (bias, *keys, *values)
        keep = (~padding).unsqueeze(-1).type_as(x)
        pooled = (x.reshape(b, s, -1) * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return (bias, *keys, *values, F.log_softmax(F.linear(pooled, self.embed_length), dim=-1))
