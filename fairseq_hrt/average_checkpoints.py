"""Average the weights of the last checkpoints of one training run (fairseq's scripts/average_checkpoints.py).

    python -m fairseq_hrt.average_checkpoints --inputs DIR --num-epoch-checkpoints N --output OUT.pt
    python -m fairseq_hrt.average_checkpoints --inputs DIR --num-update-checkpoints N \\
        [--checkpoint-upper-bound U] --output OUT.pt
    python -m fairseq_hrt.average_checkpoints --inputs A.pt B.pt ... --output OUT.pt

fairseq's script is not in the fairseq wheel; this is its behaviour and options:

* ``--num-epoch-checkpoints N`` averages the N ``checkpoint{E}.pt`` of DIR with the highest
  epochs E, ``--num-update-checkpoints N`` the N ``checkpoint_{E}_{U}.pt`` with the highest
  updates U (``--save-interval-updates``); ``--checkpoint-upper-bound`` leaves out those above
  that epoch / update. ``checkpoint_last.pt`` and ``checkpoint_best.pt`` are never picked.
* Floating-point tensors are averaged (fp16 ones summed in float32 and written as float32, as
  fairseq does); other tensors get the floor of their mean (fairseq's ``//``).
* Everything else (``cfg`` or ``args``, the optimizer history, the task state) is the first
  input's: with ``--num-*-checkpoints`` the newest, so fairseq-generate loads the result as it
  loads that checkpoint.

Unlike fairseq's script, checkpoints of different models (other parameter names or shapes, or
data binarized with another dictionary), a truncated file or too few checkpoints stop it with one
line saying what to do, and the output is written whole or not at all (a temporary file renamed).
"""

import argparse
import os
import re
import sys
import tempfile
from collections import OrderedDict
from typing import List, Optional

import torch

from fairseq_hrt import compat
from fairseq_hrt.checkpoint_files import is_truncated_archive
from fairseq_hrt.tasks.hrt_translation import HRTTranslationTask

PROG = "python -m fairseq_hrt.average_checkpoints"
EPOCH_CHECKPOINT = re.compile(r"checkpoint(\d+)\.pt")
UPDATE_CHECKPOINT = re.compile(r"checkpoint_\d+_(\d+)\.pt")


class AveragingError(ValueError):
    """Checkpoints that cannot be averaged; the message is one line saying what to do."""


def _numbered(directory: str, pattern: re.Pattern, upper_bound: Optional[int]) -> List[tuple]:
    found = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match and (upper_bound is None or int(match.group(1)) <= upper_bound):
            found.append((int(match.group(1)), name))
    return sorted(found, reverse=True)


def last_n_checkpoints(directory: str, n: int, update_based: bool, upper_bound: Optional[int] = None) -> List[str]:
    """The paths of the ``n`` checkpoints of ``directory`` with the highest epochs (or updates),
    newest first."""
    if n < 1:
        raise AveragingError(f"the number of checkpoints to average must be at least 1, got {n}")
    pattern, kind = (UPDATE_CHECKPOINT, "update") if update_based else (EPOCH_CHECKPOINT, "epoch")
    entries = _numbered(directory, pattern, upper_bound)
    if len(entries) < n:
        bound = f" up to {kind} {upper_bound} (--checkpoint-upper-bound)" if upper_bound is not None else ""
        names = ", ".join(name for _, name in entries[:5]) or "none"
        other, other_option = (EPOCH_CHECKPOINT, "epoch") if update_based else (UPDATE_CHECKPOINT, "update")
        if len(_numbered(directory, other, None)) >= n:
            hint = f"it has {other_option} checkpoints: use --num-{other_option}-checkpoints {n}"
        elif entries:
            hint = "train longer for more checkpoints, or average fewer"
        elif update_based:
            hint = "train with --save-interval-updates N for update checkpoints"
        else:
            hint = "train without --no-epoch-checkpoints for epoch checkpoints"
        raise AveragingError(
            f"{directory} has {len(entries)} {kind} checkpoint(s){bound} ({names}), fewer than "
            f"--num-{kind}-checkpoints {n}: {hint}"
        )
    return [os.path.join(directory, name) for _, name in entries[:n]]


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise AveragingError(f"{path} does not exist")
    if is_truncated_archive(path):
        raise AveragingError(
            f"{path} is truncated (its write did not finish): leave it out of --inputs, or set "
            "--checkpoint-upper-bound below it"
        )
    # safe loading: the types a fairseq checkpoint pickles besides its weights are allowed
    # (fairseq_hrt.compat), a checkpoint with any other is refused in one line
    try:
        compat.refuse_unsafe_checkpoint([path], "--inputs")
    except compat.UnsafeCheckpoint as e:
        raise AveragingError(str(e)) from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise AveragingError(f"{path} is not a fairseq checkpoint (it has no 'model' weights)")
    return state


def _check_same_model(first_path: str, first: dict, path: str, state: dict):
    expected, found = first["model"], state["model"]
    if expected.keys() != found.keys():
        missing = sorted(expected.keys() - found.keys())
        extra = sorted(found.keys() - expected.keys())
        detail = "; ".join(
            part
            for part in (
                f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else "",
                f"has {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''} in addition" if extra else "",
            )
            if part
        )
        raise AveragingError(
            f"{path} is a checkpoint of another model than {first_path} (it {detail}): average checkpoints of one "
            "training run"
        )
    for key, tensor in expected.items():
        other = found[key]
        if torch.is_tensor(tensor) and torch.is_tensor(other) and tensor.shape != other.shape:
            raise AveragingError(
                f"{path} is a checkpoint of another model than {first_path} ({key} is {list(other.shape)} there, "
                f"{list(tensor.shape)} here): average checkpoints of one training run"
            )
    # the task's saved fingerprint tells checkpoints of data binarized with another dictionary apart
    first_dictionary = HRTTranslationTask.saved_dictionary_fingerprint(first)
    dictionary = HRTTranslationTask.saved_dictionary_fingerprint(state)
    if first_dictionary and dictionary and first_dictionary != dictionary:
        raise AveragingError(
            f"{path} was trained on data binarized with another dictionary than {first_path}: average checkpoints "
            "of one training run"
        )


def average_checkpoints(paths: List[str]) -> dict:
    """The state of ``paths[0]`` with its ``model`` weights replaced by the mean over ``paths``.

    Loads one checkpoint at a time (memory: two models). Raises :class:`AveragingError` for
    checkpoints of different models, a missing or truncated file.
    """
    if not paths:
        raise AveragingError("no checkpoint to average")
    first, sums = None, OrderedDict()
    for path in paths:
        state = _load(path)
        if first is None:
            first = state
        else:
            _check_same_model(paths[0], first, path, state)
        for key, tensor in state["model"].items():
            if torch.is_tensor(tensor) and tensor.dtype in (torch.float16, torch.bfloat16):
                tensor = tensor.float()  # summing fp16 in fp16 overflows and rounds
            if key not in sums:
                sums[key] = tensor.clone() if torch.is_tensor(tensor) else tensor
            elif torch.is_tensor(tensor):
                sums[key] += tensor
    averaged = OrderedDict()
    for key, total in sums.items():
        if not torch.is_tensor(total):
            averaged[key] = total  # not a weight: the first checkpoint's
        elif total.is_floating_point():
            averaged[key] = total.div_(len(paths))
        else:
            averaged[key] = total // len(paths)
    first["model"] = averaged
    return first


def save_atomic(state: dict, output: str):
    """``torch.save`` to a temporary file beside ``output``, renamed onto it when complete."""
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".average-", suffix=".pt.tmp", dir=directory)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Average the weights of checkpoints of one training run (fairseq's "
        "scripts/average_checkpoints.py); the rest of the state is the first input's (the newest with "
        "--num-*-checkpoints).",
    )
    parser.add_argument(
        "--inputs",
        required=True,
        nargs="+",
        metavar="PATH",
        help="checkpoint files, or one directory with --num-epoch-checkpoints / --num-update-checkpoints",
    )
    parser.add_argument("--output", required=True, metavar="FILE", help="the averaged checkpoint to write")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--num-epoch-checkpoints",
        type=int,
        metavar="N",
        help="average the last N checkpoint{EPOCH}.pt of the --inputs directory",
    )
    which.add_argument(
        "--num-update-checkpoints",
        type=int,
        metavar="N",
        help="average the last N checkpoint_{EPOCH}_{UPDATE}.pt of the --inputs directory",
    )
    parser.add_argument(
        "--checkpoint-upper-bound",
        type=int,
        metavar="N",
        help="with --num-epoch-checkpoints / --num-update-checkpoints: the highest epoch / update to use",
    )
    return parser.parse_args(argv)


def select_inputs(args) -> List[str]:
    """The checkpoint files the options name."""
    count = args.num_update_checkpoints if args.num_update_checkpoints is not None else args.num_epoch_checkpoints
    if count is None:
        if args.checkpoint_upper_bound is not None:
            raise AveragingError("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
        directories = [p for p in args.inputs if os.path.isdir(p)]
        if directories:
            raise AveragingError(
                f"--inputs {directories[0]} is a directory: add --num-epoch-checkpoints N or "
                "--num-update-checkpoints N to pick its last N checkpoints, or name the checkpoint files"
            )
        return list(args.inputs)
    if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
        raise AveragingError(
            "--num-epoch-checkpoints / --num-update-checkpoints pick checkpoints from one directory: give it as "
            f"--inputs DIR (got {' '.join(args.inputs)})"
        )
    return last_n_checkpoints(
        args.inputs[0], count, args.num_update_checkpoints is not None, upper_bound=args.checkpoint_upper_bound
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        inputs = select_inputs(args)
        print(f"averaging {len(inputs)} checkpoint(s): {', '.join(inputs)}", flush=True)
        state = average_checkpoints(inputs)
    except AveragingError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    save_atomic(state, args.output)
    print(f"wrote the averaged checkpoint {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
