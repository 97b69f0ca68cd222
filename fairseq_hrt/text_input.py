"""Input text repair for the plugin's entry points: :mod:`hrt_runtime.text_input`, the one
implementation (standard library only), shared with the deployed runtime so that
fairseq-interactive, the hub and ``hrt-translate`` repair a line alike and warn alike. This
module *is* that one (same object: ``from fairseq_hrt import text_input`` and monkeypatching
either name reach the same functions)."""

import sys

from hrt_runtime import text_input as _text_input

sys.modules[__name__] = _text_input
