"""How the HRT task's training runs on the CPU: ``--cpu-autocast-bf16`` (the precision of a
training step) and ``--cpu-dropout-rng`` (where the dropout masks of CPU tensors come from).
Measurements: benchmarks/results/small-converged-cpu/README.md."""

import contextlib
import logging

import torch
from fairseq.dataclass import ChoiceEnum
from torch.nn.attention import SDPBackend, sdpa_kernel

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.modules.cpu_dropout import CPU_DROPOUT_RNGS, use_cpu_dropout_rng

logger = logging.getLogger(__name__)

CPU_DROPOUT_RNG_CHOICES = ChoiceEnum(list(CPU_DROPOUT_RNGS))


def refuse_fp16_without_cuda(cfg):
    """fairseq 0.12's trainer answers a gradient overflow, which a dynamic loss scaler expects
    routinely under ``--fp16`` / ``--memory-efficient-fp16``, with ``torch.tensor(0.0).cuda()``:
    on the CPU that fails at the first overflow, so such a run is refused before it starts."""
    fp16 = getattr(cfg, "fp16", False) or getattr(cfg, "memory_efficient_fp16", False)
    if fp16 and (getattr(cfg, "cpu", False) or not torch.cuda.is_available()):
        option = "--memory-efficient-fp16" if getattr(cfg, "memory_efficient_fp16", False) else "--fp16"
        raise RefusedOptions(
            f"{option} trains on a GPU: fairseq 0.12's trainer needs CUDA at the first gradient overflow; "
            "on the CPU drop it (train in float32) or use --cpu-autocast-bf16"
        )


class CpuTraining:
    """The task's ``--cpu-autocast-bf16`` and ``--cpu-dropout-rng``, read from its ``cfg``."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._bf16_checked = False  # the CPU's bfloat16 support, checked at the first training step

    def set_up_model(self, model, from_checkpoint: bool):
        """fairseq-train's model draws its CPU dropout masks from ``--cpu-dropout-rng``; a model
        loaded from a checkpoint decodes without dropout."""
        if not from_checkpoint:
            use_cpu_dropout_rng(model, self.cfg.cpu_dropout_rng)

    def precision(self, model):
        """The context of a training step's forward and backward: float32, or under
        ``--cpu-autocast-bf16`` CPU autocast to bfloat16."""
        if not self.cfg.cpu_autocast_bf16:
            return contextlib.nullcontext()
        param = next(model.parameters())
        if param.device.type != "cpu" or param.dtype != torch.float32:
            raise RefusedOptions(
                f"--cpu-autocast-bf16 trains a float32 model on the CPU; this one is {param.dtype} on "
                f"{param.device.type} (on a GPU use fairseq's --fp16 or --amp instead)"
            )
        if not self._bf16_checked:
            self._bf16_checked = True
            if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                logger.warning(
                    "--cpu-autocast-bf16: this CPU has no native bfloat16 (AVX512-BF16 or AMX); its "
                    "bfloat16 products are emulated and training will be many times slower than in float32"
                )
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        # PyTorch's fused CPU attention backward is much slower in bfloat16 than the plain
        # matrix products it replaces (benchmarks/results/small-converged-cpu/README.md)
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        return stack
