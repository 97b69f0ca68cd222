"""examples/multi30k/recipe.py: every step's command, for every profile, without running one."""

import importlib.util
import shlex
import subprocess
import sys

import pytest

from fairseq_hrt.testing.tiny_runs import REPO

_spec = importlib.util.spec_from_file_location("multi30k_recipe", REPO / "examples" / "multi30k" / "recipe.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)


def option(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


@pytest.mark.parametrize("profile", sorted(recipe.PROFILES))
def test_every_step_of_every_profile_has_its_command(profile, tmp_path):
    r = recipe.Recipe(recipe.parse_args(["--profile", profile, "--out", str(tmp_path), "--ssru-students"]))
    p = r.profile
    steps = [s for s in recipe.STEPS if p.distill or s not in ("teacher", "distill", "distill_bin")]
    commands = {step: [str(word) for word in r.commands(step)] for step in steps}
    trainings = {s: c for s, c in commands.items() if "fairseq_cli.train" in c}
    assert set(trainings) == {"teacher", "at", "hrt", "mp", "ssru", "ssru_tied"} & set(steps)
    for step, cmd in trainings.items():
        # a number of updates is the budget, never a time cap: the same models on any machine
        assert "--stop-time-hours" not in cmd, step
        assert option(cmd, "--max-update") == str(p.teacher_updates if step == "teacher" else p.student_updates)
        assert option(cmd, "--save-dir") == str(tmp_path / step)
        assert ("--distill-data" in cmd) == (p.distill and step != "teacher"), step
    assert option(trainings["hrt"], "--finetune-from-model") == str(tmp_path / "at" / "checkpoint_last.pt")
    assert option(trainings["mp"], "--hrt-mode") == "cmlm"
    benchmark = commands["benchmark"]
    assert benchmark[1] == str(REPO / "benchmarks" / "benchmark.py")
    assert option(benchmark, "--hrt") == str(tmp_path / "hrt" / "checkpoint_last.pt")
    assert option(commands["prepare"], "--vocab-size") == str(p.vocab_size)


def test_a_finished_step_is_skipped_and_a_failed_one_stops_the_recipe(tmp_path):
    r = recipe.Recipe(recipe.parse_args(["--profile", "tiny", "--out", str(tmp_path)]))
    r.run_step("prepare", [sys.executable, "-c", "print('prepared')"])
    assert shlex.split((tmp_path / "markers" / "prepare.done").read_text())[-1] == "print('prepared')"
    assert "prepared" in (tmp_path / "logs" / "prepare.log").read_text()
    r.run_step("prepare", [sys.executable, "-c", "raise SystemExit(3)"])  # done earlier: not run
    with pytest.raises(SystemExit, match="step 2/11 teacher failed \\(exit 3\\)"):
        r.run_step("teacher", [sys.executable, "-c", "raise SystemExit(3)"])
    assert not (tmp_path / "markers" / "teacher.done").exists()


def test_help_and_refusals():
    script = str(REPO / "examples" / "multi30k" / "recipe.py")
    assert "--profile" in subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True).stdout
    refused = subprocess.run([sys.executable, script, "--profile", "nope"], capture_output=True, text=True)
    assert refused.returncode == 2 and "invalid choice" in refused.stderr


def test_recipe_trains_one_chunk_size_by_default_and_several_on_request(tmp_path):
    """k = 2 alone by default (the benchmark decodes what was trained); a list stays
    available; profiles without a teacher train the students on raw data."""
    args = recipe.parse_args(["--out", str(tmp_path)])
    assert args.hrt_chunk_sizes == "2"
    r = recipe.Recipe(args)
    assert r.hrt_args("2", tmp_path / "at.pt")[:4] == [
        "--chunk-sizes",
        "2",
        "--finetune-from-model",
        str(tmp_path / "at.pt"),
    ]
    assert "--distill-data" in r.hrt_args("2", tmp_path / "at.pt")
    many = recipe.Recipe(recipe.parse_args(["--out", str(tmp_path), "--hrt-chunk-sizes", "2,3,4", "--profile", "mini"]))
    assert many.hrt_args(many.args.hrt_chunk_sizes, tmp_path / "at.pt") == [
        "--chunk-sizes",
        "2,3,4",
        "--finetune-from-model",
        str(tmp_path / "at.pt"),
    ]
    assert not many.profile.distill


def test_recipe_trains_ssru_students_on_request(tmp_path):
    """``recipe.py --ssru-students``: the AT student's command with the SSRU twin of its arch
    (one layer; two tied layers); the benchmark gets them as --at-extra rows."""
    assert not recipe.parse_args(["--out", str(tmp_path)]).ssru_students
    r = recipe.Recipe(recipe.parse_args(["--out", str(tmp_path), "--profile", "mini", "--ssru-students"]))
    at = r.commands("at")
    one, tied = r.ssru_cmd("ssru"), r.ssru_cmd("ssru_tied")
    assert one[one.index("--arch") + 1] == "at_mini_ssru" and tied[tied.index("--arch") + 1] == "at_mini_ssru"
    assert tied[-3:] == ["--decoder-layers", "2", "--decoder-tie-layers"]

    # same command as the AT student but arch, save dir and the tied options
    def differing(cmd):
        return {(a, b) for a, b in zip(cmd, at) if a != b}

    assert differing(one) == {("at_mini_ssru", "at_mini"), (str(tmp_path / "ssru"), str(tmp_path / "at"))}
    assert r.ssru_extra_rows() == []  # none trained yet
    for name in ("ssru", "ssru_tied"):
        r.checkpoint(name).parent.mkdir(parents=True, exist_ok=True)
        r.checkpoint(name).write_text("x")
        r.markers.mkdir(parents=True, exist_ok=True)
        (r.markers / f"{name}.done").write_text("cmd\n")
    assert r.ssru_extra_rows() == [
        "--at-extra",
        f"ssru={r.checkpoint('ssru')}",
        "--at-extra",
        f"ssru-tied={r.checkpoint('ssru_tied')}",
    ]
