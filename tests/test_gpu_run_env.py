"""``benchmarks/gpu_run.sh device``'s interpreter finds the plugin and the runtime in the checkout:
the GPU image has neither installed (the runtime is a distribution of its own), so the device
stages put both on ``PYTHONPATH`` beside the packed site (issue 87)."""

import os
import re
import subprocess
import sys
import sysconfig

from fairseq_hrt.testing.tiny_runs import REPO


def test_the_device_stages_import_the_plugin_and_the_runtime_from_the_checkout(tmp_path):
    """A fresh interpreter with only the device stages' PYTHONPATH (this venv's site-packages in
    the place of the image's own packages and the packed site) imports fairseq_hrt and
    hrt_runtime, the latter from the checkout's runtime/."""
    site = sysconfig.get_paths()["purelib"]
    env = {"PATH": os.environ["PATH"]}
    path = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "pythonpath", site],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # -S: no site processing, hence no editable install's .pth: only what PYTHONPATH names (help()
    # set as site would: fairseq's dataclasses name it)
    code = "import site; site.sethelper(); import fairseq_hrt, hrt_runtime; print(hrt_runtime.__file__)"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=str(tmp_path),
        env={**env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(REPO / "runtime" / "hrt_runtime" / "__init__.py")


def test_every_device_stage_is_in_the_help_and_the_help_is_the_whole_header():
    """The stages ``device`` runs (its ``case``) are each described in ``--help``, which prints
    the script's whole comment header (it grew past a fixed line count once)."""
    script = (REPO / "benchmarks" / "gpu_run.sh").read_text()
    body = script[script.index("device() {") :]
    stages = re.findall(r"^\s+([a-z0-9]+)\) stage ", body, flags=re.M)
    assert {"env", "cudagraph", "bench", "shapes", "wmtslice"} <= set(stages)
    shown = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    header = script[script.index("\n") + 1 : script.index("\nset -u")]
    assert shown.strip() == header.strip()
    for name in stages:
        assert re.search(rf"^#\s+{name}\s", shown, flags=re.M), name
