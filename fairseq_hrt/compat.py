"""Compatibility fixes for running fairseq 0.12 on Python 3.11 / PyTorch 2.x / NumPy.

Applied once, when :mod:`fairseq_hrt` is imported (``--user-dir`` or ``import fairseq_hrt``).
Every fix states the breakage it works around; each has a test in ``tests/test_compat.py``.
"""
import functools
import logging
import types

import torch

logger = logging.getLogger(__name__)

_APPLIED = False


def _load_trusting_fairseq_pickles(torch_load):
    """Wrap ``torch.load`` so that it defaults to ``weights_only=False``.

    Why: PyTorch >= 2.6 defaults ``torch.load`` to ``weights_only=True``, which refuses the
    pickled ``argparse.Namespace`` / ``omegaconf.DictConfig`` that every fairseq checkpoint
    stores next to its weights, so fairseq-train (--restore-file, --finetune-from-model),
    fairseq-generate, fairseq-interactive and ``checkpoint_utils`` all fail. A fairseq
    checkpoint is a pickle by design; loading one always meant trusting it, exactly as it did
    with PyTorch < 2.6. An explicit ``weights_only=...`` from the caller is respected.
    """

    @functools.wraps(torch_load)
    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return torch_load(*args, **kwargs)

    load.__fairseq_hrt_compat__ = True
    return load


class _TorchWithTrustedLoad(types.ModuleType):
    """A stand-in for the ``torch`` module inside fairseq modules that load checkpoints.

    Only ``torch.load`` differs; every other attribute is torch's own. Patching the global
    ``torch.load`` instead would silently lower the safety default for unrelated code in the
    same process, so the fix is confined to fairseq's loaders.
    """

    def __init__(self):
        super().__init__("torch")
        self.load = _load_trusting_fairseq_pickles(torch.load)

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_checkpoint_loading():
    import fairseq.checkpoint_utils as checkpoint_utils
    import fairseq.distributed.utils as distributed_utils

    # checkpoint_utils: load_checkpoint_to_cpu (train/generate/interactive/hub) and
    # torch_persistent_save's verification; distributed.utils: broadcast_object, used to
    # share the restored trainer state between ranks.
    for module in (checkpoint_utils, distributed_utils):
        if not getattr(getattr(module, "torch", None), "load", None) or getattr(
            module.torch.load, "__fairseq_hrt_compat__", False
        ):
            continue
        module.torch = _TorchWithTrustedLoad()


def apply():
    """Apply every fix once; safe to call repeatedly (fairseq imports user dirs many times)."""
    global _APPLIED
    if _APPLIED:
        return
    _patch_checkpoint_loading()
    _APPLIED = True
    logger.debug("fairseq_hrt compatibility fixes applied")
