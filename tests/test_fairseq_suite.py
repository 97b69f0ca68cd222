"""benchmarks/fairseq_suite.py: fairseq's tests run stock and with the plugin imported, compared
test by test (on a stand-in tests/ folder, so the check takes seconds)."""

import json

from benchmarks import fairseq_suite

STAND_IN_TESTS = """
import sys


def test_sees_no_plugin():
    assert "fairseq_hrt" not in sys.modules


def test_always_passes():
    pass


def test_loads_a_checkpoint():
    if "fairseq_hrt" not in sys.modules:
        raise RuntimeError("Weights only load failed. This file can still be loaded")
"""


def test_the_suite_reports_each_test_whose_outcome_the_plugin_changes(tmp_path):
    (tmp_path / "fairseq" / "tests").mkdir(parents=True)
    (tmp_path / "fairseq" / "tests" / "test_stand_in.py").write_text(STAND_IN_TESTS)
    out = tmp_path / "report"
    assert (
        fairseq_suite.main(
            ["--fairseq-tests", str(tmp_path / "fairseq"), "--files", "test_stand_in.py", "--out", str(out)]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert summary["counts"] == {"stock": {"failed": 1, "passed": 2}, "plugin": {"failed": 1, "passed": 2}}
    differing = {d["test"]: d for d in summary["differing"]}
    assert set(differing) == {
        "tests/test_stand_in.py::test_sees_no_plugin",
        "tests/test_stand_in.py::test_loads_a_checkpoint",
    }
    # a failure the weights_only fix explains is listed with it; a test the plugin breaks is not explained
    assert "weights_only" in differing["tests/test_stand_in.py::test_loads_a_checkpoint"]["explained_by"]
    assert summary["unexplained"] == ["tests/test_stand_in.py::test_sees_no_plugin"]
    assert "test_sees_no_plugin" in (out / "report.md").read_text()
