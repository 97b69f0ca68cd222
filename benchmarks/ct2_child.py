"""CTranslate2 timed inside the caller's own timing loop, from a child process.

CTranslate2's threads slow down beside PyTorch's in one process
(``benchmarks/runtime_vs_ct2.py`` says by how much), so its rows run in a process that imports
no PyTorch. Timed in a phase of their own, after ours, they would meet another state of a
shared machine (another tenant, another clock) than ours did: ratios between the phases drift
by 10-30 %. So the child is a server of single passes: :class:`ForcedLengthChild` loads the
converted model once per compute type, and each call of :meth:`ForcedLengthChild.timed`'s
callables asks it for one pass over one job's batches, which it times itself
(``time.perf_counter`` around its own ``translate_batch`` calls: the pipe's round trip is not
counted) while the caller waits on the pipe. The caller puts these callables in the same
round-robin (:func:`benchmarks.timing.time_runs`) as its own rows, and reads the child's
seconds from :attr:`ForcedLengthChild.seconds`.

The protocol (:class:`Ct2Child` and :func:`serve_passes`, which ``benchmarks/ct2_text_child.py``
shares) is one JSON line each way: the caller's first line is the set-up (model folder, device,
threads, compute types, what the passes decode), the child answers ``{"ready": {...}}`` (its
version, the compute types it loaded and why it could not load the others, whether PyTorch is
loaded; the caller adds the CPU instruction set CTranslate2 chose, from its log); then each
``{"run": [arguments]}`` is one pass, answered with its result and ``seconds`` (here
``[compute type, job]`` and ``positions``) until the caller closes the pipe.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what CTranslate2 logs at start-up with CT2_VERBOSE=1 that says how it computes on this
# machine: the CPU's instruction sets as it reads them, the one it chose, its GEMM backends
_ISA_MARKERS = ("CPU:", "Selected ISA", "Use Intel MKL", "SGEMM backend", "GEMM_S16 backend", "GEMM_S8 backend")


def one_line(e: BaseException) -> str:
    """An error as a report's line: its type and its message's first line."""
    return f"{type(e).__name__}: {e}".splitlines()[0]


class ChildFailed(RuntimeError):
    """The child could not start, load or decode: its message is one line."""


class Ct2Child:
    """A child process running ``entry`` (``"module:function"``, a loop of
    :func:`serve_passes`) given ``setup`` as its first line; :meth:`ask` sends a request and
    returns the answer, a child that fails or ends is :class:`ChildFailed` in one line. It logs
    with ``CT2_VERBOSE=1``, read for the instruction set CTranslate2 chose
    (``ready["isa"]``)."""

    def __init__(self, entry: str, setup: dict):
        module, function = entry.split(":")
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".ct2.log")  # noqa: SIM115 - closed with the child
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), CT2_VERBOSE="1")
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from {module} import {function}; {function}()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.ready = self.ask(setup).get("ready", {})
        self.ready["isa"] = self._isa_lines()

    @property
    def loaded(self) -> List[str]:
        """The compute types the child decodes with (the others: :attr:`errors`)."""
        return self.ready.get("loaded", [])

    @property
    def errors(self) -> Dict[str, str]:
        """``{compute type: why the child could not load it}``."""
        return self.ready.get("errors", {})

    def ask(self, message: dict) -> dict:
        line = ""
        if self._process.poll() is None:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
            line = self._process.stdout.readline()
        if not line:
            self._process.wait()
            raise ChildFailed(f"the CTranslate2 child process ended (exit {self._process.returncode}): {self._tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise ChildFailed(answer["error"])
        return answer

    def _lines(self) -> List[str]:
        self._log.seek(0)
        return [line.strip() for line in self._log.read().splitlines() if line.strip()]

    def _tail(self) -> str:
        lines = self._lines()
        return lines[-1] if lines else "it wrote nothing"

    def _isa_lines(self) -> List[str]:
        return [line[line.index(m) :] for line in self._lines() for m in _ISA_MARKERS if m in line]

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


class ForcedLengthChild(Ct2Child):
    """A child process decoding ``jobs`` (``{job: [{"tokens": [[pieces]], "length": n}]}``,
    the batches of :func:`benchmarks.ct2_reference.forced_length`) with the converted model in
    ``model_dir``, in each of ``compute_types``, one timed pass per request."""

    def __init__(
        self,
        model_dir: str,
        jobs: Dict[str, List[dict]],
        compute_types: Sequence[str],
        threads: int = 1,
        device: str = "cpu",
    ):
        self.seconds: Dict[Tuple[str, str], List[float]] = {}
        setup = {"model_dir": model_dir, "jobs": jobs, "compute_types": list(compute_types), "threads": threads}
        super().__init__("benchmarks.ct2_child:serve_forced_length", {**setup, "device": device})

    def timed(self, compute_type: str, job: str) -> Callable[[], List[int]]:
        """A callable for the caller's timing loop: one pass of ``job`` in ``compute_type``,
        its seconds appended to ``seconds[(compute_type, job)]``; returns the steps per sentence."""

        def run():
            answer = self.ask({"run": [compute_type, job]})
            self.seconds.setdefault((compute_type, job), []).append(answer["seconds"])
            return answer["positions"]

        return run


# ----------------------------------------------------------------------------- the child


def load_translators(setup: dict) -> Tuple[dict, dict]:
    """``(translators, ready)``: a translator of ``setup["model_dir"]`` per compute type the
    device (``setup["device"]``, default cpu) takes, and the ready message (version, loaded,
    why the others were not)."""
    import ctranslate2  # noqa: PLC0415 - the child's only heavy import

    from benchmarks.ct2_reference import load, unavailable_reason  # noqa: PLC0415

    device = setup.get("device", "cpu")
    why = unavailable_reason(use_cuda=device == "cuda")
    if why:
        raise ChildFailed(why)
    supported = ctranslate2.get_supported_compute_types(device)
    translators, errors = {}, {}
    for compute_type in setup["compute_types"]:
        if compute_type not in supported:
            errors[compute_type] = (
                f"CTranslate2 {ctranslate2.__version__} has no {compute_type} on this {device} "
                f"(it has {', '.join(sorted(supported))})"
            )
            continue
        translators[compute_type] = load(setup["model_dir"], device == "cuda", False, setup["threads"], compute_type)
    ready = {"version": ctranslate2.__version__, "loaded": list(translators), "errors": errors}
    return translators, ready


def _answer(message: dict):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve_passes(make_pass: Callable[[dict, dict], Callable[..., dict]], stdin=None):
    """A child's loop: the set-up line, the translators (:func:`load_translators`) and
    ``make_pass(setup, translators)`` (which warms them up), answered ``{"ready": ...}``; then
    each ``{"run": [arguments]}`` is one pass, ``pass(*arguments)``'s answer with the child's
    ``seconds`` around it. Errors are answered in one line."""
    stdin = stdin or sys.stdin
    setup = json.loads(stdin.readline())
    try:
        translators, ready = load_translators(setup)
        one_pass = make_pass(setup, translators)
    except Exception as e:  # noqa: BLE001 - the caller reports it in one line
        _answer({"error": one_line(e)})
        return
    _answer({"ready": {**ready, "torch_loaded": "torch" in sys.modules}})
    for line in stdin:
        try:
            started = time.perf_counter()
            answer = one_pass(*json.loads(line)["run"])
            _answer({"seconds": time.perf_counter() - started, **answer})
        except Exception as e:  # noqa: BLE001 - the caller reports it in one line
            _answer({"error": one_line(e)})


def serve_forced_length(stdin=None):
    """:class:`ForcedLengthChild`'s child: a warm-up batch per compute type, then one pass of a
    job per request."""
    from benchmarks.ct2_reference import forced_length  # noqa: PLC0415

    def make_pass(setup, translators):
        first = next(iter(setup["jobs"].values()))[:1]
        for translator in translators.values():  # one batch (a whole pass would cost a timed pass's time)
            forced_length(translator, first)
        return lambda compute_type, job: {"positions": forced_length(translators[compute_type], setup["jobs"][job])}

    serve_passes(make_pass, stdin)


def child_rows(child: Optional[ForcedLengthChild], jobs: Sequence[str]) -> Dict[Tuple[str, str], Callable]:
    """``{(compute type, job): callable}`` of every pass the child can make (none without a child)."""
    if child is None:
        return {}
    return {(c, job): child.timed(c, job) for c in child.loaded for job in jobs}
