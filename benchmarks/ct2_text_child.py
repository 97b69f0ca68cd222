"""CTranslate2 translating raw text from a child process, pass by pass, inside the caller's own
round-robin (``benchmarks/int8_quality.py``'s CTranslate2 rows).

CTranslate2's threads slow down beside PyTorch's in one process (``benchmarks/ct2_child.py``
says why it runs in a child): this module imports neither PyTorch nor the plugin, so the child
it starts holds CTranslate2 and SentencePiece only. The child tokenizes as
:class:`hrt_runtime.Translator` does, so that both runtimes read and write the same text: a line
is stripped and encoded to SentencePiece pieces (or split on white space where the exported
folder has no SentencePiece model), an empty line is translated to an empty line, and the output
pieces are joined with ``▁`` read as a space (or joined by spaces without a SentencePiece model).
A pass is timed in the child around all of it, encoding and detokenizing included, as the
runtime's ``translate`` is timed around its own.

The protocol is one JSON line each way: the caller's set-up (model folder, compute types,
threads, the SentencePiece model, the source lines), answered ``{"ready": {...}}`` (the
version, the compute types loaded and why the others could not be, whether PyTorch is loaded);
then ``{"run": [compute type, beam, max length]}``, answered ``{"seconds": s, "hyps": [...]}``.
"""

import os
from typing import List, Optional, Sequence, Tuple

from benchmarks.ct2_child import Ct2Child, serve_passes

BATCH_SIZE = 64  # hrt_runtime's default batch (hrt_runtime.options), sentences sorted by length in both


class TextChild(Ct2Child):
    """A child process translating ``sources`` (raw lines) with the converted model in
    ``model_dir`` in each of ``compute_types``, one timed pass per :meth:`translate`."""

    def __init__(
        self,
        model_dir: str,
        sources: Sequence[str],
        compute_types: Sequence[str],
        sentencepiece_model: Optional[str],
        threads: int = 1,
    ):
        setup = {  # the child runs in the repository root: paths absolute
            "model_dir": os.path.abspath(model_dir),
            "compute_types": list(compute_types),
            "sentencepiece_model": sentencepiece_model and os.path.abspath(sentencepiece_model),
            "threads": threads,
            "sources": list(sources),
        }
        super().__init__("benchmarks.ct2_text_child:serve", setup)

    def translate(self, compute_type: str, beam: int, max_len: int) -> Tuple[List[str], float]:
        """One pass over the sources: ``(translations, the child's seconds)``."""
        answer = self.ask({"run": [compute_type, beam, max_len]})
        return answer["hyps"], answer["seconds"]


# ----------------------------------------------------------------------------- the child


class _Pieces:
    """hrt_runtime.Translator's encode and decode of text, without its dictionary lookup (the
    converted model maps pieces to ids itself, an unknown piece to ``<unk>`` as the runtime does)."""

    def __init__(self, model_file: Optional[str]):
        self.spm = None
        if model_file:
            import sentencepiece  # noqa: PLC0415 - the child's

            self.spm = sentencepiece.SentencePieceProcessor(model_file=model_file)

    def encode(self, line: str) -> List[str]:
        return self.spm.encode(line.strip(), out_type=str) if self.spm is not None else line.split()

    def decode(self, pieces: Sequence[str]) -> str:
        if self.spm is None:
            return " ".join(pieces)
        return "".join(pieces).replace("\u2581", " ").strip()


def _translate(translator, pieces: _Pieces, lines: List[str], beam: int, max_len: int, suppress) -> List[str]:
    from benchmarks.ct2_reference import translate  # noqa: PLC0415

    filled = [i for i, line in enumerate(lines) if line.strip()]
    outputs = translate(translator, [pieces.encode(lines[i]) for i in filled], BATCH_SIZE, beam, max_len, suppress)
    hyps = [""] * len(lines)
    for position, i in enumerate(filled):
        hyps[i] = pieces.decode(outputs[position])
    return hyps


def serve(stdin=None):
    """:class:`TextChild`'s child: a warm-up line per compute type, then one pass over the
    sources per request (SentencePiece included in its time)."""
    from benchmarks.ct2_reference import suppressed, target_vocabulary  # noqa: PLC0415

    def make_pass(setup, translators):
        pieces = _Pieces(setup["sentencepiece_model"])
        suppress = suppressed(target_vocabulary(setup["model_dir"]) or [])
        warm_up = [line for line in setup["sources"] if line.strip()][:1]
        for translator in translators.values():
            _translate(translator, pieces, warm_up, 1, 8, suppress)

        def one_pass(compute_type, beam, max_len):
            return {"hyps": _translate(translators[compute_type], pieces, setup["sources"], beam, max_len, suppress)}

        return one_pass

    serve_passes(make_pass, stdin)
