"""The Simpler Simple Recurrent Unit (SSRU) of Marian's WNGT 2019 students
(Kim, Junczys-Dowmunt et al. 2019, "From Research to Production and Back: Ludicrously Fast
Neural Machine Translation", section 3.1), which replaces a decoder layer's self-attention::

    f_t = sigmoid(W_f x_t + b_f)
    c_t = f_t * c_{t-1} + (1 - f_t) * (W x_t)        (c_{-1} = 0)
    h_t = ReLU(c_t)

The residual connection and layer norm around it belong to the decoder layer (the paper's
``LN(ReLU(c_t) + x_t)``; pre-norm here like every other arch of this plugin). ``W`` has no
bias, as in the paper (and Marian's ``ssru`` cell). A decoding step needs only ``c_{t-1}``:
O(1) state per row and layer, where self-attention keeps every earlier key and value.
"""

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor, nn

STATE_KEY = "ssru_state"


def linear_recurrence(gates: Tensor, inputs: Tensor, initial: Optional[Tensor] = None) -> Tensor:
    """``c_t = gates_t * c_{t-1} + inputs_t`` along dim 0 for every ``t``; ``c_{-1} = initial``
    (zeros when ``None``).

    A Hillis-Steele scan of the affine maps ``c -> a c + b``: ``ceil(log2 T)`` rounds of
    element-wise operations over the whole sequence instead of ``T`` sequential steps, for
    training's full-sequence pass. It only multiplies gates (values in [0, 1]), so it is as
    stable as the sequential loop; results equal it to float rounding.
    """
    if initial is not None:
        first = torch.addcmul(inputs[:1], gates[:1], initial.unsqueeze(0))
        inputs = torch.cat([first, inputs[1:]]) if inputs.size(0) > 1 else first
    a, b = gates, inputs
    steps = a.size(0)
    offset = 1
    while offset < steps:
        # element t becomes the composition of the maps t-2*offset+1..t (old a, b on the right)
        b = torch.cat([b[:offset], torch.addcmul(b[offset:], a[offset:], b[:-offset])])
        a = torch.cat([a[:offset], a[offset:] * a[:-offset]])
        offset *= 2
    return b


@with_incremental_state
class SSRU(nn.Module):
    """SSRU over ``(T, B, C)`` inputs; with fairseq's ``incremental_state`` it continues from
    the cell state saved by the previous call (one ``(B, C)`` tensor)."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.embed_dim = embed_dim
        self.input_proj = nn.Linear(embed_dim, embed_dim, bias=False)  # W
        self.forget_gate = nn.Linear(embed_dim, embed_dim)  # W_f, b_f
        nn.init.xavier_uniform_(self.input_proj.weight)
        nn.init.xavier_uniform_(self.forget_gate.weight)
        nn.init.zeros_(self.forget_gate.bias)

    def gates_and_inputs(self, x: Tensor):
        """``(f, (1 - f) * W x)`` of the recurrence."""
        forget = torch.sigmoid(self.forget_gate(x))
        return forget, (1.0 - forget) * self.input_proj(x)

    def forward(
        self,
        x: Tensor,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """``x``: ``(T, B, C)``; ``padding_mask``: ``(B, T)``, True on padding, whose steps
        leave the cell state unchanged (left-padded targets start from a zero state)."""
        forget, inputs = self.gates_and_inputs(x)
        if padding_mask is not None:
            pad = padding_mask.transpose(0, 1).unsqueeze(-1)
            forget = forget.masked_fill(pad, 1.0)
            inputs = inputs.masked_fill(pad, 0.0)
        initial = None
        if incremental_state is not None:
            saved = self.get_incremental_state(incremental_state, STATE_KEY)
            if saved is not None:
                initial = saved["cell"]
        cells = linear_recurrence(forget, inputs, initial)
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, STATE_KEY, {"cell": cells[-1]})
        return F.relu(cells)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Beam search: row ``r`` continues old row ``new_order[r]``."""
        saved = self.get_incremental_state(incremental_state, STATE_KEY)
        if saved is not None and saved.get("cell") is not None:
            saved = {"cell": saved["cell"].index_select(0, new_order)}
            incremental_state = self.set_incremental_state(incremental_state, STATE_KEY, saved)
        return incremental_state
