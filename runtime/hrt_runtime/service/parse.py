"""A ``POST /translate`` body's JSON parsed and its ``"text"`` checked: in the service's process
for a small body, in a process of its own for a big one (:func:`checked_body`), as CPython's
``json`` holds the interpreter's lock for a whole parse, which would stall the event loop for as
long as a big body takes. This module imports only ``json``, so that process starts light."""

import json
from typing import Dict, List, Optional, Sequence


class BadRequest(Exception):
    """A request answered ``status`` with ``{"error": message}`` (and ``headers``) before any work."""

    def __init__(self, status: int, message: str, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    def __reduce__(self):  # back from the parsing process whole
        return BadRequest, (self.status, self.message, self.headers)


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


def checked_body(data: bytes, max_request_lines: int, options: Sequence[str]) -> Dict:
    """The body parsed and checked as far as JSON goes: ``"text"`` a list of at most
    ``max_request_lines`` strings without line breaks, every other key one of ``options`` with a
    JSON scalar (so that what goes back to the service is at most the body's text)."""
    body = json_of(data)
    text = lines_of(body)
    check_lines(text, max_request_lines)
    unknown = sorted(set(body) - {"text", *options})
    if unknown:
        raise BadRequest(400, f"unknown option {', '.join(map(repr, unknown))}; options: {', '.join(options)}")
    for name, value in body.items():
        if name != "text" and isinstance(value, (list, dict)):
            kind = "list" if isinstance(value, list) else "object"
            raise BadRequest(400, f"{name} must be a number, got a JSON {kind}")
    return {**body, "text": text}
