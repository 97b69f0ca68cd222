"""The tests' tiny data and fairseq command-line helpers: :mod:`benchmarks.tiny_data`, which the
fault table (benchmarks/faults.py) shares, under its old name (``from tests.tiny_data import ...``
or ``from tiny_data import ...``). This module *is* that one (same object), so monkeypatching
either name patches both."""
import sys

from benchmarks import tiny_data as _tiny_data

sys.modules[__name__] = _tiny_data
