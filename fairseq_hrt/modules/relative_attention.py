"""Decoder self-attention with relative position representations on keys only (Shaw et al. 2018).

``O_i = softmax(Q_i (K^T + R_i) / sqrt(d_k)) V`` with ``R_i[j] = E[clip(p_j - p_i, -w, w)]``,
where ``p`` are the tokens' *original* target positions (SPEC section 1, Decision): in
Skip-AT mode neighbouring inputs are k apart. Values get no relative term (HRT paper eq. 4:
it saves memory at no loss). ``w = 0`` turns the relative term off (a plain attention).

The module subclasses fairseq's :class:`MultiheadAttention` so that its projections
(``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``) have fairseq's names and initialisation:
a checkpoint of fairseq's transformer loads into it, and only ``relative_keys`` is new.
"""

import math
from typing import Dict, Optional

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from fairseq_hrt.passes.attention import attention, padding_bias, relative_bucket

__all__ = ["RelativeSelfAttention", "relative_bucket"]  # relative_bucket: where training's attention reads it


class RelativeSelfAttention(MultiheadAttention):
    def __init__(self, embed_dim, num_heads, window: int, dropout=0.0, bias=True):
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, self_attention=True)
        self.window = int(window)
        if self.window > 0:
            self.relative_keys = nn.Embedding(2 * self.window + 1, self.head_dim)
            nn.init.normal_(self.relative_keys.weight, mean=0.0, std=self.head_dim**-0.5)
        else:
            self.relative_keys = None

    def forward(  # noqa: C901 - one code path for training, full-sequence and step decoding
        self,
        x: Tensor,
        positions: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        causal: bool = True,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tensor:
        """``x``: ``(T, B, C)``; ``positions``: ``(B, T)`` original positions of ``x``.

        With ``incremental_state`` (causal step decoding) keys, values and key positions of
        earlier steps come from the cache; ``x`` then holds only the new step(s).
        """
        tgt_len, bsz, embed_dim = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        q = self.q_proj(x) * self.scaling
        k = self.k_proj(x)
        v = self.v_proj(x)
        # (T, B, C) -> (B, H, T, d)
        q = q.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
        k = k.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
        v = v.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
        key_positions = positions

        past_len = 0
        if incremental_state is not None:
            saved = self._get_input_buffer(incremental_state)
            # cache the padding mask with the keys: a step may feed <pad> (e.g. parallel
            # decoders that start from pads) and later queries must still ignore it. Without
            # any padding so far (ordinary beam search) no mask is kept: nothing to mask.
            prev_pad = None
            if saved is not None and "prev_key" in saved:
                past_len = saved["prev_key"].size(2)
                k = torch.cat([saved["prev_key"], k], dim=2)
                v = torch.cat([saved["prev_value"], v], dim=2)
                key_positions = torch.cat([saved["prev_positions"], positions], dim=1)
                prev_pad = saved.get("prev_key_padding_mask")
            if prev_pad is not None or key_padding_mask is not None:
                if prev_pad is None:
                    prev_pad = x.new_zeros(bsz, past_len, dtype=torch.bool)
                if key_padding_mask is None:
                    key_padding_mask = x.new_zeros(bsz, tgt_len, dtype=torch.bool)
                key_padding_mask = torch.cat([prev_pad, key_padding_mask], dim=1)
            self._set_input_buffer(
                incremental_state,
                {
                    "prev_key": k,
                    "prev_value": v,
                    "prev_positions": key_positions,
                    "prev_key_padding_mask": key_padding_mask,
                },
            )

        src_len = k.size(2)
        buckets = None
        if self.relative_keys is not None:
            bucket = relative_bucket(positions, key_positions, self.window)
            buckets = bucket.unsqueeze(1).expand(bsz, heads, tgt_len, bucket.size(-1))
        bias = None
        if causal and tgt_len > 1:
            # query t (at absolute step past_len + t) sees keys 0..past_len + t
            future = torch.ones(tgt_len, src_len, dtype=torch.bool, device=x.device).triu(1 + past_len)
            bias = torch.zeros(tgt_len, src_len, dtype=torch.float32, device=x.device).masked_fill(future, -math.inf)
        if key_padding_mask is not None and key_padding_mask.any():
            padding = padding_bias(key_padding_mask, src_len, bsz, torch.float32, x.device)
            bias = padding if bias is None else bias + padding
        relative_keys = self.relative_keys.weight.t() if self.relative_keys is not None else None
        out = attention(q, k, v, relative_keys, buckets, bias, self.dropout_module)  # (B, H, T, d)
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
        return self.out_proj(out)
