"""What this package's command lines show: the logging set-up of its own tools (distillation,
benchmarks), and options refused as one line (:class:`RefusedOptions`) under fairseq's."""

import logging
import os
import sys
from contextlib import contextmanager
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
    """Options that cannot go together, or cannot train or decode this model; the message
    says why. From Python it is a ``ValueError`` like any other; a command line that does not
    catch it prints ``PROG: error: MESSAGE`` and exits with status 1, as argparse does for a
    bad option, without a traceback (:func:`install_refusal_hook`)."""


@contextmanager
def refusals():
    """A ``ValueError`` raised inside (the plugin's checks of its options) leaves as
    :class:`RefusedOptions` with the same message."""
    try:
        yield
    except RefusedOptions:
        raise
    except ValueError as error:
        raise RefusedOptions(str(error)) from error


def install_refusal_hook():
    """An uncaught :class:`RefusedOptions` is one line on stderr (the interpreter then exits
    with status 1); every other exception goes to the hook that was there. Once per process."""
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
