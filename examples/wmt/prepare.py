#!/usr/bin/env python
"""The prepare step of examples/wmt/recipe.py: one joint SentencePiece model (BPE) on the raw
training text of both languages, and every split encoded with it.

    python examples/wmt/prepare.py --raw RAW --out DATA --src en --tgt ro --vocab-size 40000

Reads RAW/{train,valid,test}.{src,tgt} (download.py's raw text, or the slice), writes
DATA/spm/spm.model and DATA/spm/{train,valid,test}.{src,tgt} (pieces, for fairseq-preprocess),
and DATA/raw/{valid,test}.* (the detokenized references the evaluate step scores against).
The papers tokenize with Moses and apply joint BPE (Mask-Predict's data); SentencePiece BPE
stands in because it detokenizes exactly (setups.py says why).
"""

import argparse
import shutil
import sys
from pathlib import Path

import sentencepiece as spm

SPLITS = ("train", "valid", "test")
# SentencePiece reads at most this many training sentences (sampled): the 4.5M pairs of WMT'14
# fit in memory, but a sample of 10M lines trains the same vocabulary in a fraction of the time
INPUT_SENTENCE_SIZE = 10_000_000


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--raw", required=True, help="folder of the raw text: {train,valid,test}.{src,tgt}")
    p.add_argument("--out", required=True, help="output folder (spm/ and raw/ go here)")
    p.add_argument("--src", required=True)
    p.add_argument("--tgt", required=True)
    p.add_argument("--vocab-size", type=int, required=True, help="joint SentencePiece pieces")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    raw, out = Path(args.raw), Path(args.out)
    missing = [f"{s}.{lang}" for s in SPLITS for lang in (args.src, args.tgt) if not (raw / f"{s}.{lang}").is_file()]
    if missing:
        sys.exit(f"[prepare] {raw} lacks {', '.join(missing)}: run the download step first")
    (out / "spm").mkdir(parents=True, exist_ok=True)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    model_prefix = out / "spm" / "spm"
    if not Path(f"{model_prefix}.model").is_file():
        spm.SentencePieceTrainer.train(
            input=[str(raw / f"train.{args.src}"), str(raw / f"train.{args.tgt}")],
            model_prefix=str(model_prefix),
            vocab_size=args.vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            input_sentence_size=INPUT_SENTENCE_SIZE,
            shuffle_input_sentence=True,
            num_threads=args.threads,
            # fairseq-preprocess builds its own dictionary; SentencePiece's specials stay out of the text
            bos_id=-1,
            eos_id=-1,
            unk_surface="<unk>",
            minloglevel=2,
        )
    sp = spm.SentencePieceProcessor(model_file=f"{model_prefix}.model")
    for split in SPLITS:
        for lang in (args.src, args.tgt):
            source, encoded = raw / f"{split}.{lang}", out / "spm" / f"{split}.{lang}"
            if split != "train":
                shutil.copyfile(source, out / "raw" / f"{split}.{lang}")
            if encoded.is_file():
                continue
            partial = encoded.with_suffix(encoded.suffix + ".partial")
            with open(source, encoding="utf-8", errors="replace") as fin, open(partial, "w", encoding="utf-8") as fout:
                for line in fin:
                    fout.write(" ".join(sp.encode(line.strip(), out_type=str)) + "\n")
            partial.rename(encoded)  # a killed run leaves no half-encoded split behind
    print(f"[prepare] {out / 'spm'}: spm.model ({args.vocab_size} pieces) and {len(SPLITS) * 2} encoded files")


if __name__ == "__main__":
    main()
