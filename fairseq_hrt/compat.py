"""Compatibility fixes for running fairseq 0.12 on Python 3.11 / PyTorch 2.x / NumPy, and
workarounds for fairseq 0.12 bugs met on the HRT, CMLM and AT paths.

Applied once, when :mod:`fairseq_hrt` is imported (``--user-dir`` or ``import fairseq_hrt``).
Every fix states the breakage it works around; each has a test in ``tests/test_compat.py``
(the training-clock fix in ``tests/test_training.py``).
"""

import argparse
import functools
import glob
import inspect
import logging
import os
import pickle
import shutil
import sys
import time
import types
import zipfile

import fairseq.checkpoint_utils as checkpoint_utils
import fairseq.distributed.utils as distributed_utils
import fairseq.trainer as trainer
import fairseq.utils
import torch
from fairseq import options
from fairseq.scoring.bleu import SacrebleuScorer
from fairseq.trainer import Trainer
from sacrebleu.metrics import BLEU

from hrt_runtime import text_input


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
    _wrap_once(trainer, "torch", lambda _: _TorchProxy(tensor=_tensor_with_optional_cuda))


def _wrap_once(owner, name, make_wrapper):
    """Replace ``owner.name`` by ``make_wrapper(owner.name)``, unless it is already wrapped.

    The one guard against applying a fix twice (fairseq imports a user dir several times
    per process, and the plugin may also be imported by name): the replacement carries a
    ``__fairseq_hrt_compat__`` mark, the names of the fixes applied to ``owner.name`` (one
    function may take several, each once).
    """
    current = getattr(owner, name)
    applied = getattr(current, "__fairseq_hrt_compat__", ())
    if make_wrapper.__name__ in applied:
        return
    wrapper = make_wrapper(current)
    wrapper.__fairseq_hrt_compat__ = (*applied, make_wrapper.__name__)
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

    def restart_the_clock(arguments, extra_state):
        if arguments["reset_meters"]:
            trainer = arguments["self"]
            trainer._previous_training_time = 0
            trainer._start_time = time.time()

    return _after_loading(load_checkpoint, restart_the_clock)


def _after_loading(load_checkpoint, then):
    """``Trainer.load_checkpoint`` followed by ``then(arguments, extra_state)``, ``arguments``
    the call's, defaults included."""
    signature = inspect.signature(load_checkpoint)

    @functools.wraps(load_checkpoint)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        extra_state = load_checkpoint(*args, **kwargs)
        then(bound.arguments, extra_state)
        return extra_state

    return wrapper


def _patch_finetune_training_time():
    _expect_parameters(
        Trainer.load_checkpoint,
        ["self", "filename", "reset_optimizer", "reset_lr_scheduler", "optimizer_overrides", "reset_meters"],
        "Trainer.load_checkpoint",
    )
    _wrap_once(Trainer, "load_checkpoint", _load_checkpoint_restarting_the_clock)


def _buffered_read_repairing_bad_lines(buffered_read):
    """Replace ``fairseq_cli.interactive.buffered_read`` by one that reads through
    :mod:`hrt_runtime.text_input`.

    Why: fairseq 0.12 reads ``--input`` with ``fileinput`` (strict UTF-8) and stdin with
    Python's own decoding (``surrogateescape`` in a C/C.UTF-8 locale), so one line holding
    bytes that are not valid UTF-8 ended the whole session: ``UnicodeDecodeError`` while
    reading, or ``TypeError: not a string`` from SentencePiece on the surrogates. Now such
    bytes become U+FFFD with a warning naming the input and the line number, control
    characters and NUL bytes are handled alike, and the session translates every later line.
    Same interface and buffering as fairseq's (lines stripped, ``buffer_size`` per batch).
    """

    @functools.wraps(buffered_read)
    def wrapper(input, buffer_size):
        buffer = []
        for line in text_input.iter_lines(input):
            buffer.append(line.strip())
            if len(buffer) >= buffer_size:
                yield buffer
                buffer = []
        if buffer:
            yield buffer

    return wrapper


# How fairseq's command-line modules are recognised, computed once at import: the wrappers below
# run on every checkpoint load, and fairseq's own tests (tests/test_train.py) load checkpoints
# with ``os.path.join`` mocked, which a join per call turned into a TypeError.
_INTERACTIVE_FILE = os.path.join("fairseq_cli", "interactive.py")
_TRAIN_FILE = os.path.join("fairseq_cli", "train.py")


def _is_fairseq_interactive(module) -> bool:
    path = getattr(module, "__file__", None) or ""
    return (
        callable(getattr(module, "buffered_read", None)) and isinstance(path, str) and path.endswith(_INTERACTIVE_FILE)
    )


def patch_interactive_reading():
    """Apply :func:`_buffered_read_repairing_bad_lines` to fairseq-interactive when it runs.

    Only a module that is already loaded is patched (importing fairseq_cli.interactive here
    would configure logging for every process that imports the plugin): the console script
    loads it as ``fairseq_cli.interactive``, ``python -m fairseq_cli.interactive`` as
    ``__main__``, both before they import the user dir. Called again when the task is set
    up, which covers a program that imports the plugin before fairseq_cli.interactive.
    Idempotent.
    """
    for name in ("fairseq_cli.interactive", "__main__"):
        module = sys.modules.get(name)
        if module is not None and _is_fairseq_interactive(module):
            _wrap_once(module, "buffered_read", _buffered_read_repairing_bad_lines)


def _train_stopping_when_finished(train):
    """Wrap ``fairseq_cli.train.train`` (one epoch of fairseq-train) so that a run whose
    restored checkpoint already reached ``--max-update`` trains nothing.

    Why: fairseq 0.12 checks ``--max-update`` only after an update (in ``validate_and_save``),
    so running a finished ``fairseq-train`` command again, the usual way to resume, trained one
    more update and rewrote ``checkpoint_last.pt`` every time (an HRT run with
    ``--max-update 300``: 300, then 301, then 302; fairseq's own ``--task translation`` alike).
    Now the epoch ends before its first update with "training is already finished", fairseq's
    loop stops as it does at ``--max-update``, and no checkpoint is written. A run stopped by
    ``--max-epoch`` never enters the loop, in fairseq already. A run whose restored checkpoint
    was saved when ``--patience`` stopped it (:func:`_save_checkpoint_with_patience`) is
    finished too.
    """

    signature = inspect.signature(train)

    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        cfg, trainer = bound.arguments["cfg"], bound.arguments["trainer"]
        max_update = cfg.optimization.max_update or 0
        num_updates = trainer.get_num_updates()
        if 0 < max_update <= num_updates:
            logging.getLogger("fairseq_cli.train").info(
                "training is already finished: the checkpoint restored from %s is at update %d, --max-update is %d; "
                "nothing to train and no checkpoint written (raise --max-update to train on)",
                cfg.checkpoint.save_dir,
                num_updates,
                max_update,
            )
            return [None], True
        state = patience_state()
        patience = cfg.checkpoint.patience
        if patience > 0 and state is not None and state["num_runs"] >= patience:
            logging.getLogger("fairseq_cli.train").info(
                "training is already finished: the checkpoint restored from %s was saved after %d validations "
                "without a better score than %s, --patience is %d; nothing to train and no checkpoint written",
                cfg.checkpoint.save_dir,
                state["num_runs"],
                state["best"],
                patience,
            )
            return [None], True
        return train(*args, **kwargs)

    return wrapper


def _is_fairseq_train(module) -> bool:
    path = getattr(module, "__file__", None) or ""
    return (
        callable(getattr(module, "train", None))
        and callable(getattr(module, "validate_and_save", None))
        and isinstance(path, str)
        and path.endswith(_TRAIN_FILE)
    )


def patch_training_loop():
    """Apply :func:`_train_stopping_when_finished` to fairseq-train when it runs: as for
    fairseq-interactive (:func:`patch_interactive_reading`), only a module already loaded
    (``fairseq_cli.train`` of the console script, ``__main__`` of ``python -m fairseq_cli.train``;
    both load before the user dir) is patched. Idempotent."""
    for name in ("fairseq_cli.train", "__main__"):
        module = sys.modules.get(name)
        if module is not None and _is_fairseq_train(module):
            _expect_parameters(module.train, ["cfg", "trainer", "task", "epoch_itr"], "fairseq_cli.train.train")
            _wrap_once(module, "train", _train_stopping_when_finished)


def _load_checkpoint_patching_the_loop(load_checkpoint):
    """Wrap ``checkpoint_utils.load_checkpoint`` (fairseq-train's restore, just before its
    loop) to apply :func:`patch_training_loop` there too: a fairseq-train that imported the
    plugin before its own module was executed (``runpy``, a warm test process) is covered
    whatever the task. The look-up is two dictionary reads and a string comparison with the
    file names computed at import (a module run later, e.g. a new ``__main__`` in a forked
    test process, is still found)."""

    @functools.wraps(load_checkpoint)
    def wrapper(*args, **kwargs):
        patch_training_loop()
        return load_checkpoint(*args, **kwargs)

    return wrapper


def _patch_finished_runs():
    patch_training_loop()
    _wrap_once(checkpoint_utils, "load_checkpoint", _load_checkpoint_patching_the_loop)


# ------------------------------------------------------------------ --patience over restarts

PATIENCE_KEY = "fairseq_hrt_patience"


def _running_train_module():
    """The fairseq-train module running in this process, if any: ``__main__`` under ``python -m
    fairseq_cli.train`` (where an imported ``fairseq_cli.train`` may sit unused beside it), else
    ``fairseq_cli.train`` (the console script)."""
    for name in ("__main__", "fairseq_cli.train"):
        module = sys.modules.get(name)
        if module is not None and _is_fairseq_train(module) and hasattr(module, "should_stop_early"):
            return module
    return None


def patience_state():
    """``--patience``'s count (``fairseq_cli.train.should_stop_early``'s ``best`` and
    ``num_runs``), or None when no validation has been counted in this process."""
    module = _running_train_module()
    stop = getattr(module, "should_stop_early", None)
    if stop is None or getattr(stop, "best", None) is None:
        return None
    return {"best": stop.best, "num_runs": getattr(stop, "num_runs", 0)}


def restore_patience(extra_state) -> None:
    """Give ``should_stop_early`` the count saved in ``extra_state``; a checkpoint saved before
    the count was gives its best score (fairseq's ``best``) and a count of 0."""
    module = _running_train_module()
    if module is None or not extra_state:
        return
    saved = extra_state.get(PATIENCE_KEY)
    if saved is None and extra_state.get("best") is not None:
        saved = {"best": extra_state["best"], "num_runs": 0}
    if saved is None:
        return
    module.should_stop_early.best = saved["best"]
    module.should_stop_early.num_runs = saved["num_runs"]
    logging.getLogger("fairseq_cli.train").info(
        "--patience: %d validation(s) without a better score than %s before this resume",
        saved["num_runs"],
        saved["best"],
    )


def _save_checkpoint_with_patience(save_checkpoint):
    """Wrap ``Trainer.save_checkpoint`` to store ``--patience``'s count in the checkpoint.

    Why: fairseq 0.12 keeps that count in attributes of ``should_stop_early``, so every resume
    started it again from 0 with the first validation after it as the best: a run resumed
    once a session validated up to ``--patience`` more times, and stopped by comparing with
    a score below its real best. Saved here and restored at a plain resume
    (:func:`_load_checkpoint_restoring_patience`), a resumed run stops at the validation an
    uninterrupted one stops at."""

    @functools.wraps(save_checkpoint)
    def wrapper(self, filename, extra_state):
        state = patience_state()
        if state is not None and isinstance(extra_state, dict):
            extra_state = {**extra_state, PATIENCE_KEY: state}
        return save_checkpoint(self, filename, extra_state)

    return wrapper


def _load_checkpoint_restoring_patience(load_checkpoint):
    """Wrap ``Trainer.load_checkpoint``: a plain resume (optimizer and meters restored, as
    fairseq restores its best score) restores ``--patience``'s count; a fine-tuning start or a
    reset starts it afresh."""

    def restore_at_a_plain_resume(arguments, extra_state):
        if not arguments["reset_optimizer"] and not arguments["reset_meters"]:
            restore_patience(extra_state)

    return _after_loading(load_checkpoint, restore_at_a_plain_resume)


def _patch_patience():
    _wrap_once(Trainer, "save_checkpoint", _save_checkpoint_with_patience)
    _wrap_once(Trainer, "load_checkpoint", _load_checkpoint_restoring_patience)


# ------------------------------------------------------------------ checkpoint files


class CheckpointReadError(RuntimeError):
    """A checkpoint file that cannot be read; the message says what to do."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (e.g. a full disk); the message says what is kept."""


def readable_checkpoints(directory: str, exclude: str = "") -> list:
    """The ``*.pt`` files of ``directory`` that are complete checkpoint archives, newest first.

    A complete archive is a zip file with its central directory (PyTorch's format since 1.6),
    which is what a truncated write lacks; checked without loading the weights.
    """
    found = []
    for path in glob.glob(os.path.join(directory, "*.pt")):
        if os.path.abspath(path) == os.path.abspath(exclude) or not os.path.isfile(path):
            continue
        if zipfile.is_zipfile(path):
            found.append(path)
    return sorted(found, key=os.path.getmtime, reverse=True)


def _looks_corrupt(path: str, error: BaseException) -> bool:
    if isinstance(error, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile)):
        return True
    text = str(error).lower()
    if "corrupt" in text or "zip archive" in text or "central directory" in text:
        return True
    try:
        return (
            os.path.isfile(path)
            and os.path.getsize(path) > 0
            and not zipfile.is_zipfile(path)
            and isinstance(error, RuntimeError)
        )
    except OSError:
        return False


def corrupt_checkpoint_message(path: str, error: BaseException) -> str:
    """What to tell the user about an unreadable checkpoint (pure but for listing its folder)."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    others = readable_checkpoints(directory, exclude=path)
    lines = [
        f"cannot read the checkpoint {path}: it is truncated or corrupt ({type(error).__name__}: {error}).",
        "This happens when a run is killed or the disk fills up while the file is being written; fairseq itself "
        "writes a checkpoint to <name>.tmp and renames it when complete, and this plugin does the same for the "
        "copies fairseq makes (checkpoint_last.pt, checkpoint_best.pt), so with the plugin loaded a kill leaves "
        "the previous complete file in place.",
    ]
    if os.path.exists(path + ".tmp"):
        lines.append(f"{path}.tmp is an unfinished write, not a usable checkpoint.")
    if others:
        lines.append(
            f"Complete checkpoints in {directory} (newest first): "
            + ", ".join(os.path.basename(o) for o in others[:5])
            + "."
        )
        lines.append(
            f"What to do: resume training from one of them with --restore-file {others[0]} (fairseq-train), or "
            f"decode with --path {others[0]}; or move {os.path.basename(path)} away and run the same command to "
            "start training over."
        )
    else:
        lines.append(
            f"No other complete checkpoint is in {directory}. What to do: move {os.path.basename(path)} away and run "
            "the same command to start training over (or --restore-file / --path a checkpoint from elsewhere)."
        )
    return "\n".join(lines)


def _load_checkpoint_explaining_corruption(load_checkpoint_to_cpu):
    """Wrap fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` (every load: fairseq-train
    resuming, --restore-file, --finetune-from-model, generate, interactive, the Python API).

    Why: a truncated ``checkpoint_last.pt`` stopped fairseq-train with a traceback ending in
    PyTorch's "failed finding central directory ... checkpoint file is corrupted", which
    says neither why nor what to do. The error now names the file, keeps PyTorch's text, and
    lists the complete checkpoints next to it with the ``--restore-file`` to use.
    """

    @functools.wraps(load_checkpoint_to_cpu)
    def wrapper(path, *args, **kwargs):
        try:
            return load_checkpoint_to_cpu(path, *args, **kwargs)
        except CheckpointReadError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised unless the file is corrupt
            if not _looks_corrupt(str(path), e):
                raise
            raise CheckpointReadError(corrupt_checkpoint_message(str(path), e)) from e

    return wrapper


def _copy_atomically(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
    """``PathManager.copy`` for local files through ``dst.tmp`` and a rename.

    Why: fairseq 0.12 writes each checkpoint to ``<name>.tmp`` and renames it, but then
    *copies* it to the other names it saves under (``checkpoint_last.pt`` after
    ``checkpoint_3_10.pt`` with --save-interval-updates, after ``checkpoint_best.pt`` or an
    epoch checkpoint) with ``shutil.copyfile`` straight onto the destination. A run killed
    during that copy left a truncated ``checkpoint_last.pt``, and the next run could not
    resume. Now the destination is replaced only by a complete copy; a failed copy (full disk)
    removes its partial file and says what is kept.
    """
    if not overwrite and os.path.exists(dst_path):
        return False
    tmp = dst_path + ".tmp"
    try:
        shutil.copyfile(src_path, tmp)
        os.replace(tmp, dst_path)
    except OSError as e:
        _remove_quietly(tmp)
        raise CheckpointWriteError(e.errno, _write_failure_message(dst_path, e)) from e
    return True


class _PathManagerProxy:
    """fairseq's ``PathManager`` inside ``checkpoint_utils`` with an atomic ``copy`` for local
    paths (remote paths, handled by iopath, keep fairseq's own copy)."""

    def __init__(self, path_manager):
        self._path_manager = path_manager

    def copy(self, src_path, dst_path, overwrite=False):
        if self._path_manager.path_requires_pathmanager(dst_path):
            return self._path_manager.copy(src_path, dst_path, overwrite=overwrite)
        return _copy_atomically(src_path, dst_path, overwrite=overwrite)

    def __getattr__(self, name):
        return getattr(self._path_manager, name)


def _remove_quietly(path: str):
    try:
        os.remove(path)
    except OSError:
        pass


def _write_failure_message(path: str, error: OSError) -> str:
    path = os.path.abspath(path)
    kept = os.path.join(os.path.dirname(path), "checkpoint_last.pt")
    reason = os.strerror(error.errno) if error.errno else str(error)
    return (
        f"could not write the checkpoint {path}: {reason}. Its partial file was removed; "
        + (f"{kept}, from the previous save, is complete and unchanged. " if os.path.exists(kept) else "")
        + "Free space (or fix the error) and run the same command to resume from the last complete checkpoint; "
        "the updates since that save are lost."
    )


def _save_checkpoint_cleaning_up_on_failure(save_checkpoint):
    """Wrap ``Trainer.save_checkpoint``: when writing fails (a full disk), remove the partial
    ``<name>.tmp`` fairseq leaves behind and fail with a message that says what is kept.

    Why: on a full disk fairseq 0.12 stopped with a bare ``OSError: [Errno 28] No space left
    on device`` and left the partial ``checkpoint_last.pt.tmp`` taking the space, so a re-run
    after freeing some failed again at its first save.
    """

    @functools.wraps(save_checkpoint)
    def wrapper(self, filename, extra_state):
        try:
            return save_checkpoint(self, filename, extra_state)
        except OSError as e:
            if isinstance(e, CheckpointWriteError):
                raise
            _remove_quietly(str(filename) + ".tmp")
            raise CheckpointWriteError(e.errno, _write_failure_message(str(filename), e)) from e

    return wrapper


def _patch_checkpoint_files():
    _wrap_once(checkpoint_utils, "PathManager", _PathManagerProxy)
    _wrap_once(checkpoint_utils, "load_checkpoint_to_cpu", _load_checkpoint_explaining_corruption)
    _expect_parameters(Trainer.save_checkpoint, ["self", "filename", "extra_state"], "Trainer.save_checkpoint")
    _wrap_once(Trainer, "save_checkpoint", _save_checkpoint_cleaning_up_on_failure)


# ------------------------------------------------------------------ scoring


def sacrebleu_signature(cfg) -> str:
    """sacreBLEU's signature of what fairseq's ``--scoring sacrebleu`` computes: fairseq
    tokenizes both sides with sacreBLEU's tokenizer ``--sacrebleu-tokenizer`` (lowercased with
    ``--sacrebleu-lowercase``) and scores the tokens with ``tokenize='none'``, which is sacreBLEU
    with that tokenizer; ``--sacrebleu-char-level`` splits into characters after it (``+char``)."""
    tokenizer = str(cfg.sacrebleu_tokenizer)
    bleu = BLEU(tokenize=tokenizer, lowercase=bool(cfg.sacrebleu_lowercase))
    bleu.num_refs = 1  # fairseq scores against one reference per sentence
    signature = bleu.get_signature().format()
    return signature.replace(f"tok:{tokenizer}", f"tok:{tokenizer}+char") if cfg.sacrebleu_char_level else signature


def _sacrebleu_result_with_signature(result_string):
    """``fairseq-generate --scoring sacrebleu`` prints ``BLEU = 35.2 ...`` without the signature
    that says how the number was computed (fairseq 0.12 calls sacreBLEU's ``format()`` without
    it); with this fix it prints sacreBLEU's own ``BLEU|nrefs:1|case:mixed|eff:no|tok:13a|
    smooth:exp|version:2.6.0 = 35.2 ...``. The score is unchanged."""

    @functools.wraps(result_string)
    def with_signature(self, order=4):
        if order != 4:
            return result_string(self, order)
        return self._score(order).format(signature=sacrebleu_signature(self.cfg))

    return with_signature


def _patch_sacrebleu_scorer():
    _wrap_once(SacrebleuScorer, "result_string", _sacrebleu_result_with_signature)


# ------------------------------------------------------------------ torchrun on CPU


TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def _infer_init_method_of_torchrun_on_cpu(infer_init_method):
    """``torchrun --nproc_per_node 2 $(which fairseq-train) ... --cpu`` trains on two ranks.

    Why: fairseq 0.12's ``--distributed-world-size`` defaults to the number of GPUs (1 without
    one), and ``infer_init_method`` returns on a world size of 1 before it reads torchrun's
    environment: each rank trained alone (two unrelated runs writing one ``--save-dir``) and
    both logged everything; with ``--distributed-world-size 2`` it divided by
    ``torch.cuda.device_count()``, 0. Without a GPU, under torchrun (its four variables set,
    ``WORLD_SIZE`` > 1) and no init method of the command line's, the ranks are torchrun's,
    as fairseq does for ``torch.distributed.launch`` on GPUs; then, as always with fairseq,
    only rank 0 logs below warnings.
    """

    @functools.wraps(infer_init_method)
    def infer(cfg, force_distributed=False):
        env = os.environ
        if (
            cfg.distributed_init_method is None
            and not torch.cuda.is_available()
            and all(name in env for name in TORCHRUN_VARIABLES)
            and int(env["WORLD_SIZE"]) > 1
        ):
            cfg.distributed_init_method = "env://"
            cfg.distributed_world_size = int(env["WORLD_SIZE"])
            cfg.distributed_rank = int(env["RANK"])
            cfg.device_id = int(env.get("LOCAL_RANK", 0))
            cfg.distributed_no_spawn = True  # the processes are torchrun's
            return
        return infer_init_method(cfg, force_distributed)

    return infer


def _patch_torchrun_on_cpu():
    _wrap_once(distributed_utils, "infer_init_method", _infer_init_method_of_torchrun_on_cpu)


# ------------------------------------------------------------------ --help


class _HelpAfterTaskOptions(argparse._HelpAction):
    """``--help`` that prints on the second parse of fairseq's command line.

    fairseq (``options.parse_args_and_arch``) parses a command line twice: once to learn the
    task, architecture and criterion, then again after they added their options. ``--help``
    acts on the first parse, so ``fairseq-generate DATA --task hrt_translation --help`` listed
    none of the task's options (``--decoding``, ``--decoder-engine``, ``--decode-chunk-size``,
    ...), nor the model's or the criterion's. This action lets the first parse pass and prints
    the help on the second, with every option the command line selected.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        if not getattr(self, "passed_once", False):
            self.passed_once = True
            if hasattr(namespace, "arch") and namespace.arch is None:
                # no --arch (fairseq-train --help): fairseq adds no model options then
                # instead of failing on arch None; an --arch later on the line sets it again
                delattr(namespace, "arch")
            return
        super().__call__(parser, namespace, values, option_string)


def defer_help_to_the_second_parse():
    """When a ``parse_args_and_arch`` that asks for ``--help`` is running (it imports the user
    dir before its first parse), its parser's help action becomes :class:`_HelpAfterTaskOptions`."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not options.parse_args_and_arch.__code__:
        frame = frame.f_back
    if frame is None:
        return
    parser, given = frame.f_locals.get("parser"), frame.f_locals.get("input_args")
    given = sys.argv[1:] if given is None else given
    if not isinstance(parser, argparse.ArgumentParser) or not {"-h", "--help"} & set(given):
        return
    for action in parser._actions:
        if type(action) is argparse._HelpAction:
            action.__class__ = _HelpAfterTaskOptions


def _importing_user_module_defers_help(import_user_module):
    @functools.wraps(import_user_module)
    def wrapper(*args, **kwargs):
        try:
            return import_user_module(*args, **kwargs)
        finally:
            defer_help_to_the_second_parse()

    return wrapper


def _patch_help():
    """The first import of the plugin happens inside the running parse (``--user-dir``): its
    help is deferred here; later parses in the same process (the plugin imported already)
    through ``fairseq.utils.import_user_module``."""
    _wrap_once(fairseq.utils, "import_user_module", _importing_user_module_defers_help)
    defer_help_to_the_second_parse()


def apply():
    """Apply every fix; safe to call repeatedly (each one is applied once, see :func:`_wrap_once`)."""
    _patch_checkpoint_loading()
    _patch_fp16_overflow_on_cpu()
    _patch_finetune_training_time()
    _patch_checkpoint_files()
    patch_interactive_reading()
    _patch_finished_runs()
    _patch_patience()
    _patch_sacrebleu_scorer()
    _patch_help()
    _patch_torchrun_on_cpu()
