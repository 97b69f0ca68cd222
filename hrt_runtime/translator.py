"""Raw text in, raw text out, from an exported folder: SentencePiece, fairseq's dictionaries and
:mod:`hrt_runtime.search`, with only ``numpy``, ``onnxruntime`` and ``sentencepiece``.

Input is handled as ``fairseq-interactive`` handles it: SentencePiece pieces looked up in the
source dictionary (unknown pieces become ``<unk>``), ``</s>`` appended, sentences longer than
the model's source positions truncated (with a warning), empty lines translated to empty
lines, batches left-padded.
"""

import argparse
import itertools
import logging
import math
import os
import sys
import threading
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np
import sentencepiece

from hrt_runtime.families import DESCRIPTION, HRT, MASK_PREDICT
from hrt_runtime.model import ExportedModel
from hrt_runtime.search import SearchConfig, hrt, left_to_right, mask_predict
from hrt_runtime.text_input import iter_line_groups, repair_lines

logger = logging.getLogger(__name__)

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def read_dictionary(path: str) -> List[str]:
    """The symbols of a fairseq ``dict.txt``, by index (fairseq's four specials first)."""
    symbols = list(SPECIALS)
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            fields = line.rsplit(" ", 2 if line.endswith("#fairseq:overwrite") else 1)
            symbol = fields[0]
            if symbol in symbols and not line.endswith("#fairseq:overwrite"):
                raise ValueError(f"{path}: duplicate symbol {symbol!r}")
            symbols.append(symbol)
    return symbols


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


# a batch's source tokens at most (sentences x the longest), by default: 16 lines of the longest
# source (1024 positions) per batch instead of 64; sentences of usual lengths batch as before
MAX_TOKENS = 16384
# lines per buffer, by default (--buffer-size): 20,000 lines in buffers of 1024 took 12.7 s against
# 12.1 s in one (sorted by length once), with buffers of 256 14.2 s; memory alike (quickstart model)
BUFFER_SIZE = 1024


def _batches(todo, batch_size: int, max_tokens: Optional[int]):
    """``todo`` (sorted by length) cut into batches of at most ``batch_size`` sentences and
    ``max_tokens`` padded source tokens (at least one sentence each)."""
    batch = []
    for item in todo:
        if batch and (
            len(batch) >= batch_size
            or (max_tokens is not None and (len(batch) + 1) * max(item[1].size, batch[-1][1].size) > max_tokens)
        ):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


@dataclass(frozen=True)
class CallOptions:
    """The checked options of one ``translate`` call (see :meth:`Translator.translate`)."""

    search: SearchConfig
    chunk_size: int
    b_nat: int
    batch_size: int
    iterations: int
    length_beam: int
    max_tokens: Optional[int] = None


class Translator:
    """``Translator(folder).translate(["A man rides a bike."])``. Decoding options are fairseq's
    (``beam``, ``max_len_a``, ``max_len_b``, ``min_len``, ``lenpen``, ``unkpen``), HRT's
    (``chunk_size``: default the smallest trained one, 1 = AT mode; ``b_nat``) and Mask-Predict's
    (``iterations``: I, ``length_beam``: l; fairseq's ``--iter-decode-max-iter`` /
    ``--iter-decode-with-beam``).

    Input is repaired as every entry point repairs it (:mod:`hrt_runtime.text_input`: NUL
    removed, control characters to spaces, lone surrogates to U+FFFD, with a warning naming
    the line). One ``Translator`` may be shared by several threads: a call keeps its state to
    itself, ONNX Runtime's ``run`` is thread-safe, and the sessions are made under a lock.
    The output of a sentence does not depend on the batch it is decoded in."""

    def __init__(self, folder: str, threads: int = 1):
        if not isinstance(folder, (str, os.PathLike)):
            raise TypeError(
                f"Translator(folder): folder is the path of a folder written by fairseq-hrt-export, "
                f"got {type(folder).__name__}"
            )
        if not _is_int(threads):
            raise TypeError(f"threads must be an integer (ONNX Runtime's threads per call), got {threads!r}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1 (ONNX Runtime's threads per call), got {threads}")
        folder = os.fspath(folder)
        self.model = ExportedModel(folder, threads=threads)
        self._guard_sessions()
        config = self.model.config
        self.source_symbols = read_dictionary(os.path.join(folder, config["source_dictionary"]))
        self.target_symbols = read_dictionary(os.path.join(folder, config["target_dictionary"]))
        if len(self.target_symbols) != config["vocab_size"]:
            raise ValueError(
                f"{folder}: the target dictionary has {len(self.target_symbols)} symbols, "
                f"the model {config['vocab_size']}; export the checkpoint again"
            )
        self.source_index = {s: i for i, s in enumerate(self.source_symbols)}
        self.spm = None
        if config.get("sentencepiece_model"):
            self.spm = sentencepiece.SentencePieceProcessor(
                model_file=os.path.join(folder, config["sentencepiece_model"])
            )
        self.max_source_tokens = int(config["max_source_positions"])

    def _guard_sessions(self):
        """Make the model's sessions (created on first use) under a lock: two threads decoding
        at once would otherwise both build the same session."""
        lock = threading.Lock()
        make = self.model.session

        def session(graph):
            with lock:
                return make(graph)

        self.model.session = session

    def encode(self, line: str, where: Optional[str] = None) -> np.ndarray:
        """Source ids of one line (``where``: how a warning names it, e.g. ``"input, line 3"``)."""
        pieces = self.spm.encode(line.strip(), out_type=str) if self.spm is not None else line.split()
        unk, eos = self.model.config["source_unk"], self.model.config["source_eos"]
        ids = [self.source_index.get(p, unk) for p in pieces]
        if len(ids) + 1 > self.max_source_tokens:
            logger.warning(
                "%sa sentence of %d tokens is truncated to the model's %d source positions",
                f"{where}: " if where else "",
                len(ids) + 1,
                self.max_source_tokens,
            )
            ids = ids[: self.max_source_tokens - 1]
        return np.array(ids + [eos], np.int64)

    def decode(self, tokens: Sequence[int]) -> str:
        eos, pad = self.model.eos, self.model.pad
        pieces = [self.target_symbols[t] for t in tokens if t not in (eos, pad)]
        if self.spm is None:
            return " ".join(pieces)
        return "".join(pieces).replace("\u2581", " ").strip()

    def search(
        self,
        sources: List[np.ndarray],
        config: SearchConfig,
        chunk_size: int,
        b_nat: int = 1,
        iterations: int = 10,
        length_beam: int = 1,
    ):
        """Hypotheses of a batch of encoded sources (left-padded here, as fairseq batches them)."""
        pad = self.model.config["source_pad"]
        width = max(s.size for s in sources)
        src = np.full((len(sources), width), pad, np.int64)
        for i, s in enumerate(sources):
            src[i, width - s.size :] = s
        encoded = self.model.encode(src)
        banned = self.model.config["banned"]
        if self.model.kind == MASK_PREDICT:
            return mask_predict(
                self.model, encoded, src, iterations, length_beam, config.max_len_a, config.max_len_b, banned
            )
        if self.model.kind == HRT:
            # L is capped at the decoder's positions anyway; stated as that cap (less one chunk),
            # stage I's L // k steps and stage II's positions 1..m x k stay within them too:
            # hrt_runtime.search caps the steps, not their positions, and a batch of very long
            # lines reached position 1024 of 1024 (a traceback from ONNX Runtime)
            limit = chunk_size * ((int(self.model.config["max_target_positions"]) - 1) // chunk_size - 1)
            if chunk_size > 1 and config.max_len_a * width + config.max_len_b > limit:
                config = replace(config, max_len_a=0.0, max_len_b=limit)
            return hrt(self.model, encoded, width, config, chunk_size, banned, b_nat=b_nat)
        if chunk_size != 1:
            raise ValueError(f"chunk_size {chunk_size}: an AT model decodes left to right only (chunk_size 1)")
        return left_to_right(self.model, encoded, width, config, banned)

    def chunk_size(self, chunk_size: Optional[int]) -> int:
        """The chunk size a call decodes with: ``chunk_size`` checked against the model (``None``:
        the smallest trained one; 1: AT mode)."""
        trained = self.model.config["trained_chunk_sizes"]
        if chunk_size is None:
            return min(trained) if trained else 1
        if not _is_int(chunk_size):
            raise TypeError(f"chunk_size must be an integer (1: AT mode) or None, got {chunk_size!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (1: AT mode), got {chunk_size}")
        if chunk_size > 1 and self.model.kind != HRT:
            raise ValueError(
                f"chunk_size {chunk_size}: this is {DESCRIPTION[self.model.kind]}, it has no chunk size "
                "(chunk_size 1 or None)"
            )
        if chunk_size > 1 and chunk_size not in trained:
            raise ValueError(
                f"chunk_size {chunk_size}: this model was trained for chunk sizes "
                f"{', '.join(map(str, trained)) or 'none'}; use one of them, or 1 for AT mode"
            )
        return chunk_size

    def options(
        self,
        beam: int = 5,
        chunk_size: Optional[int] = None,
        b_nat: int = 1,
        max_len_a: float = 0.0,
        max_len_b: int = 200,
        min_len: int = 1,
        lenpen: float = 1.0,
        unkpen: float = 0.0,
        batch_size: int = 64,
        iterations: int = 10,
        length_beam: int = 1,
        max_tokens: Optional[int] = MAX_TOKENS,
    ) -> CallOptions:
        """The options of a call, checked before anything is read or decoded (one message each).
        ``max_tokens``: a batch holds at most this many source tokens (its sentences x the
        longest), as fairseq's ``--max-tokens``: memory stays bounded when lines are very long
        (``None``: only ``batch_size`` counts)."""
        k = self.chunk_size(chunk_size)
        for name, value in (
            ("beam", beam),
            ("b_nat", b_nat),
            ("batch_size", batch_size),
            ("min_len", min_len),
            ("max_len_b", max_len_b),
            ("iterations", iterations),
            ("length_beam", length_beam),
        ):
            if not _is_int(value):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        for name, value in (
            ("beam", beam),
            ("b_nat", b_nat),
            ("batch_size", batch_size),
            ("iterations", iterations),
            ("length_beam", length_beam),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
        if min_len < 0:
            raise ValueError(f"min_len must be >= 0, got {min_len}")
        if max_len_b < 0:
            raise ValueError(
                f"max_len_b must be >= 0 (the output length limit is max_len_a x source length + "
                f"max_len_b), got {max_len_b}"
            )
        for name, value, what in (
            ("max_len_a", max_len_a, "the output length limit's factor of the source length"),
            ("lenpen", lenpen, "the length penalty"),
            ("unkpen", unkpen, "the <unk> penalty"),
        ):
            if not _is_real(value):
                raise TypeError(f"{name} must be a number ({what}), got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number ({what}), got {value}")
        if max_len_a < 0:
            raise ValueError(
                f"max_len_a must be >= 0 (the output length limit's factor of the source length), got {max_len_a}"
            )
        if self.model.kind == HRT and b_nat > beam:
            raise ValueError(
                f"b_nat {b_nat} > beam {beam}: stage II fills the top b_nat of the beam's "
                "Skip-AT hypotheses, so b_nat must be <= beam (b_at)"
            )
        search = SearchConfig(
            beam=beam,
            max_len_a=float(max_len_a),
            max_len_b=int(max_len_b),
            min_len=int(min_len),
            len_penalty=float(lenpen),
            unk_penalty=float(unkpen),
        )
        return CallOptions(
            search,
            k,
            int(b_nat),
            int(batch_size),
            int(iterations),
            int(length_beam),
            None if max_tokens is None else int(max_tokens),
        )

    def translate(
        self,
        lines: Union[str, List[str]],
        beam: int = 5,
        chunk_size: Optional[int] = None,
        b_nat: int = 1,
        max_len_a: float = 0.0,
        max_len_b: int = 200,
        min_len: int = 1,
        lenpen: float = 1.0,
        unkpen: float = 0.0,
        batch_size: int = 64,
        iterations: int = 10,
        length_beam: int = 1,
        max_tokens: Optional[int] = MAX_TOKENS,
    ) -> Union[str, List[str]]:
        """The translations of one string or a list of strings (the whole list in one buffer:
        similar lengths share a batch). ``max_tokens``: see :meth:`options`."""
        options = self.options(
            beam,
            chunk_size,
            b_nat,
            max_len_a,
            max_len_b,
            min_len,
            lenpen,
            unkpen,
            batch_size,
            iterations,
            length_beam,
            max_tokens,
        )
        if isinstance(lines, str):
            return self.translate_buffer([lines], options)[0]
        if not isinstance(lines, (list, tuple)):
            raise TypeError(f"translate() takes a string or a list of strings, got {type(lines).__name__}")
        bad = [i for i, s in enumerate(lines) if not isinstance(s, str)]
        if bad:
            raise TypeError(
                f"translate() takes a string or a list of strings; item {bad[0]} of the list is "
                f"{type(lines[bad[0]]).__name__}"
            )
        return self.translate_buffer(list(lines), options)

    def translate_iter(
        self, lines: Iterable[str], buffer_size: int = BUFFER_SIZE, name: str = "input", **options
    ) -> Iterator[str]:
        """The translations of ``lines`` (any iterable of strings, e.g. an open text file or a
        generator), yielded one by one in input order as soon as their buffer of
        ``buffer_size`` lines is translated (fairseq-interactive's ``--buffer-size``): memory is
        bounded by one buffer, whatever the input's length. ``options``: :meth:`translate`'s.
        Options are checked here, before the first line is read; warnings name a line as
        ``"<name>, line N"``."""
        checked = self.options(**options)
        if not _is_int(buffer_size):
            raise TypeError(f"buffer_size must be an integer, got {buffer_size!r}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if isinstance(lines, (str, bytes)):
            raise TypeError(f"translate_iter() takes an iterable of strings (one per line), got {type(lines).__name__}")
        return self._translate_stream(iter(lines), buffer_size, name, checked)

    def _translate_stream(self, lines: Iterator[str], buffer_size: int, name: str, options: CallOptions):
        first = 1
        while True:
            buffer = list(itertools.islice(lines, buffer_size))
            if not buffer:
                return
            for i, line in enumerate(buffer):
                if not isinstance(line, str):
                    raise TypeError(
                        f"translate_iter() takes strings; {name}, line {first + i} is {type(line).__name__}"
                    )
            yield from self.translate_buffer(buffer, options, name=name, first_line=first)
            first += len(buffer)

    def translate_buffer(
        self, lines: List[str], options: CallOptions, name: str = "input", first_line: int = 1, repair: bool = True
    ) -> List[str]:
        """The translations of one buffer of lines (numbered from ``first_line`` in warnings),
        decoded in batches of similar length. ``repair``: lines not yet repaired
        (:func:`hrt_runtime.text_input.repair_lines`; a line already repaired passes unchanged)."""
        if repair:
            lines = list(repair_lines(lines, name=name, first_line=first_line))
        out = [""] * len(lines)
        todo = [
            (i, self.encode(line, f"{name}, line {first_line + i}")) for i, line in enumerate(lines) if line.strip()
        ]
        todo.sort(key=lambda item: item[1].size)  # similar lengths share a batch
        for batch in _batches(todo, options.batch_size, options.max_tokens):
            hypos = self.search(
                [s for _, s in batch],
                options.search,
                options.chunk_size,
                options.b_nat,
                options.iterations,
                options.length_beam,
            )
            for (i, _), best in zip(batch, hypos):
                out[i] = self.decode(best[0]["tokens"].tolist())
        return out


def cli_main(argv=None):
    p = argparse.ArgumentParser(
        prog="hrt-translate",
        description="Translate raw text (stdin or --input, one sentence "
        "per line) with a folder written by fairseq-hrt-export; needs only onnxruntime, numpy "
        "and sentencepiece. The input is read and translated --buffer-size lines at a time, "
        "and each buffer is printed as soon as it is translated.",
    )
    p.add_argument("folder")
    p.add_argument("--input", default="-", help="a text file (default: standard input)")
    p.add_argument(
        "--buffer-size",
        type=int,
        default=BUFFER_SIZE,
        help="lines read before translating (as fairseq-interactive's; a pipe or terminal that pauses "
        "ends a buffer early, so a waiting writer gets each translation at once)",
    )
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--chunk-size", type=int, default=None, help="HRT's k (default: the smallest trained; 1: AT mode)")
    p.add_argument("--b-nat", type=int, default=1)
    p.add_argument("--max-len-a", type=float, default=0.0)
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--min-len", type=int, default=1)
    p.add_argument("--lenpen", type=float, default=1.0)
    p.add_argument("--unkpen", type=float, default=0.0)
    p.add_argument("--iter-decode-max-iter", type=int, default=10, help="Mask-Predict's iterations I")
    p.add_argument("--iter-decode-with-beam", type=int, default=1, help="Mask-Predict's length beam l")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        help="source tokens per batch at most (sentences x the longest; bounds memory on very long lines)",
    )
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")
    try:
        if a.buffer_size < 1:
            raise ValueError(f"--buffer-size must be >= 1, got {a.buffer_size}")
        if a.input != "-" and not os.path.isfile(a.input):
            raise FileNotFoundError(f"--input {a.input}: no such file")
        translator = Translator(a.folder, threads=a.threads)
        options = translator.options(
            beam=a.beam,
            chunk_size=a.chunk_size,
            b_nat=a.b_nat,
            max_len_a=a.max_len_a,
            max_len_b=a.max_len_b,
            min_len=a.min_len,
            lenpen=a.lenpen,
            unkpen=a.unkpen,
            batch_size=a.batch_size,
            iterations=a.iter_decode_max_iter,
            length_beam=a.iter_decode_with_beam,
            max_tokens=a.max_tokens,
        )
        name = "<stdin>" if a.input == "-" else a.input
        first = 1
        for group in iter_line_groups(sys.stdin.buffer if a.input == "-" else a.input, a.buffer_size, name=name):
            out = translator.translate_buffer(group, options, name=name, first_line=first, repair=False)
            sys.stdout.write("".join(line + "\n" for line in out))
            sys.stdout.flush()  # this buffer is readable now, before the next one is read
            first += len(group)
    except (ValueError, FileNotFoundError, TypeError) as e:
        p.exit(2, f"hrt-translate: error: {e}\n")
    except BrokenPipeError:  # the reader went away (e.g. | head): nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
