"""Raw text in, raw text out, from an exported folder: SentencePiece, fairseq's dictionaries and
:mod:`hrt_runtime.search`, with only ``numpy``, ``onnxruntime`` and ``sentencepiece``.

Input is handled as ``fairseq-interactive`` handles it: SentencePiece pieces looked up in the
source dictionary (unknown pieces become ``<unk>``), ``</s>`` appended, sentences longer than
the model's source positions truncated (with a warning), empty lines translated to empty
lines, batches left-padded.
"""
import logging
import os
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from hrt_runtime.model import ExportedModel
from hrt_runtime.search import SearchConfig, hrt, left_to_right, mask_predict

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


class Translator:
    """``Translator(folder).translate(["A man rides a bike."])``. Decoding options are fairseq's
    (``beam``, ``max_len_a``, ``max_len_b``, ``min_len``, ``lenpen``, ``unkpen``), HRT's
    (``chunk_size``: default the smallest trained one, 1 = AT mode; ``b_nat``) and Mask-Predict's
    (``iterations``: I, ``length_beam``: l; fairseq's ``--iter-decode-max-iter`` /
    ``--iter-decode-with-beam``)."""

    def __init__(self, folder: str, threads: int = 1):
        self.model = ExportedModel(folder, threads=threads)
        config = self.model.config
        self.source_symbols = read_dictionary(os.path.join(folder, config["source_dictionary"]))
        self.target_symbols = read_dictionary(os.path.join(folder, config["target_dictionary"]))
        if len(self.target_symbols) != config["vocab_size"]:
            raise ValueError(f"{folder}: the target dictionary has {len(self.target_symbols)} symbols, "
                             f"the model {config['vocab_size']}")
        self.source_index = {s: i for i, s in enumerate(self.source_symbols)}
        self.spm = None
        if config.get("sentencepiece_model"):
            import sentencepiece

            self.spm = sentencepiece.SentencePieceProcessor(model_file=os.path.join(folder, config["sentencepiece_model"]))
        self.max_source_tokens = int(config["max_source_positions"])

    def encode(self, line: str) -> np.ndarray:
        pieces = self.spm.encode(line.strip(), out_type=str) if self.spm is not None else line.split()
        unk, eos = self.model.config["source_unk"], self.model.config["source_eos"]
        ids = [self.source_index.get(p, unk) for p in pieces]
        if len(ids) + 1 > self.max_source_tokens:
            logger.warning("a sentence of %d tokens is truncated to the model's %d source positions",
                           len(ids) + 1, self.max_source_tokens)
            ids = ids[: self.max_source_tokens - 1]
        return np.array(ids + [eos], np.int64)

    def decode(self, tokens: Sequence[int]) -> str:
        eos, pad = self.model.eos, self.model.pad
        pieces = [self.target_symbols[t] for t in tokens if t not in (eos, pad)]
        if self.spm is None:
            return " ".join(pieces)
        return "".join(pieces).replace("\u2581", " ").strip()

    def search(self, sources: List[np.ndarray], config: SearchConfig, chunk_size: int, b_nat: int = 1,
               iterations: int = 10, length_beam: int = 1):
        """Hypotheses of a batch of encoded sources (left-padded here, as fairseq batches them)."""
        pad = self.model.config["source_pad"]
        width = max(s.size for s in sources)
        src = np.full((len(sources), width), pad, np.int64)
        for i, s in enumerate(sources):
            src[i, width - s.size:] = s
        encoded = self.model.encode(src)
        banned = self.model.config["banned"]
        if self.model.kind == "mask-predict":
            return mask_predict(self.model, encoded, src, iterations, length_beam, config.max_len_a, config.max_len_b, banned)
        if self.model.kind == "hrt":
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
        if chunk_size > 1 and self.model.kind != "hrt":
            raise ValueError(f"chunk_size {chunk_size}: this is {'a Mask-Predict' if self.model.kind == 'mask-predict' else 'an AT'} "
                             "model, it has no chunk size (chunk_size 1 or None)")
        if chunk_size > 1 and chunk_size not in trained:
            raise ValueError(f"chunk_size {chunk_size}: this model was trained for chunk sizes "
                             f"{', '.join(map(str, trained)) or 'none'}; use one of them, or 1 for AT mode")
        return chunk_size

    def translate(self, lines: Union[str, List[str]], beam: int = 5, chunk_size: Optional[int] = None, b_nat: int = 1,
                  max_len_a: float = 0.0, max_len_b: int = 200, min_len: int = 1, lenpen: float = 1.0,
                  unkpen: float = 0.0, batch_size: int = 64, iterations: int = 10, length_beam: int = 1) -> Union[str, List[str]]:
        if isinstance(lines, str):
            return self.translate([lines], beam, chunk_size, b_nat, max_len_a, max_len_b, min_len, lenpen, unkpen, batch_size,
                                  iterations, length_beam)[0]
        if not isinstance(lines, (list, tuple)):
            raise TypeError(f"translate() takes a string or a list of strings, got {type(lines).__name__}")
        bad = [i for i, s in enumerate(lines) if not isinstance(s, str)]
        if bad:
            raise TypeError(f"translate() takes a string or a list of strings; item {bad[0]} of the list is "
                            f"{type(lines[bad[0]]).__name__}")
        k = self.chunk_size(chunk_size)
        for name, value in (("beam", beam), ("b_nat", b_nat), ("batch_size", batch_size), ("min_len", min_len),
                            ("max_len_b", max_len_b)):
            if not _is_int(value):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        for name, value in (("beam", beam), ("b_nat", b_nat), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.model.kind == "hrt" and b_nat > beam:
            raise ValueError(f"b_nat {b_nat} > beam {beam}: stage II fills the top b_nat of the beam's "
                             "Skip-AT hypotheses, so b_nat must be <= beam (b_at)")
        config = SearchConfig(beam=beam, max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len,
                              len_penalty=lenpen, unk_penalty=unkpen)
        out = [""] * len(lines)
        todo = [(i, self.encode(line)) for i, line in enumerate(lines) if line.strip()]
        todo.sort(key=lambda item: item[1].size)  # similar lengths share a batch
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            hypos = self.search([s for _, s in batch], config, k, b_nat, iterations, length_beam)
            for (i, _), best in zip(batch, hypos):
                out[i] = self.decode(best[0]["tokens"].tolist())
        return out


def read_lines(source) -> List[str]:
    """The lines of a file name or binary stream, split at ``\\n`` only (as fairseq-interactive
    reads them: a lone ``\\r`` does not end a line), without a UTF-8 BOM; bytes that are not
    UTF-8 become U+FFFD instead of ending the run."""
    if isinstance(source, str):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"--input {source}: no such file")
        with open(source, "rb") as f:
            data = f.read()
    else:
        data = source.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.rstrip(b"\r").decode("utf-8", errors="replace") for line in lines]


def cli_main(argv=None):
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="hrt-translate", description="Translate raw text (stdin or --input, one sentence "
                                "per line) with a folder written by fairseq-hrt-export; needs only onnxruntime, numpy "
                                "and sentencepiece.")
    p.add_argument("folder")
    p.add_argument("--input", default="-", help="a text file (default: standard input)")
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
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")
    try:
        translator = Translator(a.folder, threads=a.threads)
        lines = read_lines(sys.stdin.buffer if a.input == "-" else a.input)
        for line in translator.translate(lines, beam=a.beam, chunk_size=a.chunk_size, b_nat=a.b_nat, max_len_a=a.max_len_a,
                                         max_len_b=a.max_len_b, min_len=a.min_len, lenpen=a.lenpen, unkpen=a.unkpen,
                                         batch_size=a.batch_size,
                                         iterations=a.iter_decode_max_iter, length_beam=a.iter_decode_with_beam):
            print(line)
    except (ValueError, FileNotFoundError, TypeError) as e:
        p.exit(2, f"hrt-translate: error: {e}\n")


if __name__ == "__main__":
    cli_main()
