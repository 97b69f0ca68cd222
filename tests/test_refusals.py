"""Refused options (issue 79): the plugin's checks raise :class:`RefusedOptions` where they find
the mistake; under a command line it is one line ``PROG: error: REASON`` (exit status 1), and
every other exception keeps its traceback (the hook comes with the plugin's import under
fairseq's command lines, never with setting up a task); imported from Python, the plugin leaves
``sys.excepthook`` alone. The training mistakes that were a traceback or silently accepted are
each refused in one line."""

import subprocess
import sys
import types

import pytest
from fairseq_cli.train import cli_main

from fairseq_hrt import cli_logging
from fairseq_hrt.cli_logging import (
    FAIRSEQ_COMMANDS,
    RefusedOptions,
    install_refusal_hook,
    main_program,
    runs_a_command_line,
)
from fairseq_hrt.testing.tiny_runs import REPO, make_tiny_data, run_cli, train_args
from tests.hrt_fixtures import build_generator, build_task_and_model


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("refusals"), n_train=60, n_valid=10)


def _refusal(proc) -> str:
    """The one line of a refused command (exit status 1, no traceback)."""
    assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    return lines[0]


# ------------------------------------------------------------------ the hook


def _main_module(monkeypatch, **attributes):
    main = types.ModuleType("__main__")
    main.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, "__main__", main)


def test_only_a_command_line_counts_as_one(monkeypatch):
    assert not runs_a_command_line()  # pytest's process
    _main_module(monkeypatch, cli_main=cli_main, __spec__=None)  # fairseq-train's console script
    assert main_program() == "fairseq_cli.train" and runs_a_command_line(FAIRSEQ_COMMANDS)
    _main_module(monkeypatch, __spec__=types.SimpleNamespace(name="fairseq_cli.generate"))  # python -m
    assert runs_a_command_line(FAIRSEQ_COMMANDS)
    _main_module(monkeypatch, __spec__=types.SimpleNamespace(name="fairseq_hrt.distill"))
    assert runs_a_command_line() and not runs_a_command_line(FAIRSEQ_COMMANDS)
    # a program's name is no evidence: a notebook, or a script that only calls itself fairseq-*
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fairseq-train", "data"])
    _main_module(monkeypatch, __spec__=types.SimpleNamespace(name="ipykernel_launcher"))
    assert not runs_a_command_line()
    _main_module(monkeypatch, __spec__=None)
    assert not runs_a_command_line()


def test_the_hook_prints_refusals_and_hands_on_everything_else(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[1]))
    monkeypatch.setattr(cli_logging, "runs_a_command_line", lambda packages: True)
    monkeypatch.setattr(sys, "argv", ["fairseq-train"])
    install_refusal_hook()
    install_refusal_hook()  # once per process
    bug = ValueError("a bug")
    sys.excepthook(ValueError, bug, None)
    sys.excepthook(RefusedOptions, RefusedOptions("--p-raw must be in [0, 1], got 2.0"), None)
    assert seen == [bug]
    assert capsys.readouterr().err == "fairseq-train: error: --p-raw must be in [0, 1], got 2.0\n"


def _last_line_of_training_code(code: str, data) -> str:
    """The last line ``code`` prints, run in a fresh interpreter with a training command line's
    arguments (the tiny data's) in ``sys.argv``."""
    argv = [str(a) for a in train_args(data.bin_dir, "unused", max_update=1)[1:]]
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_the_plugin_from_python_leaves_the_excepthook_alone(data):
    """A fresh interpreter that imports the plugin and the hub and sets up the task keeps its
    own ``sys.excepthook``."""
    code = (
        "import sys; before = sys.excepthook\n"
        "import fairseq_hrt, fairseq_hrt.hub\n"
        "from fairseq import options, tasks\n"
        "args = options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:])\n"
        "tasks.setup_task(args)\n"
        "print('unchanged' if sys.excepthook is before else 'replaced')\n"
    )
    out = _last_line_of_training_code(code, data)
    assert out == "unchanged"


def test_the_hook_comes_with_the_plugin_under_fairseqs_command_line_never_with_a_task(data):
    """Under fairseq-train (its console script: ``cli_main`` imported into ``__main__``),
    importing the plugin, as ``--user-dir`` does, installs the hook, chained to the one before;
    setting up the task afterwards installs nothing, whatever the program calls itself."""
    code = (
        "import sys\n"
        "from fairseq_cli.train import cli_main\n"
        "sys.argv[0] = 'fairseq-train'\n"
        "before = sys.excepthook\n"
        "import fairseq_hrt\n"
        "installed = sys.excepthook is not before and sys.excepthook.refuses_options\n"
        "sys.excepthook = before\n"
        "from fairseq import options, tasks\n"
        "args = options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:])\n"
        "tasks.setup_task(args)\n"
        "print(installed, 'unchanged' if sys.excepthook is before else 'replaced')\n"
    )
    out = _last_line_of_training_code(code, data)
    assert out == "True unchanged"


def test_a_bug_in_the_tasks_checks_keeps_its_traceback(data, tmp_path):
    """A ValueError that is not a refusal, raised inside the task's checks of a fairseq-train
    run, is the interpreter's traceback, not a one-line refusal."""
    code = (
        "import sys\n"
        "from fairseq_cli.train import cli_main\n"
        "sys.argv[0] = 'fairseq-train'\n"
        "from fairseq_hrt import cli_logging\n"
        "from fairseq_hrt.tasks.hrt_translation import HRTTranslationTask\n"
        "cli_logging.refusals_in_one_line()  # as fairseq-train's --user-dir import does\n"
        "def broken(self):\n"
        "    raise ValueError('a bug, not a refusal')\n"
        "HRTTranslationTask.check_training_options = broken\n"
        "cli_main()\n"
    )
    proc = run_cli(["-c", code, *train_args(data.bin_dir, tmp_path / "ckpt", max_update=1)[1:]], check=False)
    assert proc.returncode == 1
    assert "Traceback" in proc.stdout and "ValueError: a bug, not a refusal" in proc.stdout, proc.stdout[-3000:]
    assert ": error: " not in proc.stdout


# ------------------------------------------------------------------ training mistakes, one line each


@pytest.mark.parametrize(
    "arch, extra, reason",
    [
        ("at_tiny", (), "--arch at_tiny decodes left to right only: train it with --hrt-mode at"),
        ("hrt_tiny", ("--hrt-mode", "cmlm"), "use a cmlm_* architecture"),
        ("cmlm_tiny", (), "--arch cmlm_tiny is a Mask-Predict architecture (cmlm_*): train it with --hrt-mode cmlm"),
    ],
)
def test_an_arch_without_its_hrt_mode_is_one_line(data, tmp_path, arch, extra, reason):
    proc = run_cli(train_args(data.bin_dir, tmp_path / "ckpt", *extra, arch=arch, max_update=1), check=False)
    assert reason in _refusal(proc)


def test_a_missing_distill_data_folder_is_one_line(data, tmp_path):
    missing = tmp_path / "no-such-folder"
    proc = run_cli(train_args(data.bin_dir, tmp_path / "ckpt", "--distill-data", missing, max_update=1), check=False)
    assert f"--distill-data {missing} is not a folder" in _refusal(proc)


def test_p_raw_without_distill_data_is_one_line(data, tmp_path):
    proc = run_cli(train_args(data.bin_dir, tmp_path / "ckpt", "--p-raw", "0.3", max_update=1), check=False)
    assert "--p-raw 0.3 mixes raw and distilled targets, but there is no --distill-data" in _refusal(proc)


def test_distilling_an_n_best_list_from_an_hrt_teacher_is_one_line(data, tmp_path):
    """HRT decoding gives one candidate a sentence: --nbest 5 --select-by-bleu is refused
    before the file is decoded, not run to pick among nothing."""
    run_cli(train_args(data.bin_dir, tmp_path / "hrt", max_update=2))
    proc = run_cli(
        [
            "fairseq_hrt.distill",
            "--data",
            data.bin_dir,
            "--path",
            tmp_path / "hrt" / "checkpoint_last.pt",
            "--src",
            data.raw_dir / "valid.en",
            "--out",
            tmp_path / "distilled.de",
            "--beam",
            "5",
            "--nbest",
            "5",
            "--select-by-bleu",
            data.raw_dir / "valid.de",
            "--cpu",
        ],
        check=False,
    )
    assert "--nbest 5: this teacher's decoding gives 1 candidate a sentence" in _refusal(proc)
    assert not (tmp_path / "distilled.de").exists()


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize("engine", ["lean", "fairseq"])
def test_sampling_with_mask_predict_is_refused_by_every_engine(tmp_path, engine):
    """Mask-Predict never runs fairseq's SequenceGenerator, whatever engine gives it its passes:
    ``--sampling`` is refused for the strategy, not with a hint to another engine (the lean
    engine named ``--decoder-engine fairseq``, which then ignored ``--sampling`` without a word)."""
    _, cmlm = build_task_and_model(str(tmp_path), arch="cmlm_tiny")
    with pytest.raises(RefusedOptions) as refused:
        build_generator(str(tmp_path), cmlm, "--decoder-engine", engine, "--sampling")
    assert str(refused.value) == "--decoding mask-predict does not support --sampling with any engine"
    # a strategy that runs the SequenceGenerator still gets the hint to the engine that has it
    _, at = build_task_and_model(str(tmp_path), arch="at_tiny")
    with pytest.raises(RefusedOptions, match="decode with --decoder-engine fairseq for these options"):
        build_generator(str(tmp_path), at, "--decoder-engine", "lean", "--sampling")
