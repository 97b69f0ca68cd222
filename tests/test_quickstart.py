"""The quickstart's training command (``DRY_RUN=1`` prints it without running anything)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def quickstart_commands(**env):
    full_env = dict(os.environ, DRY_RUN="1", THREADS="1", DEVICE_ARGS="--cpu", **env)
    # the console scripts of this interpreter's environment, as the README's set-up has them
    full_env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), full_env.get("PATH", "")))
    out = subprocess.run(
        ["bash", str(REPO / "examples" / "multi30k" / "quickstart.sh")],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    cmds = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return shlex.split(cmds["train"]), shlex.split(cmds["generate"])


def option(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_quickstart_trains_k2_with_the_papers_curriculum():
    """One chunk size and p_k = t / T over the whole run (T = --max-update): no
    --curriculum-updates that would end AT samples before the last update."""
    train, generate = quickstart_commands()
    assert option(train, "--chunk-sizes") == "2"
    assert option(train, "--curriculum-updates") in (None, option(train, "--max-update"))
    assert option(generate, "--decode-chunk-size") == "2"


def test_quickstart_budget_is_a_number_of_updates_not_a_time():
    """The same model on any machine, however busy: --max-update, no --stop-time-hours."""
    train, _ = quickstart_commands()
    assert option(train, "--max-update") == "600" and "--stop-time-hours" not in train


def test_quickstart_dry_run_honours_the_environment():
    train, _ = quickstart_commands(MAX_UPDATE="50", TASK_TRAIN_ARGS="--chunk-sizes 3")
    assert option(train, "--max-update") == "50" and option(train, "--chunk-sizes") == "3"
