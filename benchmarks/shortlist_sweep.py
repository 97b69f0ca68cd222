#!/usr/bin/env python
"""Tune a lexical shortlist: BLEU, words/s and candidate-set size for several
``--per-source`` / ``--frequent`` settings, against the same models without a shortlist.

Tune on the validation set (``--src``/``--raw-src``/``--raw-ref`` of ``valid``), then report
the chosen setting on the test set with ``benchmark.py --shortlist FILE``. Shortlists are
built in this process from the binarized training set of ``--data`` (as
``fairseq-hrt-shortlist`` builds them) and written to ``--out-dir/shortlists/`` (or ``--shortlist-dir``).

Rows: for every model given (``--at``: greedy; ``--hrt``: k = 2, b_at/b_nat = 1/1, lean
engine) one row without a shortlist and one per setting. Speed: source words/s at every
``--batch-sizes`` (batch 1: first ``--bs1-sentences`` sentences), the median of ``--runs``
passes that go round-robin over the rows (a busy machine slows all rows alike); candidates:
the mean size of the candidate set per batch. Output: a table (stdout) and
``--out-dir/sweep.json``.

Example::

    python benchmarks/shortlist_sweep.py --data D/data-bin --spm D/spm/spm.model \\
        --src D/spm/valid.en --raw-src D/raw/valid.en --raw-ref D/raw/valid.de \\
        --at R/at/checkpoint_last.pt --hrt R/hrt/checkpoint_last.pt \\
        --settings 75/75,10/50,10/50/0.05 --out-dir R/shortlist-sweep
"""

import argparse
import functools
import logging
import os

import torch

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import Context, FairseqRunner, System, add_data_arguments, read_lines  # noqa: E402
from benchmarks.report_files import write_report  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt import shortlist as sl  # noqa: E402
from fairseq_hrt.cli_logging import setup_logging  # noqa: E402
from fairseq_hrt.scoring.metrics import sacrebleu_score, source_words  # noqa: E402

logger = logging.getLogger("shortlist_sweep")


def parse_settings(text: str):
    """``"75/75,10/50/0.05"`` -> ``[(75, 75, 0.0), (10, 50, 0.05)]`` (per source / frequent /
    minimum score)."""
    out = []
    for item in str(text).split(","):
        parts = item.strip().split("/")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            setting = (int(parts[0]), int(parts[1]), float(parts[2]) if len(parts) == 3 else 0.0)
        except ValueError:
            raise ValueError(f"--settings {item!r}: expected PER_SOURCE/FREQUENT[/MIN_SCORE]") from None
        if min(setting[:2]) < 1:
            raise ValueError(f"--settings {item!r}: PER_SOURCE and FREQUENT must be >= 1")
        out.append(setting)
    return out


def setting_name(setting) -> str:
    n, m, t = setting
    return f"{n}/{m}" + (f"/{t:g}" if t else "")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_arguments(p, data_help="binarized data dir: dictionaries and the training set", max_sentences=False)
    p.add_argument("--at", help="AT checkpoint (greedy rows)")
    p.add_argument("--hrt", help="HRT checkpoint (k = 2, 1/1 rows)")
    p.add_argument("--hrt-chunk-size", type=int, default=2)
    p.add_argument(
        "--settings",
        default="75/75,20/50,10/50,10/50/0.05",
        help="comma-separated PER_SOURCE/FREQUENT[/MIN_SCORE] settings (fairseq-hrt-shortlist's "
        "--per-source, --frequent, --min-score)",
    )
    p.add_argument("--method", choices=sl.METHODS, default="ibm1")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--batch-sizes", default="1,128")
    p.add_argument("--bs1-sentences", type=int, default=100)
    p.add_argument("--runs", type=int, default=3, help="timed passes per row and batch size (median)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--out-dir", required=True, help="sweep.json and sweep.md go here")
    p.add_argument("--shortlist-dir", help="where the built shortlists go (default: OUT_DIR/shortlists)")
    args = p.parse_args(argv)
    if not args.at and not args.hrt:
        p.error("give --at and/or --hrt")
    try:
        args.settings = parse_settings(args.settings)
    except ValueError as e:
        p.error(str(e))
    return args


def build_shortlists(args):
    src_lang, tgt_lang, src_dict, tgt_dict = sl.load_dictionaries(args.data, None, None)
    src, tgt = sl.read_binarized(args.data, "train", src_lang, tgt_lang, src_dict, tgt_dict)
    paths = {}
    for n, m, t in args.settings:
        path = os.path.join(
            args.shortlist_dir or os.path.join(args.out_dir, "shortlists"), f"{args.method}-{n}-{m}-{t:g}.pt"
        )
        built = time_runs(
            lambda: sl.build_shortlist(src, tgt, src_dict, tgt_dict, n, m, args.method, args.iterations, t).save(path)
        )
        logger.info("shortlist %s: %s (%.1fs)", setting_name((n, m, t)), path, built.total)
        paths[(n, m, t)] = path
    return paths


def sweep_models(args) -> list:
    """``(name, checkpoint, generation args, decoding options)`` of each model swept."""
    models = []
    if args.at:
        models.append(("AT greedy", args.at, {"beam": 1}, {"decoding": "beam", "decode_chunk_size": "1"}))
    if args.hrt:
        models.append(
            (
                f"HRT k={args.hrt_chunk_size} 1/1",
                args.hrt,
                {"beam": 1},
                {"decoding": "hrt", "decode_chunk_size": str(args.hrt_chunk_size), "b_nat": 1},
            )
        )
    return models


def sweep_rows(args, models, paths, ctx) -> list:
    """A row per model and setting (``None``: the whole vocabulary), with its runner and shortlist."""
    rows = []
    for name, ckpt, gen_args, options in models:
        for setting in [None] + list(args.settings):
            row_options = dict(options, decoder_engine="lean", quantize="none")
            label = name
            if setting is not None:
                row_options["shortlist"] = paths[setting]
                label = f"{name} +shortlist {setting_name(setting)}"
            system = System(label, name.split()[0], ckpt, dict(gen_args, **options))
            runner = FairseqRunner(system, ctx, dict(gen_args, max_len_b=args.max_len_b), row_options, greedy=True)
            short = runner.task.load_shortlist(paths[setting]) if setting is not None else None
            rows.append(
                {
                    "name": label,
                    "model": name,
                    "setting": setting,
                    "runner": runner,
                    "shortlist": short,
                    "times": {},
                    "candidates": {},
                }
            )
    return rows


def measure(args, rows, batch_sizes, lines, raw_src, refs) -> dict:
    """Every row's times (and shortlist candidates per batch) at every batch size, its BLEU at
    the largest; returns the source words decoded per batch size."""
    results = {}
    for bs in batch_sizes:
        subset = lines[: args.bs1_sentences] if bs == 1 and args.bs1_sentences else lines
        prepared = {r["name"]: r["runner"].prepare(subset, bs) for r in rows}
        for r in rows:
            r["runner"].run(prepared[r["name"]], warm_up=True)
        before = {r["name"]: (r["shortlist"].batches, r["shortlist"].total_candidates) for r in rows if r["shortlist"]}
        timings = time_runs(
            {r["name"]: functools.partial(r["runner"].run, prepared[r["name"]]) for r in rows}, runs=args.runs
        )
        for r in rows:
            r["times"][bs] = timings[r["name"]]
            short = r["shortlist"]
            if short is not None:  # candidates per batch over the runs (each run decodes the same batches)
                b0, c0 = before[r["name"]]
                r["candidates"][bs] = (short.total_candidates - c0) / max(1, short.batches - b0)
            if bs == max(batch_sizes):
                r["bleu"] = sacrebleu_score(
                    r["runner"].texts(timings[r["name"]].value, len(subset)), refs[: len(subset)]
                )["score"]
        results[bs] = source_words(raw_src[: len(subset)])
    return results


def report_rows(rows, batch_sizes, results, report, table) -> None:
    """Each row's BLEU and speeds (with their ratio to the model's row without a shortlist)
    into ``report`` and the markdown ``table``."""
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["setting"] is None)
        cells, entry = [], {"name": r["name"], "bleu": round(r["bleu"], 2), "speed": {}}
        for bs in batch_sizes:
            wps = results[bs] / r["times"][bs].median
            ratio = wps / (results[bs] / base["times"][bs].median)
            cand = r["candidates"].get(bs)
            entry["speed"][str(bs)] = {
                "words_per_second": round(wps, 1),
                "ratio": round(ratio, 3),
                "mean_candidates": round(cand, 1) if cand is not None else None,
            }
            cells.append(f"{wps:.1f} ({ratio:.2f}x) | " + (f"{cand:.0f}" if cand is not None else "all"))
        report["rows"].append(entry)
        table.append(f"| {r['name']} | {r['bleu']:.2f} | " + " | ".join(cells) + " |")


def main(argv=None):
    args = parse_args(argv)
    setup_logging()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    paths = build_shortlists(args)
    ctx = Context(args.data, args.spm, args.out_dir, threads=args.threads, max_len_b=args.max_len_b)
    lines, raw_src, refs = read_lines(args.src), read_lines(args.raw_src), read_lines(args.raw_ref)
    models = sweep_models(args)
    rows = sweep_rows(args, models, paths, ctx)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = measure(args, rows, batch_sizes, lines, raw_src, refs)

    table = [
        "| system | BLEU | " + " | ".join(f"bs={b} words/s (x) | bs={b} candidates" for b in batch_sizes) + " |",
        "|---|---|" + "---|---|" * len(batch_sizes),
    ]

    def rel(path):  # the report is read on other machines: paths relative to its folder
        return os.path.relpath(os.path.abspath(path), os.path.abspath(args.out_dir))

    report = {
        "settings": {
            "method": args.method,
            "iterations": args.iterations,
            "tuning_set": rel(args.raw_src),
            "data": rel(args.data),
            "models": {name: rel(ckpt) for name, ckpt, _, _ in models},
            "threads": args.threads,
            "runs": args.runs,
            "bs1_sentences": args.bs1_sentences,
            "vocabulary": len(rows[0]["runner"].task.target_dictionary),
        },
        "rows": [],
    }
    report_rows(rows, batch_sizes, results, report, table)
    text = "\n".join(table) + "\n"
    write_report(args.out_dir, "sweep", report, text)


if __name__ == "__main__":
    main()
