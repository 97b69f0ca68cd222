"""Scoring: sacreBLEU (with signature), source-word counts for speed, and COMET from a
local checkpoint only. Importing this package is cheap: sacreBLEU and unbabel-comet are
imported inside the functions that need them."""
from fairseq_hrt.scoring.comet import CometUnavailable, comet_score, resolve_comet_model
from fairseq_hrt.scoring.metrics import sacrebleu_score, source_words

__all__ = ["CometUnavailable", "comet_score", "resolve_comet_model", "sacrebleu_score", "source_words"]
