"""fairseq 0.12's checkpoints under PyTorch's safe loading (``torch.load(weights_only=True)``).

PyTorch >= 2.6 loads with ``weights_only=True`` by default: its unpickler builds tensors and
plain containers, and refuses any other type a pickle names, so that a downloaded file cannot
run code. Every fairseq checkpoint pickles a few types besides its weights, and fairseq's own
loaders (``checkpoint_utils.load_checkpoint_to_cpu`` for fairseq-train's ``--restore-file`` and
``--finetune-from-model``, fairseq-generate, fairseq-interactive and the hub;
``distributed.utils.broadcast_object`` for a restore shared between ranks) call ``torch.load``
with that default, so without more every one of them fails.

:func:`register_checkpoint_types`, run when the plugin is imported, adds those types to PyTorch's
own allow-list (``torch.serialization.add_safe_globals``). Nothing of fairseq or torch is
replaced and ``weights_only=True`` stays on: a checkpoint that names any other type is still
refused, and :func:`refuse_unsafe_checkpoint` says so in one line naming the file.

Why each type is there, and why none of them can run code when unpickled:

* ``argparse.Namespace``: fairseq-train's configuration, pickled in ``cfg["model"]`` of every
  checkpoint (``args`` in older ones). An attribute bag, restored by setting its ``__dict__``.
* numpy's ``ndarray``, its ``_reconstruct`` and numeric ``dtype`` classes: the metrics of
  ``extra_state`` after a validation with ``--eval-bleu`` (the BLEU counts are numpy arrays).
  ``_reconstruct`` makes an empty array that is then filled from bytes; only numeric dtypes
  (no object or structured arrays) are allowed.
* omegaconf's ``DictConfig``, ``ListConfig``, their ``Metadata``/``ContainerMetadata``, ``AnyNode``,
  and ``typing.Any``, ``collections.defaultdict``, ``builtins.dict``/``list``/``int`` (the types the
  metadata names): a loaded checkpoint's ``cfg`` is a ``DictConfig``, and fairseq-train restoring
  with several ranks pickles the loaded state to send it from rank 0 to the others. Each is
  restored by updating its ``__dict__``; a container's interpolations are resolved when read,
  with the resolvers of the process that reads them, as for any configuration fairseq loads.
* fairseq's ``distributed.utils._TensorPlaceholder``: that re-pickled state travels with each
  tensor replaced by a placeholder holding its index (a dataclass of one ``int``).

The list is what ``torch.serialization.get_unsafe_globals_in_checkpoint`` finds in the
checkpoints the plugin and stock fairseq 0.12 write (tests/test_safe_loading.py).
"""

import argparse
import collections
import os
import typing
from typing import Iterable, List, Optional

import numpy as np
import torch
from fairseq.distributed.utils import _TensorPlaceholder
from omegaconf import DictConfig, ListConfig
from omegaconf.base import ContainerMetadata, Metadata
from omegaconf.nodes import AnyNode

from fairseq_hrt.checkpoint_files import checkpoint_to_restore
from fairseq_hrt.cli_logging import RefusedOptions

NUMERIC_DTYPES = (
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
)

CHECKPOINT_TYPES = (
    argparse.Namespace,
    np.core.multiarray._reconstruct,
    np.ndarray,
    np.dtype,
    *(type(np.dtype(t)) for t in NUMERIC_DTYPES),
    DictConfig,
    ListConfig,
    ContainerMetadata,
    Metadata,
    AnyNode,
    typing.Any,
    collections.defaultdict,
    dict,
    list,
    int,
    _TensorPlaceholder,
)


def register_checkpoint_types():
    """Add :data:`CHECKPOINT_TYPES` to PyTorch's allow-list of ``weights_only`` loading (once:
    a type already there is not added again)."""
    known = set(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals([t for t in CHECKPOINT_TYPES if t not in known])


class UnsafeCheckpoint(RefusedOptions):
    """A checkpoint whose pickle names a type outside the allow-list; not loaded."""


def unsafe_types(path: str) -> List[str]:
    """The types and functions ``path``'s pickle names that safe loading would refuse, found
    by reading its opcodes, without running any of it (``[]`` for a file PyTorch cannot scan,
    e.g. its pre-1.6 format: ``torch.load`` judges those itself)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, ValueError, OSError):
        return []


def refuse_unsafe_checkpoint(paths: Iterable[str], option: str):
    """Raise :class:`UnsafeCheckpoint` for the first of ``paths`` (given as ``option``) that holds
    a type outside the allow-list: one line naming the file, before anything unpickles it."""
    for path in paths:
        if not path or not os.path.isfile(path):
            continue
        found = unsafe_types(path)
        if found:
            raise UnsafeCheckpoint(
                f"{option} {path} was not loaded: its pickle names {', '.join(found[:5])}, outside the types a "
                "fairseq checkpoint holds (fairseq_hrt/compat.py), and loading it could run code; load it only "
                "if you trust its source, e.g. torch.load(PATH, weights_only=False) in your own code, and "
                "save its weights without that object"
            )


def refuse_unsafe_restore(save_dir: str, restore_file: str, finetune_from_model: Optional[str]):
    """fairseq-train's checkpoint to restore (``--restore-file``, or ``--finetune-from-model`` when
    the save dir has no checkpoint_last.pt), refused as :func:`refuse_unsafe_checkpoint` says."""
    path = checkpoint_to_restore(save_dir, restore_file, finetune_from_model)
    if path is not None:
        option = "--finetune-from-model" if path == finetune_from_model else "--restore-file"
        refuse_unsafe_checkpoint([path], option)


def refuse_unsafe_decoding_paths(path: Optional[str]):
    """fairseq-generate's and fairseq-interactive's ``--path`` (checkpoints separated by ``:``),
    refused as :func:`refuse_unsafe_checkpoint` says before fairseq loads them."""
    if path:
        refuse_unsafe_checkpoint(path.split(os.pathsep), "--path")
