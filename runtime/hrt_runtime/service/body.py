"""A ``POST /translate`` body read and checked before any work: JSON, its ``"text"`` (one
sentence per string), its options, and the limits of one request. Each refusal is a
:class:`BadRequest` with the status and the message the client gets."""

import json
from typing import Dict, List, Optional, Sequence, Tuple

from hrt_runtime.call_options import CallOptions
from hrt_runtime.errors import Refused
from hrt_runtime.options import DECODING, Option
from hrt_runtime.translator import Translator

# the options a request may set: Translator.translate's, but the batching (the service's own), and its deadline
REQUEST_OPTIONS = tuple(o.name for o in DECODING if o.name not in ("batch_size", "max_tokens")) + ("timeout",)
MAX_BODY_BYTES = 16 * 2**20


class BadRequest(Exception):
    """A request answered ``status`` with ``{"error": message}`` before any work."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def timeout_option(request_timeout: float) -> Option:
    """A request's ``"timeout"``: seconds to its deadline, at most the service's ``--request-timeout``."""
    return Option("timeout", float, None, 0.001, request_timeout, "seconds to the request's deadline", optional=True)


def json_of(data: bytes) -> Dict:
    """The body as a JSON object holding ``"text"``."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(400, 'the body must be JSON: {"text": ["a sentence", ...], "beam": 5, ...}') from None
    except RecursionError:
        raise BadRequest(400, "the body's JSON is nested too deep") from None
    if not isinstance(body, dict) or "text" not in body:
        raise BadRequest(400, 'the body must be a JSON object with "text": a list of strings')
    return body


def lines_of(body: Dict) -> List[str]:
    """``"text"``: a list of strings (one string: a list of one)."""
    text = body["text"]
    if isinstance(text, str):
        text = [text]
    if not isinstance(text, list) or not all(isinstance(line, str) for line in text):
        raise BadRequest(400, '"text" must be a list of strings (one sentence each)')
    return text


def line_break_in(lines: List[str]) -> Optional[int]:
    """The index of the first line holding a line break (a request is one sentence per string:
    a break inside one would be translated as one sentence and come back cut)."""
    return next((i for i, line in enumerate(lines) if "\n" in line or "\r" in line), None)


def check_lines(text: List[str], max_request_lines: int) -> None:
    """At most ``--max-request-lines`` lines, none holding a line break."""
    if len(text) > max_request_lines:
        raise BadRequest(
            413, f"{len(text)} lines in one request; at most {max_request_lines} (--max-request-lines): split it"
        )
    broken = line_break_in(text)
    if broken is not None:
        raise BadRequest(
            400,
            f'"text" line {broken + 1} holds a line break; send one sentence per string (its translation is '
            "one string)",
        )


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


def check_tokens(tokens: int, max_request_tokens: int) -> None:
    """At most ``--max-request-tokens`` source tokens in one request (413 with its figure)."""
    if tokens > max_request_tokens:
        raise BadRequest(
            413,
            f"{tokens} source tokens in one request; at most {max_request_tokens} (--max-request-tokens): split it",
        )


def check_positions(positions: Sequence[int], max_request_positions: int) -> None:
    """At most ``--max-request-positions`` decoder positions in one request (413 with its figure)."""
    if sum(positions) > max_request_positions:
        raise BadRequest(
            413,
            f"this request may cost {sum(positions)} decoder positions (lines x beam x the length limit its "
            f"options allow); at most {max_request_positions} (--max-request-positions): send fewer "
            "lines, a smaller beam or a lower max_len_b",
        )
