"""README.md's two set-up commands are exactly what CI (.ci/run) runs; its tables and those of
docs/training.md and docs/decoding.md name what the plugin has."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fairseq.models import ARCH_CONFIG_REGISTRY

import fairseq_hrt  # noqa: F401  (registers the strategies and archs)
from fairseq_hrt.generation.engines import ENGINES
from fairseq_hrt.generation.strategies import DECODING_STRATEGIES
from fairseq_hrt.testing.tiny_runs import USER_DIR, run_cli

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


def _section(text: str, heading: str) -> str:
    return re.search(rf"^## {heading}\n(.*?)(?=^## )", text, re.S | re.M).group(1)


def _table_options(section: str):
    """``(options, first cell)`` of each table row whose first cell names options."""
    for row in re.findall(r"^\| (`--.*?) \|", section, re.M):
        yield re.findall(r"`(--[a-z0-9-]+)", row), row


def test_every_option_of_the_training_and_decoding_tables_is_in_the_commands_help():
    """Each option the tables of the README's Train and Decode sections, docs/training.md and
    docs/decoding.md name is one ``python -m fairseq_hrt.options_help`` lists for that command
    line: training options with an HRT arch and ``--criterion hrt_loss`` (a row marked ``cmlm_*``
    with a Mask-Predict arch instead, and not with the HRT arch), decoding options for
    ``fairseq-generate --task hrt_translation``."""

    def help_of(command, *args):
        # fairseq's --help lists only its first parse's options (docs/compatibility.md)
        cmd = ["fairseq_hrt.options_help", command, "--user-dir", USER_DIR, "--task", "hrt_translation", *args]
        out = run_cli(cmd).stdout
        return set(re.findall(r"(?<![\w-])(--[a-z0-9-]+)", out))

    train = {arch: help_of("train", "--arch", arch, "--criterion", "hrt_loss") for arch in ("hrt_tiny", "cmlm_tiny")}
    generate = help_of("generate")
    readme = (REPO / "README.md").read_text()
    training = _section(readme, "Train") + (REPO / "docs" / "training.md").read_text()
    decoding = _section(readme, "Decode") + (REPO / "docs" / "decoding.md").read_text()
    rows = 0
    for options, row in _table_options(training):
        for option in options:
            if "cmlm_*" in row:
                assert option in train["cmlm_tiny"] and option not in train["hrt_tiny"], row
            else:
                assert option in train["hrt_tiny"], row
        rows += 1
    for options, row in _table_options(decoding):
        assert set(options) <= generate, row
        rows += 1
    assert rows >= 40


def test_the_shortlist_sentence_names_what_supports_shortlists():
    """docs/decoding.md's "Works with `--decoding ...` on the engines ...": the strategies and
    engines that declare ``supports_shortlist``, no more, no fewer."""
    text = " ".join((REPO / "docs" / "decoding.md").read_text().split())
    sentence = re.search(r"Works with `--decoding (.*?) on the engines (.*?) \(", text)
    assert set(re.findall(r"`?([a-z-]+)`?(?:,| and|$)", sentence.group(1).replace("`", "") + ",")) == {
        n for n, s in DECODING_STRATEGIES.items() if s.supports_shortlist
    }
    assert set(re.findall(r"`([a-z]+)`", sentence.group(2))) == {n for n, e in ENGINES.items() if e.supports_shortlist}


def test_the_readmes_architecture_table_is_the_plugins_archs():
    """The archs the README's table lists are the ones the plugin registers, the models' own
    names (``hrt_transformer``, ...) included, no more, no fewer."""
    text = (REPO / "README.md").read_text()
    table = re.search(r"^\| family \| archs \|\n(.*?)\n\n", text, re.S | re.M).group(1)
    listed = {
        name for cell in re.findall(r"^\| [^|]* \| ([^|]*) \|", table, re.M) for name in re.findall(r"`(\w+)`", cell)
    }
    plugin = {
        arch for arch, configure in ARCH_CONFIG_REGISTRY.items() if configure.__module__.startswith("fairseq_hrt")
    }
    assert listed == plugin
