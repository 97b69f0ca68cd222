"""The encoder's planned pass: fairseq's encoder (``TransformerEncoderBase``: scaled
embeddings plus its positions, pre- or post-norm layers, padding zeroed) over its own
modules, with fused, scaled q/k/v projections and the attention of every pass
(:func:`~fairseq_hrt.passes.attention.attention`), then every decoder layer's encoder
keys/values. The exported encoder graph traces it and the CUDA-graph engine captures it;
written over the modules because the traced module would carry several hundred shape
operators."""

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_hrt.passes.attention import attention, padding_bias
from fairseq_hrt.passes.projections import fused_weights


class EncoderPass:
    """``src_tokens (B, S)`` (left-padded, as fairseq batches them) -> ``(bias (B, 1, 1, S),
    *keys, *values)``: the padding bias and every decoder layer's encoder keys, then values
    ``(B, H, S, d)``; with ``length`` (Mask-Predict) also the length predictor's
    log-probabilities (``CMLMTransformerModel.forward_length``). Read from the model's modules
    when made: make another when the weights change."""

    def __init__(self, model, length: bool = False):
        encoder, decoder = model.encoder, model.decoder
        self.embed_length = model.embed_length.weight.detach() if length else None
        self.embed_tokens, self.embed_positions = encoder.embed_tokens, encoder.embed_positions
        self.embed_scale = encoder.embed_scale
        self.layernorm_embedding, self.layer_norm = encoder.layernorm_embedding, encoder.layer_norm
        self.padding_idx = encoder.padding_idx
        attn = encoder.layers[0].self_attn
        self.heads, self.dim = attn.num_heads, attn.embed_dim
        self.head_dim = self.dim // self.heads
        self.layers = [
            (layer, [w.detach() for w in fused_weights(qkv_of(layer.self_attn), (layer.self_attn.scaling, 1.0, 1.0))])
            for layer in encoder.layers
        ]
        decoder_attn = decoder.layers[0].encoder_attn
        self.decoder_heads, self.decoder_head_dim = decoder_attn.num_heads, decoder_attn.head_dim
        self.decoder_kv = [
            [w.detach() for w in fused_weights([layer.encoder_attn.k_proj, layer.encoder_attn.v_proj])]
            for layer in decoder.layers
        ]
        self._stacked_kv = None  # every layer's decoder_kv as one product's weights, made by stacked()

    def __call__(self, src_tokens: Tensor):
        x, padding, bias = self.encoded(src_tokens)
        b, s = src_tokens.shape
        keys, values = [], []
        kv_shape = (b, s, self.decoder_heads, self.decoder_head_dim)
        for weight, kv_bias in self.decoder_kv:
            k, v = F.linear(x, weight, kv_bias).split(self.decoder_heads * self.decoder_head_dim, dim=-1)
            keys.append(k.reshape(kv_shape).transpose(1, 2))
            values.append(v.reshape(kv_shape).transpose(1, 2))
        return (bias, *keys, *values, *self.length_lprobs(x, padding, b, s))

    def stacked(self, src_tokens: Tensor):
        """``(bias, kv, ...)``: as a call, every decoder layer's keys then values one ``(2, L, B,
        H, S, d)`` view of a single matrix product over all the layers' weights (a kernel, where
        a call makes ``L`` and their ``2 L`` transposes; not traced: the exported encoder keeps a
        graph output a layer's keys or values)."""
        x, padding, bias = self.encoded(src_tokens)
        b, s = src_tokens.shape
        if self._stacked_kv is None:
            self._stacked_kv = [torch.cat(parts) for parts in zip(*self.decoder_kv)]
        layers = len(self.decoder_kv)
        kv = F.linear(x, *self._stacked_kv).view(b, s, layers, 2, self.decoder_heads, self.decoder_head_dim)
        return (bias, kv.permute(3, 2, 0, 4, 1, 5), *self.length_lprobs(x, padding, b, s))

    def encoded(self, src_tokens: Tensor):
        """``(x (B x S, C), padding (B, S), bias (B, 1, 1, S))``: the encoder's output and its padding."""
        b, s = src_tokens.shape
        padding = src_tokens.eq(self.padding_idx)
        x = self.embed_scale * self.embed_tokens(src_tokens)
        if self.embed_positions is not None:
            x = x + self.embed_positions(src_tokens)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = (x * (~padding).unsqueeze(-1).type_as(x)).reshape(-1, self.dim)  # (B x S, C): projections are Gemms
        bias = padding_bias(padding, s, b, torch.float32, src_tokens.device)
        for layer, qkv in self.layers:
            x = self.layer(layer, qkv, x, bias, (b, s, self.heads, self.head_dim))
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x, padding, bias

    def length_lprobs(self, x: Tensor, padding: Tensor, b: int, s: int):
        """Mask-Predict: ``(log-probabilities of the target length,)``; else ``()``."""
        if self.embed_length is None:
            return ()
        keep = (~padding).unsqueeze(-1).type_as(x)
        pooled = (x.reshape(b, s, -1) * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return (F.log_softmax(F.linear(pooled, self.embed_length), dim=-1),)

    def layer(self, layer, qkv, x: Tensor, bias: Tensor, shape) -> Tensor:
        """fairseq's ``TransformerEncoderLayerBase`` over ``x`` ``(B x S, C)``."""
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
        return x


def qkv_of(attn):
    """An attention's q, k, v projections, in the order their fused weights are."""
    return [attn.q_proj, attn.k_proj, attn.v_proj]
