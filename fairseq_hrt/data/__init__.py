"""Datasets of the HRT task (:mod:`fairseq_hrt.data.mixdistill`: MixDistill's distilled targets;
:mod:`fairseq_hrt.data.truncation`: sources cut at --max-source-positions)."""
