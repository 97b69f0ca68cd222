"""The decoder layer of every pass, written once: :func:`layer_forward` around one
self-attention (:func:`self_attention`, whose keys and values come from a cache, the past
or the queries themselves), one SSRU recurrence (:func:`recurrence`, :func:`ssru_step`) and
one encoder attention (:func:`encoder_attention`); :func:`non_causal_layers` is the
non-causal pass of the lean engines, the CUDA-graph engine and the exported graphs alike.

Activations are ``(N, C)`` (one query per row, or ``B x T`` rows of ``rows`` sentences) or
``(N, W, C)``; every reshape has a ``-1`` for the rows, so a traced graph carries no shape
arithmetic for them."""

from typing import Optional

import torch
from torch import Tensor

from fairseq_hrt.modules.ssru import linear_recurrence
from fairseq_hrt.passes.attention import attention


def prologue(plan, tokens: Tensor, positions: Optional[Tensor], x: Optional[Tensor] = None) -> Tensor:
    """Token embeddings (``x`` when already made) plus ``positions``' embeddings, then the
    embedding layer norm."""
    if x is None:
        x = plan.embed(tokens)
    if positions is not None:
        x = x + positions
    if plan.layernorm_embedding is not None:
        x = plan.layernorm_embedding(x)
    return x


def layer_forward(layer, i: int, x: Tensor, self_block, encoder_block, pick=None, dropout=None) -> Tensor:
    """Decoder layer ``i`` (pre- or post-norm residual blocks) around the given self- and
    encoder-attention blocks, functions ``(layer, i, h) -> output`` (``encoder_block``
    ``None``: a layer without encoder attention): the passes, and the plugin's training
    layers (:func:`~fairseq_hrt.modules.decoder_layer_blocks.decoder_layer`), differ only in
    those.

    ``pick``: ``x -> x`` at the query slots only. The layer's output is then computed at those
    slots alone: ``self_block`` takes its keys and values from every slot of ``h`` and its
    queries from ``pick(h)``, and the residual, the encoder attention and the feed-forward run
    on the picked slots (the last layer of a non-causal pass whose output is read at a few
    slots: HRT's stage II reads only its masks). ``dropout``: ``(dropout, activation_dropout)``
    modules, training's (the passes run none)."""
    drop, activation_drop = dropout if dropout is not None else (None, None)
    pre_norm = layer.pre_norm
    residual = x if pick is None else pick(x)
    h = layer.self_attn_norm(x) if pre_norm else x
    out = self_block(layer, i, h)
    x = residual + (out if drop is None else drop(out))
    if not pre_norm:
        x = layer.self_attn_norm(x)
    if encoder_block is not None:
        residual = x
        h = layer.encoder_attn_norm(x) if pre_norm else x
        out = encoder_block(layer, i, h)
        x = residual + (out if drop is None else drop(out))
        if not pre_norm:
            x = layer.encoder_attn_norm(x)
    residual = x
    h = layer.final_norm(x) if pre_norm else x
    h = layer.activation(layer.fc1(h))
    out = layer.fc2(h if activation_drop is None else activation_drop(h))
    x = residual + (out if drop is None else drop(out))
    if not pre_norm:
        x = layer.final_norm(x)
    return x


def split_heads(layer, y: Tensor, rows: Optional[int]) -> Tensor:
    """``(N, C)`` -> ``(N, H, 1, d)`` (``rows`` ``None``: one query per row; a view, no
    transpose), else ``(rows, ..., C)`` -> ``(rows, H, W, d)``."""
    if rows is None:
        return y.reshape(-1, layer.heads, 1, layer.head_dim)
    return y.reshape(rows, -1, layer.heads, layer.head_dim).transpose(1, 2)


def self_attention(layer, h: Tensor, rows: Optional[int], keys_of, buckets, bias, pick=None) -> Tensor:
    """Self-attention of ``h`` (see :func:`split_heads` for ``rows``). ``keys_of``: ``(k, v)
    -> (keys, values)``, the queries' own keys/values written into a cache, appended to the
    past or taken as they are (``None``). ``pick``: the queries are ``pick(h)``'s slots only.
    The output has ``h``'s layout: ``(N, C)``, or ``(rows, W, C)`` for a three-dimensional
    ``h``."""
    q, k, v = layer.qkv(h)
    if pick is not None:
        q = pick(q)
    if layer.q_scaling is not None:
        q = q * layer.q_scaling
    q, k, v = split_heads(layer, q, rows), split_heads(layer, k, rows), split_heads(layer, v, rows)
    keys, values = (k, v) if keys_of is None else keys_of(k, v)
    out = attention(q, keys, values, layer.relative_keys, buckets, bias)  # (N, H, W, d)
    if rows is None:
        return layer.self_out(out.reshape(-1, layer.dim))
    out = out.transpose(1, 2)
    return layer.self_out(out.reshape(rows, -1, layer.dim) if h.dim() == 3 else out.reshape(-1, layer.dim))


def encoder_attention(layer, x: Tensor, keys: Tensor, values: Tensor, bias: Tensor, one_query: bool = False):
    """Encoder attention for ``x`` ``(N, C)`` or ``(N, W, C)`` over ``(B, H, S, d)`` keys/values:
    the ``N / B`` rows of a sentence (its beam) and their ``W`` queries are the queries of one
    attention over its source. ``one_query``: ``N`` is ``B`` and ``W`` 1 (an exported step:
    no transpose, a copy there)."""
    q = layer.encoder_q(x)
    if layer.q_scaling is not None:
        q = q * layer.q_scaling
    if one_query:
        out = attention(split_heads(layer, q, None), keys, values, None, None, bias)
        return layer.encoder_out(out.reshape(-1, layer.dim))
    q = q.view(keys.size(0), -1, layer.heads, layer.head_dim).transpose(1, 2)
    out = attention(q, keys, values, None, None, bias).transpose(1, 2)  # (B, rows x W, H, d)
    # (reshape's shape as ints: a torch.Size costs more, per layer and step)
    return layer.encoder_out(out.reshape(-1, layer.dim) if x.dim() == 2 else out.reshape(x.size(0), x.size(1), -1))


def ssru_step(projections, cell: Tensor) -> Tensor:
    """:func:`ssru_step_` into a new tensor (the exported step's: a graph writes no input)."""
    negated_gate, projected = projections
    return torch.lerp(cell, projected, torch.sigmoid(negated_gate))


def ssru_step_(projections, cell: Tensor) -> Tensor:
    """The SSRU's next cell, in place: ``c <- c + (1 - f) (W x - c) = f c + (1 - f) W x``
    (one ``lerp``), from ``(-(W_f x + b_f), W x)``: ``sigmoid`` of the negated gate is
    ``1 - f`` without a subtraction. Equals :class:`fairseq_hrt.modules.ssru.SSRU` to float
    rounding."""
    negated_gate, projected = projections
    return cell.lerp_(projected, torch.sigmoid(negated_gate))


def recurrence(layer, cells: Tensor, x: Tensor, at) -> Tensor:
    """The SSRU of queries ``x`` with its cells ``(N, T + 1, C)`` (``DecoderState``): ``at`` an
    int or a ``(1,)`` tensor, one step for every row from the cell at ``at`` (``c = f * c +
    (1 - f) * W x``, :func:`ssru_step_`); ``(N, W)`` positions, each row's block from the cell
    before its first position by a parallel scan
    (:func:`~fairseq_hrt.modules.ssru.linear_recurrence`). The new cells are cached; output
    ``ReLU(c)``."""
    projections = layer.ssru_projections(x)
    if type(at) is int:
        cell = cells[:, at + 1]
        ssru_step_(projections, cell.copy_(cells[:, at]))
        return torch.relu(cell)
    if at.dim() == 1:
        cell = ssru_step_(projections, cells.index_select(1, at).squeeze(1))
        cells.index_copy_(1, at + 1, cell.unsqueeze(1))
        return torch.relu(cell)
    n, w, c = x.shape
    negated_gate, projected = projections
    forget = torch.sigmoid(-negated_gate)
    initial = cells.gather(1, at[:, :1].unsqueeze(-1).expand(n, 1, c)).squeeze(1)
    block = linear_recurrence(forget.transpose(0, 1), ((1.0 - forget) * projected).transpose(0, 1), initial).transpose(
        0, 1
    )
    cells.scatter_(1, (at + 1).unsqueeze(-1).expand(n, w, c), block)
    return torch.relu(block)


def non_causal_layers(plan, encoder, x: Tensor, rows: int, buckets, bias, queries: Optional[Tensor] = None):
    """The layers of a non-causal pass without cache over ``x`` ``(rows x T, C)`` (``<pad>``
    keys masked by ``bias``, relative ``buckets`` ``(B, H, T, T)``), encoder attention over
    ``encoder`` (an ``EncoderKV``, one row per sentence); the output ``(rows x T, C)``, or
    with ``queries`` ``(Q,)`` ``(rows x Q, C)``: the last layer computes its keys and values
    at every slot but everything else at those columns only (:func:`layer_forward`'s
    ``pick``), the same features as the whole pass at those columns."""

    def self_block(layer, i, h):
        return self_attention(layer, h, rows, None, buckets, bias)

    def encoder_block(layer, i, h):
        return encoder_attention(layer, h, encoder.keys[i], encoder.values[i], encoder.bias)

    last = len(plan.layers) - 1
    for i, layer in enumerate(plan.layers):
        if i < last or queries is None:
            x = layer_forward(layer, i, x, self_block, encoder_block)
            continue

        def pick(y, dim=layer.dim):  # (B x T, C) -> (B x Q, C)
            return y.reshape(rows, -1, dim).index_select(1, queries).reshape(-1, dim)

        picked = None if buckets is None else buckets.index_select(2, queries)  # the picked queries' rows

        def last_block(layer, i, h):
            return self_attention(layer, h, rows, None, picked, bias, pick)

        x = layer_forward(layer, i, x, last_block, encoder_block, pick)
    return x
