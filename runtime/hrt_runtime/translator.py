"""Raw text in, raw text out, from an exported folder: SentencePiece, fairseq's dictionaries and
:mod:`hrt_runtime.search`, with only ``numpy``, ``onnxruntime`` and ``sentencepiece``.

Input is handled as ``fairseq-interactive`` handles it: SentencePiece pieces looked up in the
source dictionary (unknown pieces become ``<unk>``), ``</s>`` appended, sentences longer than
the model's source positions truncated (with a warning), empty lines translated to empty
lines, batches left-padded.
"""

import itertools
import logging
import os
import sys
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np
import sentencepiece

from hrt_runtime.call_options import CallOptions, batches_of, call_options, chunk_size_of, positions_of
from hrt_runtime.errors import Refused, RefusedMissing, RefusedType
from hrt_runtime.families import HRT, MASK_PREDICT
from hrt_runtime.integrity import DamagedFolderError
from hrt_runtime.model import ExportedModel
from hrt_runtime.options import (
    BUFFER,
    BUFFER_SIZE,
    DECODING,
    THREADS,
    check_arguments,
    command_parser,
)
from hrt_runtime.search import SearchConfig, hrt, left_to_right, mask_predict
from hrt_runtime.stdout import stdout_to_devnull
from hrt_runtime.text_input import LineWarnings, check_sentences, iter_line_groups, repair_lines
from hrt_runtime.work import stoppable

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
                raise Refused(f"{path}: duplicate symbol {symbol!r}")
            symbols.append(symbol)
    return symbols


def _line_groups(lines: Iterator[str], size: int, name: str) -> Iterator[List[str]]:
    """Strings in groups of ``size``, each without its line ending; a non-string is refused naming its line."""
    first = 1
    while True:
        group = list(itertools.islice(lines, size))
        if not group:
            return
        for i, line in enumerate(group):
            if not isinstance(line, str):
                raise RefusedType(f"translate_iter() takes strings; {name}, line {first + i} is {type(line).__name__}")
        yield [line[:-2] if line.endswith("\r\n") else line[:-1] if line.endswith("\n") else line for line in group]
        first += len(group)


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
            raise RefusedType(
                f"Translator(folder): folder is the path of a folder written by fairseq-hrt-export, "
                f"got {type(folder).__name__}"
            )
        threads = THREADS.check(threads)
        folder = os.fspath(folder)
        self.model = ExportedModel(folder, threads=threads)
        config = self.model.config
        self.source_symbols = read_dictionary(os.path.join(folder, config["source_dictionary"]))
        self.target_symbols = read_dictionary(os.path.join(folder, config["target_dictionary"]))
        if len(self.target_symbols) != config["vocab_size"]:
            raise Refused(
                f"{folder}: the target dictionary has {len(self.target_symbols)} symbols, "
                f"the model {config['vocab_size']}; export the checkpoint again"
            )
        self.source_index = {s: i for i, s in enumerate(self.source_symbols)}
        self.spm = None
        if config.get("sentencepiece_model"):
            self.spm = sentencepiece.SentencePieceProcessor(
                model_file=os.path.join(folder, config["sentencepiece_model"])
            )
        else:  # a folder exported without one (docs/deploy.md, "pieces mode"), said once at load
            logger.warning(
                "%s has no SentencePiece model: its input is read as whitespace-separated pieces of its source "
                "dictionary, and its output written as pieces",
                folder,
            )
        self.max_source_tokens = int(config["max_source_positions"])

    def encode(self, line: str, warnings: Optional[LineWarnings] = None, lineno: int = 0) -> np.ndarray:
        """Source ids of one line, truncated to the model's source positions (``warnings``: where
        that is reported, the line numbered ``lineno``; else logged unnumbered)."""
        pieces = self.spm.encode(line.strip(), out_type=str) if self.spm is not None else line.split()
        unk, eos = self.model.config["source_unk"], self.model.config["source_eos"]
        ids = [self.source_index.get(p, unk) for p in pieces]
        if len(ids) + 1 > self.max_source_tokens:
            message = (
                f"a sentence of {len(ids) + 1} tokens is truncated to the model's {self.max_source_tokens} "
                "source positions"
            )
            if warnings is None:
                logger.warning(message)
            else:
                warnings.warn(lineno, message)
            ids = ids[: self.max_source_tokens - 1]
        return np.array(ids + [eos], np.int64)

    def encode_lines(
        self, lines: Sequence[str], name: str = "input", first_line: int = 1
    ) -> List[Optional[np.ndarray]]:
        """The source ids of repaired lines (``None`` for an empty line), truncations reported
        as ``"<name>, line N"`` (N from ``first_line``), the first few one by one, then a count."""
        warnings = LineWarnings(name, what="truncated")
        sources = [
            self.encode(line, warnings, first_line + i) if line.strip() else None for i, line in enumerate(lines)
        ]
        warnings.finish(len(lines))
        return sources

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
        stop=None,
        gate=None,
    ):
        """Hypotheses of a batch of encoded sources (left-padded here, as fairseq batches them).
        ``stop``: asked before every decoder pass; once true, :class:`hrt_runtime.work.Stopped`.
        ``gate``: a :class:`hrt_runtime.work.PassGate` each decoder pass waits at for its turn."""
        pad = self.model.config["source_pad"]
        width = max(s.size for s in sources)
        src = np.full((len(sources), width), pad, np.int64)
        for i, s in enumerate(sources):
            src[i, width - s.size :] = s
        model = stoppable(self.model, stop, gate)
        encoded = model.encode(src)
        banned = self.model.config["banned"]
        if self.model.kind == MASK_PREDICT:
            return mask_predict(
                model, encoded, src, iterations, length_beam, config.max_len_a, config.max_len_b, banned
            )
        if self.model.kind == HRT:  # its length limit: hrt_runtime.search (position_cap), as every engine
            return hrt(model, encoded, width, config, chunk_size, banned, b_nat=b_nat)
        if chunk_size != 1:
            raise Refused(f"chunk_size {chunk_size}: an AT model decodes left to right only (chunk_size 1)")
        return left_to_right(model, encoded, width, config, banned)

    def positions(self, sources: Sequence[Optional[np.ndarray]], options: CallOptions) -> List[int]:
        """The decoder positions each encoded line may cost under ``options`` (:func:`.call_options.positions_of`)."""
        return positions_of(self.model, sources, options)

    def chunk_size(self, chunk_size: Optional[int]) -> int:
        """The chunk size a call decodes with (:func:`.call_options.chunk_size_of`)."""
        return chunk_size_of(self.model, chunk_size)

    def options(self, **given) -> CallOptions:
        """The options of a call, checked before anything is read or decoded
        (:func:`.call_options.call_options`)."""
        return call_options(self.model, **given)

    def translate(self, lines: Union[str, List[str]], **options) -> Union[str, List[str]]:
        """The translations of one string or a list of strings (the whole list in one buffer:
        similar lengths share a batch). ``options``: :meth:`options`'s."""
        checked = self.options(**options)
        check_sentences(lines)
        if isinstance(lines, str):
            return self.translate_buffer([lines], checked)[0]
        return self.translate_buffer(list(lines), checked)

    def translate_iter(
        self, lines: Iterable[str], buffer_size: int = BUFFER_SIZE, name: Optional[str] = None, **options
    ) -> Iterator[str]:
        """The translations of ``lines`` (any iterable of strings, e.g. an open text file or a
        generator), yielded one by one in input order as soon as their buffer of
        ``buffer_size`` lines is translated (fairseq-interactive's ``--buffer-size``): memory is
        bounded by one buffer, whatever the input's length. ``options``: :meth:`translate`'s.
        Options are checked here, before the first line is read. A line's ending (``\\n``, with a
        ``\\r`` before it) is not part of it, as when ``hrt-translate`` reads a file; warnings name
        a line as ``"<name>, line N"`` (``name``: default the file's name, else ``"input"``)."""
        checked = self.options(**options)
        buffer_size = BUFFER.check(buffer_size)
        if isinstance(lines, (str, bytes)):
            raise RefusedType(
                f"translate_iter() takes an iterable of strings (one per line), got {type(lines).__name__}"
            )
        name = name or str(getattr(lines, "name", "input"))
        groups = self.translate_groups(_line_groups(iter(lines), buffer_size, name), checked, name)
        return itertools.chain.from_iterable(groups)  # checked above, before the first line is read

    def translate_groups(
        self, groups: Iterable[List[str]], options: CallOptions, name: str, repair: bool = True
    ) -> Iterator[List[str]]:
        """The one streaming loop (``translate_iter``, ``hrt-translate``): the translations of
        each group of lines, as soon as it is translated; lines numbered across groups."""
        first = 1
        for group in groups:
            yield self.translate_buffer(group, options, name=name, first_line=first, repair=repair)
            first += len(group)

    def translate_buffer(
        self, lines: List[str], options: CallOptions, name: str = "input", first_line: int = 1, repair: bool = True
    ) -> List[str]:
        """The translations of one buffer of lines (numbered from ``first_line`` in warnings),
        decoded in batches of similar length. ``repair``: lines not yet repaired
        (:func:`hrt_runtime.text_input.repair_lines`; a line already repaired passes unchanged)."""
        if repair:
            lines = list(repair_lines(lines, name=name, first_line=first_line))
        return self.translate_sources(self.encode_lines(lines, name, first_line), options, name, first_line)

    def translate_sources(
        self,
        sources: Sequence[Optional[np.ndarray]],
        options: CallOptions,
        name: Optional[str] = "input",
        first_line: int = 1,
        stop=None,
        gate=None,
    ) -> List[str]:
        """The translations of encoded lines (:meth:`encode_lines`; ``None``: an empty line,
        translated to an empty line), decoded in batches of similar length (:func:`batches_of`).
        A batch its options refuse (``min_len`` beyond a limit that ``max_len_a`` makes depend
        on the batch's width) is named by its first line (``name``, numbered from ``first_line``;
        ``None``: not named, the lines are not the caller's). ``stop``, ``gate``: :meth:`search`'s."""
        out = [""] * len(sources)
        for batch in batches_of(sources, options):
            try:
                hypos = self.search(
                    [sources[i] for i in batch],
                    options.search,
                    options.chunk_size,
                    options.b_nat,
                    options.iterations,
                    options.length_beam,
                    stop=stop,
                    gate=gate,
                )
            except Refused as e:
                if name is None or isinstance(e, DamagedFolderError):  # the folder's fault, not a line's
                    raise
                others = f" (and {len(batch) - 1} more lines of its batch)" if len(batch) > 1 else ""
                raise Refused(f"{name}, line {first_line + min(batch)}{others}: {e}") from None
            for i, best in zip(batch, hypos):
                out[i] = self.decode(best[0]["tokens"].tolist())
        return out


class OutputError(Exception):
    """The output could not be written (a full disk): the command's one line, exit code 1."""


def _print(lines: List[str]):
    """``lines`` on standard output, flushed: this buffer is readable now, before the next one is
    read. A write that fails (``> /dev/full``) is an :class:`OutputError`; a reader that went
    away (``| head``) stays a ``BrokenPipeError``."""
    try:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write the output: {e.strerror or e}") from None


def _open_input(path: str):
    """``--input``: any readable path but a folder (a file, ``/dev/stdin``, a pipe such as
    bash's ``<(cmd)``, ``/dev/null``), opened before the model is loaded so that a wrong path
    is said at once; ``None`` for ``-`` (standard input)."""
    if path == "-":
        return None
    if os.path.isdir(path):
        raise Refused(f"--input {path} is a folder; give a text file (or - for standard input)")
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise RefusedMissing(f"--input {path}: no such file") from None
    except OSError as e:
        raise Refused(f"--input {path}: cannot read it: {e.strerror or e}") from None


def _translate(a):
    """``hrt-translate``'s work, on parsed arguments ``a``."""
    values = check_arguments(a, (BUFFER, *DECODING, THREADS))
    stream = _open_input(a.input)
    try:
        translator = Translator(a.folder, threads=values["threads"])
        options = translator.options(**{o.name: values[o.name] for o in DECODING})
        name = "<stdin>" if stream is None else a.input
        source = sys.stdin.buffer if stream is None else stream
        groups = iter_line_groups(source, values["buffer_size"], name=name)
        for out in translator.translate_groups(groups, options, name, repair=False):
            _print(out)
    finally:
        if stream is not None:
            stream.close()


def command(argv=None):
    """``hrt-translate`` on ``argv``: a refusal, an output that cannot be written and a reader
    that went away end in one line (or none) with their exit codes; a Ctrl-C is left to
    :func:`hrt_runtime.translate_command.cli_main`, which also covers importing this module."""
    p = command_parser(
        "hrt-translate",
        "Translate raw text (stdin or --input, one sentence "
        "per line) with a folder written by fairseq-hrt-export; needs only onnxruntime, numpy "
        "and sentencepiece. The input is read and translated --buffer-size lines at a time, "
        "and each buffer is printed as soon as it is translated.",
        (BUFFER, *DECODING, THREADS),
    )
    p.add_argument(
        "--input",
        default="-",
        help="a file to read (also /dev/stdin, a pipe such as <(cmd), /dev/null); default: standard input",
    )
    try:
        a = p.parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")
        _translate(a)
    except Refused as e:  # the runtime's refusals only: any other exception is a bug and keeps its traceback
        p.exit(2, f"hrt-translate: error: {e}\n")
    except OutputError as e:
        stdout_to_devnull()
        p.exit(1, f"hrt-translate: error: {e}\n")
    except BrokenPipeError:  # the reader went away (e.g. | head): nothing more to say
        stdout_to_devnull()
        sys.exit(1)


if __name__ == "__main__":
    command()
