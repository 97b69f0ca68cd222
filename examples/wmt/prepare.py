#!/usr/bin/env python
"""The prepare step of examples/wmt/recipe.py: the training pairs cleaned, one joint
SentencePiece model (BPE) on the cleaned training text of both languages, and every split
encoded with it.

    python examples/wmt/prepare.py --raw RAW --out DATA --src en --tgt ro --vocab-size 40000 \\
        --clean-max-len 80 --clean-ratio 9

Reads RAW/{train,valid,test}.{src,tgt} (download.py's raw text, or the slice), writes
DATA/raw/train.* (the training pairs the cleaning kept), DATA/raw/{valid,test}.* (whole: the
detokenized references the evaluate step scores against), DATA/spm/spm.model and
DATA/spm/{train,valid,test}.{src,tgt} (pieces, for fairseq-preprocess).

Cleaning, of the training split only, as Moses' clean-corpus-n.perl cleaned the data the HRT
paper reused (Mask-Predict's; setups.py cites the scripts): a pair goes when a side is empty or
has more than --clean-max-len words, or when one side has more than --clean-ratio times the
other's words. Words are whitespace-separated words of the raw text (the scripts counted Moses
tokens). 0 turns a rule off. The papers tokenize with Moses and apply joint BPE; SentencePiece
BPE stands in because it detokenizes exactly (setups.py says why).
"""

import argparse
import shutil
import sys
from pathlib import Path
from typing import Iterable, Iterator, Tuple

import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import SPLITS, misaligned_split  # noqa: E402

# SentencePiece reads at most this many training sentences (sampled): the 4.5M pairs of WMT'14
# fit in memory, but a sample of 10M lines trains the same vocabulary in a fraction of the time
INPUT_SENTENCE_SIZE = 10_000_000


def read_lines(path: Path) -> Iterator[str]:
    """A file's lines without their end; "\\n" alone ends a line. A stray "\\r" inside a
    sentence becomes a space: fairseq-preprocess reads "\\r" as a line end, and a pair split in
    two would shift every later line of that side."""
    with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
        for line in f:
            yield line.rstrip("\n").rstrip("\r").replace("\r", " ")


def clean_pairs(pairs: Iterable[Tuple[str, str]], max_len: int, ratio: float) -> Iterator[Tuple[str, str, str]]:
    """(source, target, verdict) of each pair: verdict "" keeps it, "length" or "ratio" names the
    rule that drops it (clean-corpus-n.perl's order: length first)."""
    for src, tgt in pairs:
        n_src, n_tgt = len(src.split()), len(tgt.split())
        if max_len and (min(n_src, n_tgt) == 0 or max(n_src, n_tgt) > max_len):
            yield src, tgt, "length"
        elif ratio and min(n_src, n_tgt) > 0 and max(n_src, n_tgt) > ratio * min(n_src, n_tgt):
            yield src, tgt, "ratio"
        else:
            yield src, tgt, ""


def check_aligned(raw: Path, src: str, tgt: str):
    """Stops in one line when a split's two sides have different line counts."""
    misaligned = misaligned_split(raw, src, tgt)
    if misaligned:
        a, na, b, nb = misaligned
        sys.exit(
            f"[prepare] {a} has {na} lines and {b} has {nb}: the two sides must align line by line; "
            f"fetch the corpus again (recipe.py --steps download --redo download)"
        )


def clean_training_split(raw: Path, out: Path, src: str, tgt: str, max_len: int, ratio: float):
    """OUT/raw/train.{src,tgt}: the training pairs ``clean_pairs`` keeps; one line of counts."""
    kept_src, kept_tgt = out / "raw" / f"train.{src}", out / "raw" / f"train.{tgt}"
    if kept_src.is_file() and kept_tgt.is_file():
        print(f"[prepare] {kept_src.parent}: cleaned training pairs from an earlier run")
        return
    partial = [p.with_suffix(p.suffix + ".partial") for p in (kept_src, kept_tgt)]
    counts = {"": 0, "length": 0, "ratio": 0}
    pairs = zip(read_lines(raw / f"train.{src}"), read_lines(raw / f"train.{tgt}"))
    with open(partial[0], "w", encoding="utf-8") as fs, open(partial[1], "w", encoding="utf-8") as ft:
        for s, t, verdict in clean_pairs(pairs, max_len, ratio):
            counts[verdict] += 1
            if not verdict:
                fs.write(s + "\n")
                ft.write(t + "\n")
    for p, final in zip(partial, (kept_src, kept_tgt)):
        p.rename(final)  # a killed run leaves no half-cleaned split behind
    total = sum(counts.values())
    length = f"an empty side or over {max_len} words" if max_len else "off"
    ratio_rule = f"a length ratio over {ratio:g}" if ratio else "off"
    print(
        f"[prepare] cleaned {raw}/train.{{{src},{tgt}}}: {total} pairs, {counts['']} kept; removed "
        f"{counts['length']} by length ({length}), {counts['ratio']} by ratio ({ratio_rule})"
    )


def train_sentencepiece(model_prefix: Path, inputs, vocab_size: int, threads: int):
    spm.SentencePieceTrainer.train(
        input=[str(p) for p in inputs],
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        input_sentence_size=INPUT_SENTENCE_SIZE,
        shuffle_input_sentence=True,
        num_threads=threads,
        # fairseq-preprocess builds its own dictionary; SentencePiece's specials stay out of the text
        bos_id=-1,
        eos_id=-1,
        unk_surface="<unk>",
        minloglevel=2,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--raw", required=True, help="folder of the raw text: {train,valid,test}.{src,tgt}")
    p.add_argument("--out", required=True, help="output folder (spm/ and raw/ go here)")
    p.add_argument("--src", required=True)
    p.add_argument("--tgt", required=True)
    p.add_argument("--vocab-size", type=int, required=True, help="joint SentencePiece pieces")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--clean-max-len",
        type=int,
        default=80,
        help="drop training pairs with an empty side or more than N words on a side (0: keep all)",
    )
    p.add_argument(
        "--clean-ratio",
        type=float,
        default=9.0,
        help="drop training pairs whose longer side has more than R times the words of the other (0: keep all)",
    )
    args = p.parse_args(argv)

    raw, out = Path(args.raw), Path(args.out)
    missing = [f"{s}.{lang}" for s in SPLITS for lang in (args.src, args.tgt) if not (raw / f"{s}.{lang}").is_file()]
    if missing:
        sys.exit(f"[prepare] {raw} lacks {', '.join(missing)}: run the download step first")
    check_aligned(raw, args.src, args.tgt)
    (out / "spm").mkdir(parents=True, exist_ok=True)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    clean_training_split(raw, out, args.src, args.tgt, args.clean_max_len, args.clean_ratio)
    model_prefix = out / "spm" / "spm"
    if not Path(f"{model_prefix}.model").is_file():
        train_files = [out / "raw" / f"train.{lang}" for lang in (args.src, args.tgt)]
        train_sentencepiece(model_prefix, train_files, args.vocab_size, args.threads)
    sp = spm.SentencePieceProcessor(model_file=f"{model_prefix}.model")
    for split in SPLITS:
        for lang in (args.src, args.tgt):
            source, encoded = out / "raw" / f"{split}.{lang}", out / "spm" / f"{split}.{lang}"
            if split != "train":  # held out: whole, never cleaned
                shutil.copyfile(raw / f"{split}.{lang}", source)
            if encoded.is_file():
                continue
            partial = encoded.with_suffix(encoded.suffix + ".partial")
            with open(partial, "w", encoding="utf-8") as fout:
                for line in read_lines(source):
                    fout.write(" ".join(sp.encode(line.strip(), out_type=str)) + "\n")
            partial.rename(encoded)  # a killed run leaves no half-encoded split behind
    print(f"[prepare] {out / 'spm'}: spm.model ({args.vocab_size} pieces) and {len(SPLITS) * 2} encoded files")


if __name__ == "__main__":
    main()
