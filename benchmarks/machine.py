"""The measuring machine as a report names it: its CPU model (:func:`cpu_name`) and the
instruction sets its kernels may use (:func:`cpu_isa`). No PyTorch here: the scripts that keep
it out of their process (CTranslate2's side, ``benchmarks/batch_step.py``) name the machine too."""

import platform
from typing import List


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the instruction sets that CPU kernels choose between (ONNX Runtime's MLAS, oneDNN, MKL,
# CTranslate2's own): a CPU speed is read with them
ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve",
)  # fmt: skip


def cpu_isa() -> List[str]:
    """Which of :data:`ISA_FLAGS` this CPU has (``/proc/cpuinfo``'s flags; empty where it has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in ISA_FLAGS if flag in have]
    except OSError:
        pass
    return []
