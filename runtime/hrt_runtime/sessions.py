"""The ONNX Runtime sessions of an exported folder's graphs, on the CPU: each made on first use,
once, however many threads ask for it at the same time."""

import os
import threading
from typing import Callable, Dict

from hrt_runtime.errors import Refused


def session_options(ort, threads: int):
    """The options of every session: ``threads`` intra-op threads, one inter-op thread (the
    graphs are chains of operators), every graph optimization."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, int(threads))
    options.inter_op_num_threads = 1
    # no arena: ONNX Runtime's CPU arena keeps the memory of the largest batch it ever ran (a
    # service would keep a large request's memory for good); without it, that memory goes back to malloc
    options.enable_cpu_mem_arena = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # idle worker threads sleep instead of spinning between runs: the search's numpy work runs
    # between two steps, on the core a spinning worker would hold
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class GraphSessions:
    """The sessions of ``graphs`` (role -> file name in ``folder``) of a model of ``kind``."""

    def __init__(self, folder: str, graphs: Dict[str, str], kind: str, threads: int):
        import onnxruntime as ort  # noqa: PLC0415 - optional: onnxruntime

        self.folder, self.graphs, self.kind = folder, graphs, kind
        self._ort = ort
        self._options = session_options(ort, threads)
        self._sessions: Dict[str, object] = {}
        # two threads decoding at once (hrt-serve, a Translator shared by threads) must not both
        # make the same session
        self._lock = threading.Lock()
        self._runners: Dict[str, Callable] = {}

    def session(self, graph: str):
        with self._lock:
            if graph not in self._sessions:
                name = self.graphs.get(graph)
                if name is None:
                    raise Refused(
                        f"{self.folder} has no {graph} graph (a {self.kind} model; graphs: {', '.join(self.graphs)})"
                    )
                self._sessions[graph] = self._ort.InferenceSession(
                    os.path.join(self.folder, name), self._options, providers=["CPUExecutionProvider"]
                )
            return self._sessions[graph]

    def runner(self, graph: str) -> Callable:
        """``feeds -> outputs`` of a graph's session: the session's own run, without the Python
        wrapper's checks of every feed, which weigh on a small step (the feeds are the model's own)."""
        found = self._runners.get(graph)
        if found is None:
            session = self.session(graph)
            names = [output.name for output in session.get_outputs()]
            run = session._sess.run
            found = self._runners[graph] = lambda feeds: run(names, feeds, None)
        return found
