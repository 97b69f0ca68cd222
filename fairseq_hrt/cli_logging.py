"""What this package's command lines show: the logging set-up of its own tools (distillation,
benchmarks), and options refused as one line (:class:`RefusedOptions`) under fairseq's."""

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
    From Python it is a ``ValueError`` like any other; under a command line that does not catch
    it, it prints ``PROG: error: MESSAGE`` and exits with status 1, as argparse does for a bad
    option, without a traceback (:func:`install_refusal_hook`)."""


# the programs whose uncaught refusals are one line: fairseq's command lines and the plugin's
# own, run as ``python -m MODULE`` (the module's name) or as a console script (its file name)
COMMAND_MODULES = ("fairseq_cli", "fairseq_hrt")
COMMAND_SCRIPTS = ("fairseq-",)


def runs_a_command_line() -> bool:
    """Whether this process's main program is a fairseq command line or one of the plugin's:
    ``python -m fairseq_cli.train`` / ``python -m fairseq_hrt.distill`` (the ``__main__``
    module's spec) or ``fairseq-train`` / ``fairseq-hrt-export`` (the script's name)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None) or ""
    if name.split(".")[0] in COMMAND_MODULES:
        return True
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return script.startswith(COMMAND_SCRIPTS)


def install_refusal_hook():
    """Under a command line (:func:`runs_a_command_line`), an uncaught :class:`RefusedOptions`
    is one line on stderr (the interpreter then exits with status 1); every other exception
    goes to the hook that was there, with its traceback. Once per process.

    Nothing is installed when the plugin is used from Python (the hub, tests, a notebook, a
    program that imports fairseq's ``main``): ``sys.excepthook`` is the program's own, and a
    library has no business deciding how that program's uncaught errors look; a caller catches
    the refusal (a ``ValueError``) and sees its message there."""
    if not runs_a_command_line():
        return
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
