"""The runtime's numeric options, defined once: their defaults, ranges and meaning, read by
:meth:`hrt_runtime.Translator.options`, ``hrt-translate``'s flags, ``hrt-serve``'s request
options and its own settings. Every value is checked by :func:`check_number`, so a bad value
gets the same one-line message whichever door it came through.

Why ranges and not only ``finite``: a finite value can still break the arithmetic
(``lenpen`` 400 made ``length ** lenpen`` overflow) or the machine (a beam of a million).
The bounds are wide enough for any sensible use and small enough that every score stays a
finite float32: with ``|lenpen| <= 10`` and at most 1024 target positions,
``length ** lenpen`` lies within 1e-31..1e31.
"""

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Sequence

import numpy as np

from hrt_runtime.errors import Refused, RefusedType
from hrt_runtime.search import SearchConfig

# a batch's source tokens at most (sentences x the longest), by default: 16 lines of the longest
# source (1024 positions) per batch instead of 64; sentences of usual lengths batch as before
MAX_TOKENS = 16384
# lines per buffer, by default (--buffer-size): each buffer is sorted by length, so a larger one makes
# batches of more similar lengths, and is held in memory whole
BUFFER_SIZE = 1024


@dataclass(frozen=True)
class Option:
    """One numeric option: its keyword (``name``), ``int`` or ``float``, default, closed range
    and a few words on what it is (in messages and ``--help``). ``flag``: its command-line flag
    where it is not ``--name-with-dashes``; ``optional``: ``None`` is a value too."""

    name: str
    kind: type
    default: object
    low: float
    high: float
    what: str
    flag: Optional[str] = None
    optional: bool = False

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def check(self, value, label: Optional[str] = None):
        """``value`` as this option's type, or the one message (``label``: how it is named, e.g. its flag)."""
        if value is None and self.optional:
            return None
        return check_number(label or self.name, value, self.kind, self.low, self.high, self.what)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def range_message(name: str, kind: type, low, high, what: str = "", value=None) -> str:
    """The one message of a refused number."""
    a = "an integer" if kind is int else "a finite number"
    return f"{name} must be {a} from {_number(low)} to {_number(high)}{f' ({what})' if what else ''}, got {value!r}"


def check_number(name: str, value, kind: type, low, high, what: str = ""):
    """``value`` as ``kind`` (``int`` or ``float``) if it is one, finite and within ``low..high``;
    else ``TypeError`` (not a number of that kind) or ``ValueError``, with :func:`range_message`."""
    if not (_is_int(value) if kind is int else _is_real(value)):
        raise RefusedType(range_message(name, kind, low, high, what, value))
    if not (math.isfinite(value) and low <= value <= high):
        raise Refused(range_message(name, kind, low, high, what, value))
    return kind(value)


_defaults = SearchConfig()  # fairseq's generation defaults, which the runtime keeps

# the options of a translation (Translator.options, hrt-translate, a request to hrt-serve), in
# the order Translator.options takes them; chunk_size is checked against the model as well
DECODING: Sequence[Option] = (
    Option("beam", int, _defaults.beam, 1, 256, "the beam size; HRT's b_at"),
    Option("chunk_size", int, None, 1, 64, "HRT's k; default the smallest trained one, 1: AT mode", optional=True),
    Option("b_nat", int, 1, 1, 256, "HRT's skeletons filled by stage II, at most beam"),
    Option("max_len_a", float, _defaults.max_len_a, 0, 100, "the output length limit's factor of the source length"),
    Option("max_len_b", int, _defaults.max_len_b, 0, 100000, "the output length limit's constant"),
    Option("min_len", int, _defaults.min_len, 0, 100000, "the shortest output, in tokens"),
    Option("lenpen", float, _defaults.len_penalty, -10, 10, "the length penalty"),
    Option("unkpen", float, _defaults.unk_penalty, -1000, 1000, "the <unk> penalty"),
    Option("batch_size", int, 64, 1, 100000, "sentences per batch"),
    Option("iterations", int, 10, 1, 1000, "Mask-Predict's iterations I", flag="--iter-decode-max-iter"),
    Option("length_beam", int, 1, 1, 256, "Mask-Predict's length beam l", flag="--iter-decode-with-beam"),
    Option(
        "max_tokens",
        int,
        MAX_TOKENS,
        1,
        10**9,
        "source tokens per batch, sentences x the longest; bounds memory on very long lines",
        optional=True,
    ),
)
DECODING_BY_NAME: Dict[str, Option] = {option.name: option for option in DECODING}


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the system has one (a container
    or ``taskset`` gives fewer than ``os.cpu_count()``), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity masks (macOS, Windows)
        return os.cpu_count() or 1


# more threads than CPUs only make the threads wait for each other (1024 on 2 cores was accepted)
CPUS = usable_cpus()
THREADS = Option(
    "threads", int, 1, 1, CPUS, f"ONNX Runtime's threads per call, at most the {CPUS} CPUs this process may use"
)
BUFFER = Option("buffer_size", int, BUFFER_SIZE, 1, 10**7, "lines read before translating")


def decoding_values(**given) -> Dict[str, object]:
    """Every decoding option's value: ``given`` ones checked, the others their defaults. An
    unknown keyword is refused with the list of options (a misspelling is not ignored)."""
    unknown = sorted(set(given) - set(DECODING_BY_NAME))
    if unknown:
        raise RefusedType(
            f"unknown option {', '.join(map(repr, unknown))}; options: {', '.join(o.name for o in DECODING)}"
        )
    return {o.name: o.check(given[o.name]) if o.name in given else o.default for o in DECODING}


def add_arguments(parser, options: Sequence[Option], **defaults):
    """``options`` as flags of an ``argparse`` parser (``defaults``: a command's own, by name).
    Values are parsed as strings and converted and checked after parsing, with the flag as
    their name (:func:`check_arguments`): ``--beam 2.5`` gets the range message, in one line,
    instead of argparse's usage block."""
    for option in options:
        parser.add_argument(
            option.cli_flag,
            dest=option.name,
            default=defaults.get(option.name, option.default),
            help=f"{option.what} ({_number(option.low)} to {_number(option.high)}; default: %(default)s)",
        )


def number_of(text, kind: type):
    """A command-line value as ``kind`` (``int`` or ``float``); ``text`` itself where it is not
    one, which :func:`check_number` then refuses with the range message. A default (not a
    string) passes unchanged."""
    if not isinstance(text, str):
        return text
    try:
        return kind(text)
    except ValueError:
        return text


def check_arguments(args, options: Sequence[Option]) -> Dict[str, object]:
    """The parsed values of ``options``, each converted (:func:`number_of`) and checked (messages name the flag)."""
    return {o.name: o.check(number_of(getattr(args, o.name), o.kind), o.cli_flag) for o in options}


def _flag_of(word: str, flags: Collection[str]) -> Optional[str]:
    """The flag ``word`` names: itself, or the one flag it abbreviates (as argparse reads it)."""
    if word in flags:
        return word
    if not word.startswith("--"):
        return None
    matches = [flag for flag in flags if flag.startswith(word)]
    return matches[0] if len(matches) == 1 else None


def joined_values(argv: Sequence[str], numeric_flags: Collection[str], flags: Collection[str]) -> List[str]:
    """``argv`` with ``--flag VALUE`` written ``--flag=VALUE`` where ``--flag`` (or an abbreviation
    of it among ``flags``) is in ``numeric_flags`` and VALUE starts with one '-': argparse takes
    ``-inf`` or ``-1e3`` for an option ("expected one argument"); joined, the value reaches the
    option's check. A VALUE starting '--' is another flag; nothing after ``--`` is touched."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return out + list(argv[i:])
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if value.startswith("-") and not value.startswith("--") and _flag_of(word, flags) in numeric_flags:
            out.append(f"{word}={value}")
            i += 2
        else:
            out.append(word)
            i += 1
    return out


class CommandParser(argparse.ArgumentParser):
    """The runtime's commands' parser (:func:`command_parser`): every refusal is one line, as the
    range messages are (argparse prints its usage block first), and a negative or non-finite
    value of a numeric flag reaches the flag's check (:func:`joined_values`)."""

    numeric_flags: Collection[str] = frozenset()

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(joined_values(args, self.numeric_flags, self._option_string_actions), namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def command_parser(prog: str, description: str, options: Sequence[Option], **defaults) -> CommandParser:
    """The parser of ``hrt-translate`` and ``hrt-serve``: the exported ``folder`` and ``options``'
    flags (:func:`add_arguments`; ``defaults``: the command's own, by name). A command adds its
    other flags, parses, then checks the values with :func:`check_arguments`."""
    parser = CommandParser(prog=prog, description=description)
    parser.add_argument("folder", help="a folder written by fairseq-hrt-export")
    add_arguments(parser, options, **defaults)
    parser.numeric_flags = frozenset(option.cli_flag for option in options)
    return parser


# hrt-serve's own settings (beside THREADS)
SERVICE: Sequence[Option] = (
    Option("port", int, 8000, 0, 65535, "the TCP port to listen on; 0: a free one, announced"),
    Option("max_batch", int, 64, 1, 100000, "sentences per batch, at most"),
    Option(
        "max_wait_ms",
        float,
        0.0,
        0,
        60000,
        "how long the oldest waiting request waits for others to join its batch (0: none; requests that "
        "arrive while a batch is translated form the next one)",
    ),
    Option(
        "max_batch_tokens",
        int,
        4096,
        1,
        10**9,
        "padded source tokens per batch, at most (sentences x the longest): a long request's batches stay short, "
        "so other requests' batches come in between (with a larger bound the others wait for a whole large batch)",
    ),
    Option("max_queue", int, 256, 1, 10**6, "requests waiting, at most (then 503)"),
    Option("max_request_lines", int, 256, 1, 10**6, "lines in one request, at most (then 413)"),
    Option(
        "max_request_tokens",
        int,
        65536,
        1,
        10**9,
        "source tokens in one request, at most, counted after truncation to the model's positions (then 413)",
    ),
    Option(
        "drain_seconds",
        float,
        30.0,
        0,
        3600,
        "at SIGTERM, how long queued requests may still be translated (the least work left first, /health "
        "answering 503); those left then are answered 503",
    ),
    Option(
        "workers",
        int,
        2,
        1,
        64,
        "decoder passes run at once, each with --threads ONNX Runtime threads: the batches in progress take "
        "turns at every pass, the one with the least work left first, so that a long request slows only itself",
    ),
    Option(
        "max_running_batches",
        int,
        8,
        1,
        1024,
        "batches in progress at once, at most, each in a thread of its own (their passes share the --workers)",
    ),
    Option(
        "max_batch_positions",
        int,
        65536,
        1,
        10**9,
        "decoder positions per batch, at most (lines x beam x the length limit their options allow): a costly "
        "request is cut into batches of this much work, a line that alone may cost more is refused (413); the "
        "batches in progress hold at most --workers times this, and a quarter more for short batches",
    ),
    Option(
        "max_request_positions",
        int,
        2**20,
        1,
        10**12,
        "decoder positions one request may cost, at most (lines x beam x the length limit its options allow; then 413)",
    ),
    Option(
        "max_positions_in_flight",
        int,
        2**22,
        1,
        10**13,
        "decoder positions of the requests admitted and not yet answered, at most (then 503); at least "
        "--max-request-positions",
    ),
    Option(
        "max_client_share",
        float,
        0.5,
        0.001,
        1.0,
        "the fraction of --max-positions-in-flight one client (its address) may hold, at most: a client holding "
        "positions is told 503 when a further request would pass it (its first request is admitted whatever it "
        "costs), so one client cannot take the whole budget",
    ),
    Option(
        "request_timeout",
        float,
        60.0,
        0.001,
        86400,
        "seconds from a request's arrival to its deadline (a request's \"timeout\" may ask for less); then it is "
        "answered 504 and its work stops between two decoder steps",
    ),
    Option("body_timeout", float, 10.0, 0.001, 3600, "seconds a request's body may take to arrive (then 408)"),
    Option(
        "idle_timeout",
        float,
        15.0,
        0.001,
        86400,
        "seconds a connection may stay without a whole request (its headers included) before it is closed",
    ),
    Option(
        "max_connections",
        int,
        512,
        1,
        10**6,
        "connections open at once, at most (then 503 and closed); lowered to fit the file limit (ulimit -n)",
    ),
)
SERVICE_BY_NAME: Dict[str, Option] = {option.name: option for option in SERVICE}
