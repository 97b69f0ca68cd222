"""Measuring scripts of fairseq-hrt (not part of the shipped plugin).

Run them as modules from the repository root (``python -m benchmarks.benchmark ...``) or as
files (``python benchmarks/benchmark.py ...``). Shared parts: :mod:`benchmarks.timing` (the one
timing loop), :mod:`benchmarks.measure` (decoding, rows from the plugin's registries),
:mod:`benchmarks.report_files` (the one atomic report writer) and :mod:`benchmarks.faults` (the
reliability scenarios of the fault table, on the tiny-data setting of
:mod:`fairseq_hrt.testing.tiny_runs`, which the tests share). Nothing here imports ``tests/``
or ``examples/`` or runs an example (the examples run benchmarks, not the other way round).
"""
