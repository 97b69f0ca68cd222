"""benchmarks/fairseq_suite.py: fairseq's tests run stock and with the plugin imported, compared
test by test (on a stand-in tests/ folder, so the check takes seconds)."""

import json

import pytest

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


def stand_in_tree(tmp_path):
    (tmp_path / "fairseq" / "tests").mkdir(parents=True)
    (tmp_path / "fairseq" / "tests" / "test_stand_in.py").write_text(STAND_IN_TESTS)
    return tmp_path / "fairseq"


def test_modes_both_runs_stock_and_plugin(tmp_path):
    tree = stand_in_tree(tmp_path)
    out = tmp_path / "report"
    argv = ["--fairseq-tests", str(tree), "--files", "test_stand_in.py", "--out", str(out), "--modes", "both"]
    assert fairseq_suite.main(argv) == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert sorted(r["mode"] for r in runs) == ["plugin", "stock"]


@pytest.mark.parametrize("modes", ["stoc", "plugin,all", ","])
def test_an_unknown_mode_is_refused(tmp_path, modes, capsys):
    tree = stand_in_tree(tmp_path)
    with pytest.raises(SystemExit) as e:
        fairseq_suite.main(["--fairseq-tests", str(tree), "--modes", modes, "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "the modes are stock, plugin, or both" in capsys.readouterr().err


def test_a_folder_without_tests_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        fairseq_suite.main(["--fairseq-tests", str(tmp_path), "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "no tests/ folder in it" in capsys.readouterr().err


def test_a_run_in_which_no_test_ran_is_an_error(tmp_path, capsys):
    tree = stand_in_tree(tmp_path)
    (tree / "tests" / "test_empty.py").write_text("VALUE = 1\n")
    argv = ["--fairseq-tests", str(tree), "--files", "test_empty.py", "--out", str(tmp_path / "r")]
    assert fairseq_suite.main(argv) == 1
    err = capsys.readouterr().err
    assert "error: stock run of tests/test_empty.py ran no test" in err
    assert "error: plugin run of tests/test_empty.py ran no test" in err
