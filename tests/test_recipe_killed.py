"""examples/multi30k/recipe.py killed and run again (docs/reliability.md): the recipe and its
running step SIGKILLed together (as Ctrl-C stops them, one process group) while it distills and
while a student trains (``--profile tiny``, up to the Mask-Predict student), then re-run, it
never leaves a partial distilled corpus in place, resumes the student from its checkpoint,
skips the finished steps and finishes every step. A test of the example, so it runs the
example (benchmarks and the plugin's tests do not)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.faults import LOADED, checkpoint_updates
from fairseq_hrt.testing.tiny_runs import REPO, SHARED_MULTI30K, SRC, TGT, cli_env, read_lines, write_raw_corpus

RECIPE = REPO / "examples" / "multi30k" / "recipe.py"


def kill_recipe(work: Path) -> dict:
    """The recipe (--profile tiny, up to the MP student) SIGKILLed with its step during
    distillation, then during the AT student's training, then run to the end."""
    out = work / "recipe"
    cmd = [sys.executable, str(RECIPE), "--profile", "tiny", "--out", str(out), "--threads", "1", "--until", "mp"]
    if not (SHARED_MULTI30K / "test.en").is_file():
        raw = write_raw_corpus(work / "recipe_raw", n_train=300, n_valid=20, prefer="synthetic")
        for lang in (SRC, TGT):
            shutil.copy(f"{raw['valid']}.{lang}", work / "recipe_raw" / f"test.{lang}")
        cmd += ["--raw-dir", str(work / "recipe_raw")]
    env = cli_env()
    result = {}

    def run_until(condition, label):
        with open(work / f"recipe_{label}.log", "w") as log:
            proc = subprocess.Popen(
                cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            start = time.time()
            while proc.poll() is None and not condition():
                if time.time() - start > 600:
                    break
                time.sleep(0.05)
            finished_first = proc.poll() is not None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return {"finished_before_the_kill": finished_first}

    distill_log = out / "logs" / "distill.log"
    result["kill_in_distill"] = run_until(
        lambda: distill_log.exists() and "distilling" in distill_log.read_text(errors="replace"), "distill"
    )
    result["kill_in_distill"]["distilled_output_exists"] = (out / "distill" / "train.de").exists()
    # the first checkpoint is saved at the end of the first epoch (a few updates of 60)
    result["kill_in_training"] = run_until(lambda: (out / "at" / "checkpoint_last.pt").exists(), "training")
    result["kill_in_training"]["checkpoint_updates"] = checkpoint_updates(out / "at" / "checkpoint_last.pt")
    final = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=900)
    result["rerun_returncode"] = final.returncode
    result["rerun_log"] = [line for line in final.stderr.splitlines() if line.startswith("[recipe] step")]
    at_out = (out / "logs" / "at.log").read_text(errors="replace")
    result["at_resumed_from"] = [int(m.group(3)) for m in LOADED.finditer(at_out)]
    train_en, distilled_de = out / "data" / "spm" / "train.en", out / "distill" / "train.de"
    result["train_lines"] = len(read_lines(train_en)) if train_en.exists() else -1
    result["distilled_lines"] = len(read_lines(distilled_de)) if distilled_de.exists() else -1
    result["markers"] = sorted(p.name for p in (out / "markers").glob("*.done"))
    return result


@pytest.mark.slow
def test_recipe_killed_during_distillation_and_training_is_finished_by_a_rerun(tmp_path):
    r = kill_recipe(tmp_path)
    d, t = r["kill_in_distill"], r["kill_in_training"]
    assert not d["finished_before_the_kill"] and not t["finished_before_the_kill"]
    assert not d["distilled_output_exists"]  # only a complete distilled corpus is ever in place
    assert t["checkpoint_updates"] is not None
    assert r["rerun_returncode"] == 0, r["rerun_log"]
    assert r["distilled_lines"] == r["train_lines"] > 0
    assert r["at_resumed_from"] and r["at_resumed_from"][-1] == t["checkpoint_updates"] < 60  # mid-training
    assert {
        "prepare.done",
        "teacher.done",
        "distill.done",
        "distill_bin.done",
        "at.done",
        "hrt.done",
        "mp.done",
    } <= set(r["markers"])
    assert any("skipped, done earlier" in line for line in r["rerun_log"])
