"""What this package's command lines show: the logging set-up of its own tools (distillation,
benchmarks), and options refused as one line (:class:`RefusedOptions`) under fairseq's command
lines."""

import logging
import os
import sys
from typing import Optional


def setup_logging(log_file: Optional[str] = None):
    """fairseq's log format, to ``log_file`` or stderr.

    ``force=True`` because importing fairseq (its text_to_speech task) already configured the
    root logger, which would otherwise make this call a no-op.
    """
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        handlers=[handler],
        force=True,
    )
    logging.captureWarnings(True)  # library warnings (e.g. DataLoader pin_memory) into the log


class RefusedOptions(ValueError):
    """Options that cannot go together, or cannot train or decode this model; the message is one
    sentence saying what to change. The plugin's checks of options raise it where they find the
    mistake; every other exception (a bug, a damaged file) is left as it is, traceback and all.
    From Python it is a ``ValueError`` like any other; under fairseq's command lines (and the
    plugin's own that ask for it) it prints ``PROG: error: MESSAGE`` and exits with status 1, as
    argparse does for a bad option, without a traceback (:func:`install_refusal_hook`)."""


# the packages of the programs whose uncaught refusals are one line: fairseq's command lines,
# and the plugin's own that install the hook themselves (fairseq_hrt.distill)
FAIRSEQ_COMMANDS = ("fairseq_cli",)
COMMAND_PACKAGES = ("fairseq_cli", "fairseq_hrt")


def main_program() -> str:
    """The module whose command line this process runs: ``python -m fairseq_cli.train`` -> the
    ``__main__`` module's spec (``fairseq_cli.train``); a console script (``fairseq-train``,
    which is ``from fairseq_cli.train import cli_main; sys.exit(cli_main())``) -> the module of
    the ``cli_main`` it imported; ``""`` for anything else (``python -c``, a notebook, pytest)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name and name != "__main__":
        return name
    entry = getattr(main, "cli_main", None)
    return getattr(entry, "__module__", None) or ""


def runs_a_command_line(packages=COMMAND_PACKAGES) -> bool:
    """Whether :func:`main_program` is a module of one of ``packages``."""
    return main_program().split(".")[0] in packages


def install_refusal_hook(packages=COMMAND_PACKAGES):
    """When this process runs a command line of ``packages`` (:func:`runs_a_command_line`), an
    uncaught :class:`RefusedOptions` is one line (:func:`refusals_in_one_line`).

    Called when fairseq's ``--user-dir`` imports the plugin (``fairseq_hrt/__init__``, with
    ``packages=FAIRSEQ_COMMANDS``: fairseq's command lines catch no exception, and have no
    other place where a plugin's refusal could become one line), and by the plugin's own
    command lines that ask for it. Nothing is installed when the plugin is used from Python
    (the hub, tests, a notebook, a program that imports fairseq's ``main``):
    ``sys.excepthook`` is the program's own; a caller catches the refusal (a ``ValueError``)."""
    if runs_a_command_line(packages):
        refusals_in_one_line()


def refusals_in_one_line():
    """From now on an uncaught :class:`RefusedOptions` is one line on stderr (the interpreter
    then exits with status 1); every other exception goes to the hook that was there, with its
    traceback. Once per process."""
    previous = sys.excepthook
    if getattr(previous, "refuses_options", False):
        return

    def hook(kind, value, traceback):
        if isinstance(value, RefusedOptions):
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "fairseq"
            print(f"{prog}: error: {value}", file=sys.stderr, flush=True)
        else:
            previous(kind, value, traceback)

    hook.refuses_options = True
    sys.excepthook = hook
