"""Compatibility fixes for running fairseq 0.12 on Python 3.11 / PyTorch 2.x / NumPy, and
workarounds for fairseq 0.12 bugs met on the HRT, CMLM and AT paths.

Applied once, when :mod:`fairseq_hrt` is imported (``--user-dir`` or ``import fairseq_hrt``).
Every fix states the breakage it works around; each has a test in ``tests/test_compat.py``
(the training-clock fix in ``tests/test_training.py``).
"""
import functools
import inspect
import time
import types

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


def _patch_checkpoint_loading():
    import fairseq.checkpoint_utils as checkpoint_utils
    import fairseq.distributed.utils as distributed_utils

    # checkpoint_utils: load_checkpoint_to_cpu (train/generate/interactive/hub) and
    # torch_persistent_save's verification; distributed.utils: broadcast_object, used to
    # share the restored trainer state between ranks.
    for module in (checkpoint_utils, distributed_utils):
        _wrap_once(module, "torch", lambda _: _TorchProxy(load=_load_trusting_fairseq_pickles(torch.load)))


class _CudaOptionalTensor(torch.Tensor):
    """A tensor whose ``.cuda()`` is a no-op (returning a plain tensor) without CUDA."""

    def cuda(self, *args, **kwargs):
        plain = self.as_subclass(torch.Tensor)
        return plain.cuda(*args, **kwargs) if torch.cuda.is_available() else plain


def _tensor_with_optional_cuda(*args, **kwargs):
    t = torch.tensor(*args, **kwargs)
    return t if torch.cuda.is_available() else t.as_subclass(_CudaOptionalTensor)



def _patch_fp16_overflow_on_cpu():
    """fairseq 0.12's Trainer handles a gradient overflow (routine with ``--fp16``: the
    dynamic loss scaler skips the update and lowers the scale) with
    ``grad_norm = torch.tensor(0.0).cuda()``, which crashes without CUDA ("Torch not compiled
    with CUDA enabled"), so fp16 training on CPU died at its first overflow. That is the only
    ``torch.tensor`` call in fairseq/trainer.py; on CPU it now stays on the CPU."""
    import fairseq.trainer as trainer

    _wrap_once(trainer, "torch", lambda _: _TorchProxy(tensor=_tensor_with_optional_cuda))


def _wrap_once(owner, name, make_wrapper):
    """Replace ``owner.name`` by ``make_wrapper(owner.name)``, unless it is already wrapped.

    The one guard against applying a fix twice (fairseq imports a user dir several times
    per process, and the plugin may also be imported by name): the replacement carries a
    ``__fairseq_hrt_compat__`` mark.
    """
    current = getattr(owner, name)
    if getattr(current, "__fairseq_hrt_compat__", False):
        return
    wrapper = make_wrapper(current)
    wrapper.__fairseq_hrt_compat__ = True
    setattr(owner, name, wrapper)


def _expect_parameters(func, names, what: str):
    """Fail loudly when fairseq changed a function that a fix wraps or relies on."""
    found = list(inspect.signature(func).parameters)
    if found[: len(names)] != list(names):
        raise RuntimeError(
            f"fairseq_hrt.compat: {what} has parameters {found}, the fix for it was written for "
            f"{list(names)}; this fairseq version needs the fix reviewed (see fairseq_hrt/compat.py)"
        )


def _load_checkpoint_restarting_the_clock(load_checkpoint):
    """Wrap ``Trainer.load_checkpoint`` so that a run that resets its meters also restarts its
    training clock.

    Why: fairseq 0.12 restores ``previous_training_time`` from any checkpoint it loads, also
    for ``--finetune-from-model`` (which resets optimizer, scheduler, meters and data
    loader). A fine-tuned model therefore starts with its parent's training time, and
    ``--stop-time-hours`` stopped HRT fine-tuned from a 17-minute AT run after 370 of 800
    updates with a 30-minute cap. With ``reset_meters`` (set by ``--finetune-from-model`` and
    ``--reset-meters``) the clock starts at 0, like the other meters; a plain resume keeps it.
    """

    signature = inspect.signature(load_checkpoint)

    @functools.wraps(load_checkpoint)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        extra_state = load_checkpoint(*args, **kwargs)
        if bound.arguments["reset_meters"]:
            trainer = bound.arguments["self"]
            trainer._previous_training_time = 0
            trainer._start_time = time.time()
        return extra_state

    return wrapper


def _patch_finetune_training_time():
    from fairseq.trainer import Trainer

    _expect_parameters(Trainer.load_checkpoint, ["self", "filename", "reset_optimizer", "reset_lr_scheduler",
                                                 "optimizer_overrides", "reset_meters"], "Trainer.load_checkpoint")
    _wrap_once(Trainer, "load_checkpoint", _load_checkpoint_restarting_the_clock)


def apply():
    """Apply every fix; safe to call repeatedly (each one is applied once, see :func:`_wrap_once`)."""
    _patch_checkpoint_loading()
    _patch_fp16_overflow_on_cpu()
    _patch_finetune_training_time()
