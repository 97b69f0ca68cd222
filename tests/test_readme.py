"""README.md's two set-up commands are exactly what CI (.ci/run) runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_commands():
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"### (\d)\. [^\n]*\n\n```bash\n(.*?)\n```", text, re.S)
    return {int(n): body.strip() for n, body in blocks}


def test_readme_has_exactly_two_setup_commands_and_ci_runs_them():
    cmds = readme_commands()
    assert sorted(cmds) == [1, 2]
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    for cmd in cmds.values():
        assert "\n" not in cmd, "each set-up command is one line"
        assert cmd in ci_lines, f"{cmd!r} is not run verbatim by .ci/run"


def test_setup_installs_fairseq_without_its_dependencies():
    cmd = readme_commands()[1]
    assert "pip install --no-deps -r requirements-fairseq.txt" in cmd
    reqs = (REPO / "requirements.txt").read_text()
    assert re.search(r"^torch==2\.13\.0", reqs, re.M)
    assert "torchaudio" not in reqs and "torchvision" not in reqs
    fairseq_reqs = (REPO / "requirements-fairseq.txt").read_text()
    assert re.search(r"^ve-fairseq==0\.12\.3$", fairseq_reqs, re.M)


def test_readme_python_example_runs_on_the_quickstart_model():
    """The README's Python example, verbatim, on the model the set-up command trains (CI runs
    the set-up command before the tests; skipped where the quickstart has not run)."""
    text = (REPO / "README.md").read_text()
    code = re.search(r"### From Python\n.*?```python\n(.*?)\n```", text, re.S).group(1)
    ckpt = REPO / "work/multi30k-sp4000/runs/hrt_translation-hrt_transformer/checkpoints/checkpoint_best.pt"
    if not ckpt.exists():
        pytest.skip("the quickstart (README set-up command) has not run in this checkout")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = out.stdout.strip().splitlines()[-2:]
    translations = eval(first)  # a printed list of three strings
    assert len(translations) == 3 and translations[1] == "" and translations[0] and translations[2]
    assert second.strip()
