"""Moved to :mod:`fairseq_hrt.passes.search_rules` (below ``export/``, which must not import this package:
see docs/design.md); this name is that module, for the code that still imports it here."""

import sys

from fairseq_hrt.passes import search_rules as _moved

sys.modules[__name__] = _moved
