"""Measuring scripts of fairseq-hrt (not part of the shipped plugin).

Run them as modules from the repository root (``python -m benchmarks.benchmark ...``) or as
files (``python benchmarks/benchmark.py ...``). Shared parts: :mod:`benchmarks.timing` (the one
timing loop), :mod:`benchmarks.measure` (decoding, rows from the plugin's registries),
:mod:`benchmarks.report_files` (the one atomic report writer), :mod:`benchmarks.faults` (the
reliability scenarios of the fault table) and :mod:`benchmarks.tiny_runs` (tiny corpora and
fairseq command lines; the tests' harness, tests/tiny_data.py, builds on it). Nothing here
imports ``tests/``.
"""
