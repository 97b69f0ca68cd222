"""What a batch holds between passes: its encoder side (:class:`EncoderKV`) and its caches
(:class:`DecoderState`)."""

from typing import List, Optional

import torch
from torch import Tensor

from fairseq_hrt.passes.layers import encoder_attention


class EncoderKV:
    """The encoder side of one batch: every layer's encoder-attention keys and values
    ``(B, H, S, d)`` and the source padding bias ``(B, 1, 1, S)``, one row per sentence.
    Projected once per batch (:meth:`DecoderPass.encoder`); it serves a
    :class:`DecoderState` and, on its own, the non-causal pass."""

    __slots__ = ("keys", "values", "bias", "stacked")

    def __init__(self, keys: List[Tensor], values: List[Tensor], bias: Tensor, stacked: Optional[Tensor] = None):
        self.keys, self.values, self.bias = keys, values, bias
        # (2, L, B, H, S, d) when keys and values are its views (the CUDA-graph engine's
        # buffers): one copy moves every layer's, where a copy a layer costs a launch each
        self.stacked = stacked

    @classmethod
    def of_stack(cls, stacked: Tensor, bias: Tensor) -> "EncoderKV":
        """Keys and values as views of ``stacked`` ``(2, L, B, H, S, d)``."""
        return cls(list(stacked[0].unbind(0)), list(stacked[1].unbind(0)), bias, stacked)

    def stack(self) -> Tensor:
        """Keys and values as one ``(2, L, B, H, S, d)`` tensor (``stacked`` itself, or a copy)."""
        if self.stacked is not None:
            return self.stacked
        return torch.stack(self.keys + self.values).unflatten(0, (2, -1))  # one copy

    def select(self, index: Tensor) -> "EncoderKV":
        """The sentences ``index`` (in that order; repeats allowed), a new object."""
        if self.stacked is not None:
            return EncoderKV.of_stack(self.stacked.index_select(2, index), self.bias.index_select(0, index))
        return EncoderKV(
            [k.index_select(0, index) for k in self.keys],
            [v.index_select(0, index) for v in self.values],
            self.bias.index_select(0, index),
        )

    def attention(self, layer, i: int, x: Tensor) -> Tensor:
        """Encoder attention of layer ``i`` for ``x`` (:func:`encoder_attention`)."""
        return encoder_attention(layer, x, self.keys[i], self.values[i], self.bias)


class DecoderState:
    """The caches of one batch for :meth:`DecoderPass.step` / :meth:`DecoderPass.block`.

    Self-attention keys/values ``(rows, H, steps, d)`` per layer, position ``p`` at index
    ``p``; SSRU layers' cells ``(rows, steps + 1, C)`` per layer, the cell after position
    ``p`` at index ``p + 1`` (index 0: the zero cell before position 0), so a step or a
    block starts from the cell at its first position's index. Both written in place.
    ``encoder``: the :class:`EncoderKV` of the batch's sentences (rows are sentence-major)."""

    def __init__(self, plan, encoder: EncoderKV, self_k, self_v, cells, positions, buckets, output=None):
        self.plan = plan
        self.output = output if output is not None else plan.output
        self.encoder = encoder
        self.self_k, self.self_v, self.cells = self_k, self_v, cells
        self.positions, self.buckets = positions, buckets

    def reorder_rows(self, index: Tensor, step: int):
        """Row ``r`` of the caches becomes old row ``index[r]`` (positions ``0..step``), in place."""
        n = index.numel()
        for cache in self.self_k + self.self_v:
            cache[:n, :, : step + 1] = cache[:, :, : step + 1].index_select(0, index)
        for cells in self.cells:
            cells[:n, : step + 2] = cells[:, : step + 2].index_select(0, index)

    def select_sentences(self, index: Tensor):
        """Keep only the given sentences' encoder keys/values (finished ones leave)."""
        self.encoder = self.encoder.select(index)
