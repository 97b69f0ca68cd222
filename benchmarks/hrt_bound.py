#!/usr/bin/env python
"""HRT's speed bound at fixed lengths, and what the engine delivers on real text, row by row.

For a checkpoint (``--path``) or a random model of a named shape (``--arch``, speed does not
depend on the weights), and each engine (``--engines lean,onnxruntime``), at each batch size:

* **the bound**: with fixed lengths (``--src-len`` source and ``--tgt-len`` target tokens per
  sentence, so no runaway plays a part) the time of the encoder, of N AT steps (from
  ``</s>``), of N / k Skip-AT steps (from ``<s_k>``) and of one stage-II pass (N slots, the
  masks read) -- each the engine's own calls of the one search's backend contract
  (``encode``, ``greedy_loop`` where the backend has one for the batch, else ``begin`` +
  ``step``, ``parallel``), the fastest of ``--runs`` -- and the HRT /
  AT ratio they allow: ``(encoder + N steps) / (encoder + N/k steps + stage II)``;
* **delivered** (a checkpoint and ``--src``): the same model decoding that text in AT mode
  (greedy) and with HRT k, source words/second (``--max-len-a`` / ``--max-len-b`` for both),
  the ratio, and the share of the bound it reaches; then where the time goes per sentence
  (encoder, decoder steps, stage II, the search around them: :mod:`benchmarks.time_split`),
  so a gap between the two ratios is explained part by part. ``--at-path``: the AT greedy
  row is decoded by that AT model (the AT student) instead of the HRT model's AT mode, for an
  HRT model trained on with p_k = 1, whose AT mode has decayed and writes outputs of other
  lengths than an AT's.

Prints a table and writes ``OUT/hrt_bound.md`` and ``OUT/hrt_bound.json``::

    python -m benchmarks.hrt_bound --arch hrt_mini --vocab 4008 --out OUT            # random weights
    python -m benchmarks.hrt_bound --path ckpt.pt --data data-bin --src test.en --out OUT
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

if not __package__:  # python benchmarks/hrt_bound.py (a file): the repository root on sys.path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import measure, time_split  # noqa: E402
from benchmarks.onnx_gate import random_model  # noqa: E402
from benchmarks.report_files import write_report  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt.generation.engines import engine_choices, get_engine  # noqa: E402
from fairseq_hrt.generation.search_generator import SearchGenerator  # noqa: E402
from hrt_runtime.search import Rules, SearchConfig, mask_columns  # noqa: E402


def backend_of(engine: str, model, task, threads: int, int8: bool = False):
    """``(backend, encode)`` of the one search for ``engine`` (any registered engine): the
    backend its generator runs the search on, ``encode(src (B, S) int64 array)`` its encoding
    of a batch. ``int8``: the int8 copy of an engine that quantizes its own graphs (ONNX
    Runtime's); ``threads``: the engine's, which it takes from torch's."""
    if int8 and not get_engine(engine).quantizes_itself:
        raise ValueError(f"int8 backends are those of engines that quantize their own graphs; {engine} runs float here")
    torch.set_num_threads(threads)
    generator = one_search_generator(engine, model, task, "int8" if int8 else "none")

    def encode(src):
        tokens = torch.from_numpy(src)
        return generator.encode({"src_tokens": tokens, "src_lengths": torch.full((src.shape[0],), src.shape[1])})

    return generator.backend, encode


def one_search_generator(engine: str, model, task, quantize: str) -> SearchGenerator:
    """The engine's generator of greedy search (an HRT model in its AT mode, which holds the
    model's start symbols and <mask> for stage II): the one search over its backend, or an
    error naming an engine that runs another search (fairseq's). Every other decoding option
    at its default, whatever the checkpoint saved (no shortlist, no --compile)."""
    options = dict(measure.row_defaults(), decoder_engine=engine, quantize=quantize, decode_chunk_size="1")
    generator = measure.build_generator(task, model, {"beam": 1}, options)
    if not isinstance(generator, SearchGenerator):
        raise ValueError(f"the {engine} engine does not run the one search (hrt_runtime.search): no backend to time")
    return generator


def banned_symbols(task) -> list:
    """The target symbols no decoder outputs: padding, ``<s>``, ``<mask>`` and the ``<s_k>``."""
    d = task.target_dictionary
    return [d.pad(), d.bos(), task.mask_idx, *task.chunk_start_idx.values()]


def fixed_length_calls(backend, encode, task, bsz: int, src_len: int, tgt_len: int, k: int) -> dict:
    """``{part: call}``: the backend's calls of the encoder (``encoder``), of N AT steps
    (``at_steps``), of N / k Skip-AT steps (``skip_at_steps``) and of one stage-II pass
    (``stage2``) on ``bsz`` random sentences of ``src_len`` source and ``tgt_len`` target
    tokens, the search's own calls."""
    tgt = task.target_dictionary
    vocab = backend.vocab_size
    rng = np.random.RandomState(0)
    src = rng.randint(tgt.nspecial + 10, vocab - 16, (bsz, src_len)).astype(np.int64)
    src[:, -1] = tgt.eos()
    start = task.chunk_start_idx[k]
    bias = np.zeros(vocab, np.float32)
    bias[banned_symbols(task)] = -np.inf
    rows = backend.rows(None)
    encoded = encode(src)
    width = tgt_len
    tokens = rng.randint(tgt.nspecial + 10, vocab - 16, (bsz, width)).astype(np.int64)
    queries = mask_columns(width, k)
    tokens[:, queries] = task.mask_idx
    positions = np.broadcast_to(np.arange(1, width + 1), (bsz, width)).astype(np.int64).copy()
    select = np.flatnonzero(tokens[:, queries] == task.mask_idx)

    # the greedy loop of a backend that has one (ONNX Runtime and the CUDA-graph engine, few rows), as the
    # search runs it: n steps, </s> banned until the last, which the rules force
    loop_rules = {
        n: Rules(SearchConfig(beam=1, max_len_b=n - 1), tgt.eos(), tgt.unk(), [], rows, vocab)
        for n in (tgt_len, tgt_len // k)
    }
    for n, rules in loop_rules.items():
        rules.usual = rules.early = np.where(rules.early == -np.inf, -np.inf, bias).astype(np.float32)

    def steps(n, first):
        rules = loop_rules[n]
        if backend.greedy_loop(encoded, first, n - 1, rules.config.min_len, rules.biases, rows) is not None:
            return
        state = backend.begin(encoded, bsz, n + 1, first, rows)
        prev = np.full((bsz,), first, np.int64)
        for step in range(n):
            _, prev = backend.step(state, prev, step, bias, scores=False)  # as the rows it bounds decode

    return {
        "encoder": lambda: encode(src),
        "at_steps": lambda: steps(tgt_len, tgt.eos()),
        "skip_at_steps": lambda: steps(tgt_len // k, start),
        "stage2": lambda: backend.parallel(encoded, tokens, positions, queries, select, bias, rows),
    }


def fixed_length_times(
    backend, encode, task, bsz: int, src_len: int, tgt_len: int, k: int, runs: int, sync=None
) -> dict:
    """ms of :func:`fixed_length_calls` (the fastest of ``runs``, round-robin), and the HRT /
    AT ratio they bound. ``sync`` (on a GPU, ``torch.cuda.synchronize``): called as the clock
    starts and stops, so each part's queued device work is counted in it."""
    with torch.no_grad():
        calls = fixed_length_calls(backend, encode, task, bsz, src_len, tgt_len, k)
        timed = time_runs(calls, warmup=1, runs=runs, sync=sync)
    ms = {name: t.min * 1000 for name, t in timed.items()}
    at = ms["encoder"] + ms["at_steps"]
    hrt = ms["encoder"] + ms["skip_at_steps"] + ms["stage2"]
    return {
        **{f"{name}_ms": round(v, 4) for name, v in ms.items()},
        "at_ms": round(at, 4),
        "hrt_ms": round(hrt, 4),
        "bound": round(at / hrt, 3),
    }


def delivered(
    path: str,
    data: str,
    lines,
    engine: str,
    bsz: int,
    k: int,
    runs: int,
    max_len_a: float,
    max_len_b: int,
    at_path: Optional[str] = None,
):
    """Source words/second of AT greedy (the HRT model's AT mode, or the AT model ``at_path``)
    and HRT k on ``lines``, and their time split."""
    words = sum(len(line.replace("\u2581", " ").split()) for line in lines)
    # the checkpoint with its folder: a study's checkpoints are all checkpoint_best.pt
    out = {"at_from": os.path.join(*Path(at_path).parts[-2:]) if at_path else "AT mode"}
    loaded = {}  # without at_path both rows decode the one HRT model: load it once
    for name, chunk, checkpoint in (("at", 1, at_path or path), ("hrt", k, path)):
        if checkpoint not in loaded:
            model, task = measure.load(checkpoint, data)
            loaded[checkpoint] = model, task, measure.make_batches(task, model, lines, bsz, False)
        model, task, batches = loaded[checkpoint]
        options = {"decoder_engine": engine, "decode_chunk_size": str(chunk), "b_nat": 1}
        generator = measure.build_generator(
            task, model, {"beam": 1, "max_len_a": max_len_a, "max_len_b": max_len_b}, options
        )
        measure.generate(task, model, generator, batches[:2])  # warm-up
        timing = time_runs(lambda: measure.generate(task, model, generator, batches), runs=runs)
        out[name] = {
            "words_per_second": round(words / timing.min, 1),
            "ms_per_sentence": round(timing.min / len(lines) * 1000, 4),
        }
        split = time_split.split(
            checkpoint, data, lines, bsz, chunk, 1, engine=engine, max_len_a=max_len_a, max_len_b=max_len_b
        )
        out[name]["split_ms_per_sentence"] = {part: round(v, 4) for part, v in split["parts_ms_per_sentence"].items()}
        out[name]["decoder_steps_per_batch"] = round(split["decoder_steps_per_batch"], 2)
    out["ratio"] = round(out["hrt"]["words_per_second"] / out["at"]["words_per_second"], 3)
    return out


def model_and_task(args, workdir: str):
    if args.path:
        model, task = measure.load(args.path, args.data)
        return model, task, os.path.basename(os.path.dirname(os.path.abspath(args.path))) or args.path

    task, model = random_model(args.arch, args.vocab, workdir, extra_args=args.model_args.split())
    return model, task, f"{args.arch} {args.model_args}".strip() + " (random)"


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", help="an HRT checkpoint (with --data); else --arch")
    p.add_argument("--data", help="the checkpoint's binarized data (its dictionaries)")
    p.add_argument("--arch", default="hrt_mini", help="a random model of this architecture (without --path)")
    p.add_argument("--model-args", default="", help="more model options for --arch, e.g. '--decoder-layers 2'")
    p.add_argument("--vocab", type=int, default=4008, help="vocabulary of the random model")
    p.add_argument("--engines", default="onnxruntime,lean")
    p.add_argument("--batches", default="1,128")
    p.add_argument("--chunk-size", type=int, default=2)
    p.add_argument("--src-len", type=int, default=16)
    p.add_argument("--tgt-len", type=int, default=16)
    p.add_argument("--runs", type=int, default=20, help="fixed-length timings: the fastest of this many")
    p.add_argument("--src", help="SentencePiece-piece source lines to decode (delivered speed; needs --path)")
    p.add_argument("--limit-batch1", type=int, default=200, help="sentences of --src decoded at batch 1")
    p.add_argument("--delivered-runs", type=int, default=3)
    p.add_argument(
        "--at-path",
        help="AT checkpoint of the same dictionary whose greedy decoding is the delivered AT row (the AT student), "
        "instead of the HRT model's AT mode",
    )
    p.add_argument("--max-len-a", type=float, default=1.2)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.src and not args.path:
        p.error("--src (the delivered speed) needs a checkpoint (--path, --data)")
    if args.at_path and not args.src:
        p.error("--at-path is the delivered AT row: it needs --src")
    torch.set_num_threads(args.threads)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in engine_choices():
            p.error(f"--engines: {e!r} is not one of {', '.join(engine_choices())}")
    batches = [int(b) for b in args.batches.split(",")]

    workdir = tempfile.mkdtemp()
    model, task, name = model_and_task(args, workdir)
    k = args.chunk_size
    rows = []
    for engine in engines:
        backend, encode = backend_of(engine, model, task, args.threads)
        for bsz in batches:
            row = {
                "model": name,
                "engine": engine,
                "batch": bsz,
                "k": k,
                "src_len": args.src_len,
                "tgt_len": args.tgt_len,
                **fixed_length_times(backend, encode, task, bsz, args.src_len, args.tgt_len, k, args.runs),
            }
            if args.src:
                lines = measure.read_lines(args.src)
                if bsz == 1 and args.limit_batch1:
                    lines = lines[: args.limit_batch1]
                row["delivered"] = delivered(
                    args.path,
                    args.data,
                    lines,
                    engine,
                    bsz,
                    k,
                    args.delivered_runs,
                    args.max_len_a,
                    args.max_len_b,
                    at_path=args.at_path,
                )
                row["delivered"]["share_of_bound"] = round(row["delivered"]["ratio"] / row["bound"], 3)
                row["delivered"]["sentences"] = len(lines)
            rows.append(row)
            print(row, flush=True)
    text = report_text(rows, args)
    write_report(args.out, "hrt_bound", {"config": vars(args), "threads": args.threads, "rows": rows}, text)


def report_text(rows, args) -> str:
    n, k = args.tgt_len, args.chunk_size
    out = [
        f"## HRT k = {k} against AT greedy: the fixed-length bound ({args.src_len} source, {n} target tokens, "
        f"{args.threads} thread(s), ms, fastest of {args.runs})",
        "",
        f"| model | engine | batch | encoder | AT {n} steps | Skip-AT {n // k} steps | stage II | AT | HRT | bound |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['engine']} | {r['batch']} | {r['encoder_ms']:.3f} | {r['at_steps_ms']:.3f} | "
            f"{r['skip_at_steps_ms']:.3f} | {r['stage2_ms']:.3f} | {r['at_ms']:.3f} | {r['hrt_ms']:.3f} | "
            f"{r['bound']:.2f}x |"
        )
    delivered_rows = [r for r in rows if "delivered" in r]
    if delivered_rows:
        out += [
            "",
            f"## Delivered on `{os.path.basename(args.src)}` (at most {args.max_len_a} x source + "
            f"{args.max_len_b} tokens; ms per sentence split as benchmarks/time_split.py)",
            "",
            f"AT greedy: {delivered_rows[0]['delivered']['at_from']}.",
            "",
            "| engine | batch | sentences | AT words/s | HRT words/s | ratio | bound | share of bound | "
            "AT: encoder / steps / other | HRT: encoder / steps / stage II / other | steps per batch (AT / HRT) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
        ]
        for r in delivered_rows:
            d = r["delivered"]
            a, h = d["at"]["split_ms_per_sentence"], d["hrt"]["split_ms_per_sentence"]
            out.append(
                f"| {r['engine']} | {r['batch']} | {d['sentences']} | {d['at']['words_per_second']:.0f} | "
                f"{d['hrt']['words_per_second']:.0f} | {d['ratio']:.2f}x | {r['bound']:.2f}x | "
                f"{d['share_of_bound']:.0%} | {a['encoder']:.3f} / {a['decoder steps']:.3f} / {a['other']:.3f} | "
                f"{h['encoder']:.3f} / {h['decoder steps']:.3f} / {h['stage II']:.3f} / {h['other']:.3f} | "
                f"{d['at']['decoder_steps_per_batch']:.1f} / {d['hrt']['decoder_steps_per_batch']:.1f} |"
            )
        out += [
            "",
            "The bound uses fixed lengths; delivered outputs have their own lengths (a Skip-AT skeleton may "
            "run longer or shorter than half of AT mode's output), and the search around the steps is in "
            "'other' (argmax bookkeeping, finished sentences leaving the batch, stage II's input).",
        ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
