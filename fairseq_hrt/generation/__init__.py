"""Decoding: options (:mod:`.options`), engines (:mod:`.engines`), strategies
(:mod:`.strategies`) and their generators. Every module of this package is imported here,
as fairseq imports its ``models/`` and ``tasks/``: a strategy or an engine registers itself
when its module is imported, so adding one is adding its module (see docs/design.md)."""

import importlib
import os

for _file in sorted(os.listdir(os.path.dirname(__file__))):
    if _file.endswith(".py") and not _file.startswith("_"):
        importlib.import_module(f"{__name__}.{_file[:-3]}")
