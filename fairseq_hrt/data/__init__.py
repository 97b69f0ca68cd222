"""Datasets of the HRT task (:mod:`fairseq_hrt.data.mixdistill`: MixDistill's distilled targets;
:mod:`fairseq_hrt.data.source_input`: sources repaired and cut at --max-source-positions)."""
