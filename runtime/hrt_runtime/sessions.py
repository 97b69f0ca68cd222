"""The ONNX Runtime sessions of an exported folder's graphs, on the CPU: each made on first use,
once, however many threads ask for it at the same time, from the bytes of the files opened at
start (:class:`hrt_runtime.integrity.FolderFiles`), never from the folder's paths: a graph first
used after a re-export into the folder is still the one checked at start."""

import threading
from typing import Callable, Dict, Optional

from hrt_runtime.errors import Refused
from hrt_runtime.integrity import FolderFiles


def session_options(ort, threads: int, memory_arena: bool = False):
    """The options of every session: ``threads`` intra-op threads, one inter-op thread (the
    graphs are chains of operators), every graph optimization; ONNX Runtime's CPU memory arena
    only with ``memory_arena``."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, int(threads))
    options.inter_op_num_threads = 1
    # no arena by default: ONNX Runtime's CPU arena keeps the memory of the largest batch it ever
    # ran (a service would keep a large request's memory for good); without it, that memory goes
    # back to malloc. With it, a large batch's step reuses its intermediates' memory instead of
    # faulting in fresh pages each run: 1-7 % faster E12D1 steps at batch 128, none at base
    # (benchmarks/results/batch128-cpu/README.md), for a process that decodes and ends
    options.enable_cpu_mem_arena = bool(memory_arena)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # idle worker threads sleep instead of spinning between runs: the search's numpy work runs
    # between two steps, on the core a spinning worker would hold
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class GraphSessions:
    """The sessions of ``graphs`` (role -> file name in ``folder``) of a model of ``kind``,
    read from ``files``; ``weights``: the file the graphs' external data is in (``None``: none);
    ``memory_arena``: the sessions keep ONNX Runtime's CPU memory arena (:func:`session_options`)."""

    def __init__(
        self,
        folder: str,
        graphs: Dict[str, str],
        kind: str,
        threads: int,
        files: FolderFiles,
        weights: Optional[str] = None,
        memory_arena: bool = False,
    ):
        import onnxruntime as ort  # noqa: PLC0415 - optional: onnxruntime

        self.folder, self.graphs, self.kind = folder, graphs, kind
        self._ort, self._threads = ort, threads
        self.files, self.weights = files, weights
        self.memory_arena = bool(memory_arena)
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
                self._sessions[graph] = self._build(name)
            return self._sessions[graph]

    def _build(self, name: str):
        """A session of the graph file ``name`` with its external data given from memory: ONNX
        Runtime copies what it needs while the session is made, so the weights' bytes are held
        for that time only (a session made from the path would read whatever file is there now)."""
        options = session_options(self._ort, self._threads, self.memory_arena)
        weights = self.files.read(self.weights) if self.weights else None
        if weights is not None:
            options.add_external_initializers_from_files_in_memory([self.weights], [weights], [len(weights)])
        return self._ort.InferenceSession(bytes(self.files.read(name)), options, providers=["CPUExecutionProvider"])

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
