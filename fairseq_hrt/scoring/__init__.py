"""Scoring: sacreBLEU (with signature), source-word counts for speed, and COMET from a
local checkpoint only (:mod:`fairseq_hrt.scoring.comet`).

Importing this package is cheap: its names are resolved on first use (PEP 562), so that
``python -m fairseq_hrt.scoring.comet`` runs without the submodule being pre-imported, and
unbabel-comet itself is only imported when a COMET model is loaded.
"""

import importlib

_EXPORTS = {
    "sacrebleu_score": "metrics",
    "source_words": "metrics",
    "paired_bleu_difference": "metrics",
    "mean_paired_bleu_difference": "metrics",
    "CometUnavailable": "comet",
    "comet_score": "comet",
    "resolve_comet_model": "comet",
    "load_comet_model": "comet",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
