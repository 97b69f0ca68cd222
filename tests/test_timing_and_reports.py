"""benchmarks/timing.py (the one timing loop) and the one atomic report writer
(benchmarks/report_files.py: write_files / write_file / write_report)."""

import ast
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report_files, step_anatomy, timing
from benchmarks.benchmark import engine_agreement

REPO = Path(__file__).resolve().parents[1]


def test_time_runs_statistics_warmup_and_last_value(monkeypatch):
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # three runs of 1, 3 and 2 seconds
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    calls, synced = [], []
    result = timing.time_runs(lambda: calls.append(1) or len(calls), warmup=2, runs=3, sync=lambda: synced.append(1))
    assert len(calls) == 5 and result.value == 5  # 2 warm-ups (untimed) + 3 runs; the last run's value
    assert len(synced) == 6  # before and after each timed run
    assert result.seconds == (1.0, 3.0, 2.0) and result.runs == 3 and result.total == 6.0
    assert result.mean == 2.0 and result.median == 2.0 and result.min == 1.0 and result.max == 3.0
    assert result.stdev == pytest.approx(statistics.stdev([1.0, 3.0, 2.0]))
    assert timing.TimingResult((0.5,)).stdev == 0.0  # one run: no spread
    with pytest.raises(ValueError):
        timing.time_runs(lambda: None, runs=0)


def test_time_runs_goes_round_robin_over_a_mapping():
    order = []
    results = timing.time_runs(
        {"a": lambda: order.append("a") or "A", "b": lambda: order.append("b") or "B"},
        warmup=1,
        runs=2,
        before_each=lambda name, r: order.append(f"{name}{r}"),
    )
    assert order == ["a", "b", "a0", "a", "b0", "b", "a1", "a", "b1", "b"]
    assert set(results) == {"a", "b"} and results["a"].value == "A" and results["b"].runs == 2
    assert all(s >= 0 for r in results.values() for s in r.seconds)


def test_write_files_replaces_all_targets_and_leaves_no_temporary_file(tmp_path):
    (tmp_path / "r.json").write_text("old")
    report_files.write_files(str(tmp_path / "new"), {"a.md": "text", "b.png": b"\x89PNG"})
    assert (tmp_path / "new" / "a.md").read_text() == "text" and (tmp_path / "new" / "b.png").read_bytes() == b"\x89PNG"
    report_files.write_report(str(tmp_path), "r", {"x": 1}, "| table |", echo=False)
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": 1} and (tmp_path / "r.md").read_text() == "| table |"
    report_files.write_file(str(tmp_path / "one.txt"), "line\n")
    assert (tmp_path / "one.txt").read_text() == "line\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "one.txt", "r.json", "r.md"]


def test_an_interrupted_write_keeps_the_old_report_and_no_temporary_file(tmp_path, monkeypatch):
    report_files.write_report(str(tmp_path), "report", {"run": 1}, "old table", echo=False)

    def replace_then_fail(src, dst, _real=os.replace, _calls=[]):
        _calls.append(dst)
        if len(_calls) == 2:  # the markdown went in, the JSON (written last) does not
            raise KeyboardInterrupt
        return _real(src, dst)

    monkeypatch.setattr(report_files.os, "replace", replace_then_fail)
    with pytest.raises(KeyboardInterrupt):
        report_files.write_report(str(tmp_path), "report", {"run": 2}, "new table", echo=False)
    assert json.loads((tmp_path / "report.json").read_text()) == {"run": 1}  # report.json: old and whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]  # no stray .part file

    def fail(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(report_files.os, "replace", fail)
    with pytest.raises(OSError):
        report_files.write_file(str(tmp_path / "report.json"), "{}")
    assert json.loads((tmp_path / "report.json").read_text()) == {"run": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_a_failed_temporary_write_replaces_nothing(tmp_path):
    (tmp_path / "a.md").write_text("old a")
    with pytest.raises(TypeError):
        report_files.write_files(str(tmp_path), {"a.md": "new a", "b.json": object()})  # b cannot be written
    assert (tmp_path / "a.md").read_text() == "old a" and sorted(p.name for p in tmp_path.iterdir()) == ["a.md"]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_benchmarks_never_import_tests_and_edit_sys_path_only_in_the_file_shim():
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        assert not any(m == "tests" or m.startswith("tests.") for m in _imports(path)), path.name
        text = path.read_text()
        edits = text.count("sys.path.insert") + text.count("sys.path.append")
        assert edits <= 1, path.name
        if edits:
            assert "if not __package__:" in text, path.name


@pytest.mark.parametrize(
    "script",
    [
        "benchmark",
        "shortlist_sweep",
        "time_split",
        "hrt_quality",
        "fault_table",
        "serve_load",
        "runtime_stream",
        "step_anatomy",
        "hrt_bound",
        "runtime_vs_ct2",
        "int8_quality",
        "host_costs",
        "cache_probe",
    ],
)
def test_every_script_runs_as_a_module_and_as_a_file(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    as_module = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script}", "--help"], cwd=REPO, env=env, capture_output=True, text=True
    )
    as_file = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{script}.py"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert as_module.returncode == 0 and as_file.returncode == 0, as_module.stderr + as_file.stderr
    assert (
        as_module.stdout.startswith("usage:") and as_file.stdout.split("\n", 1)[1] == as_module.stdout.split("\n", 1)[1]
    )


def test_engine_agreement_pairs_every_engine_row_with_its_lean_row():
    hyps = {
        "AT greedy": ["a b", "c", "d"],
        "AT greedy (onnxruntime)": ["a b", "c d", "d"],
        "AT greedy +shortlist": ["x", "y", "z"],
        "AT greedy (onnxruntime) +shortlist": ["x", "y", "z"],
        "HRT k=2 (fairseq engine)": ["p", "q", "r"],
        "HRT k=2": ["p", "q", "s"],
        "CTranslate2 AT greedy": ["a", "c", "d"],
    }
    bleu = {name: float(i) for i, name in enumerate(hyps)}
    rows = {a["system"]: a for a in engine_agreement(hyps, bleu)}
    assert set(rows) == {"AT greedy (onnxruntime)", "AT greedy (onnxruntime) +shortlist", "HRT k=2 (fairseq engine)"}
    assert (
        rows["AT greedy (onnxruntime)"]["reference"] == "AT greedy"
        and rows["AT greedy (onnxruntime)"]["identical"] == 2
    )
    assert rows["AT greedy (onnxruntime) +shortlist"]["reference"] == "AT greedy +shortlist"
    assert (
        rows["AT greedy (onnxruntime) +shortlist"]["identical"] == 3
        and rows["HRT k=2 (fairseq engine)"]["identical"] == 2
    )
    assert (
        rows["AT greedy (onnxruntime)"]["bleu_difference"] == 1.0 and rows["AT greedy (onnxruntime)"]["sentences"] == 3
    )


def test_step_anatomy_adds_up_to_the_step(exported_tiny, tmp_path):
    """benchmarks/step_anatomy.py on an exported HRT model (relative keys): every operator of the
    optimised graph is counted once in one group, each group's time is the sum of its
    operators', the table's sum line is the first run plus the groups, the output layer is one
    operator, and the loop's cost per step is reported (a folder without restricted graphs: no
    loop over a shortlist's rows, and the report says why). Structure and arithmetic only: no
    time is compared with another (a busy machine changes every one of them)."""
    pytest.importorskip("onnxruntime")

    step_anatomy.main(
        [
            "--onnx",
            exported_tiny["hrt"],
            "--rows",
            "12",
            "--calls",
            "20",
            "--repeats",
            "2",
            "--steps",
            "2,6",
            "--out-dir",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "step_anatomy.json").read_text())
    graph = report["step_graph"]
    assert graph["groups"]["output layer"]["operators"] == 1 and graph["groups"]["projections"]["operators"] >= 4
    added = graph["operators_added"]
    assert graph["operators"] == len(added) + 1 == 1 + sum(g["operators"] for g in graph["groups"].values())
    assert set(graph["groups"]) == {op["group"] for op in added} <= set(step_anatomy.GROUPS)
    for name, g in graph["groups"].items():
        assert g["us"] == pytest.approx(sum(op["us"] for op in added if op["group"] == name))
        assert g["operators"] == sum(op["group"] == name for op in added)
    assert all(op["us"] >= 0 for op in added) and graph["us_first_operator_run"] > 0 and graph["us_total"] > 0
    table = (tmp_path / "step_anatomy.md").read_text()
    summed = graph["us_first_operator_run"] + sum(g["us"] for g in graph["groups"].values())
    assert f"| sum | {graph['operators']} | {summed:.1f} |" in table
    assert f"one run from Python: {graph['us_total']:.1f} us" in table
    loop = report["loop"]["whole vocabulary"]
    assert set(report["loop"]) == {"whole vocabulary"} and loop["steps"] == [2, 6]
    assert loop["us_per_step"] == pytest.approx((loop["us_run_of_long"] - loop["us_run_of_short"]) / (6 - 2))
    assert "No loop over 12 rows: the folder has no greedy_restricted graph" in table


def test_runtime_vs_ct2_runs_without_pytorch(exported_tiny, tmp_path):
    """benchmarks/runtime_vs_ct2.py: a process that never imports PyTorch decodes the exported
    AT and HRT folders (greedy; the HRT model in AT mode and with k = 2) at batch 1 and 2, with
    BLEU and words/s per row and batch size."""
    pytest.importorskip("onnxruntime")
    lines = [" ".join(f"w{(3 * i + j) % 40}" for j in range(1 + i % 7)) for i in range(6)]
    for name in ("src", "ref"):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "runtime_vs_ct2.py"),
            "--onnx",
            f"AT={exported_tiny['at']}",
            "--onnx",
            f"HRT={exported_tiny['hrt']}",
            "--src",
            str(tmp_path / "src"),
            "--raw-src",
            str(tmp_path / "src"),
            "--raw-ref",
            str(tmp_path / "ref"),
            "--batch-sizes",
            "1,2",
            "--runs",
            "1",
            "--runs-large",
            "1",
            "--max-len-b",
            "5",
            "--out-dir",
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "runtime_vs_ct2.json").read_text())
    assert set(report["rows"]) == {
        "AT greedy (hrt_runtime)",
        "HRT AT-mode b=1 (hrt_runtime)",
        "HRT k=2 b_at=1 b_nat=1 (hrt_runtime)",
    }
    for row in report["rows"].values():
        assert row["1"]["words_per_second"] > 0 and row["2"]["sentences"] == 6 and "bleu" in row
