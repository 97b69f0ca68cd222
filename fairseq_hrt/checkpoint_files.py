"""A truncated checkpoint found before fairseq-train resumes from it (``--task hrt_translation``).

fairseq 0.12 writes a checkpoint to ``<name>.tmp`` and renames it, but *copies* it to the other
names it saves under (``checkpoint_last.pt`` after ``checkpoint_3_10.pt`` or
``checkpoint_best.pt``) straight onto the destination, so a run killed during that copy leaves a
truncated ``checkpoint_last.pt``. Running the same command again then stops with a traceback
ending in PyTorch's "failed finding central directory", which says neither why nor what to do.

The task checks the checkpoint fairseq-train is about to restore when it builds the criterion
(fairseq-train builds it just before it loads the checkpoint; decoding builds none), and refuses
a truncated one with a message that lists the complete checkpoints next to it and the
``--restore-file`` to use. fairseq itself, and every other task, are unchanged.
"""

import glob
import os
import zipfile
from typing import List, Optional

from fairseq_hrt.cli_logging import RefusedOptions

# PyTorch's checkpoint format since 1.6 is a zip archive; its first bytes are a zip entry's
ZIP_ENTRY_MAGIC = b"PK\x03\x04"


class CheckpointReadError(RefusedOptions):
    """A checkpoint file that cannot be read; the message says what to do."""


def is_truncated_archive(path: str) -> bool:
    """A file that starts as PyTorch's zip archive but lacks the archive's central directory
    (what a write that did not finish leaves), or an empty one; checked without loading it. A
    checkpoint in PyTorch's legacy (pre-1.6, not zip) format is not judged."""
    if os.path.getsize(path) == 0:
        return True
    with open(path, "rb") as f:
        starts_as_zip = f.read(len(ZIP_ENTRY_MAGIC)) == ZIP_ENTRY_MAGIC
    return starts_as_zip and not zipfile.is_zipfile(path)


def readable_checkpoints(directory: str, exclude: str = "") -> List[str]:
    """The ``*.pt`` files of ``directory`` that are complete checkpoint archives, newest first."""
    found = []
    for path in glob.glob(os.path.join(directory, "*.pt")):
        if os.path.abspath(path) == os.path.abspath(exclude) or not os.path.isfile(path):
            continue
        if zipfile.is_zipfile(path):
            found.append(path)
    return sorted(found, key=os.path.getmtime, reverse=True)


def truncated_checkpoint_message(path: str) -> str:
    """What to tell the user about a truncated checkpoint (pure but for listing its folder)."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    others = readable_checkpoints(directory, exclude=path)
    lines = [
        f"cannot read the checkpoint {path}: it is truncated (a zip archive without its central directory).",
        "This happens when a run is killed or the disk fills up while the file is being written: fairseq "
        "copies a checkpoint it saved to checkpoint_last.pt and checkpoint_best.pt in place.",
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
            f"What to do: resume training from one of them with --restore-file {others[0]}; or move "
            f"{os.path.basename(path)} away and run the same command to start training over."
        )
    else:
        lines.append(
            f"No other complete checkpoint is in {directory}. What to do: move {os.path.basename(path)} away and run "
            "the same command to start training over (or --restore-file a checkpoint from elsewhere)."
        )
    return "\n".join(lines)


def checkpoint_to_restore(save_dir: str, restore_file: str, finetune_from_model: Optional[str]) -> Optional[str]:
    """The file fairseq-train's ``checkpoint_utils.load_checkpoint`` will load (its rules, for a
    run without model-parallel suffixes), or None when it will start from scratch."""
    if restore_file == "checkpoint_last.pt":
        last = os.path.join(save_dir, "checkpoint_last.pt")
        if os.path.exists(last):
            return last
        return finetune_from_model if finetune_from_model and os.path.exists(finetune_from_model) else None
    return restore_file if os.path.exists(restore_file) else None


def check_checkpoint_to_restore(save_dir: str, restore_file: str, finetune_from_model: Optional[str]) -> None:
    """Refuse (:class:`CheckpointReadError`) a truncated checkpoint that fairseq-train would restore."""
    path = checkpoint_to_restore(save_dir, restore_file, finetune_from_model)
    if path is not None and os.path.isfile(path) and is_truncated_archive(path):
        raise CheckpointReadError(truncated_checkpoint_message(path))
