"""results.md and results.json of examples/wmt/recipe.py: every evaluated model's scores
(python -m fairseq_hrt.evaluate's JSON) beside its speed (benchmarks/benchmark.py's reports),
and the time each step took."""

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from recipe import Recipe

BENCH_BATCH_SIZES = (1, 8, 128)
# what a slice's numbers mean, by --slice-size
SLICE_NOTES = {
    "smoke": " Tiny models and tens of updates (--slice-size smoke): their BLEU is 0 by design, the run "
    "shows the path.",
    "learn": " Small models trained for minutes on a small corpus (--slice-size learn): their BLEU shows "
    "that every step learns and hands on what it learned, not what the paper's models score; the speeds "
    "are those of small models on this machine, not the paper's.",
    # shared/data holds no En-Ro text but newstest2016: too little to learn from in minutes
    "learn-newstest": " Small models trained for minutes on under 2,000 newstest lines (--slice-size learn; "
    "shared/data has no other text of this pair): too little to learn from, so BLEU near 0 is expected "
    "here; pass your own parallel text with --corpus to see the models learn.",
}


def slice_note(recipe: "Recipe") -> str:
    size = recipe.args.slice_size
    if size == "learn" and not recipe.corpus and recipe.setup.slice_data.endswith("-newstest"):
        return SLICE_NOTES["learn-newstest"]
    return SLICE_NOTES[size]


def _score(metrics: dict, metric: str) -> Optional[float]:
    """A score of ``python -m fairseq_hrt.evaluate --json``: {metric: {"score": ...}}."""
    return (metrics.get(metric) or {}).get("score")


def benchmark_rows(recipe: "Recipe") -> Dict[str, dict]:
    """{evaluate row: {batch size: (words/s, ratio to AT greedy)}} from the benchmark reports."""
    s = recipe.setup
    speeds = {}
    for k in s.hrt_chunk_sizes:
        report = json.loads((recipe.work / "benchmark" / f"k{k}" / "report.json").read_text())
        for system in report["systems"]:
            name = system["name"]
            if name == "AT greedy":
                row = "at-greedy"
            elif name.startswith("HRT") and "AT-mode" not in name and "[" not in name:
                row = f"hrt-k{k}"
            elif name.startswith("MP") or "Mask-Predict" in name:
                row = f"mp-i{s.mp_iterations}"
            else:
                continue
            speed = {b: (v["words_per_second"], v.get("ratio_vs_baseline")) for b, v in system["speed"].items()}
            speeds.setdefault(row, speed)
    return speeds


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({len(os.sched_getaffinity(0))} cores)"
    except OSError:
        pass
    return f"{len(os.sched_getaffinity(0))} cores"


def steps_time(step_seconds: Dict[str, float], recipe: "Recipe") -> str:
    if not step_seconds:
        return "Time of the steps: not recorded (they ran before the recipe kept it)."
    where = f"; {recipe.threads} thread(s) per job, on {cpu_name()}" if recipe.cpu else ""
    per_step = ", ".join(f"{name} {sec:.0f} s" for name, sec in step_seconds.items())
    return f"Time of the steps: {sum(step_seconds.values()):.0f} s in all ({per_step}{where})."


def write_results(recipe: "Recipe") -> str:
    s = recipe.setup
    speeds = benchmark_rows(recipe)
    rows = []
    for path in sorted((recipe.work / "evaluate").glob("*.json")):
        metrics = json.loads(path.read_text())
        row = path.stem
        rows.append(
            dict(
                model=row,
                sacrebleu=_score(metrics, "sacrebleu"),
                tokenized_bleu=_score(metrics, "tokenized_bleu"),
                chrf=_score(metrics, "chrf"),
                comet=_score(metrics, "comet"),
                words_per_second={
                    str(b): (speeds.get(row, {}).get(str(b)) or (None, None))[0] for b in BENCH_BATCH_SIZES
                },
                speedup_vs_at_greedy={
                    str(b): (speeds.get(row, {}).get(str(b)) or (None, None))[1] for b in BENCH_BATCH_SIZES
                },
            )
        )
    order = ["teacher", "at-greedy"]
    rows.sort(key=lambda r: (order.index(r["model"]) if r["model"] in order else len(order), r["model"]))
    results = dict(
        setup=s.name, slice=recipe.args.slice, paper=s.paper, step_seconds=recipe.step_seconds(), rows=rows,
        data=recipe.data_description(),
    )  # fmt: skip

    def cell(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    lines = [
        f"# {s.name}{' (slice)' if recipe.args.slice else ''}: {s.paper}",
        "",
        f"Data: {results['data']}. Subwords: joint SentencePiece BPE ({s.vocab_size} pieces) in place of "
        "the paper's Moses tokenization + BPE." + (slice_note(recipe) if recipe.args.slice else ""),
        "",
        "| model | sacreBLEU | tokenized BLEU | chrF | COMET | words/s bs=1 | bs=8 | bs=128 "
        "| speed-up vs AT greedy (1/8/128) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        wps = [cell(r["words_per_second"][str(b)], "{:.1f}") for b in BENCH_BATCH_SIZES]
        ratios = [r["speedup_vs_at_greedy"][str(b)] for b in BENCH_BATCH_SIZES]
        ratio = "n/a" if all(x is None for x in ratios) else "/".join(cell(x) for x in ratios)
        lines.append(
            f"| {r['model']} | {cell(r['sacrebleu'])} | {cell(r['tokenized_bleu'])} | {cell(r['chrf'])} | "
            f"{cell(r['comet'], '{:.4f}')} | {' | '.join(wps)} | {ratio} |"
        )
    bench = f"the first {s.bench_sentences} test sentences" if s.bench_sentences else "the whole test set"
    lines += [
        "",
        f"Rows: teacher (beam {s.distill_beam}, its last checkpoint: the one that distilled); the students "
        f"averaged over their last {s.average_last} interval checkpoints: at-greedy (the speed baseline), "
        + (f"at-beam{s.at_beam}, " if s.at_beam > 1 else "")
        + f"hrt-kK (chunk size K, b_at = {s.hrt_beam}, b_nat = 1)"
        + (f", mp-iI (Mask-Predict, I iterations, {s.mp_length_beam} length candidates)" if s.mp_student else "")
        + f". Scores: python -m fairseq_hrt.evaluate on the whole test set (COMET n/a: no local COMET model). "
        f"Speed: benchmarks/benchmark.py, source words/s on {bench} (batch 1: the first "
        f"{s.bench_bs1_sentences}), lean engine, {recipe.threads} thread(s); reports in benchmark/k*/.",
        "",
        steps_time(results["step_seconds"], recipe),
    ]
    table = "\n".join(lines) + "\n"
    (recipe.work / "results.md").write_text(table)
    (recipe.work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return table
