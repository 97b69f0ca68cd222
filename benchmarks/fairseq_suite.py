"""fairseq's own tests, stock and with the plugin imported: does importing fairseq_hrt change fairseq?

Runs each given file of fairseq's ``tests/`` twice, each run in a fresh ``pytest`` process: once
stock, once with ``import fairseq_hrt`` done before the tests are collected (what ``--user-dir
fairseq_hrt`` or an ``import fairseq_hrt`` does to a process). Every test's outcome is recorded as
it finishes (a file that runs past ``--timeout`` keeps the outcomes it reached), and
``report.md`` / ``report.json`` list the counts and every test whose outcome differs, with the
effect of importing the plugin that explains it when one does (docs/compatibility.md).

fairseq's tests are not part of this repository: take them from fairseq's git tag, e.g.
``git --git-dir=<fairseq clone>/.git archive v0.12.3 tests | tar x -C /tmp/fairseq-tests``, and
pass ``--fairseq-tests /tmp/fairseq-tests`` (the folder that holds ``tests/``).

    python -m benchmarks.fairseq_suite --fairseq-tests /tmp/fairseq-tests
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "fairseq-suite"
MODES = ("stock", "plugin")

# test_binaries.py's TestTranslation (its 29 train/generate runs; the whole file is 54 tests, over
# an hour a run on 2 shared cores: pass --files test_binaries.py ... for it), and the files
# docs/compatibility.md names (fairseq's tests that touch checkpoints, training, data and
# scoring); test_checkpoint_utils_for_task_level_attributes.py is from fairseq's main branch
DEFAULT_FILES = (
    "test_binaries.py::TestTranslation",
    "test_train.py",
    "test_checkpoint_utils.py",
    "test_checkpoint_utils_for_task_level_attributes.py",
    "test_dictionary.py",
    "test_iterators.py",
    "test_data_utils.py",
    "test_utils.py",
    "test_file_io.py",
    "test_valid_subset_checks.py",
    "test_label_smoothing.py",
    "test_token_block_dataset.py",
    "test_concat_dataset.py",
    "test_noising.py",
    "test_metrics.py",
    "test_binarizer.py",
    "test_sequence_scorer.py",
)

# A stock failure that the plugin turns green is explained by what importing the plugin does to
# the process (docs/compatibility.md) when its message says so; by what fairseq's failure says.
FIXES_BY_FAILURE = {
    "weights only load failed": "compat: the types fairseq checkpoints pickle (argparse.Namespace, numpy "
    "metrics, omegaconf containers) are on PyTorch's allow-list (torch.serialization.add_safe_globals); "
    "torch.load keeps weights_only=True",
}

# Loaded into both runs with -p: records each test's outcome as it finishes; in the plugin run it
# imports fairseq_hrt first, as --user-dir does.
RECORDER = """
import json, os

if os.environ.get("FAIRSEQ_SUITE_IMPORT_PLUGIN") == "1":
    import fairseq_hrt  # noqa: F401

_OUT = os.environ["FAIRSEQ_SUITE_OUTCOMES"]


def pytest_collectreport(report):
    if report.failed:
        with open(_OUT, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "outcome": "error", "when": "collect",
                                "message": str(report.longrepr).splitlines()[-1][:300]}) + "\\n")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.when != "call" and report.failed:
            outcome = "error"
        else:
            outcome = report.outcome
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else ""
        if not message and isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            message = str(report.longrepr[-1])
        with open(_OUT, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "outcome": outcome, "when": report.when,
                                "message": message.splitlines()[0][:300] if message else ""}) + "\\n")
"""


def run_file(fairseq_tests: Path, test_file: str, mode: str, work: Path, timeout: float, plugin_path=()) -> dict:
    """One pytest process for ``test_file`` in ``mode``: ``{"outcomes": {test: record}, ...}``;
    ``plugin_path``: folders that hold another copy of fairseq_hrt and hrt_runtime (e.g. a
    ``git archive`` of an earlier commit), searched before the installed ones."""
    outcomes_path = work / f"{mode}-{test_file.replace('::', '-')}.jsonl"
    outcomes_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(work), *map(str, plugin_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        FAIRSEQ_SUITE_OUTCOMES=str(outcomes_path),
        FAIRSEQ_SUITE_IMPORT_PLUGIN="1" if mode == "plugin" else "0",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fairseq_suite_recorder"]
    cmd += [f"tests/{test_file}"]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=fairseq_tests, env=env, capture_output=True, text=True, timeout=timeout)
        timed_out, tail = False, (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        timed_out = True
        tail = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))[-2000:]
    outcomes = {}
    if outcomes_path.exists():
        for line in outcomes_path.read_text().splitlines():
            record = json.loads(line)
            # setup/call/teardown: a failure anywhere decides; the call's outcome otherwise
            if record["test"] not in outcomes or record["outcome"] in ("failed", "error"):
                outcomes[record["test"]] = record
    return {
        "file": test_file,
        "mode": mode,
        "seconds": round(time.monotonic() - start, 1),
        "timed_out": timed_out,
        "outcomes": outcomes,
        "output_tail": tail if not outcomes or timed_out else "",
    }


def _installed_version(*distributions: str) -> str:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "?"


def _in_file(test: str, file_spec: str) -> bool:
    return test.startswith(f"tests/{file_spec}")


def counts(outcomes: dict) -> dict:
    total = {}
    for record in outcomes.values():
        total[record["outcome"]] = total.get(record["outcome"], 0) + 1
    return dict(sorted(total.items()))


def explain(stock: dict, plugin: dict) -> str:
    if stock and plugin and stock["outcome"] in ("failed", "error") and plugin["outcome"] == "passed":
        for clue, fix in FIXES_BY_FAILURE.items():
            if clue.lower() in stock["message"].lower():
                return fix
    return ""


def compare(results: list) -> dict:
    merged = {mode: {} for mode in MODES}
    for result in results:
        merged[result["mode"]].update(result["outcomes"])
    differing = []
    for test in sorted(set(merged["stock"]) | set(merged["plugin"])):
        stock, plugin = merged["stock"].get(test), merged["plugin"].get(test)
        if (stock or {}).get("outcome") != (plugin or {}).get("outcome"):
            differing.append(
                {
                    "test": test,
                    "stock": stock["outcome"] if stock else "not run",
                    "plugin": plugin["outcome"] if plugin else "not run",
                    "stock_message": stock["message"] if stock else "",
                    "plugin_message": plugin["message"] if plugin else "",
                    "explained_by": explain(stock, plugin),
                }
            )
    failing = {
        mode: sorted(t for t, r in merged[mode].items() if r["outcome"] in ("failed", "error")) for mode in MODES
    }
    return {
        "counts": {mode: counts(merged[mode]) for mode in MODES},
        "differing": differing,
        "unexplained": [d["test"] for d in differing if not d["explained_by"]],
        "failing": failing,
        "messages": {mode: {t: merged[mode][t]["message"] for t in failing[mode]} for mode in MODES},
    }


def _plain(message: str) -> str:
    """A message without its terminal colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", message).strip()


def _count_line(c: dict) -> str:
    return ", ".join(f"{n} {outcome}" for outcome, n in c.items()) or "nothing ran"


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    summary = report["summary"]
    lines = [
        "# fairseq's own tests, stock and with the plugin imported",
        "",
        f"fairseq {report['fairseq_version']} tests (`{report['fairseq_tests_ref']}`), PyTorch "
        f"{report['torch_version']}, Python {report['python_version']}; each file in a fresh pytest process, "
        "once stock and once with `import fairseq_hrt` first. Made by `python -m benchmarks.fairseq_suite` "
        f"(files: {', '.join(report['files'])})"
        + "".join(f"; the {mode} outcomes are those of the run of `{path}`" for mode, path in report["reused"].items())
        + ".",
        *(["", report["note"]] if report.get("note") else []),
        "",
        "| | " + " | ".join(MODES) + " |",
        "| --- | " + " | ".join("---" for _ in MODES) + " |",
        "| now | " + " | ".join(_count_line(summary["counts"][m]) for m in MODES) + " |",
    ]
    before = report.get("before")
    if before:
        lines.append(
            f"| before ({before['label']}) | " + " | ".join(_count_line(before["counts"][m]) for m in MODES) + " |"
        )
    lines += ["", "## Tests whose outcome differs", ""]
    if not summary["differing"]:
        lines.append("None: every test has the same outcome stock and with the plugin.")
    explained = {}
    for d in summary["differing"]:
        if d["explained_by"]:
            explained.setdefault((d["explained_by"], d["stock"], d["plugin"]), []).append(d)
            continue
        lines.append(f"* `{d['test']}`: stock {d['stock']}, plugin {d['plugin']}: **not explained by a listed fix**")
        for mode in MODES:
            if d[f"{mode}_message"]:
                lines.append(f"  * {mode}: `{_plain(d[f'{mode}_message'])}`")
    for (why, stock, plugin), tests in explained.items():
        first_failure = _plain(tests[0]["stock_message"])
        lines.append(
            f"* {len(tests)} tests, stock {stock} and plugin {plugin}: {why}. Stock's failure: `{first_failure}`"
        )
        lines.append("  " + ", ".join(f"`{d['test'].removeprefix('tests/')}`" for d in tests))
    if before:
        changed = sorted(
            t
            for t in set(before["plugin_outcomes"]) | set(report["outcomes"]["plugin"])
            if before["plugin_outcomes"].get(t, {}).get("outcome")
            != report["outcomes"]["plugin"].get(t, {}).get("outcome")
        )
        lines += ["", f"## With the plugin: now against {before['label']}", ""]
        if not changed:
            lines.append("Every test has the same outcome.")
        for t in changed:
            was = before["plugin_outcomes"].get(t, {}).get("outcome", "not run")
            now = report["outcomes"]["plugin"].get(t, {}).get("outcome", "not run")
            lines.append(f"* `{t}`: {was} before, {now} now")
    lines += ["", "## Failing in both runs (fairseq 0.12 on this PyTorch/Python, not the plugin)", ""]
    for test in sorted(set(summary["failing"]["stock"]) & set(summary["failing"]["plugin"])):
        lines.append(f"* `{test}`: `{_plain(summary['messages']['stock'][test])}`")
    silent = [r for r in report["runs"] if r["output_tail"]]
    if silent:
        lines += ["", "## Runs that recorded no outcome or ran past the time limit", ""]
        for r in silent:
            lines += [f"* {r['file']} ({r['mode']}):", "", "```", r["output_tail"][-1000:], "```"]
    lines += ["", "## Time per file (seconds)", "", "| file | stock | plugin |", "| --- | ---: | ---: |"]
    for f in report["files"]:
        row = {r["mode"]: r for r in report["runs"] if r["file"] == f}
        cells = [f"{row[m]['seconds']}" + (" (timed out)" if row[m]["timed_out"] else "") for m in MODES if m in row]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fairseq-tests", required=True, type=Path, help="the folder that holds fairseq's tests/")
    parser.add_argument("--fairseq-tests-ref", default="v0.12.3", help="where the tests come from, for the report")
    parser.add_argument(
        "--files",
        nargs="+",
        default=list(DEFAULT_FILES),
        help="files of tests/ to run, or pytest node ids in them (test_binaries.py::TestTranslation)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="which runs: stock, plugin, or both (stock,plugin)")
    parser.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="MODE=REPORT_JSON",
        help="take MODE's outcomes from an earlier report.json of the same files instead of running it "
        "(with --modes leaving MODE out)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per file and run")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once")
    parser.add_argument(
        "--plugin-source",
        type=Path,
        help="run the plugin of this source tree (e.g. a git archive of another commit) instead of the installed one",
    )
    parser.add_argument("--before", type=Path, help="an earlier report.json whose counts the report shows too")
    parser.add_argument("--before-label", default="before", help="what --before was")
    parser.add_argument("--note", default="", help="a paragraph for the report: how the runs were made")
    return parser


def run_modes(args, modes: list) -> list:
    """Every file of ``--files`` under each mode asked for (``--jobs`` at once), then the runs
    that ``--reuse`` takes from earlier reports."""
    plugin_path = ()
    if args.plugin_source:
        plugin_path = (args.plugin_source.resolve(), args.plugin_source.resolve() / "runtime")
    with tempfile.TemporaryDirectory(prefix="fairseq-suite-") as tmp:
        work = Path(tmp)
        (work / "fairseq_suite_recorder.py").write_text(textwrap.dedent(RECORDER))
        jobs = [(f, m) for f in args.files for m in MODES if m in modes]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(
                pool.map(
                    lambda job: run_file(args.fairseq_tests.resolve(), job[0], job[1], work, args.timeout, plugin_path),
                    jobs,
                )
            )
    for mode, path in dict(spec.split("=", 1) for spec in args.reuse).items():
        earlier = json.loads(Path(path).read_text())
        runs += [
            {**r, "outcomes": {t: o for t, o in earlier["outcomes"][mode].items() if _in_file(t, r["file"])}}
            for r in earlier["runs"]
            if r["mode"] == mode
        ]
    return runs


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.replace("both", ",".join(MODES)).split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"--modes {args.modes}: the modes are stock, plugin, or both")
    if not (args.fairseq_tests / "tests").is_dir():
        parser.error(f"--fairseq-tests {args.fairseq_tests}: no tests/ folder in it (fairseq's source tree holds one)")

    runs = run_modes(args, modes)
    reused = dict(spec.split("=", 1) for spec in args.reuse)
    report = {
        "fairseq_version": _installed_version("ve-fairseq", "fairseq-fixed", "fairseq"),
        "fairseq_tests_ref": args.fairseq_tests_ref,
        "torch_version": _installed_version("torch"),
        "python_version": sys.version.split()[0],
        "files": args.files,
        "plugin_source": str(args.plugin_source or "installed"),
        # named relative to this report's folder, as every report names its paths
        "reused": {mode: os.path.relpath(path, args.out) for mode, path in reused.items()},
        "note": args.note,
        "summary": compare(runs),
        "outcomes": {m: {t: o for r in runs if r["mode"] == m for t, o in r["outcomes"].items()} for m in MODES},
        "runs": [{k: v for k, v in r.items() if k != "outcomes"} for r in runs],
    }
    if args.before:
        earlier = json.loads(args.before.read_text())
        report["before"] = {
            "label": args.before_label,
            **earlier["summary"],
            "plugin_outcomes": earlier["outcomes"]["plugin"],
        }
    write_report(args.out, report)
    summary = report["summary"]
    print(f"stock: {_count_line(summary['counts']['stock'])}; plugin: {_count_line(summary['counts']['plugin'])}")
    print(f"differing: {len(summary['differing'])}, unexplained: {summary['unexplained']}; report: {args.out}")
    # a comparison of runs in which nothing ran would say "differing: 0" of nothing
    silent = [r for r in runs if not r["outcomes"]]
    for r in silent:
        why = "timed out" if r["timed_out"] else (r["output_tail"].strip().splitlines() or ["no output"])[-1]
        print(f"error: {r['mode']} run of tests/{r['file']} ran no test ({why})", file=sys.stderr)
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
