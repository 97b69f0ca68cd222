"""What fairseq 0.12 needs to run on PyTorch 2.x (and a CPU-only PyTorch), and nothing else.

Applied once, when :mod:`fairseq_hrt` is imported (``--user-dir`` or ``import fairseq_hrt``), so
these are the only changes the plugin makes to fairseq for every task of the process. Each
replaces the ``torch`` global of one fairseq module by a proxy that differs from torch in one
function; no fairseq function or class is replaced, and torch itself is untouched. Each fix
states the breakage it works around and has a test in ``tests/test_compat.py``; which fairseq
tests it turns green is in ``benchmarks/results/fairseq-suite/report.md``.

What the plugin adds to fairseq for its own runs (``--task hrt_translation``) lives in the
task, criterion and scorer modules, not here; docs/compatibility.md lists both.
"""

import functools
import types

import fairseq.checkpoint_utils as checkpoint_utils
import fairseq.distributed.utils as distributed_utils
import fairseq.trainer as trainer
import torch


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

    return load


class _TorchProxy(types.ModuleType):
    """A stand-in for the ``torch`` module inside one fairseq module.

    Only the attributes given as overrides differ; every other attribute is torch's own.
    Patching torch itself instead would change behaviour for unrelated code in the same
    process (e.g. silently lower ``torch.load``'s safety default), so each fix is confined
    to the fairseq module that needs it.
    """

    def __init__(self, **overrides):
        super().__init__("torch")
        for name, value in overrides.items():
            setattr(self, name, value)

    def __getattr__(self, name):
        return getattr(torch, name)


def _torch_loading_fairseq_pickles(_torch):
    return _TorchProxy(load=_load_trusting_fairseq_pickles(torch.load))


def _patch_checkpoint_loading():
    # checkpoint_utils: load_checkpoint_to_cpu (train/generate/interactive/hub) and
    # torch_persistent_save's verification; distributed.utils: broadcast_object, used to
    # share the restored trainer state between ranks.
    for module in (checkpoint_utils, distributed_utils):
        _wrap_once(module, "torch", _torch_loading_fairseq_pickles)


class _CudaOptionalTensor(torch.Tensor):
    """A tensor whose ``.cuda()`` is a no-op (returning a plain tensor) without CUDA."""

    def cuda(self, *args, **kwargs):
        plain = self.as_subclass(torch.Tensor)
        return plain.cuda(*args, **kwargs) if torch.cuda.is_available() else plain


def _tensor_with_optional_cuda(*args, **kwargs):
    t = torch.tensor(*args, **kwargs)
    return t if torch.cuda.is_available() else t.as_subclass(_CudaOptionalTensor)


def _torch_with_optional_cuda_tensors(_torch):
    return _TorchProxy(tensor=_tensor_with_optional_cuda)


def _patch_fp16_overflow_on_cpu():
    """fairseq 0.12's Trainer handles a gradient overflow (routine with ``--fp16``: the
    dynamic loss scaler skips the update and lowers the scale) with
    ``grad_norm = torch.tensor(0.0).cuda()``, which crashes without CUDA ("Torch not compiled
    with CUDA enabled"), so fp16 training on CPU died at its first overflow. That is the only
    ``torch.tensor`` call in fairseq/trainer.py; on CPU it now stays on the CPU."""
    _wrap_once(trainer, "torch", _torch_with_optional_cuda_tensors)


def _wrap_once(owner, name, make_wrapper):
    """Replace ``owner.name`` by ``make_wrapper(owner.name)``, unless it is already wrapped.

    The one guard against applying a fix twice (fairseq imports a user dir several times
    per process, and the plugin may also be imported by name): the replacement carries a
    ``__fairseq_hrt_compat__`` mark, the names of the fixes applied to ``owner.name``.
    """
    current = getattr(owner, name)
    applied = getattr(current, "__fairseq_hrt_compat__", ())
    if make_wrapper.__name__ in applied:
        return
    wrapper = make_wrapper(current)
    wrapper.__fairseq_hrt_compat__ = (*applied, make_wrapper.__name__)
    setattr(owner, name, wrapper)


# What the fixes replace, as (module, global): tests/test_compat.py checks that importing the
# plugin changes nothing else of fairseq.
PATCHED = (
    ("fairseq.checkpoint_utils", "torch"),
    ("fairseq.distributed.utils", "torch"),
    ("fairseq.trainer", "torch"),
)


def apply():
    """Apply every fix; safe to call repeatedly (each one is applied once, see :func:`_wrap_once`)."""
    _patch_checkpoint_loading()
    _patch_fp16_overflow_on_cpu()
