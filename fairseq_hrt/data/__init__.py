"""Datasets of the HRT task (:mod:`fairseq_hrt.data.mixdistill`: MixDistill's distilled targets)."""
