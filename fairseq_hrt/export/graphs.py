"""The passes of a model as ``nn.Module``s of fixed inputs and outputs, for ``torch.onnx.export``.

Each graph is written over the decoder's one planned pass
(:class:`~fairseq_hrt.generation.decoder_pass.StepPlan` and
:func:`~fairseq_hrt.generation.decoder_pass.layer_forward`): the same fused weights and the
same layer function as the lean engine, only the caches differ. ONNX Runtime cannot write into
an input, so a step takes the past keys/values ``(N, H, t, d)`` of every layer and returns
them grown by its own position (``present``), and the caller feeds them to the next step.

* :class:`EncoderGraph`: source tokens -> every decoder layer's encoder-attention keys/values
  and the source padding bias (projected once per batch, as :class:`EncoderKV`).
* :class:`StepGraph`: one left-to-right step at ``step x stride`` (AT: stride 1; Skip-AT:
  ``k``, with its key-only relative positions), ending in the search's choice: with
  ``top = 1`` the best allowed token and its log-probability, with ``top = K`` the ``K`` best
  allowed logits, their ids and the row's log-sum-exp (beam search normalises only those).
  The rules (banned symbols, ``</s>`` before ``--min-len`` or forced at the maximum length,
  ``--unkpen``) come in as an additive ``logit_bias`` over the output rows.
* :class:`ParallelGraph`: one non-causal pass over tokens at given positions (HRT's stage II,
  Mask-Predict), ending in the best allowed token of every slot and its log-probability.

With ``restricted=True`` a graph takes the output layer's weight rows (and bias) as inputs
instead of holding the whole vocabulary's: a shortlist's rows, gathered once per batch.
"""
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_hrt.generation.decoder_pass import EncoderKV, StepPlan, attention, decoder_pass, layer_forward


def output_weights(decoder):
    """The output projection's weight ``(V, C)`` and bias (or ``None``) as plain tensors."""
    projection = decoder.output_projection
    return projection.weight.detach(), (projection.bias.detach() if getattr(projection, "bias", None) is not None else None)


class _DecoderGraph(nn.Module):
    """What every decoder graph holds: the planned pass, the position table, the output rows."""

    def __init__(self, model, max_positions: int, restricted: bool = False):
        super().__init__()
        decoder = model.decoder
        self.pass_ = decoder_pass(decoder)
        if self.pass_.recurrent:
            raise ValueError("an SSRU decoder cannot be exported (its cells need a recurrent step graph); "
                             "decode it with --decoder-engine lean")
        with torch.no_grad():  # the fused weights become constants of the graph
            self.plan = StepPlan(decoder)
        self.heads, self.head_dim = self.pass_.heads, self.pass_.head_dim
        self.layers_count = len(self.plan.layers)
        table = self.pass_.position_table(max_positions, 1, decoder.dictionary.eos(), decoder.embed_tokens.weight.device)
        self.register_buffer("positions", table.detach() if table is not None else None, persistent=False)
        self.window = self.pass_.window
        self.restricted = restricted

    def position_rows(self, positions: Tensor) -> Optional[Tensor]:
        return None if self.positions is None else self.positions[positions]

    def logits(self, x: Tensor, out_weight: Optional[Tensor], out_bias: Optional[Tensor]) -> Tensor:
        if not self.restricted:
            return self.plan.output(x)
        return F.linear(self.plan.features(x), out_weight, out_bias)


def best_allowed(logits: Tensor, logit_bias: Tensor):
    """``(log-probability, index)`` of the best row of ``logits + logit_bias`` (``-inf``:
    banned); normalised over the raw logits, as :class:`SearchRules` does."""
    logits = logits.float()
    best, token = (logits + logit_bias).max(dim=-1)
    return best - torch.logsumexp(logits, dim=-1), token


class StepGraph(_DecoderGraph):
    """One left-to-right step; see the module's docstring. Inputs, in order: ``tokens (N,)``,
    ``step ()``, ``stride ()``, ``logit_bias (V,)``, the encoder bias ``(B, 1, 1, S)``, per
    layer encoder keys, values ``(B, H, S, d)``, per layer past keys, values ``(N, H, t, d)``,
    and with ``restricted`` the output rows' weight ``(V, C)`` and bias ``(V,)``. Outputs: the
    choice (``top`` 1: ``score (N,)``, ``token (N,)``; else ``logits (N, K)``, ``index (N, K)``,
    ``log_norm (N,)``), then per layer present keys, values ``(N, H, t + 1, d)``."""

    def __init__(self, model, max_positions: int, top: int = 1, restricted: bool = False):
        super().__init__(model, max_positions, restricted)
        self.top = top

    def forward(self, tokens, step, stride, logit_bias, encoder_bias, *caches):
        n_layers = self.layers_count
        enc_k, enc_v = list(caches[0:n_layers]), list(caches[n_layers:2 * n_layers])
        past_k, past_v = caches[2 * n_layers:3 * n_layers], caches[3 * n_layers:4 * n_layers]
        out_weight = out_bias = None
        if self.restricted:
            out_weight, out_bias = caches[4 * n_layers], caches[4 * n_layers + 1]
        encoder = EncoderKV(enc_k, enc_v, encoder_bias)
        n = tokens.size(0)
        x = self.plan.embed(tokens)
        if self.positions is not None:
            x = x + self.positions.index_select(0, (step * stride).view(1))
        if self.plan.layernorm_embedding is not None:
            x = self.plan.layernorm_embedding(x)
        buckets = None
        if self.window > 0:  # keys at steps 0..step, positions j * stride, seen from step * stride
            distance = (torch.arange(past_k[0].size(2) + 1, device=tokens.device) - step) * stride
            buckets = distance.clamp(-self.window, self.window) + self.window
        present_k: List[Tensor] = []
        present_v: List[Tensor] = []

        def self_block(layer, i, h):
            q, k, v = layer.qkv(h)
            q = (q * layer.scaling).view(n, self.heads, 1, self.head_dim)
            keys = torch.cat([past_k[i], k.view(n, self.heads, 1, self.head_dim)], dim=2)
            values = torch.cat([past_v[i], v.view(n, self.heads, 1, self.head_dim)], dim=2)
            present_k.append(keys)
            present_v.append(values)
            out = attention(q, keys, values, layer.relative_keys, buckets, None)
            return layer.self_out(out.reshape(n, -1))

        for i, layer in enumerate(self.plan.layers):
            x = layer_forward(layer, i, x, self_block, encoder.attention)
        logits = self.logits(x, out_weight, out_bias).float()
        if self.top == 1:
            score, token = best_allowed(logits, logit_bias)
            return (score, token, *present_k, *present_v)
        log_norm = torch.logsumexp(logits, dim=-1)
        top_logits, index = (logits + logit_bias).topk(self.top, dim=-1)
        return (top_logits, index, log_norm, *present_k, *present_v)


class ParallelGraph(_DecoderGraph):
    """One non-causal pass; see the module's docstring. Inputs: ``tokens (B, T)``, their
    ``positions (B, T)``, ``select (M,)`` (the slots to predict, flat indices into ``B x T``:
    stage II projects only its masks onto the vocabulary), ``logit_bias (V,)``, the encoder
    bias ``(B, 1, 1, S)``, per layer encoder keys, values (and with ``restricted`` the output
    rows' weight and bias). Outputs: ``score (M,)``, ``token (M,)`` (rows of the output layer)."""

    def __init__(self, model, max_positions: int, restricted: bool = False):
        super().__init__(model, max_positions, restricted)
        self.padding_idx = model.decoder.padding_idx

    def forward(self, tokens, positions, select, logit_bias, encoder_bias, *caches):
        n_layers = self.layers_count
        encoder = EncoderKV(list(caches[0:n_layers]), list(caches[n_layers:2 * n_layers]), encoder_bias)
        out_weight = out_bias = None
        if self.restricted:
            out_weight, out_bias = caches[2 * n_layers], caches[2 * n_layers + 1]
        n, t = tokens.shape
        x = self.plan.embed(tokens)
        if self.positions is not None:
            x = x + self.positions[positions]
        if self.plan.layernorm_embedding is not None:
            x = self.plan.layernorm_embedding(x)
        bias = torch.zeros(n, 1, 1, t, dtype=torch.float32, device=tokens.device).masked_fill(
            tokens.eq(self.padding_idx).view(n, 1, 1, t), -math.inf)
        buckets = None
        if self.window > 0:
            buckets = (positions.unsqueeze(1) - positions.unsqueeze(2)).clamp(-self.window, self.window) + self.window
            buckets = buckets.unsqueeze(1).expand(n, self.heads, t, t)

        def self_block(layer, i, h):
            q, k, v = layer.qkv(h)
            shape = (n, t, self.heads, self.head_dim)
            q, k, v = (q * layer.scaling).view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
            out = attention(q, k, v, layer.relative_keys, buckets, bias)
            return layer.self_out(out.transpose(1, 2).reshape(n, t, -1))

        for i, layer in enumerate(self.plan.layers):
            x = layer_forward(layer, i, x, self_block, encoder.attention)
        selected = x.reshape(n * t, -1).index_select(0, select)
        return best_allowed(self.logits(selected, out_weight, out_bias), logit_bias)


class EncoderGraph(nn.Module):
    """Source tokens ``(B, S)`` -> the encoder bias ``(B, 1, 1, S)`` and every decoder layer's
    encoder keys, then values ``(B, H, S, d)``: the encoder and the projections the lean
    engine makes once per batch (:meth:`DecoderPass.encoder`)."""

    def __init__(self, model):
        super().__init__()
        self.encoder = model.encoder
        self.pass_ = decoder_pass(model.decoder)
        self.padding_idx = model.encoder.padding_idx

    def forward(self, src_tokens):
        src_lengths = src_tokens.ne(self.padding_idx).long().sum(dim=1)
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        kv = self.pass_.encoder(encoder_out)
        return (kv.bias, *kv.keys, *kv.values)
