"""Logging set-up shared by this package's command-line tools (distillation, benchmarks)."""

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
