"""A ``POST /translate`` body read and checked before any work: JSON, its ``"text"`` (one
sentence per string), its options, and the limits of one request. Each refusal is a
:class:`BadRequest` with the status and the message the client gets."""

from typing import Dict, Optional, Sequence, Tuple

from hrt_runtime.call_options import CallOptions
from hrt_runtime.errors import Refused
from hrt_runtime.options import DECODING, Option
from hrt_runtime.service.parse import BadRequest
from hrt_runtime.translator import Translator

# the options a request may set: Translator.translate's, but the batching (the service's own), and its deadline
REQUEST_OPTIONS = tuple(o.name for o in DECODING if o.name not in ("batch_size", "max_tokens")) + ("timeout",)
MAX_BODY_BYTES = 16 * 2**20


def timeout_option(request_timeout: float) -> Option:
    """A request's ``"timeout"``: seconds to its deadline, at most the service's ``--request-timeout``."""
    return Option("timeout", float, None, 0.001, request_timeout, "seconds to the request's deadline", optional=True)


def options_of(
    body: Dict, translator: Translator, timeout: Option, max_batch: int, max_batch_tokens: int
) -> Tuple[CallOptions, Optional[float]]:
    """The request's decoding options, checked as ``Translator.options`` checks them (the batching
    is the service's), and its ``"timeout"`` (``None``: not given)."""
    unknown = sorted(set(body) - {"text", *REQUEST_OPTIONS})
    if unknown:
        raise BadRequest(400, f"unknown option {', '.join(map(repr, unknown))}; options: {', '.join(REQUEST_OPTIONS)}")
    try:
        seconds = timeout.check(body.get("timeout"))
        options = translator.options(
            batch_size=max_batch,
            max_tokens=max_batch_tokens,
            **{k: v for k, v in body.items() if k not in ("text", "timeout")},
        )
    except Refused as e:
        raise BadRequest(400, str(e)) from None
    return options, seconds


def check_positions(positions: Sequence[int], max_request_positions: int) -> None:
    """At most ``--max-request-positions`` decoder positions in one request (413 with its figure)."""
    if sum(positions) > max_request_positions:
        raise BadRequest(
            413,
            f"this request may cost {sum(positions)} decoder positions (lines x beam x the length limit its "
            f"options allow); at most {max_request_positions} (--max-request-positions): send fewer "
            "lines, a smaller beam or a lower max_len_b",
        )
