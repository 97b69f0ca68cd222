#!/usr/bin/env python
"""The download step of ``recipe.py --slice``: cut a set-up's slice out of shared/data into the
layout download.py writes (DEST/<setup>/raw/{train,valid,test}.*).

    python examples/wmt/make_slice.py --setup wmt16_en_ro --data ../shared/data --dest WORK/download

The cut of each set-up and size is its ``slice_of(setup, size).slice_data`` / ``.slice_splits``
(setups.py): ``--size smoke`` cuts newstest files, ``--size learn`` Multi30k for En-De (newstest
for En-Ro). ``--train-lines N`` and ``--test-lines N`` keep the first N training and test pairs of
it (the tests' shorter slice).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from setups import SETUPS, SLICE_SIZES, slice_of  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=sorted(SETUPS), required=True)
    p.add_argument("--data", required=True, help="the shared data folder (holding wmt16-en-ro-newstest/ ...)")
    p.add_argument("--dest", required=True)
    p.add_argument("--size", choices=SLICE_SIZES, default="learn", help="the slice's size (setups.py slice_of)")
    p.add_argument("--train-lines", type=int, default=0, help="keep only the first N training pairs (0: all)")
    p.add_argument("--test-lines", type=int, default=0, help="keep only the first N test pairs (0: all)")
    args = p.parse_args(argv)
    setup = slice_of(SETUPS[args.setup], args.size)
    folder = Path(args.data) / setup.slice_data
    out = Path(args.dest) / setup.download_setup / "raw"
    out.mkdir(parents=True, exist_ok=True)
    for split, (source_split, start, stop) in setup.slice_splits.items():
        keep = {"train": args.train_lines, "test": args.test_lines}.get(split)
        if keep:
            stop = min(stop, start + keep)
        for lang in (setup.src, setup.tgt):
            source = folder / f"{source_split}.{lang}"
            if not source.is_file():
                sys.exit(f"[slice] {source} not found: pass the shared data folder with --data")
            lines = source.read_text(encoding="utf-8").splitlines(keepends=True)[start:stop]
            (out / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
        print(f"[slice] {split}: lines {start + 1}-{stop} of {folder.name}/{source_split}.* ({stop - start} pairs)")


if __name__ == "__main__":
    main()
