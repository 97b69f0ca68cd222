#!/usr/bin/env python
"""Where decoding time goes: encoder, left-to-right decoder steps, HRT's stage II and the
rest (the search around the steps: argmax, scores, finished sentences leaving the batch; batching),
per sentence, for AT greedy and HRT with the lean engine.

The speed targets of the benchmark are ratios; this says why a ratio is what it is. Each
part is timed by wrapping the function that does it (the encoder's ``forward_torchscript``,
the lean engine's ``DecoderPass.step``, HRT's ``fill_skeletons``), so the parts add up
to the measured total, and "other" is what is left. Decoder steps are also counted: an HRT
k = 2 sentence takes about half of AT's steps, and whatever else it pays is in the table.

Example (after examples/multi30k/recipe.py --profile full)::

    python benchmarks/time_split.py --data R/data/data-bin --src R/data/spm/test.en \\
        --at R/at/checkpoint_last.pt --hrt R/hrt/checkpoint_last.pt --threads 2 --out-dir R/time-split
"""
import argparse
import os
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import measure  # noqa: E402

PARTS = ("encoder", "decoder steps", "stage II", "other")


class Timers:
    """Seconds and calls of the wrapped functions while :meth:`active`."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}

    def wrap(self, name, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def patched(timers: Timers, model):
    """Wrap the parts' functions (restored by the returned function)."""
    from fairseq_hrt.generation import decoder_pass, hrt_generator

    originals = [(model.encoder, "forward_torchscript", model.encoder.forward_torchscript),
                 (decoder_pass.DecoderPass, "step", decoder_pass.DecoderPass.step),
                 (hrt_generator, "fill_skeletons", hrt_generator.fill_skeletons)]
    model.encoder.forward_torchscript = timers.wrap("encoder", model.encoder.forward_torchscript)
    decoder_pass.DecoderPass.step = timers.wrap("decoder steps", decoder_pass.DecoderPass.step)
    hrt_generator.fill_skeletons = timers.wrap("stage II", hrt_generator.fill_skeletons)

    def restore():
        for owner, name, value in originals:
            setattr(owner, name, value)

    return restore


def split(checkpoint: str, data: str, lines: List[str], batch_size: int, chunk_size: int, runs: int) -> dict:
    model, task = measure.load(checkpoint, data)
    options = {"decoder_engine": "lean", "quantize": "none", "decoding": "auto", "jacobi_block_size": None,
               "b_nat": 1, "shortlist": None, "decode_chunk_size": str(chunk_size)}
    generator = measure.build_generator(task, model, {"beam": 1}, options)
    batches = measure.make_batches(task, model, lines, batch_size, False)
    measure.decode(task, model, generator, batches[:1])  # warm-up
    timers = Timers()
    restore = patched(timers, model)
    try:
        total = 0.0
        for _ in range(runs):
            hyps, seconds = measure.decode(task, model, generator, batches)
            total += seconds
    finally:
        restore()
    n = len(lines) * runs
    per_sentence = {part: timers.seconds.get(part, 0.0) / n * 1000 for part in PARTS[:-1]}
    per_sentence["other"] = total / n * 1000 - sum(per_sentence.values())
    steps = timers.calls.get("decoder steps", 0)
    return {
        "ms_per_sentence": total / n * 1000,
        "parts_ms_per_sentence": per_sentence,
        "decoder_steps_per_batch": steps / runs / len(batches),
        "batches": len(batches),
        "ms_per_decoder_step": timers.seconds.get("decoder steps", 0.0) / max(steps, 1) * 1000,
        "output_tokens_per_sentence": sum(h.numel() for h in hyps.values()) / len(lines),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="binarized data dir (the models' dictionaries)")
    p.add_argument("--src", required=True, help="test source as the models read it (SentencePiece pieces)")
    p.add_argument("--at", required=True, help="AT checkpoint (greedy, lean engine)")
    p.add_argument("--hrt", help="HRT checkpoint: AT mode and --chunk-size")
    p.add_argument("--chunk-size", type=int, default=2, help="HRT's k (default 2)")
    p.add_argument("--batch-sizes", default="1,128")
    p.add_argument("--sentences", type=int, default=0, help="first N sentences at batch 1 (0 = all); larger batches take all")
    p.add_argument("--bs1-sentences", type=int, default=100, help="sentences at batch 1 (default 100, as benchmark.py)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    src = measure.read_lines(args.src, args.sentences)
    systems = [("AT greedy", args.at, 1)]
    if args.hrt:
        systems += [("HRT AT-mode b=1", args.hrt, 1), (f"HRT k={args.chunk_size} b_at=1 b_nat=1", args.hrt, args.chunk_size)]
    report = {"threads": args.threads, "torch": torch.__version__, "sentences": len(src), "systems": {}}
    rows = []
    for bs in measure.parse_ints(args.batch_sizes):
        lines = src[: args.bs1_sentences] if bs == 1 else src
        for name, checkpoint, k in systems:
            result = split(checkpoint, args.data, lines, bs, k, args.runs)
            result["sentences"] = len(lines)
            report["systems"].setdefault(name, {})[str(bs)] = result
            parts = result["parts_ms_per_sentence"]
            rows.append(f"| {name} | {bs} | {result['ms_per_sentence']:.3f} | "
                        + " | ".join(f"{parts[part]:.3f} ({parts[part] / result['ms_per_sentence']:.0%})" for part in PARTS)
                        + f" | {result['decoder_steps_per_batch']:.1f} | {result['ms_per_decoder_step']:.3f} |")
    table = ["| system | batch | ms/sentence | " + " | ".join(PARTS) + " | decoder steps/batch | ms/step |",
             "|---|---:|---:|" + "---:|" * len(PARTS) + "---:|---:|"] + rows
    text = (f"## Where the decoding time goes (lean engine, {args.threads} thread(s), torch {torch.__version__})\n\n"
            "ms per sentence (share of the total); decoder steps: left-to-right steps (AT, HRT stage I) "
            "per batch, each over the batch's active rows; ms/step: mean time of one step\n\n" + "\n".join(table) + "\n")
    measure.write_report(args.out_dir, "time_split", report, text)


if __name__ == "__main__":
    main()
