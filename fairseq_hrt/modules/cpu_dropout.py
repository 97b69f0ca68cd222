"""Dropout masks of CPU tensors drawn by NumPy's PCG64 instead of torch's Bernoulli kernel.

torch's CPU ``bernoulli_`` draws one 64-bit number per element through a serial kernel, a
large share of a one-thread ``at_small`` update under ``perf``; NumPy's PCG64 fills float32
uniforms faster (benchmarks/results/small-converged-cpu/README.md, "Dropout masks"), and a mask
compared from them keeps each element with probability ``1 - p`` to within 2**-24: the same
dropout, from another random stream.

Reproducible as fairseq's own: each call seeds its generator with one number drawn from torch's
default generator, which fairseq's trainer reseeds from ``--seed`` and the update number before
every update, so a run and its resumption draw the same masks. Tensors on other devices, and
``--cpu-dropout-rng torch``, keep fairseq's ``F.dropout``.
"""

from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from fairseq.modules.fairseq_dropout import FairseqDropout

from fairseq_hrt.cli_logging import RefusedOptions

CPU_DROPOUT_RNGS = ("pcg64", "torch")
_SEED_BOUND = 2**62


def dropout_mask(shape, p: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The scaled keep-mask of inverted dropout: ``1 / (1 - p)`` where an element is kept (with
    probability ``1 - p``), ``0`` elsewhere, drawn by PCG64 from ``seed``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    uniform = np.random.Generator(np.random.PCG64(seed)).random(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
    keep = torch.from_numpy(uniform >= np.float32(p)).view(shape)
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


def pcg64_dropout(x: torch.Tensor, p: float, inplace: bool = False) -> torch.Tensor:
    """``F.dropout(x, p, training=True)`` for a CPU tensor, its mask from :func:`dropout_mask`
    seeded by torch's default generator."""
    seed = int(torch.randint(0, _SEED_BOUND, (1,)).item())
    mask = dropout_mask(x.shape, p, x.dtype, seed)
    return x.mul_(mask) if inplace else x * mask


class PCG64Dropout(FairseqDropout):
    """fairseq's dropout module, drawing the masks of CPU tensors with :func:`pcg64_dropout`."""

    def forward(self, x, inplace: bool = False):
        # p = 1 (every element dropped, no scale) stays F.dropout's
        if 0 < self.p < 1 and (self.training or self.apply_during_inference) and x.device.type == "cpu":
            return pcg64_dropout(x, self.p, inplace=inplace)
        return super().forward(x, inplace=inplace)

    @classmethod
    def from_module(cls, module: FairseqDropout) -> "PCG64Dropout":
        new = cls(module.p, module_name=module.module_name)
        new.apply_during_inference = module.apply_during_inference
        new.train(module.training)
        return new


def use_cpu_dropout_rng(model: nn.Module, rng: Optional[str]) -> int:
    """Give every fairseq dropout module of ``model`` the CPU mask generator ``rng``
    (:data:`CPU_DROPOUT_RNGS`; ``torch`` or None leaves fairseq's); returns how many were
    replaced. Replaces the modules in their parents, as module swaps do (no weights change)."""
    if rng in (None, "torch"):
        return 0
    if rng != "pcg64":
        raise RefusedOptions(f"--cpu-dropout-rng {rng!r}: choose one of {', '.join(CPU_DROPOUT_RNGS)}")
    replaced = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is FairseqDropout:
                setattr(parent, name, PCG64Dropout.from_module(child))
                replaced += 1
    return replaced
