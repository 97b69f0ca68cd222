"""Moved to :mod:`fairseq_hrt.passes.decoder_pass` (below ``export/``, which must not import this package:
see docs/design.md); this name is that module, for the code that still imports it here."""

import sys

from fairseq_hrt.passes import decoder_pass as _moved

sys.modules[__name__] = _moved
