"""Input text repair for the plugin's entry points: :mod:`hrt_runtime.text_input`, the one
implementation (standard library only), shared with the deployed runtime so that
fairseq-interactive, the hub and ``hrt-translate`` repair a line alike and warn alike."""
from hrt_runtime.text_input import (  # noqa: F401
    BYTE_ORDER_MARK, CONTROL, ERROR_POLICIES, MAX_WARNINGS_PER_FILE, NUL, REPLACEMENT_CHARACTER, UNDECODABLE,
    InputTextError, LineProblems, clean_text, decode_line, iter_line_groups, iter_lines, logger, read_lines,
    repair_lines)
