"""A decoder's or encoder's linear and norm modules as plain functions, with the q/k/v
projections of an attention fused into one matrix product: the one fusion every pass (the
lean and CUDA-graph engines, the exported graphs) runs."""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def as_function(module):
    """A plain ``nn.Linear`` / ``nn.LayerNorm`` as a function of its tensors: the same
    arithmetic without the per-call cost of ``Module.__call__``, which at batch 1 is a good
    part of a step. Other modules (int8-quantized linears) are returned as they are."""
    if module is None:
        return None
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if type(module) is nn.LayerNorm:
        shape, weight, bias, eps = module.normalized_shape, module.weight, module.bias, module.eps
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    return module


def fused_weights(modules: Sequence[nn.Linear], scales: Optional[Sequence[float]] = None):
    """``(weight, bias)`` of plain ``nn.Linear`` ``modules`` concatenated, module ``i``'s rows
    multiplied by ``scales[i]`` (an exported graph's queries carry their scaling in their
    weights: one operator less per attention)."""
    scales = scales or [1.0] * len(modules)
    weight = torch.cat([m.weight * s if s != 1.0 else m.weight for m, s in zip(modules, scales)])
    bias = torch.cat([m.bias * s if s != 1.0 else m.bias for m, s in zip(modules, scales)])
    return weight, bias


def fused_projections(*modules, scales: Optional[Sequence[float]] = None):
    """``x -> (m(x) for m in modules)``: one matrix product over the concatenated weights when
    every module is a plain ``nn.Linear`` with a bias (:func:`fused_weights`; ``scales``: see
    there), else one call each (int8-quantized linears), scaled after."""
    if all(type(m) is nn.Linear for m in modules) and all(m.bias is not None for m in modules):
        weight, bias = fused_weights(modules, scales)
        sizes = [m.out_features for m in modules]
        return lambda x: F.linear(x, weight, bias).split(sizes, dim=-1)
    functions = [as_function(m) for m in modules]
    if scales is None or all(s == 1.0 for s in scales):
        return lambda x: tuple(f(x) for f in functions)
    return lambda x: tuple(f(x) * s if s != 1.0 else f(x) for f, s in zip(functions, scales))


def projection(module, scale: float = 1.0):
    """``x -> module(x) * scale`` as one function (a plain ``nn.Linear``: the scale in its
    weights, :func:`fused_weights`)."""
    if scale == 1.0:
        return as_function(module)
    if type(module) is nn.Linear and module.bias is not None:
        weight, bias = fused_weights([module], [scale])
        return lambda x: F.linear(x, weight, bias)
    function = as_function(module)
    return lambda x: function(x) * scale


def ssru_projections(ssru):
    """``x -> (-(W_f x + b_f), W x)``: one matrix product over ``[-W_f; W]`` (bias
    ``[-b_f; 0]``) when both are plain ``nn.Linear`` (else, e.g. int8-quantized, one call
    each)."""
    gate, projection_ = ssru.forget_gate, ssru.input_proj
    if type(gate) is nn.Linear and type(projection_) is nn.Linear:
        weight = torch.cat([-gate.weight, projection_.weight])
        bias = torch.cat([-gate.bias, torch.zeros_like(gate.bias)])
        size = gate.out_features
        return lambda x: F.linear(x, weight, bias).split(size, dim=-1)
    gate_f, projection_f = as_function(gate), as_function(projection_)
    return lambda x: (gate_f(x).neg_(), projection_f(x))
