#!/usr/bin/env python
"""Decoding speed (source words/second) and quality of HRT vs AT on one checkpoint.

Every configuration decodes the same sentences in the same process, so the ratios compare
like with like. The AT baseline is the HRT model's AT mode: left-to-right search from ``</s>``
with the engine of ``--engine`` (stage I of HRT uses the same engine). ``--at-path`` adds a separately trained AT checkpoint decoded by fairseq's
left-to-right search (e.g. an ``at_e6d1`` baseline); ``--mp-path`` adds a Mask-Predict
(``cmlm_*``) checkpoint, one row MP(I) per ``--mp-iterations`` value, with length beam
``--length-beam``.

Speed: batch 1 is the mean of ``--runs`` (default 5) passes over the first ``--bs1-sentences``
sentences (the WMT efficiency task's metric); larger batches decode the whole set once after
a warm-up, with fairseq's length-sorted batching. Time covers the model (encoder, both
stages, beam search), not reading or detokenising text. Words are whitespace words of the
*raw* source.

Example:
  python benchmarks/decode_speed.py --data work/multi30k/data-bin --path CKPT \
      --src work/multi30k/spm/test.en --raw-src work/multi30k/raw/test.en \
      --raw-ref work/multi30k/raw/test.de --spm work/multi30k/spm/spm.model \
      --json out/speed.json
"""
import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fairseq_hrt  # noqa: E402,F401  (registers the plugin, applies compat)
from fairseq import checkpoint_utils, utils  # noqa: E402
from fairseq.dataclass.configs import GenerationConfig  # noqa: E402

from fairseq_hrt.scoring.metrics import sacrebleu_score, source_words  # noqa: E402

logger = logging.getLogger("decode_speed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="binarized data dir (dictionaries)")
    p.add_argument("--path", required=True, help="HRT checkpoint")
    p.add_argument("--at-path", help="optional AT checkpoint (fairseq transformer / at_* arch)")
    p.add_argument("--mp-path", help="optional Mask-Predict checkpoint (cmlm_* arch)")
    p.add_argument("--mp-iterations", default="1,4,10", help="Mask-Predict iteration counts I to measure")
    p.add_argument("--length-beam", type=int, default=1, help="Mask-Predict length beam l")
    p.add_argument("--src", required=True, help="source file as the model reads it (SentencePiece pieces)")
    p.add_argument("--raw-src", required=True, help="raw source (for counting words)")
    p.add_argument("--raw-ref", help="raw reference: adds detokenised sacreBLEU per configuration")
    p.add_argument("--spm", help="SentencePiece model to detokenise hypotheses (needed with --raw-ref)")
    p.add_argument("--chunk-sizes", default="2,3,4", help="HRT chunk sizes to measure")
    p.add_argument("--beam", type=int, default=1, help="b_at (and the AT beam)")
    p.add_argument("--b-nat", type=int, default=1)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--runs", type=int, default=5, help="batch-1 runs to average")
    p.add_argument("--bs1-sentences", type=int, default=200, help="sentences decoded at batch 1")
    p.add_argument("--max-sentences", type=int, default=0, help="use only the first N sentences (0 = all)")
    p.add_argument("--max-len-b", type=int, default=200, help="L, the max target length")
    p.add_argument("--lenpen", type=float, default=1.0)
    p.add_argument("--engine", choices=("lean", "fairseq"), default="lean", help="--decoder-engine of every row")
    p.add_argument("--quantize", choices=("none", "int8"), default="none", help="--quantize of every model (CPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--cpu", action="store_true", help="decode on CPU even if a GPU is present")
    p.add_argument("--fp16", action="store_true", help="half precision (GPU)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def read_lines(path, limit=0) -> List[str]:
    """Input text as every entry point reads it (fairseq_hrt.text_input: bad bytes replaced
    with a warning naming file and line, lines split at \\n only)."""
    from fairseq_hrt import text_input

    lines = text_input.read_lines(path)
    return lines[:limit] if limit else lines


def load(path, data, use_cuda, fp16):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})
    model = models[0]
    model.eval()
    if fp16:
        model.half()
    if use_cuda:
        model.cuda()
    return model, task


def make_batches(task, model, lines: List[str], batch_size: int, use_cuda: bool):
    d = task.source_dictionary
    tokens = [d.encode_line(line, add_if_not_exist=False).long() for line in lines]
    lengths = [t.numel() for t in tokens]
    dataset = task.build_dataset_for_inference(tokens, lengths)
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False,
    ).next_epoch_itr(shuffle=False)
    batches = []
    for sample in itr:
        batches.append(utils.move_to_cuda(sample) if use_cuda else sample)
    return batches


def build_generator(task, model, chunk_size, beam, b_nat, max_len_b, lenpen, mp_iterations=None, length_beam=1,
                    engine="lean", quantize="none"):
    """The task's generator for one configuration; ``engine`` / ``quantize`` are the task's
    ``--decoder-engine`` / ``--quantize`` (int8 quantizes ``model`` in place)."""
    task.cfg.decoder_engine = engine
    task.cfg.quantize = quantize
    if mp_iterations is not None:  # Mask-Predict: the task picks MaskPredictGenerator
        gen_cfg = GenerationConfig(
            iter_decode_max_iter=mp_iterations, iter_decode_with_beam=length_beam, max_len_b=max_len_b
        )
        return task.build_generator([model], gen_cfg)
    gen_cfg = GenerationConfig(beam=beam, max_len_b=max_len_b, lenpen=lenpen)
    if hasattr(task.cfg, "decode_chunk_size"):
        task.cfg.decode_chunk_size = str(chunk_size)
        task.cfg.b_nat = b_nat
    return task.build_generator([model], gen_cfg)


def decode(task, model, generator, batches, use_cuda) -> (Dict[int, torch.Tensor], float):
    hyps = {}
    if use_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for sample in batches:
            out = task.inference_step(generator, [model], sample)
            for i, sid in enumerate(sample["id"].tolist()):
                hyps[sid] = out[i][0]["tokens"]
    if use_cuda:
        torch.cuda.synchronize()
    return hyps, time.perf_counter() - start


def detok(task, hyps, spm_model, n):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_model)
    out = []
    for i in range(n):
        pieces = task.target_dictionary.string(hyps[i].cpu(), extra_symbols_to_ignore={task.target_dictionary.eos()})
        out.append(sp.decode(pieces.split()))
    return out


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    logging.getLogger("fairseq_hrt").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.fp16 and not use_cuda:
        raise SystemExit("--fp16 needs a GPU (half-precision matmuls on CPU are not a speed-up)")
    src = read_lines(args.src, args.max_sentences)
    raw_src = read_lines(args.raw_src, args.max_sentences)
    if len(src) != len(raw_src):
        raise SystemExit(f"--src has {len(src)} lines but --raw-src has {len(raw_src)}")
    refs = read_lines(args.raw_ref, args.max_sentences) if args.raw_ref else None
    if refs is not None and not args.spm:
        raise SystemExit("--raw-ref needs --spm to detokenise hypotheses")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    chunk_sizes = [int(k) for k in args.chunk_sizes.split(",") if k]

    systems = []  # (name, model, task, chunk_size, Mask-Predict iterations)
    model, task = load(args.path, args.data, use_cuda, args.fp16)
    systems.append((f"HRT AT-mode (C_d=1) b={args.beam}", model, task, 1, None))
    for k in chunk_sizes:
        systems.append((f"HRT k={k} b_at={args.beam} b_nat={args.b_nat}", model, task, k, None))
    if args.at_path:
        at_model, at_task = load(args.at_path, args.data, use_cuda, args.fp16)
        systems.insert(0, (f"AT checkpoint ({args.engine} engine) b={args.beam}", at_model, at_task, None, None))
    if args.mp_path:
        mp_model, mp_task = load(args.mp_path, args.data, use_cuda, args.fp16)
        for iterations in [int(i) for i in args.mp_iterations.split(",") if i]:
            systems.append((f"MP I={iterations} l={args.length_beam}", mp_model, mp_task, None, iterations))
    device = torch.cuda.get_device_name() if use_cuda else f"CPU ({torch.get_num_threads()} threads)"
    results = {"device": device, "fp16": args.fp16, "torch": torch.__version__, "systems": []}

    n_words_all = source_words(raw_src)
    bs1_n = min(args.bs1_sentences, len(src)) if args.bs1_sentences else len(src)
    n_words_bs1 = source_words(raw_src[:bs1_n])
    for name, m, t, k, mp_iterations in systems:
        gen = build_generator(
            t, m, k if k is not None else 1, args.beam, args.b_nat, args.max_len_b, args.lenpen,
            mp_iterations, args.length_beam, engine=args.engine, quantize=args.quantize,
        )
        row = {"system": name, "chunk_size": k, "speed": {}}
        if mp_iterations is not None:
            row.update(mp_iterations=mp_iterations, length_beam=args.length_beam)
        for bs in batch_sizes:
            lines = src[:bs1_n] if bs == 1 else src
            words = n_words_bs1 if bs == 1 else n_words_all
            batches = make_batches(t, m, lines, bs, use_cuda)
            decode(t, m, gen, batches[: max(1, min(len(batches), 4))], use_cuda)  # warm-up
            runs = args.runs if bs == 1 else 1
            times = []
            for _ in range(runs):
                hyps, seconds = decode(t, m, gen, batches, use_cuda)
                times.append(seconds)
            mean = statistics.mean(times)
            row["speed"][str(bs)] = {
                "words_per_second": words / mean,
                "seconds": mean,
                "runs": runs,
                "sentences": len(lines),
                "words": words,
            }
            logger.info("%-48s batch %4d: %8.1f words/s (%d run(s), %.2fs)", name, bs, words / mean, runs, mean)
            if bs != 1 and refs is not None and "bleu" not in row:
                bleu = sacrebleu_score(detok(t, hyps, args.spm, len(lines)), refs[: len(lines)])
                row["bleu"], row["bleu_signature"] = bleu["score"], bleu["signature"]
        results["systems"].append(row)

    base = next(r for r in results["systems"] if "AT-mode" in r["system"])
    fastest_at = {
        bs: max(
            r["speed"][bs]["words_per_second"]
            for r in results["systems"]
            if r["chunk_size"] in (None, 1) and "mp_iterations" not in r
        )
        for bs in map(str, batch_sizes)
    }
    for r in results["systems"]:
        for bs, s in r["speed"].items():
            s["ratio_vs_at_mode"] = s["words_per_second"] / base["speed"][bs]["words_per_second"]
            s["ratio_vs_fastest_at"] = s["words_per_second"] / fastest_at[bs]
    print(markdown_table(results, batch_sizes))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        logger.info("wrote %s", args.json)
    return results


def markdown_table(results, batch_sizes) -> str:
    head = "| system | BLEU | " + " | ".join(f"words/s bs={b} (x fastest AT)" for b in batch_sizes) + " |"
    lines = [f"Device: {results['device']}{' fp16' if results['fp16'] else ''}", "", head,
             "|" + "---|" * (2 + len(batch_sizes))]
    for r in results["systems"]:
        bleu = f"{r['bleu']:.2f}" if "bleu" in r else "-"
        cells = [
            f"{r['speed'][str(b)]['words_per_second']:.1f} ({r['speed'][str(b)]['ratio_vs_fastest_at']:.2f}x)"
            for b in batch_sizes
        ]
        lines.append(f"| {r['system']} | {bleu} | " + " | ".join(cells) + " |")
    sig = next((r["bleu_signature"] for r in results["systems"] if "bleu_signature" in r), None)
    if sig:
        lines += ["", f"sacreBLEU signature: {sig}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
