"""Checks the recipe makes of the files a step will read, before any job starts, so that a bad
input ends in one line naming the file and what to do instead of a traceback hours later.

- a parallel text folder (a user's ``--corpus``, or what download/slice wrote): every split's
  two sides exist and have as many lines; the held-out splits have no empty line and no line
  longer than the decoders take (training lines of either kind are dropped by prepare's
  cleaning, which says how many);
- a checkpoint a step reads: a whole file (PyTorch's zip archive ends with its directory, so a
  truncated copy is seen without loading it).
"""

import zipfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

SPLITS = ("train", "valid", "test")
HELD_OUT = ("valid", "test")
# the longest held-out line, in words: the decoders' positions (1024 pieces) hold about 250
# words of subword text, the length limit of the papers' cleaning (Moses clean-corpus-n)
MAX_HELD_OUT_WORDS = 250


def count_lines(path: Path) -> int:
    """Lines as every later step reads them: split at "\\n" only."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def side_counts(folder: Path, split: str, src: str, tgt: str) -> Tuple[Path, int, Path, int]:
    """``(source side, its lines, target side, its lines)`` of one split."""
    a, b = Path(folder) / f"{split}.{src}", Path(folder) / f"{split}.{tgt}"
    return a, count_lines(a), b, count_lines(b)


def misaligned_split(folder: Path, src: str, tgt: str, splits: Sequence[str] = SPLITS) -> Optional[tuple]:
    """:func:`side_counts` of the first split whose two sides differ in line count, or None."""
    for split in splits:
        counts = side_counts(folder, split, src, tgt)
        if counts[1] != counts[3]:
            return counts
    return None


def parallel_text_problem(folder: Path, src: str, tgt: str, splits: Sequence[str] = SPLITS) -> Optional[str]:
    """One line saying what is wrong with the parallel text in ``folder``, or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} is not a folder"
    missing = [f"{s}.{lang}" for s in splits for lang in (src, tgt) if not (folder / f"{s}.{lang}").is_file()]
    if missing:
        layout = f"{{{','.join(splits)}}}.{{{src},{tgt}}}"
        return f"{folder} lacks {', '.join(missing)} (it needs {layout}, one sentence a line)"
    for split in splits:
        a, na, b, nb = side_counts(folder, split, src, tgt)
        if na != nb:
            return f"{a} has {na} lines and {b} has {nb}: the two sides of a split must be line-aligned"
        if na == 0:
            return f"{a} and {b} are empty"
    for split in (s for s in splits if s in HELD_OUT):
        for lang in (src, tgt):
            problem = held_out_line_problem(folder / f"{split}.{lang}")
            if problem:
                return problem
    return None


def held_out_line_problem(path: Path) -> Optional[str]:
    """An empty or over-long line of a held-out file (those are scored line by line, so the
    recipe may not drop them as it drops training lines)."""
    empty: List[int] = []
    long: List[int] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            words = len(line.split())
            if words == 0:
                empty.append(number)
            elif words > MAX_HELD_OUT_WORDS:
                long.append(number)
    if empty:
        return f"{path}: line(s) {_numbers(empty)} empty: a held-out pair needs text on both sides; remove the pair"
    if long:
        return (
            f"{path}: line(s) {_numbers(long)} longer than {MAX_HELD_OUT_WORDS} words: split them into "
            "sentences (both sides) or remove the pair"
        )
    return None


def _numbers(numbers: List[int]) -> str:
    shown = ", ".join(map(str, numbers[:5]))
    return shown + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why a checkpoint cannot be read (cut short, not a checkpoint), or None."""
    if not zipfile.is_zipfile(path):
        size = Path(path).stat().st_size
        return f"{path} ({size} bytes) is not a whole checkpoint (cut short by a full disk or a killed copy?)"
    return None
