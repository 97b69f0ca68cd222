"""One way to read input text, used by every entry point that reads sentences: from a file or
stdin, ``fairseq-interactive`` (its lines, through the hrt_translation task), ``hrt-translate``,
``python -m fairseq_hrt.distill`` and the benchmark scripts; from Python, ``Translator.translate``
and the hub's ``translate`` (:func:`repair_lines`). Standard library only: the deployed runtime
(no PyTorch, no fairseq) and the plugin import this one module, so every entry point repairs a
line the same way, with the same warning.

Why: fairseq-interactive read stdin with Python's default error handler, so a line holding
bytes that are not valid UTF-8 reached SentencePiece as lone surrogates and ended the whole
session with ``TypeError: not a string`` (or ``UnicodeDecodeError`` for ``--input FILE``);
distillation stopped with a bare ``UnicodeDecodeError`` that named neither the file nor the
line. Here a bad line is repaired and reported, and the run goes on:

* bytes that are not valid UTF-8 are replaced by U+FFFD (the replacement character, one per
  invalid sequence), or the read stops with :class:`InputTextError` naming the file and line
  when ``errors="strict"``;
* NUL bytes are removed; other control characters (Unicode category Cc: C0, DEL, C1) but the
  tab become a space, so they cannot split or glue words behind the tokenizer's back;
* line and paragraph separators (U+2028, U+2029) become a space;
* a byte-order mark at the start of the file is dropped.

Every repaired line is logged as a warning naming the file and the line number (the first
:data:`MAX_WARNINGS_PER_FILE` of a file one by one, then a count). Lines end at ``\\n`` only
(a trailing ``\\r`` is dropped), as ``wc -l`` counts them: Python's text mode would also
split at a lone ``\\r``, which shifts every later line of a line-aligned corpus. Everything
else (empty lines, lines of spaces, very long lines, any script or emoji) passes unchanged:
what to do with its length is the model's limit (``--max-source-positions``).
"""

import logging
import os
import select
import stat
import sys
import unicodedata
from dataclasses import dataclass, field
from typing import BinaryIO, Iterable, Iterator, List, Optional, Tuple, Union

from hrt_runtime.errors import Refused, RefusedType

logger = logging.getLogger("hrt_runtime.text_input")

REPLACEMENT_CHARACTER = "\ufffd"
BYTE_ORDER_MARK = "\ufeff"
MAX_WARNINGS_PER_FILE = 10
ERROR_POLICIES = ("replace", "strict")

# problems found in a line, as they are named in warnings
UNDECODABLE = "bytes that are not valid UTF-8"
NUL = "NUL bytes"
CONTROL = "control characters"

_SEPARATORS = {"\u2028", "\u2029"}


class InputTextError(Refused):
    """A line that cannot be read under ``errors="strict"``; the message names file and line."""


@dataclass
class LineProblems:
    """What :func:`decode_line` repaired in one line (empty when nothing)."""

    kinds: List[str] = field(default_factory=list)
    first_bad_byte: Optional[int] = None  # byte offset of the first invalid UTF-8 sequence
    bad_bytes: bytes = b""

    def __bool__(self):
        return bool(self.kinds)

    def describe(self) -> str:
        parts = []
        for kind in self.kinds:
            if kind == UNDECODABLE and self.first_bad_byte is not None:
                parts.append(
                    f"{UNDECODABLE} (first at byte {self.first_bad_byte}: {self.bad_bytes!r}) replaced by U+FFFD"
                )
            elif kind == UNDECODABLE:  # text handed over decoded: its bytes are gone (lone surrogates)
                parts.append(f"{UNDECODABLE} replaced by U+FFFD")
            elif kind == NUL:
                parts.append(f"{NUL} removed")
            else:
                parts.append(f"{kind} replaced by spaces")
        return "; ".join(parts)


def clean_text(text: str) -> Tuple[str, List[str]]:
    """Repair one decoded line: lone surrogates (undecodable bytes kept by Python's
    ``surrogateescape``, e.g. from stdin in a C.UTF-8 locale) -> U+FFFD, NUL removed, other
    control characters but the tab -> space, U+2028/U+2029 -> space.

    Returns the text and the kinds of problems found (:data:`UNDECODABLE`, :data:`NUL`,
    :data:`CONTROL`). Pure; text without any of these comes back unchanged (same object).
    """
    if text.isprintable() and not any(c in _SEPARATORS for c in text):
        return text, []  # fast path: nothing to repair (printable excludes Cc, Cs, Zl, Zp)
    kinds: List[str] = []
    out = []
    for c in text:
        if c == "\0":
            if NUL not in kinds:
                kinds.append(NUL)
            continue
        if c == "\t" or c.isprintable() or c == " ":
            out.append(c)
            continue
        category = unicodedata.category(c)
        if category == "Cs":
            if UNDECODABLE not in kinds:
                kinds.append(UNDECODABLE)
            out.append(REPLACEMENT_CHARACTER)
        elif category == "Cc":
            if CONTROL not in kinds:
                kinds.append(CONTROL)
            out.append(" ")
        elif c in _SEPARATORS:
            out.append(" ")
        else:  # format characters (e.g. the zero-width joiner of emoji sequences), private use: kept
            out.append(c)
    return "".join(out), kinds


def decode_line(raw: bytes, errors: str = "replace") -> Tuple[str, LineProblems]:
    """Decode one line's bytes (without its ``\\n``) as UTF-8 and repair it (:func:`clean_text`).

    ``errors="replace"``: invalid UTF-8 sequences become U+FFFD; ``"strict"``: they raise
    :class:`InputTextError` (without a file name; :func:`iter_lines` adds it).
    """
    if errors not in ERROR_POLICIES:
        raise Refused(f"errors must be one of {ERROR_POLICIES}, got {errors!r}")
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    problems = LineProblems()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        problems.first_bad_byte = e.start
        problems.bad_bytes = raw[e.start : e.end]
        if errors == "strict":
            raise InputTextError(f"{UNDECODABLE} at byte {e.start}: {problems.bad_bytes!r} ({e.reason})") from None
        text = raw.decode("utf-8", errors="replace")
        problems.kinds.append(UNDECODABLE)
    text, kinds = clean_text(text)
    problems.kinds.extend(k for k in kinds if k not in problems.kinds)
    return text, problems


class LineWarnings:
    """Logs the lines of one file (or request) that needed something (``what``: "repaired",
    "truncated"): the first ``max_warnings`` one by one, then only their count at the end, so
    a file or a request of bad lines logs a few lines, not one per line."""

    def __init__(self, name: str, max_warnings: int = MAX_WARNINGS_PER_FILE, what: str = "repaired"):
        self.name = name
        self.max_warnings = max_warnings
        self.what = what
        self.count = 0

    def warn(self, lineno: int, message: str):
        self.count += 1
        if self.count <= self.max_warnings:
            logger.warning("%s, line %d: %s", self.name, lineno, message)
        if self.count == self.max_warnings + 1:
            logger.warning("%s: more lines %s; only their number is reported at the end", self.name, self.what)

    def report(self, lineno: int, problems: LineProblems):
        self.warn(lineno, problems.describe())

    def finish(self, lines: int):
        if self.count > self.max_warnings:
            logger.warning("%s: %d of %d lines were %s (see above)", self.name, self.count, lines, self.what)


def check_sentences(sentences):
    """``translate()`` takes one string or a list (or tuple) of strings: else the one message
    (the runtime's ``Translator.translate`` and the hub's ``translate``)."""
    if isinstance(sentences, str):
        return
    if isinstance(sentences, (list, tuple)):
        bad = [i for i, s in enumerate(sentences) if not isinstance(s, str)]
        if not bad:
            return
        raise RefusedType(
            f"translate() takes a string or a list of strings; item {bad[0]} of the list is "
            f"{type(sentences[bad[0]]).__name__}"
        )
    raise RefusedType(f"translate() takes a string or a list of strings, got {type(sentences).__name__}")


Source = Union[str, BinaryIO]


def _open_binary(source: Source):
    if source == "-":
        return sys.stdin.buffer, "<stdin>", False
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        return open(source, "rb"), str(source), True
    return source, getattr(source, "name", "<stream>"), False


def _is_live(stream) -> Optional[int]:
    """The file descriptor of ``stream`` when it is a pipe, terminal or socket (input that may
    pause), else ``None`` (a regular file, or a stream without a descriptor)."""
    try:
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) else fd


def _raw_lines(stream, pauses: bool) -> Iterator[Optional[bytes]]:
    """The raw lines of a binary stream with their ``\\n``. With ``pauses``, a pipe or terminal
    is read with ``os.read`` as its bytes arrive, and ``None`` is yielded whenever every line
    that arrived has been yielded and nothing more can be read right now (the writer waits)."""
    fd = _is_live(stream) if pauses else None
    if fd is None:
        while True:
            raw = stream.readline()
            if not raw:
                return
            yield raw
    pending = bytearray()
    while True:
        end = pending.find(b"\n")
        if end >= 0:
            raw = bytes(pending[: end + 1])
            del pending[: end + 1]
            yield raw
            continue
        if not select.select([fd], [], [], 0)[0]:
            yield None  # nothing more now: the caller may act on what it has
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        pending += chunk
    if pending:
        yield bytes(pending)


def iter_lines(
    source: Source,
    errors: str = "replace",
    name: Optional[str] = None,
    max_warnings: int = MAX_WARNINGS_PER_FILE,
    pauses: bool = False,
) -> Iterator[Optional[str]]:
    """The lines of a file, ``"-"`` (stdin) or a binary stream, decoded and repaired.

    Lazy (one line at a time), so an interactive session translates each line as it comes.
    Lines keep their spaces; only the ``\\n`` (and a ``\\r`` before it) is removed.
    ``pauses``: also yield ``None`` when a pipe or terminal has nothing more to read for now
    (:func:`iter_line_groups`).
    """
    if errors not in ERROR_POLICIES:
        raise Refused(f"errors must be one of {ERROR_POLICIES}, got {errors!r}")
    stream, default_name, owned = _open_binary(source)
    name = name or default_name
    reporter = LineWarnings(name, max_warnings)
    lineno = 0
    try:
        for raw in _raw_lines(stream, pauses):
            if raw is None:
                yield None
                continue
            lineno += 1
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            try:
                text, problems = decode_line(raw, errors)
            except InputTextError as e:
                raise InputTextError(f"{name}, line {lineno}: {e}") from None
            if lineno == 1 and text.startswith(BYTE_ORDER_MARK):
                text = text[1:]
            if problems:
                reporter.report(lineno, problems)
            yield text
    finally:
        reporter.finish(lineno)
        if owned:
            stream.close()


def read_lines(path: Source, errors: str = "replace", name: Optional[str] = None) -> List[str]:
    """All lines of ``path`` (see :func:`iter_lines`)."""
    return list(iter_lines(path, errors=errors, name=name))


def iter_line_groups(source: Source, max_lines: int, name: Optional[str] = None) -> Iterator[List[str]]:
    """The repaired lines of ``source`` (:func:`iter_lines`) in groups of at most ``max_lines``
    (``--buffer-size``): a group also ends when a pipe or terminal has nothing more to read for
    now, so a line typed or written by a waiting program is translated at once, while a file or
    a busy pipe fills whole groups. Memory: one group of lines."""
    if max_lines < 1:
        raise Refused(f"max_lines must be >= 1, got {max_lines}")
    group: List[str] = []
    for line in iter_lines(source, name=name, pauses=True):
        if line is None:
            if group:
                yield group
                group = []
            continue
        group.append(line)
        if len(group) >= max_lines:
            yield group
            group = []
    if group:
        yield group


def repair_lines(
    lines: Iterable[str], name: str = "input", first_line: int = 1, max_warnings: int = MAX_WARNINGS_PER_FILE
) -> Iterator[str]:
    """Lines already decoded (a list handed to ``translate()``) repaired as :func:`iter_lines`
    repairs a file's (:func:`clean_text`), each repaired line reported as ``"<name>, line N:
    ..."``, N counted from ``first_line``. Lazy; text that needs no repair passes unchanged."""
    reporter = LineWarnings(name, max_warnings)
    lineno = first_line - 1
    try:
        for lineno, line in enumerate(lines, first_line):
            text, kinds = clean_text(line)
            if kinds:
                problems = LineProblems(kinds=kinds)
                reporter.report(lineno, problems)
            yield text
    finally:
        reporter.finish(lineno - first_line + 1)
