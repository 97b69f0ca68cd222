#!/usr/bin/env python
"""The quickstart's HRT model read for what it is: HRT decoding (k) beside the same model in
AT mode (k = 1), same beam, on the test set (sacreBLEU, chrF) and at batch 1 (source words/s).

A model trained for a few minutes loses more to HRT decoding than a converged one: this puts
the quickstart's k = 2 number next to its own AT mode, and next to what the converged study
reached (the report :data:`REFERENCE`), so that a first number is not taken for HRT's quality.

    python examples/multi30k/compare_modes.py --checkpoint-dir RUN/checkpoints --data DATA/data-bin \
        --raw-src DATA/raw/test.en --raw-ref DATA/raw/test.de --chunk-size 2 --beam 5 --json RUN/modes.json
"""

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import fairseq_hrt  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt.scoring.metrics import chrf_score, sacrebleu_score  # noqa: E402

# where a trained model's k = 2 and AT mode stand, printed beside the quickstart's numbers
REFERENCE = "benchmarks/results/small-converged-cpu/README.md"


def words(lines):
    return sum(len(line.split()) for line in lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-file", default="checkpoint_best.pt")
    p.add_argument("--data", required=True, help="binarized data folder (dictionaries; spm/ beside it)")
    p.add_argument("--raw-src", required=True)
    p.add_argument("--raw-ref", required=True)
    p.add_argument("--chunk-size", type=int, default=2, help="k of HRT decoding")
    p.add_argument("--beam", type=int, default=5, help="b_at of both modes (b_nat = 1)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size of the BLEU pass")
    p.add_argument("--speed-sentences", type=int, default=100, help="test sentences timed at batch 1")
    p.add_argument("--json", help="write the numbers here")
    a = p.parse_args(argv)
    # the numbers are the output: fairseq's loading and batching INFO lines would bury them
    for name in ("fairseq", "fairseq_hrt"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # PyTorch's data loader on a machine without GPU

    model = fairseq_hrt.from_pretrained(a.checkpoint_dir, checkpoint_file=a.checkpoint_file, data_name_or_path=a.data)
    sources = Path(a.raw_src).read_text(encoding="utf-8").splitlines()
    references = Path(a.raw_ref).read_text(encoding="utf-8").splitlines()
    modes = {f"k={a.chunk_size}": a.chunk_size, "AT mode (k=1)": 1}
    result = {"beam": a.beam, "b_nat": 1, "modes": {}}
    for name, k in modes.items():
        hyps = model.translate(sources, chunk_size=k, beam=a.beam, b_nat=1, batch_size=a.batch_size)
        bleu, chrf = sacrebleu_score(hyps, references), chrf_score(hyps, references)
        result["modes"][name] = {"bleu": round(bleu["score"], 2), "chrf": round(chrf["score"], 2)}
        result["bleu_signature"], result["chrf_signature"] = bleu["signature"], chrf["signature"]

    timed = sources[: a.speed_sentences]

    def decode(k):
        return lambda: [model.translate(s, chunk_size=k, beam=a.beam, b_nat=1) for s in timed]

    # round-robin over the modes (a slow patch of a shared machine hits both), one warm-up pass
    times = time_runs({name: decode(k) for name, k in modes.items()}, warmup=1, runs=2)
    for name in modes:
        result["modes"][name]["words_per_second_bs1"] = round(words(timed) / times[name].mean, 1)
    result["speed_sentences"] = len(timed)
    result["reference"] = REFERENCE

    hrt, at = (result["modes"][name] for name in modes)
    print(
        f"   HRT k={a.chunk_size}:      BLEU {hrt['bleu']:.2f}  chrF {hrt['chrf']:.2f}  "
        f"{hrt['words_per_second_bs1']:.0f} words/s at batch 1"
    )
    print(
        f"   same model, AT mode: BLEU {at['bleu']:.2f}  chrF {at['chrf']:.2f}  "
        f"{at['words_per_second_bs1']:.0f} words/s at batch 1  (beam {a.beam}, first {len(timed)} sentences timed)"
    )
    print(f"   a model trained for minutes: read k={a.chunk_size} against its AT mode; trained for days: {REFERENCE}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
