#!/usr/bin/env python
"""Quality and speed of AT, HRT and Mask-Predict on one test set: JSON, markdown, Pareto plot.

Systems (each family only when its checkpoint is given):

* ``--at``  AT (deep encoder, shallow decoder): greedy and beam 5 (``--at-beams``), and the
  same for every ``--at-extra NAME=CKPT`` (other AT students, e.g. SSRU decoders: rows
  ``AT[NAME] ...``). **The fastest AT greedy row of the run (per batch size, whichever engine
  or AT checkpoint) is the baseline of every speed ratio.**
  The same checkpoint is also converted to CTranslate2 and decoded with its C++ engine
  (``--ctranslate2``, on when the ``ctranslate2`` package is installed): the outside reference
  for AT speed.
* ``--hrt`` HRT: chunk size k = 2 (``--hrt-chunk-sizes``, e.g. ``2,3,4`` for a model trained
  for those) with b_at/b_nat = 1/1 and 5/1 (``--hrt-beams``), and the same model in AT mode
  (C_d = 1) with beam b_at (``--hrt-at-mode no`` leaves these out); the same for every
  ``--hrt-extra NAME=CKPT`` (rows ``HRT[NAME] ...``, e.g. a second seed).
* ``--mp``  Mask-Predict with I = 1, 4, 10 iterations (``--mp-iterations``), length beam l.
* Exact parallel forms of greedy search (``--parallel pj,pgj,hgj,hrt-spec``, default none):
  Jacobi decoding of the AT checkpoint (``AT PJ``, ``AT PGJ b=3``, ``AT HGJ b=3``;
  ``--jacobi-block-size``) and ``HRT hrt-spec b=4`` (``--spec-block-size``), the HRT model
  drafting with its non-autoregressive mode and verifying with its AT mode. Their rows report
  decoder passes per sentence (greedy rows: one pass per output token) and must have their
  greedy row's BLEU (``AT greedy`` / ``HRT AT-mode b=1``).

Every AT and HRT system is measured with each engine of ``--engines`` (default lean and
fairseq: the lean engine's rows keep the plain name, fairseq's ``SequenceGenerator`` rows say
"(fairseq engine)", ONNX Runtime's ``--decoder-engine onnxruntime`` rows "(onnxruntime)"), on
CPU also with ``--quantize int8`` (``--int8``: an "int8" row per system and engine that quantizes,
lean and onnxruntime, and "CTranslate2 AT greedy int8" beside CTranslate2's float row), with
``--shortlist FILE`` also restricted to a lexical shortlist (a "+shortlist" row per system and
engine of ``--engines`` that supports shortlists, lean and onnxruntime: "AT greedy
+shortlist" is the lean engine's, "AT greedy (onnxruntime) +shortlist" ONNX Runtime's, with
``--int8`` also "int8 +shortlist"; and beside them "CTranslate2 AT greedy +vmap" / "... beam b
+vmap" (and "int8 +vmap"), CTranslate2 with its vocabulary map written from the same
shortlist), and with ``--compile yes`` also with the lean step compiled by ``torch.compile``
(a "compiled" row per system; a compiled AT greedy row may be the run's baseline, as it is a
float AT greedy decoder). A row whose engine cannot
decode it (ONNX Runtime: an SSRU student, HRT's stage-II options) is left out, and the report
says why.

Each family is one adapter in ``measure.py`` (the shared measuring code that
``hrt_quality.py`` uses too): it lists its rows and decodes them; the loop here only times.

Quality: detokenised sacreBLEU (with its signature) against the raw references; COMET when a
local COMET model is given (``--comet-model`` or ``$COMET_MODEL``), otherwise the report says
"not available" and why -- never a number.

Speed: source words per second (whitespace words of the raw source), model time only (no
text reading or detokenisation), at every ``--batch-sizes``. Batch 1 is the mean of ``--runs``
passes over the first ``--bs1-sentences`` sentences (the WMT efficiency task's metric); larger
batches decode every sentence (``--runs-large`` passes) with fairseq's length-sorted batching.
Each system is warmed up on one batch first (an engine that captures per batch shape,
``cuda-graph``, on a whole pass), and the passes go round-robin over the systems
(pass r of every system, then pass r + 1), so that a slow patch of a shared machine hits all
systems alike. Every speed is also given as a ratio to the fastest AT greedy measured in this
process.

Output (``--out-dir``): ``report.json``, ``report.md`` (also printed), ``pareto.png`` (BLEU vs
words/s per batch size, Pareto front marked) and ``hyps/<system>.txt``. A long run (a study's
hundred rows on one thread take hours) saves what it has measured in ``resume.json`` as it
goes: ``--resume`` after an interruption keeps every finished batch size (speeds compared
within one batch size always come from one process), the outputs and the ``--translate`` files.

Example (after examples/multi30k/recipe.py)::

    python benchmarks/benchmark.py --data D/data-bin --spm D/spm/spm.model --src D/spm/test.en \\
        --raw-src D/raw/test.en --raw-ref D/raw/test.de \\
        --at R/at/checkpoint_last.pt --hrt R/hrt/checkpoint_last.pt --mp R/mp/checkpoint_last.pt \\
        --threads 2 --out-dir R/benchmark
"""

import argparse
import datetime
import functools
import io
import json
import logging
import os
import platform
import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fairseq  # noqa: E402
import sentencepiece  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import fairseq_hrt  # noqa: F401  (registers the plugin and the checkpoint types it loads safely)
from benchmarks import ct2_reference  # noqa: E402
from benchmarks.machine import cpu_name  # noqa: E402
from benchmarks.measure import (  # noqa: E402,F401  (the pure parts are part of this script's interface)
    BASELINE,
    CT2_FAMILY,
    Context,
    System,
    adapter_of,
    add_data_arguments,
    cuda_sync,
    engine_suffixes,
    fastest_baseline,
    model_shape,
    parse_beam_pairs,
    parse_engines,
    parse_ints,
    parse_named_checkpoints,
    read_lines,
    systems_from_args,
)
from benchmarks.report_files import file_stamp, write_file, write_files  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt.cli_logging import setup_logging  # noqa: E402
from fairseq_hrt.scoring.comet import CometUnavailable, comet_score, resolve_comet_model  # noqa: E402
from fairseq_hrt.scoring.metrics import chrf_score, sacrebleu_score, source_words  # noqa: E402

logger = logging.getLogger("benchmark")


# --------------------------------------------------------------------------- pure parts


def speed_ratios(words_per_second: Dict[str, Dict[str, float]], baseline) -> Dict[str, Dict[str, Optional[float]]]:
    """``{system: {batch size: words/s}}`` -> the same with ratios to ``baseline`` (a system,
    or ``{batch size: system}``) at the same batch size (None where it was not measured)."""
    if isinstance(baseline, str):
        base = words_per_second.get(baseline, {})
    else:
        base = {b: words_per_second.get(name, {}).get(b) for b, name in baseline.items()}
    return {
        name: {bs: (wps / base[bs] if base.get(bs) else None) for bs, wps in speeds.items()}
        for name, speeds in words_per_second.items()
    }


def pareto_front(points: Sequence[tuple]) -> List[int]:
    """Indices of the (speed, quality) points that no other point dominates (at least as
    fast and as good, better in one), ordered by increasing speed. Points with a missing
    coordinate are never on the front."""
    valid = [i for i, (s, q) in enumerate(points) if s is not None and q is not None]
    front = []
    for i in valid:
        si, qi = points[i]
        dominated = any(
            points[j][0] >= si and points[j][1] >= qi and (points[j][0] > si or points[j][1] > qi)
            for j in valid
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], points[i][1]))


def relative_paths(decoding: dict, rel) -> dict:
    """A row's decoding options with its files (``shortlist``) as ``rel`` gives them."""
    return {k: rel(v) if k == "shortlist" and v else v for k, v in decoding.items()}


RESUME_FILE = "resume.json"
# options that change neither what is decoded nor how it is timed: a resumed run may differ in them
_NOT_MEASURED = {"out_dir", "log_file", "resume", "translate", "translations_dir", "comet_model", "comet_encoder"}


def command_fingerprint(args, system_names: Sequence[str]) -> dict:
    """What a resumed run must share with the interrupted one for the measurements to be
    reused: every option that changes what is decoded or how it is timed, the systems, and the
    size and modification time of every file an option names (a study rewrites
    ``checkpoint_best.pt`` in place; ``NAME=PATH`` values count by their path)."""
    options = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_MEASURED}
    files = {}
    for value in options.values():
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str):
                continue
            for path in (item, item.split("=", 1)[-1]):
                if os.path.isfile(path):
                    files[os.path.abspath(path)] = file_stamp(path)
    # as it reads back from JSON (lists, not tuples), so that equal commands compare equal
    return json.loads(json.dumps({"options": options, "systems": list(system_names), "files": files}))


class ResumeState:
    """``OUT/resume.json``: what a run has measured so far (each batch size's speeds once every
    system has them, each system's decoder passes over the whole test set, whose texts are in
    ``OUT/hyps/``, the ``--translate`` files written), saved as it goes and removed when the
    report is written. ``resume``: start from the file when it was written by the same command
    (:func:`command_fingerprint`); a file of another command is ignored and replaced, with a
    warning."""

    def __init__(self, path: str, fingerprint: dict, resume: bool):
        self.path = path
        self.data = {"command": fingerprint, "batch_sizes": {}, "outputs": {}, "translated": {}}
        if resume and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            if old.get("command") == fingerprint:
                self.data = old
                logger.info(
                    "%s: going on from an interrupted run (batch sizes measured: %s; outputs of %d systems)",
                    path,
                    ", ".join(old["batch_sizes"]) or "none",
                    len(old["outputs"]),
                )
            else:
                logger.warning(
                    "%s: written by another command (options, systems or checkpoint files differ): starting again",
                    path,
                )

    def save(self):
        write_file(self.path, json.dumps(self.data) + "\n")


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9=._-]+", "_", name).strip("_")


def short_reason(reason: str) -> str:
    """The first sentence of an unavailability message (the report's JSON keeps all of it)."""
    return reason.split(". ")[0].rstrip(".")


def engine_agreement(hyps: Dict[str, List[str]], bleu: Dict[str, float]) -> List[dict]:
    """Every row of another engine than lean next to its lean row (the same name without the
    engine's suffix, e.g. "AT greedy (onnxruntime) +shortlist" and "AT greedy +shortlist"):
    sentences with identical output and the BLEU difference. Float rounding differs between
    runtimes, so a near-tie may flip a token; the counts say how often."""
    out = []
    for name, texts in hyps.items():
        for suffix in engine_suffixes():
            if suffix in name:
                reference = name.replace(suffix, "", 1)
                if reference in hyps:
                    same = sum(a == b for a, b in zip(texts, hyps[reference]))
                    out.append(
                        {
                            "system": name,
                            "reference": reference,
                            "identical": same,
                            "sentences": len(texts),
                            "bleu_difference": round(bleu[name] - bleu[reference], 2),
                        }
                    )
    return out


def _report_header(report: dict, bss: List[str]) -> List[str]:
    """The report's lines before the table: how it was measured and what the columns mean."""
    meta, test, comet = report["meta"], report["meta"]["test"], report["comet"]
    return [
        "## Benchmark: BLEU, COMET and source words/second",
        "",
        f"- test set: `{test['raw_src']}`, {test['sentences']} sentences, {test['words']} source words; "
        f"batch 1: first {test['bs1_sentences']} sentences ({test['bs1_words']} words), mean of "
        f"{meta['runs_bs1']} runs; larger batches: all sentences, {meta['runs_large']} run(s); "
        "each after a warm-up (one batch; the cuda-graph engine's: a whole pass, its graphs captured)",
        f"- device: {meta['device']}, {meta['threads']} torch thread(s); torch {meta['torch']}, "
        f"fairseq {meta['fairseq']}, Python {meta['python']}; {meta['date']}"
        + (
            "; measured by an earlier process of the same command, interrupted and resumed: "
            + ", ".join(f"bs={b} ({d})" for b, d in meta["resumed_batch_sizes"].items())
            if meta.get("resumed_batch_sizes")
            else ""
        ),
        f"- BLEU: sacreBLEU on detokenised output, signature `{report['bleu_signature']}`",
        f"- chrF: sacreBLEU, signature `{report.get('chrf_signature')}`",
        "- COMET: "
        + (f"{comet['model']}" if comet["available"] else f"not available ({short_reason(comet['reason'])})"),
        f"- speed: source words/s; in brackets the ratio to {meta['baseline'] or 'AT greedy (not measured)'}"
        + (
            " (" + ", ".join(f"bs={b}: {n}" for b, n in meta.get("baseline_per_batch_size", {}).items()) + ")"
            if meta.get("baseline_per_batch_size")
            else ""
        ),
        "- engines: rows without a suffix use the lean engine (`--decoder-engine lean`); '(fairseq engine)' "
        "rows use fairseq's SequenceGenerator; '(onnxruntime)' rows ONNX Runtime over the exported model "
        "(`--decoder-engine onnxruntime`); 'int8' rows add `--quantize int8`; 'compiled' rows `--compile` "
        "(both lean); '+shortlist' rows `--shortlist` (in the engine named before it); CTranslate2 '+vmap' rows "
        "CTranslate2's vocabulary map (`use_vmap`) of the same shortlist",
        "",
        "- passes/sent: decoder passes per sentence (greedy rows: one per output token; hrt-spec: "
        "drafting + verifying passes, accepted tokens per verifying pass in brackets)",
        "",
        f"- lengths: every system's output is at most {meta.get('max_len_a', 0)} x source length + "
        f"{meta['max_len_b']} tokens; len: hypothesis / reference length (sacreBLEU tokens), "
        "BP: BLEU's brevity penalty",
        "",
        "| system | BLEU | chrF | len (BP) | COMET | passes/sent | "
        + " | ".join(f"bs={b} words/s" for b in bss)
        + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(bss),
    ]


def _system_row(s: dict, bss: List[str]) -> str:
    """A system's row of the table."""
    cells = []
    for b in bss:
        sp = s["speed"][b]
        ratio = f" ({sp['ratio_vs_baseline']:.2f}x)" if sp["ratio_vs_baseline"] is not None else ""
        cells.append(f"{sp['words_per_second']:.1f}{ratio}")
    comet_cell = f"{s['comet']:.4f}" if s["comet"] is not None else "n/a"
    passes = s.get("passes_per_sentence")
    passes_cell = f"{passes:.2f}" if passes is not None else "-"
    if s.get("accepted_per_verify_pass") is not None:
        passes_cell += f" ({s['accepted_per_verify_pass']:.2f})"
    length_cell = f"{s['length_ratio']:.3f} ({s['brevity_penalty']:.3f})" if s.get("length_ratio") is not None else "-"
    return (
        f"| {s['name']} | {s['bleu']:.2f} | {_num(s.get('chrf'))} | {length_cell} | {comet_cell} | {passes_cell} | "
        + " | ".join(cells)
        + " |"
    )


def _report_notes(report: dict, bss: List[str]) -> List[str]:
    """The report's lines after the table: Pareto fronts, caveats, agreement, skipped rows and
    the checkpoints' shapes."""
    meta, lines = report["meta"], []
    for b in bss:
        lines.append(f"Pareto front (BLEU vs words/s), batch {b}: " + ", ".join(report["pareto"][b]))
    if meta.get("threads", 1) > 1 and any(s.get("family") == CT2_FAMILY for s in report["systems"]):
        # CTranslate2's threads are slow in a process whose PyTorch ran first (the reports show
        # by how much); loading CTranslate2 before PyTorch's first op avoids it
        lines += [
            "",
            "CTranslate2 rows with more than one thread: CTranslate2's OpenMP threads run several "
            "times slower in a process where PyTorch's OpenMP threads started first (as here); "
            "read them as a lower bound and compare with a one-thread run.",
        ]
    if report.get("agreement"):
        lines += ["", "Engines against lean (identical output sentences, BLEU difference):"]
        lines += [
            f"- {a['system']}: {a['identical']}/{a['sentences']} identical to {a['reference']} "
            f"({100.0 * a['identical'] / max(1, a['sentences']):.1f} %), BLEU {a['bleu_difference']:+.2f}"
            for a in report["agreement"]
        ]
    if report["skipped"]:
        lines += [""] + [f"Skipped {sk.get('system') or sk['family']}: {sk['reason']}" for sk in report["skipped"]]
    shapes = {s["checkpoint"]: s["shape"] for s in report["systems"] if s.get("shape")}
    if shapes:
        lines += ["", "| checkpoint | arch | embedding dim | encoder layers | decoder layers | parameters |"]
        lines += ["|---|---|---:|---:|---:|---:|"]
        lines += [
            f"| `{path}` | {m['arch']} | {m['embed_dim']} | {m['encoder_layers']} | {m['decoder_layers']} | "
            f"{m['parameters']:,} |"
            for path, m in shapes.items()
        ]
    return lines


def markdown_report(report: dict) -> str:
    bss = [str(b) for b in report["meta"]["batch_sizes"]]
    lines = _report_header(report, bss)
    lines += [_system_row(s, bss) for s in report["systems"]]
    for sk in report["skipped"]:
        lines.append(
            f"| {sk.get('system') or sk['family']}: skipped | - | - | - | - | - | "
            + " | ".join("-" for _ in bss)
            + " |"
        )
    lines.append("")
    lines += _report_notes(report, bss)
    return "\n".join(lines) + "\n"


def _num(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def pareto_png(report: dict) -> bytes:
    """The PNG bytes of :func:`pareto_plot`."""
    buf = io.BytesIO()
    pareto_plot(report, buf)
    return buf.getvalue()


def pareto_plot(report: dict, path):
    """BLEU vs words/s, one panel per batch size, Pareto front as a dashed line (``path``: a
    file name or a binary file object)."""
    import matplotlib  # noqa: PLC0415 - optional: matplotlib, for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional: matplotlib, for plots

    bss = [str(b) for b in report["meta"]["batch_sizes"]]
    systems = report["systems"]
    ncols = min(2, len(bss))
    nrows = (len(bss) + ncols - 1) // ncols
    # points carry a number, the names stand in a key below the panels: names written next to
    # the points ran over each other wherever systems are close (most of them are)
    key_rows = (len(systems) + 1) // 2
    fig = plt.figure(figsize=(7 * ncols, 5 * nrows + 0.22 * key_rows + 0.4))
    grid = fig.add_gridspec(nrows + 1, ncols, height_ratios=[5] * nrows + [0.22 * key_rows + 0.4])
    axes = [fig.add_subplot(grid[r, c]) for r in range(nrows) for c in range(ncols)]
    colors = {"AT": "tab:blue", CT2_FAMILY: "tab:purple", "HRT": "tab:red", "MP": "tab:green"}
    for ax, b in zip(axes, bss):
        xs = [s["speed"][b]["words_per_second"] for s in systems]
        ys = [s["bleu"] for s in systems]
        on_front = set(report["pareto"][b])
        for number, (s, x, y) in enumerate(zip(systems, xs, ys), 1):
            ax.scatter(
                x, y, color=colors[s["family"]], s=30, zorder=3, edgecolors="black" if s["name"] in on_front else "none"
            )
            ax.annotate(str(number), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = [systems.index(next(s for s in systems if s["name"] == n)) for n in report["pareto"][b]]
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "k--", lw=1, zorder=2, label="Pareto front")
        if xs and max(xs) > 10 * min(xs):
            ax.set_xscale("log")
        ax.set_title(f"batch size {b}")
        ax.set_xlabel("source words / second")
        ax.set_ylabel("BLEU")
        ax.grid(alpha=0.3)
        for fam, c in colors.items():
            if any(s["family"] == fam for s in systems):
                ax.scatter([], [], color=c, label=fam)
        ax.legend(fontsize=8, loc="best")
    for ax in axes[len(bss) :]:
        ax.axis("off")
    key = fig.add_subplot(grid[nrows, :])
    key.axis("off")
    for number, s in enumerate(systems, 1):
        column, row = divmod(number - 1, key_rows)
        key.text(
            0.01 + 0.5 * column,
            1 - (row + 0.5) / key_rows,
            f"{number}  {s['name']}",
            fontsize=7,
            color=colors[s["family"]],
            va="center",
            transform=key.transAxes,
        )
    meta = report["meta"]
    fig.suptitle(f"BLEU vs speed ({meta['device']}, {meta['threads']} thread(s))", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


# --------------------------------------------------------------------------- measuring


def comet_for(systems: List[System], raw_src, refs, hyps, args) -> dict:
    """Score every system with a local COMET model, or say why COMET is not available."""
    try:
        model = resolve_comet_model(args.comet_model)
        for s in systems:
            s.comet = comet_score(raw_src, hyps[s.name], refs, model_path=model, encoder_path=args.comet_encoder)[
                "score"
            ]
    except CometUnavailable as e:
        for s in systems:
            s.comet = None
        logger.warning("COMET: not available (%s)", e)
        return {"available": False, "reason": str(e), "model": None}
    return {"available": True, "reason": None, "model": model}


def choose_device(args) -> bool:
    """Threads, device and ``--int8`` (``auto``: on CPU) of the run; whether it uses a GPU."""
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.fp16 and not use_cuda:
        raise SystemExit("--fp16 needs a GPU (half-precision matmuls on CPU are not a speed-up)")
    int8_rows = args.int8 == "yes" or (args.int8 == "auto" and not use_cuda)
    if int8_rows and use_cuda:
        raise SystemExit("--int8 yes: dynamic int8 quantization is for CPU decoding (add --cpu)")
    args.int8 = "yes" if int8_rows else "no"
    return use_cuda


def systems_to_measure(args, use_cuda: bool):
    """``(systems, skipped)`` of the command line; CTranslate2's rows left out (with the
    reason) when it cannot run here, unless ``--ctranslate2 yes`` asked for them."""
    systems, skipped = systems_from_args(args)
    if not systems:
        raise SystemExit("no system to measure: give at least one of --at, --hrt, --mp")
    if any(s.family == CT2_FAMILY for s in systems):
        reason = ct2_reference.unavailable_reason(use_cuda)
        if reason and args.ctranslate2 == "yes":
            raise SystemExit(f"--ctranslate2 yes: {reason}")
        if reason:
            logger.warning("CTranslate2 rows skipped: %s", reason)
            systems = [s for s in systems if s.family != CT2_FAMILY]
            skipped.append({"family": "CTranslate2", "reason": reason})
    return systems, skipped


def read_test_set(args):
    """``(src, raw_src, refs)``: the test set's lines, refused unless aligned."""
    src = read_lines(args.src, args.max_sentences)
    raw_src = read_lines(args.raw_src, args.max_sentences)
    refs = read_lines(args.raw_ref, args.max_sentences)
    if not len(src) == len(raw_src) == len(refs):
        raise SystemExit(
            f"--src, --raw-src, --raw-ref have {len(src)}, {len(raw_src)}, {len(refs)} lines; they must be aligned"
        )
    return src, raw_src, refs


def make_runners(systems: List[System], ctx: Context, skipped: List[dict]):
    """``(systems, runners)``: a runner per system its adapter can decode; the others are added
    to ``skipped`` with the adapter's reason."""
    shared, runners = {}, {}
    for s in systems:
        reason = adapter_of(s).refused(s, ctx)
        if reason:  # e.g. an ONNX Runtime row of a checkpoint the exporter cannot take
            logger.warning("%s: left out: %s", s.name, reason)
            skipped.append({"family": s.family, "system": s.name, "reason": reason})
        else:
            runners[s.name] = adapter_of(s).runner(s, ctx, shared)
    return [s for s in systems if s.name in runners], runners


@dataclass
class Bench:
    """What the steps of one run share: its rows and their runners, the test set, and the
    resume state (``state.data["outputs"]``: system -> its decoder passes, from a pass over
    every sentence; its texts are in ``hyps/``)."""

    args: argparse.Namespace
    use_cuda: bool
    systems: List[System]
    runners: Dict[str, object]
    src: List[str]
    raw_src: List[str]
    refs: List[str]
    n_bs1: int
    state: "ResumeState"

    @property
    def outputs(self) -> dict:
        return self.state.data["outputs"]

    def hyps_file(self, s: System) -> str:
        return os.path.join(self.args.out_dir, "hyps", slug(s.name) + ".txt")

    def keep_outputs(self, s: System, hyps, before) -> None:
        """The row's outputs (into ``hyps/``) and decoder passes, from its first passes over
        every sentence (the counters of ``before`` are diffed: per sentence, so any number of passes)."""
        if s.name not in self.outputs:
            passes, accepted = self.runners[s.name].passes(hyps, before)
            texts = self.runners[s.name].texts(hyps, len(self.src))
            write_file(self.hyps_file(s), "".join(h + "\n" for h in texts))
            self.outputs[s.name] = {"passes_per_sentence": passes, "accepted_per_verify_pass": accepted}


def measure_batch_size(bench: Bench, bs: int, bar) -> None:
    """Time every system at batch size ``bs`` (round-robin passes after a warm-up) into its
    ``speed``, and save the batch size in the resume state."""
    args, systems, runners = bench.args, bench.systems, bench.runners
    lines = bench.src[: bench.n_bs1] if bs == 1 else bench.src
    words = source_words(bench.raw_src[: len(lines)])
    prepared = {s.name: runners[s.name].prepare(lines, bs) for s in systems}
    for s in systems:  # warm-up: first calls allocate memory and pick kernels
        runners[s.name].run(prepared[s.name], warm_up=True)
    runs = args.runs if bs == 1 else args.runs_large
    before = {s.name: runners[s.name].counters() for s in systems}

    def progress(name, r):
        if r or name != systems[0].name:
            bar.update(1)
        bar.set_postfix_str(f"bs={bs} {name}")

    timings = time_runs(
        {s.name: functools.partial(runners[s.name].run, prepared[s.name]) for s in systems},
        runs=runs,
        sync=cuda_sync(bench.use_cuda),
        before_each=progress,
    )
    bar.update(1)
    for s in systems:
        t = timings[s.name]
        if len(lines) == len(bench.src):
            bench.keep_outputs(s, t.value, before[s.name])
        s.speed[str(bs)] = {
            "words_per_second": words / t.mean,
            "seconds": t.mean,
            "run_seconds": list(t.seconds),
            "stdev_seconds": t.stdev,
            "sentences": len(lines),
            "words": words,
        }
        logger.info("%-28s batch %4d: %9.1f words/s (%d run(s), %.3fs)", s.name, bs, words / t.mean, runs, t.mean)
    bench.state.data["batch_sizes"][str(bs)] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "speed": {s.name: s.speed[str(bs)] for s in systems},
    }
    bench.state.save()


def measure_speeds(bench: Bench, batch_sizes: List[int]) -> Dict[int, str]:
    """Every system's speed at every batch size: those an interrupted run of the same command
    finished are taken from the resume state, the others measured. Returns the resumed ones
    (batch size -> when they were measured)."""
    args, systems = bench.args, bench.systems
    measured = bench.state.data["batch_sizes"]  # str(bs) -> {"date", "speed": {system: ...}}, as they finish
    resumed = {b: measured[str(b)]["date"] for b in batch_sizes if str(b) in measured}
    for b, date in resumed.items():
        logger.info("batch size %d: taken from the interrupted run of %s (%s)", b, date, bench.state.path)
    todo = [bs for bs in batch_sizes if bs not in resumed]
    total_passes = sum((args.runs if bs == 1 else args.runs_large) * len(systems) for bs in todo)
    bar = tqdm(total=total_passes, desc="benchmark", unit="pass", disable=None)
    for bs in todo:
        measure_batch_size(bench, bs, bar)
    bar.close()
    for s in systems:
        for b in resumed:
            s.speed[str(b)] = measured[str(b)]["speed"][s.name]
    return resumed


def score_quality(bench: Bench, batch_sizes: List[int]):
    """Every system's BLEU, chrF, length ratio and decoder passes, from its outputs over the
    whole test set (decoded once, untimed, when no timed pass covered it). Returns
    ``(hyps, BLEU signature, chrF signature)``."""
    for s in bench.systems:  # quality needs every sentence: decode it once, untimed, if no pass did
        if s.name not in bench.outputs:
            runner = bench.runners[s.name]
            before = runner.counters()
            bench.keep_outputs(s, runner.run(runner.prepare(bench.src, max(batch_sizes))), before)
            bench.state.save()
    hyps, signature, chrf_signature = {}, None, None
    for s in bench.systems:
        hyps[s.name] = read_lines(bench.hyps_file(s))
        s.passes_per_sentence = bench.outputs[s.name]["passes_per_sentence"]
        s.accepted_per_verify_pass = bench.outputs[s.name]["accepted_per_verify_pass"]
        bleu = sacrebleu_score(hyps[s.name], bench.refs)
        s.bleu, signature = bleu["score"], bleu["signature"]
        chrf = chrf_score(hyps[s.name], bench.refs)
        s.chrf, chrf_signature = chrf["score"], chrf["signature"]
        s.length_ratio, s.brevity_penalty = bleu["sys_len"] / max(1, bleu["ref_len"]), bleu["bp"]
    return hyps, signature, chrf_signature


def compare_rows(systems: List[System], batch_sizes: List[int]):
    """``(baselines, pareto)``: each speed's ratio to the batch size's baseline (set in the
    rows), the baseline per batch size, and the rows on the speed/BLEU Pareto front."""
    baselines = fastest_baseline(systems, [str(b) for b in batch_sizes])
    ratios = speed_ratios({s.name: {b: v["words_per_second"] for b, v in s.speed.items()} for s in systems}, baselines)
    for s in systems:
        for b, v in s.speed.items():
            v["ratio_vs_baseline"] = ratios[s.name][b]
    pareto = {}
    for b in map(str, batch_sizes):
        front = pareto_front([(s.speed[b]["words_per_second"], s.bleu) for s in systems])
        pareto[b] = [systems[i].name for i in front]
    return baselines, pareto


def report_meta(bench: Bench, batch_sizes: List[int], baselines, resumed: Dict[int, str], rel) -> dict:
    """The report's ``meta``: when, where and how it was measured, and on which test set."""
    args, raw_src, n_bs1 = bench.args, bench.raw_src, bench.n_bs1
    device = torch.cuda.get_device_name() if bench.use_cuda else f"CPU ({cpu_name()})"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device + (" fp16" if args.fp16 else ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "fairseq": fairseq.__version__,
        "python": platform.python_version(),
        "batch_sizes": batch_sizes,
        "runs_bs1": args.runs,
        "runs_large": args.runs_large,
        "baseline": "the fastest AT greedy of this run" if baselines else None,
        "baseline_per_batch_size": baselines,
        # {batch size: when it was measured} for those an earlier, interrupted process of the
        # same command measured (--resume); the others were measured by this one
        "resumed_batch_sizes": {str(b): date for b, date in resumed.items()},
        "engines": parse_engines(args.engines),
        "max_len_a": args.max_len_a,
        "max_len_b": args.max_len_b,
        "lenpen": args.lenpen,
        "test": {
            "src": rel(args.src),
            "raw_src": rel(args.raw_src),
            "raw_ref": rel(args.raw_ref),
            "sentences": len(bench.src),
            "words": source_words(raw_src),
            "bs1_sentences": n_bs1,
            "bs1_words": source_words(raw_src[:n_bs1]),
        },
    }


def run(args) -> dict:
    use_cuda = choose_device(args)
    systems, skipped = systems_to_measure(args, use_cuda)
    batch_sizes = parse_ints(args.batch_sizes)
    src, raw_src, refs = read_test_set(args)
    n_bs1 = min(args.bs1_sentences, len(src)) if args.bs1_sentences else len(src)
    ctx = Context(
        args.data,
        args.spm,
        args.out_dir,
        use_cuda=use_cuda,
        fp16=args.fp16,
        threads=args.threads,
        max_len_b=args.max_len_b,
        lenpen=args.lenpen,
        max_len_a=args.max_len_a,
    )
    systems, runners = make_runners(systems, ctx, skipped)
    state = ResumeState(
        os.path.join(args.out_dir, RESUME_FILE), command_fingerprint(args, [s.name for s in systems]), args.resume
    )
    bench = Bench(args, use_cuda, systems, runners, src, raw_src, refs, n_bs1, state)
    for name in [s.name for s in systems if s.name in bench.outputs and not os.path.exists(bench.hyps_file(s))]:
        del bench.outputs[name]  # its texts were lost with the folder's hyps/: decode them again

    resumed = measure_speeds(bench, batch_sizes)
    hyps, signature, chrf_signature = score_quality(bench, batch_sizes)
    comet = comet_for(systems, raw_src, refs, hyps, args)
    translated = translate_sets(args, systems, runners, max(batch_sizes), state)
    baselines, pareto = compare_rows(systems, batch_sizes)

    def rel(path):  # the report is read on other machines: paths relative to its folder
        return os.path.relpath(os.path.abspath(path), os.path.abspath(args.out_dir))

    return {
        "meta": report_meta(bench, batch_sizes, baselines, resumed, rel),
        "bleu_signature": signature,
        "chrf_signature": chrf_signature,
        "comet": comet,
        "systems": [
            dict(
                asdict(s),
                checkpoint=rel(s.checkpoint),
                hyps=rel(bench.hyps_file(s)),  # its test outputs, for paired comparisons of the rows
                decoding=relative_paths(s.decoding, rel),
                shape=model_shape(s.checkpoint),
            )
            for s in systems
        ],
        "translated": {name: {"source": rel(path), "folder": folder} for name, (path, folder) in translated.items()},
        "skipped": skipped,
        "pareto": pareto,
        "agreement": engine_agreement(hyps, {s.name: s.bleu for s in systems}),
    }


def translate_sets(args, systems, runners, batch_size, state: "ResumeState") -> Dict[str, tuple]:
    """``--translate NAME=RAW_FILE``: every system translates the file (SentencePiece of
    ``--spm``, batches of ``batch_size``, untimed) into ``OUT/<--translations-dir>/NAME/<system><ext>``
    (``ext``: the reference's, e.g. ``.de``), one detokenised line per source line; a file that
    ``state`` lists as written (by an interrupted run of the same command) is kept.
    ``{NAME: (RAW_FILE, folder relative to OUT)}``."""
    sets = parse_named_checkpoints(args.translate, "--translate", "RAW_FILE")
    if not sets:
        return {}
    spm = sentencepiece.SentencePieceProcessor(model_file=args.spm)
    ext = os.path.splitext(args.raw_ref)[1] or ".txt"
    out = {}
    for name, path in sets:
        raw = read_lines(path)
        pieces = [" ".join(spm.encode(line, out_type=str)) for line in raw]
        folder = os.path.join(args.translations_dir, name)
        done = state.data["translated"].setdefault(f"{name}={os.path.abspath(path)}", [])
        for s in systems:
            target = os.path.join(args.out_dir, folder, s.name + ext)
            if s.name in done and os.path.exists(target):
                continue
            runner = runners[s.name]
            texts = runner.texts(runner.run(runner.prepare(pieces, batch_size)), len(pieces))
            write_file(target, "".join(t + "\n" for t in texts))
            done.append(s.name)
            state.save()
        logger.info("%s: %d lines translated by %d systems into %s", path, len(raw), len(systems), folder)
        out[name] = (path, folder)
    return out


def _add_system_arguments(g) -> None:
    """The checkpoints and the rows of each family."""
    g.add_argument("--at", help="AT checkpoint (fairseq transformer / at_* arch)")
    g.add_argument("--at-beams", default="1,5", help="AT beam sizes; beam 1 = AT greedy, the speed baseline")
    g.add_argument(
        "--at-extra",
        action="append",
        default=[],
        metavar="NAME=CKPT",
        help="another AT checkpoint (e.g. an SSRU student), rows 'AT[NAME] greedy' / 'AT[NAME] beam b'; "
        "its greedy rows are baseline candidates too (repeatable)",
    )
    g.add_argument("--hrt", help="HRT checkpoint")
    g.add_argument(
        "--hrt-extra",
        action="append",
        default=[],
        metavar="NAME=CKPT",
        help="another HRT checkpoint (e.g. another seed), rows 'HRT[NAME] ...' for every chunk size and "
        "beam pair (not the --hrt-options rows; repeatable)",
    )
    g.add_argument("--hrt-chunk-sizes", default="2", help="chunk sizes k (each trained by the model)")
    g.add_argument("--hrt-beams", default="1/1,5/1", help="b_at/b_nat pairs; AT mode is run with each b_at")
    g.add_argument(
        "--hrt-at-mode",
        choices=("yes", "no"),
        default="yes",
        help="the HRT models' AT-mode rows ('HRT AT-mode b=...'); 'no' leaves them out, e.g. for models "
        "trained on with p_k = 1, whose AT mode has decayed and which are compared with their AT "
        "students instead",
    )
    g.add_argument(
        "--hrt-options",
        nargs="+",
        metavar="NAME:OPTION=VALUE,...",
        default=[],
        help="more HRT rows (first chunk size and b_at/b_nat pair) with decoding options by name, e.g. "
        "refine20:hrt_refine_fraction=0.2 fallback:hrt_fallback_threshold=-1.0 "
        "rescore:hrt_rescore=true,beam=5,b_nat=5",
    )
    g.add_argument(
        "--ctranslate2",
        choices=("auto", "yes", "no"),
        default="auto",
        help="also decode the --at checkpoint with CTranslate2 (the outside AT speed reference): auto = when "
        "the ctranslate2 package is installed (else the report says why not), yes = required, no = never",
    )
    g.add_argument("--mp", help="Mask-Predict (CMLM) checkpoint")
    g.add_argument("--mp-iterations", default="1,4,10", help="Mask-Predict iterations I")
    g.add_argument("--mp-length-beam", type=int, default=5, help="Mask-Predict length candidates l")
    g.add_argument(
        "--parallel",
        default="",
        help="rows of the strategies that decode with their own passes, comma-separated (every such "
        "registered strategy: Jacobi pj, pgj, hgj of --at, hrt-spec of --hrt); default none; pj decodes "
        "the whole maximum length per pass: slow",
    )
    g.add_argument("--jacobi-block-size", type=int, default=3, help="b of the PGJ / HGJ rows")
    g.add_argument("--spec-block-size", type=int, default=4, help="drafted tokens per pass of the hrt-spec row")


def _add_decoding_arguments(g) -> None:
    """The engines, row variants and length limits every system decodes with."""
    g.add_argument(
        "--engines",
        default="lean,fairseq",
        help="decoder engines of the AT and HRT rows (--decoder-engine), comma-separated: any registered "
        "engine (lean, fairseq, onnxruntime: it exports each checkpoint once to $FAIRSEQ_HRT_ONNX_CACHE)",
    )
    g.add_argument(
        "--compile",
        choices=("no", "yes"),
        default="no",
        help="add a compiled (--compile: torch.compile of the lean engine's step) row per AT and HRT "
        "system; the first batch of each row pays the compilation (its warm-up)",
    )
    g.add_argument(
        "--int8",
        choices=("auto", "yes", "no"),
        default="auto",
        help="add an int8 (--quantize int8) row per system on the default engine (PyTorch's int8) and on "
        "each engine of --engines that quantizes its own graphs (onnxruntime), and CTranslate2's int8 "
        "beside its float row: auto = on CPU",
    )
    g.add_argument(
        "--shortlist",
        metavar="FILE",
        help="a lexical shortlist (fairseq-hrt-shortlist): adds a '+shortlist' row per AT, HRT and "
        "Mask-Predict configuration and engine of --engines that supports shortlists (lean, "
        "onnxruntime), and a CTranslate2 '+vmap' row per CTranslate2 row (its vocabulary map of the "
        "same shortlist)",
    )
    g.add_argument(
        "--max-len-a",
        type=float,
        default=0.0,
        help="maximum target length a x source length + b (fairseq's --max-len-a) for every system, "
        "the same for AT, HRT and CTranslate2: a runaway output then decides neither BLEU nor "
        "its batch's time; 0 = L = --max-len-b",
    )
    g.add_argument("--max-len-b", type=int, default=200, help="L, the maximum target length (b of a x src + b)")
    g.add_argument("--lenpen", type=float, default=1.0, help="length penalty of the beam searches")


def _add_measuring_arguments(g) -> None:
    g.add_argument("--batch-sizes", default="1,8,32,128")
    g.add_argument("--runs", type=int, default=5, help="passes averaged at batch size 1")
    g.add_argument("--runs-large", type=int, default=1, help="passes averaged at larger batch sizes")
    g.add_argument("--bs1-sentences", type=int, default=100, help="sentences decoded at batch size 1 (0 = all)")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads (recorded in the report)")
    g.add_argument("--cpu", action="store_true", help="decode on CPU even if a GPU is present")
    g.add_argument("--fp16", action="store_true", help="half precision (GPU only)")
    g.add_argument(
        "--comet-model", help="local COMET model dir or .ckpt (default: $COMET_MODEL; nothing is downloaded)"
    )
    g.add_argument("--comet-encoder", help="local files of the COMET model's encoder (see fairseq-hrt-comet --help)")


def _add_output_arguments(g) -> None:
    g.add_argument("--out-dir", required=True, help="report.json, report.md, pareto.png and hyps/ go here")
    g.add_argument("--log-file", help="write the log to this file instead of stderr")
    g.add_argument(
        "--resume",
        action="store_true",
        help=f"go on from an interrupted run of the same command in --out-dir (OUT/{RESUME_FILE}, saved as "
        "it goes): the batch sizes it measured (their speeds, from that process, dated in the report), the "
        "outputs it decoded and the --translate files it wrote are kept; options, systems or checkpoint "
        "files that changed start it again",
    )
    g.add_argument(
        "--translate",
        action="append",
        default=[],
        metavar="NAME=RAW_FILE",
        help="also translate this raw source with every system (untimed, not scored) into "
        "OUT/<--translations-dir>/NAME/<system>.<reference's extension> (repeatable)",
    )
    g.add_argument("--translations-dir", default="translations", help="folder of --translate's outputs in OUT")


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """One line (argparse's error) for values the parser's types do not refuse."""
    if args.runs < 1 or args.runs_large < 1 or args.threads < 1:
        p.error("--runs, --runs-large and --threads must be >= 1")
    try:
        parse_beam_pairs(args.hrt_beams)
        parse_named_checkpoints(args.at_extra)
        parse_named_checkpoints(args.hrt_extra, "--hrt-extra")
        parse_named_checkpoints(args.translate, "--translate", "RAW_FILE")
        if not parse_ints(args.batch_sizes) or min(parse_ints(args.batch_sizes)) < 1:
            raise ValueError("--batch-sizes must list positive integers")
    except ValueError as e:
        p.error(str(e))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_arguments(p.add_argument_group("data"))
    g = p.add_argument_group("systems (a family is skipped when its checkpoint is not given)")
    _add_system_arguments(g)
    _add_decoding_arguments(g)
    _add_measuring_arguments(p.add_argument_group("measuring"))
    _add_output_arguments(p.add_argument_group("output"))
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    setup_logging(args.log_file)
    os.makedirs(args.out_dir, exist_ok=True)
    timed = time_runs(lambda: run(args))
    report = timed.value
    report["meta"]["benchmark_seconds"] = round(timed.total, 1)
    md = markdown_report(report)
    # written together, report.json last: it exists only for a complete run
    write_files(
        args.out_dir,
        {"pareto.png": pareto_png(report), "report.md": md, "report.json": json.dumps(report, indent=2) + "\n"},
    )
    state_file = os.path.join(args.out_dir, RESUME_FILE)
    if os.path.exists(state_file):  # complete: report.json, never both
        os.remove(state_file)
    print(md)
    logger.info("wrote %s in %.0fs", os.path.join(args.out_dir, "report.{json,md}, pareto.png"), timed.total)
    return report


if __name__ == "__main__":
    main()
