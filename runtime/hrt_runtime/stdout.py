"""Standard output of the command lines when its reader has gone (imports only os and sys: the
command lines' Ctrl-C handling runs before anything heavy is imported)."""

import os
import sys


def stdout_to_devnull():
    """Standard output to /dev/null: what is still buffered for it cannot be written, and the
    interpreter's last flush would print a second error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
