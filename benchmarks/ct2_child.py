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

The protocol is one JSON line each way: the caller's first line is the set-up (model folder,
device, threads, compute types, the jobs' batches, see :func:`serve`), the child answers
``{"ready": {...}}`` (its version, the compute types it loaded and why it could not load the
others, the CPU instruction set it chose); then ``{"run": [compute type, job]}`` is answered
``{"seconds": s, "positions": [...]}`` until the caller closes the pipe.
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


class ChildFailed(RuntimeError):
    """The child could not start, load or decode: its message is one line."""


class ForcedLengthChild:
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
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".ct2.log")  # noqa: SIM115 - read at ready, closed with the child
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), CT2_VERBOSE="1")
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from benchmarks.ct2_child import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=REPO,
        )
        setup = {"model_dir": model_dir, "jobs": jobs, "compute_types": list(compute_types), "threads": threads}
        self.ready = self._ask({**setup, "device": device}).get("ready", {})
        self.ready["isa"] = self._isa_lines()

    @property
    def loaded(self) -> List[str]:
        """The compute types the child decodes with (the others: :attr:`errors`)."""
        return self.ready.get("loaded", [])

    @property
    def errors(self) -> Dict[str, str]:
        """``{compute type: why the child could not load it}``."""
        return self.ready.get("errors", {})

    def timed(self, compute_type: str, job: str) -> Callable[[], List[int]]:
        """A callable for the caller's timing loop: one pass of ``job`` in ``compute_type``,
        its seconds appended to ``seconds[(compute_type, job)]``; returns the steps per sentence."""

        def run():
            answer = self._ask({"run": [compute_type, job]})
            self.seconds.setdefault((compute_type, job), []).append(answer["seconds"])
            return answer["positions"]

        return run

    def _ask(self, message: dict) -> dict:
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

    def _tail(self) -> str:
        self._log.seek(0)
        lines = [line.strip() for line in self._log.read().splitlines() if line.strip()]
        return lines[-1] if lines else "it wrote nothing"

    def _isa_lines(self) -> List[str]:
        self._log.seek(0)
        found = []
        for line in self._log.read().splitlines():
            for marker in _ISA_MARKERS:
                if marker in line:
                    found.append(line[line.index(marker) :].strip())
        return found

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


def _load(setup: dict) -> Tuple[dict, dict]:
    """``(translators, ready)``: a translator per compute type the device takes, and the
    ready message (version, loaded, errors)."""
    import ctranslate2  # noqa: PLC0415 - the child's only heavy import

    from benchmarks.ct2_reference import load  # noqa: PLC0415

    device = setup["device"]
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


def serve(stdin=None):
    """The child's loop (see the module's docstring): a warm-up batch per compute type at
    set-up, then one timed pass per request."""
    from benchmarks.ct2_reference import forced_length  # noqa: PLC0415

    stdin = stdin or sys.stdin
    setup = json.loads(stdin.readline())
    try:
        if setup["device"] == "cuda":
            from benchmarks.ct2_reference import unavailable_reason  # noqa: PLC0415

            why = unavailable_reason(use_cuda=True)
            if why:
                raise ChildFailed(why)
        translators, ready = _load(setup)
        first = next(iter(setup["jobs"].values()))[:1]
        for translator in translators.values():  # warm-up: one batch (a whole pass would cost a timed pass's time)
            forced_length(translator, first)
    except Exception as e:  # noqa: BLE001 - the caller reports it in one line
        _answer({"error": f"{type(e).__name__}: {e}".splitlines()[0]})
        return
    _answer({"ready": ready})
    for line in stdin:
        compute_type, job = json.loads(line)["run"]
        try:
            started = time.perf_counter()
            positions = forced_length(translators[compute_type], setup["jobs"][job])
            seconds = time.perf_counter() - started
        except Exception as e:  # noqa: BLE001 - the caller reports it in one line
            _answer({"error": f"{type(e).__name__}: {e}".splitlines()[0]})
            continue
        _answer({"seconds": seconds, "positions": positions})


def child_rows(child: Optional[ForcedLengthChild], jobs: Sequence[str]) -> Dict[Tuple[str, str], Callable]:
    """``{(compute type, job): callable}`` of every pass the child can make (none without a child)."""
    if child is None:
        return {}
    return {(c, job): child.timed(c, job) for c in child.loaded for job in jobs}
