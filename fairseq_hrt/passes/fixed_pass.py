"""A decoder's planned pass with its weights fixed when made, for graphs that hold them as
constants (the exported graphs, :mod:`fairseq_hrt.export.graphs`; the CUDA-graph engine's
captures): the queries' scaling folded into their projections, the position table made
once, the output layer whole or given as inputs (a shortlist's rows). :func:`parallel_choice`
is HRT's stage II and Mask-Predict's iteration with its token choice, as both run it."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_hrt.passes.attention import padding_bias, pair_buckets
from fairseq_hrt.passes.decoder_pass import decoder_pass
from fairseq_hrt.passes.layers import non_causal_layers, prologue
from fairseq_hrt.passes.plan import StepPlan
from fairseq_hrt.passes.state import EncoderKV
from fairseq_hrt.passes.token_choice import argmax_block, best_allowed


class FixedPass:
    """The folded plan (:class:`~fairseq_hrt.passes.plan.StepPlan` with ``folded``) and what a
    graph reads with it. ``restricted``: the output layer's rows come as inputs; ``blocked``
    false: the greedy choice is one ``TopK`` (a graph for few rows,
    :func:`~fairseq_hrt.passes.token_choice.best_allowed`)."""

    def __init__(self, model, max_positions: int, restricted: bool = False, blocked: bool = True):
        decoder = model.decoder
        pass_ = decoder_pass(decoder)
        self.recurrent = pass_.recurrent  # SSRU layers: a cell per layer instead of keys/values
        with torch.no_grad():  # the folded weights are constants, outside any autograd graph
            self.plan = StepPlan(decoder, folded=True)
        self.heads, self.head_dim = pass_.heads, pass_.head_dim
        self.dim = self.heads * self.head_dim
        table = pass_.position_table(max_positions, 1, decoder.dictionary.eos(), decoder.embed_tokens.weight.device)
        self.positions = table.detach() if table is not None else None
        self.window = pass_.window
        self.padding_idx = decoder.padding_idx
        self.restricted = restricted
        # the greedy choice's blocks over the whole output layer (restricted rows: their number varies)
        self.block = 0 if not blocked else 1 if restricted else argmax_block(decoder.output_projection.weight.size(0))

    def prologue(self, tokens: Tensor, positions: Optional[Tensor]) -> Tensor:
        """The embedded ``tokens`` at rows ``positions`` of the position table."""
        return prologue(self.plan, tokens, None if self.positions is None else self.positions[positions])

    def logits(self, x: Tensor, out_weight: Optional[Tensor] = None, out_bias: Optional[Tensor] = None) -> Tensor:
        if not self.restricted:
            return self.plan.output(x)
        return F.linear(self.plan.features(x), out_weight, out_bias)


def parallel_choice(fixed: FixedPass, tokens, positions, queries, select, logit_bias, encoder: EncoderKV, out_rows=()):
    """One non-causal pass over ``tokens (B, T)`` at ``positions (B, T)`` (rows of the position
    table), its last layer at the columns ``queries (Q,)`` only, and the best allowed token
    and its log-probability at the slots ``select (M,)`` (flat indices into ``B x Q``):
    ``(score (M,), token (M,))``. ``out_rows``: the output rows' weight and bias
    (``restricted``)."""
    n, t = tokens.shape
    x = fixed.prologue(tokens, positions).reshape(-1, fixed.dim)
    bias = padding_bias(tokens.eq(fixed.padding_idx), t, n, torch.float32, tokens.device)
    buckets = pair_buckets(positions, fixed.window, fixed.heads) if fixed.window > 0 else None
    x = non_causal_layers(fixed.plan, encoder, x, n, buckets, bias, queries)
    selected = x.index_select(0, select)
    return best_allowed(fixed.logits(selected, *out_rows), logit_bias, 1, fixed.block)
