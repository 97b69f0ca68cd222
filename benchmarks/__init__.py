"""Measuring scripts of fairseq-hrt (not part of the shipped plugin).

Run them as modules from the repository root (``python -m benchmarks.benchmark ...``) or as
files (``python benchmarks/benchmark.py ...``). Shared parts: :mod:`benchmarks.timing` (the one
timing loop), :mod:`benchmarks.measure` (decoding and the one atomic report writer),
:mod:`benchmarks.faults` (the reliability scenarios of the fault table) and
:mod:`benchmarks.tiny_data` (tiny corpora and fairseq command-line helpers, also used by the tests).
"""
