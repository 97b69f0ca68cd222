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

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.ct2_child import ChildFailed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_SIZE = 64  # hrt_runtime's default batch (hrt_runtime.options), sentences sorted by length in both


class TextChild:
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
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".ct2.log")  # noqa: SIM115 - read on failure, closed with the child
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from benchmarks.ct2_text_child import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=REPO,
        )
        setup = {  # the child runs in the repository root: paths absolute
            "model_dir": os.path.abspath(model_dir),
            "compute_types": list(compute_types),
            "sentencepiece_model": sentencepiece_model and os.path.abspath(sentencepiece_model),
            "threads": threads,
            "sources": list(sources),
        }
        self.ready = self._ask(setup)["ready"]

    @property
    def loaded(self) -> List[str]:
        return self.ready["loaded"]

    @property
    def errors(self) -> Dict[str, str]:
        return self.ready["errors"]

    def translate(self, compute_type: str, beam: int, max_len: int) -> Tuple[List[str], float]:
        """One pass over the sources: ``(translations, the child's seconds)``."""
        answer = self._ask({"run": [compute_type, beam, max_len]})
        return answer["hyps"], answer["seconds"]

    def _ask(self, message: dict) -> dict:
        line = ""
        if self._process.poll() is None:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
            line = self._process.stdout.readline()
        if not line:
            self._process.wait()
            self._log.seek(0)
            tail = [x.strip() for x in self._log.read().splitlines() if x.strip()] or ["it wrote nothing"]
            raise ChildFailed(f"the CTranslate2 child process ended (exit {self._process.returncode}): {tail[-1]}")
        answer = json.loads(line)
        if "error" in answer:
            raise ChildFailed(answer["error"])
        return answer

    def close(self):
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


def _answer(message: dict):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(stdin=None):
    """The child's loop (see the module's docstring)."""
    stdin = stdin or sys.stdin
    setup = json.loads(stdin.readline())
    try:
        import ctranslate2  # noqa: PLC0415 - the child's only heavy import

        from benchmarks.ct2_reference import load, suppressed, target_vocabulary  # noqa: PLC0415

        supported = ctranslate2.get_supported_compute_types("cpu")
        translators, errors = {}, {}
        for compute_type in setup["compute_types"]:
            if compute_type not in supported:
                errors[compute_type] = (
                    f"CTranslate2 {ctranslate2.__version__} has no {compute_type} on this CPU "
                    f"(it has {', '.join(sorted(supported))})"
                )
                continue
            translators[compute_type] = load(setup["model_dir"], False, False, setup["threads"], compute_type)
        pieces = _Pieces(setup["sentencepiece_model"])
        suppress = suppressed(target_vocabulary(setup["model_dir"]) or [])
        warm_up = [line for line in setup["sources"] if line.strip()][:1]
        for translator in translators.values():
            _translate(translator, pieces, warm_up, 1, 8, suppress)
    except Exception as e:  # noqa: BLE001 - the caller reports it in one line
        _answer({"error": f"{type(e).__name__}: {e}".splitlines()[0]})
        return
    ready = {"version": ctranslate2.__version__, "loaded": list(translators), "errors": errors}
    _answer({"ready": {**ready, "torch_loaded": "torch" in sys.modules}})
    for line in stdin:
        compute_type, beam, max_len = json.loads(line)["run"]
        try:
            started = time.perf_counter()
            hyps = _translate(translators[compute_type], pieces, setup["sources"], beam, max_len, suppress)
            seconds = time.perf_counter() - started
        except Exception as e:  # noqa: BLE001 - the caller reports it in one line
            _answer({"error": f"{type(e).__name__}: {e}".splitlines()[0]})
            continue
        _answer({"seconds": seconds, "hyps": hyps})
