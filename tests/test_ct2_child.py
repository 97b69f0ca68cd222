"""benchmarks/ct2_child.py: CTranslate2 timed pass by pass from a child process, inside the
caller's own round-robin: every pass decodes the forced lengths, the child's clock is kept per
pass, a compute type the device lacks and a child that cannot load are one line each."""

import os

import pytest

from benchmarks import ct2_reference
from benchmarks.ct2_child import ChildFailed, ForcedLengthChild, child_rows
from benchmarks.onnx_gate import random_model
from benchmarks.timing import time_runs

pytestmark = pytest.mark.skipif(ct2_reference.unavailable_reason() is not None, reason="needs ctranslate2")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    work = tmp_path_factory.mktemp("ct2_child")
    os.makedirs(work / "at")
    task, _ = random_model(
        "at_tiny", 60, str(work), extra_args=["--hrt-mode", "at"], checkpoint=str(work / "at" / "checkpoint.pt")
    )
    model_dir = ct2_reference.convert(str(work / "at" / "checkpoint.pt"), str(work), str(work), "src", "tgt")
    symbols = task.target_dictionary.symbols
    jobs = {
        "1/short": [{"tokens": [[symbols[10], symbols[11]]], "length": 4}, {"tokens": [[symbols[12]]], "length": 8}],
        "2/long": [{"tokens": [[symbols[10]] * 9, [symbols[13]] * 5], "length": 12}],
    }
    return model_dir, jobs


def test_passes_run_in_the_callers_round_robin_and_keep_the_childs_seconds(converted):
    model_dir, jobs = converted
    calls = []
    with ForcedLengthChild(model_dir, jobs, ["float32", "int8"], threads=1) as child:
        assert child.loaded == ["float32", "int8"] and child.errors == {}
        assert child.ready["version"]
        fns = child_rows(child, list(jobs))
        assert set(fns) == {(c, j) for c in ("float32", "int8") for j in jobs}
        fns["ours"] = lambda: calls.append(len(calls))
        timed = time_runs(fns, runs=3)
        # the forced lengths: n steps per sentence, whatever the (random) weights choose
        assert timed[("float32", "1/short")].value == [4, 8]
        assert timed[("int8", "2/long")].value == [12, 12]
        assert calls == [0, 1, 2]
        for key in set(fns) - {"ours"}:
            seconds = child.seconds[key]
            assert len(seconds) == 3 and all(s > 0 for s in seconds)
            # the child's clock counts its decoding only, not the pipe's round trip
            assert max(seconds) <= max(timed[key].seconds)
        process = child._process
    assert process.poll() is not None  # closed with the context


def test_a_compute_type_the_device_lacks_is_a_line_and_the_others_load(converted):
    ctranslate2 = pytest.importorskip("ctranslate2")
    model_dir, jobs = converted
    missing = next(
        c for c in ("bfloat16", "float16", "int8_bfloat16") if c not in ctranslate2.get_supported_compute_types("cpu")
    )
    with ForcedLengthChild(model_dir, jobs, ["float32", missing]) as child:
        assert child.loaded == ["float32"]
        assert f"has no {missing} on this cpu" in child.errors[missing]
        assert "\n" not in child.errors[missing]
        assert set(child_rows(child, ["1/short"])) == {("float32", "1/short")}
    assert child_rows(None, ["1/short"]) == {}


def test_a_child_that_cannot_load_fails_in_one_line(tmp_path, converted):
    _, jobs = converted
    with pytest.raises(ChildFailed) as failed:
        ForcedLengthChild(str(tmp_path / "no-model"), jobs, ["float32"]).close()
    assert "\n" not in str(failed.value) and str(failed.value)
