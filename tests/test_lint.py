"""The tree passes the repository's linter and formatter (ruff.toml): a lint error or an
unformatted file fails the suite, as it would fail review."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff():
    # the ruff of this interpreter's environment (requirements.txt pins it), else one on PATH
    local = Path(sys.executable).parent / "ruff"
    found = str(local) if local.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -r requirements.txt")
    return found


@pytest.mark.parametrize("command", [["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]])
def test_tree_is_lint_clean_and_formatted(command):
    done = subprocess.run([_ruff(), *command], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff {' '.join(command)}:\n{done.stdout}{done.stderr}"
