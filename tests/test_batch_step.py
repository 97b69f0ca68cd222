"""benchmarks/batch_step.py end to end on a tiny model: every pass timed (ours, its step's variants,
CTranslate2's forced lengths in its child process), the variants choosing the plain step's tokens,
ONNX Runtime's profile of the step read, and the report written with the CPU it ran on."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import batch_step, ct2_reference, machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    reason = ct2_reference.unavailable_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("batch-step")
    out = root / "out"
    argv = ["--shapes", "tiny", "--vocab", "120", "--batch", "5", "--src-len", "6", "--steps", "3", "--runs", "2"]
    # a process of its own, as it is run: it refuses to measure where PyTorch is imported (as here)
    script = os.path.join(REPO, "benchmarks", "batch_step.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, script, *argv, "--workdir", str(root / "models"), "--out-dir", str(out)], check=True, env=env
    )
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), root / "models"


def test_every_pass_is_timed_in_each_run(report):
    data = report[0]
    block = data["shapes"]["tiny"]
    passes = {"ours encoder", "CTranslate2 1 step", "CTranslate2 4 steps", *batch_step.STEP_VARIANTS}
    passes |= {"CTranslate2 1 step, scored", "CTranslate2 4 steps, scored"}
    assert passes <= set(block["run_ms"])
    assert all(len(block["run_ms"][name]) == 2 and min(block["run_ms"][name]) > 0 for name in passes)
    assert all(block["fastest_ms"][name] == min(block["run_ms"][name]) for name in passes)
    assert {"CTranslate2 step", "CTranslate2 encoder", "ours steps (per step)"} <= set(block["derived_ms"])
    assert "CTranslate2 step, scored" in block["derived_ms"]


def test_the_variants_choose_the_plain_steps_tokens_and_ctranslate2_makes_every_step(report):
    checks = report[0]["shapes"]["tiny"]["same_tokens"]
    expected = {*batch_step.STEP_VARIANTS, "encoder, blocks of 16 sentences", "CTranslate2 steps made"}
    assert set(checks) == expected - {"ours steps"}
    assert all(checks.values()), checks


def test_the_profiles_cover_a_round_of_each_session(report):
    profiles = report[0]["shapes"]["tiny"]["profile"]
    assert set(profiles) == {"encoder", "step"}
    for graph, runs in (("encoder", 1), ("step", 3)):  # a round: one encoding, or one run per step
        profile = profiles[graph]
        assert profile["runs"] == runs and profile["rounds"] == 2 and profile["total_ms"] > 0
        assert abs(sum(profile["op_types"].values()) - profile["total_ms"]) < 0.01 + 1e-3 * len(profile["op_types"])
        assert all(op in profile["op_types"] for _, op, _ in profile["nodes"])
    assert {"MatMul", "LogSoftmax"} <= set(profiles["step"]["op_types"])


def test_the_report_names_the_cpu_its_flags_and_the_command(report):
    data, md, _ = report
    meta = data["meta"]
    assert meta["cpu"] and isinstance(meta["isa_flags"], list)
    assert set(meta["isa_flags"]) <= set(machine.ISA_FLAGS)
    assert meta["threads"] == 1 and meta["batch"] == 5 and meta["steps"] == 3
    assert "--shapes tiny" in meta["command"] and f"`{meta['command']}`" in md
    assert "## tiny" in md and "| step: ours steps |" in md and "| operator type | ms | share |" in md
    assert "| step, CTranslate2 with return_scores" in md


def test_summarize_profile_sums_node_kernel_times_by_type_in_the_fastest_round():
    def node(name, op, ts, dur):
        return {"cat": "Node", "name": name, "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [  # two rounds of two runs each; the second round is the faster
        {"cat": "Session", "name": "model_run", "ts": 0, "dur": 90},
        node("/MatMul_kernel_time", "MatMul", 1, 5000),
        node("/MatMul_fence_before", "MatMul", 1, 7),
        {"cat": "Session", "name": "model_run", "ts": 100, "dur": 90},
        node("/LogSoftmax_kernel_time", "LogSoftmax", 101, 2000),
        {"cat": "Session", "name": "model_run", "ts": 200, "dur": 90},
        node("/MatMul_kernel_time", "MatMul", 201, 3000),
        node("/MatMul_1_kernel_time", "MatMul", 202, 1000),
        {"cat": "Session", "name": "model_run", "ts": 300, "dur": 90},
        node("/LogSoftmax_kernel_time", "LogSoftmax", 301, 2000),
    ]
    found = batch_step.summarize_profile(events, per_round=2)
    assert found["runs"] == 2 and found["rounds"] == 2 and found["total_ms"] == 6.0
    assert found["op_types"] == {"MatMul": 4.0, "LogSoftmax": 2.0}
    assert found["nodes"][0] == ["/MatMul", "MatMul", 3.0]


def test_it_refuses_to_measure_in_a_process_with_pytorch(tmp_path):
    import torch  # noqa: F401, PLC0415 - the point: PyTorch in this process

    if ct2_reference.unavailable_reason():
        pytest.skip(ct2_reference.unavailable_reason())
    with pytest.raises(SystemExit, match="PyTorch was imported"):
        batch_step.main(["--shapes", "tiny", "--workdir", str(tmp_path / "w"), "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


def test_the_encoder_in_blocks_of_sentences_writes_the_whole_batchs_outputs(report):
    from hrt_runtime.model import ExportedModel  # noqa: PLC0415

    model = ExportedModel(str(report[2] / "tiny" / "onnx"), threads=1)
    src, _ = batch_step.fixed_inputs(model, 5, 6)
    src[1, :3] = model.config["source_pad"]  # a left-padded sentence
    whole = model.encode(src)
    blocks = batch_step.encode_in_blocks(model, src, block=2)  # blocks of 2, 2 and 1 sentences
    expected = [whole.bias, *whole.keys, *whole.values]
    assert len(blocks) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(blocks, expected))
    other = batch_step.encode_in_blocks(model, src[::-1].copy(), block=2)
    assert not np.array_equal(other[1], expected[1])
