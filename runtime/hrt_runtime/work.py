"""The work of a translation, known before it starts and stoppable while it runs.

* :func:`line_positions`: the decoder positions one line may cost under its options, the most
  the search can compute for it (every hypothesis run to its length limit). ``hrt-serve`` admits
  a request by the sum over its lines, not by the bytes it sends: a few kilobytes of lines with a
  large ``beam`` and ``min_len`` ask for far more memory and time than their size says.
* :class:`StoppableBackend`: a search backend that asks ``stop()`` before every decoder pass and
  raises :class:`Stopped` once it is true (its client went away, its deadline passed, the drain
  ended): the search's arrays are then dropped with the call. With a :class:`PassGate`
  (``hrt-serve``'s scheduler) each pass also waits for its turn, so that many searches advance a
  pass at a time. The one pass it cannot cut is ``greedy.onnx`` (every step of a greedy search
  in one ONNX Runtime call), which runs for at most :data:`hrt_runtime.model.LOOP_ROWS` rows (at
  most the positions of a two-line request), under a gate only up to
  :data:`LOOP_POSITIONS_PER_TURN` positions.
"""

from typing import Callable, List, Optional, Protocol, Sequence

import numpy as np

from hrt_runtime.families import HRT, MASK_PREDICT
from hrt_runtime.search import SearchConfig, position_cap


def output_limit(config: SearchConfig, source_tokens: int, stride: int, max_positions: int) -> int:
    """The most steps a left-to-right search of ``stride`` makes for a line of ``source_tokens``
    (fairseq's ``a x S + b``, Skip-AT's ``/ k``, within the decoder's positions)."""
    return max(0, config.for_chunk_size(stride).length_limit(source_tokens, position_cap(max_positions, stride)))


def line_positions(
    kind: str,
    source_tokens: int,
    config: SearchConfig,
    chunk_size: int,
    b_nat: int,
    iterations: int,
    length_beam: int,
    max_positions: int,
) -> int:
    """Decoder positions one line may cost: ``beam x (steps + 1)`` for a left-to-right search;
    HRT adds stage II's ``b_nat x k x (steps + 1)`` slots; Mask-Predict ``length_beam x
    iterations x`` its longest length."""
    if kind == MASK_PREDICT:
        longest = max(1, min(int(config.max_len_a * source_tokens + config.max_len_b), max_positions - 1))
        return length_beam * iterations * longest
    k = chunk_size if kind == HRT else 1
    steps = output_limit(config, source_tokens, k, max_positions) + 1
    return config.beam * steps + (b_nat * k * steps if k > 1 else 0)


def cut_by_positions(batches: List[List[int]], cost: Sequence[int], max_positions: int) -> List[List[int]]:
    """``batches`` (lists of line indices) cut further so that each holds at most
    ``max_positions`` of ``cost`` (a line costing more is a batch of its own)."""
    out = []
    for batch in batches:
        part, total = [], 0
        for i in batch:
            if part and total + cost[i] > max_positions:
                out.append(part)
                part, total = [], 0
            part.append(i)
            total += cost[i]
        out.append(part)
    return out


class Stopped(Exception):
    """A translation stopped between two decoder passes: nobody waits for it any more."""


class PassGate(Protocol):
    """Where each decoder pass of a search waits for its turn (``hrt-serve``'s scheduler,
    :class:`hrt_runtime.service.turns.BatchTurns`): ``enter(positions)`` before a pass of that
    many decoder positions (it may raise :class:`Stopped`), ``leave()`` after it."""

    def enter(self, positions: int) -> None: ...

    def leave(self) -> None: ...


# a greedy loop (every step in one call) runs under a gate only while its worst case is a short
# request's: the positions it may compute in one call all hold one turn
LOOP_POSITIONS_PER_TURN = 512


class StoppableBackend:
    """``backend`` (an :class:`~hrt_runtime.model.ExportedModel`) with ``stop()`` asked before
    each pass (encoder, step, greedy loop, non-causal pass) and, with a ``gate``, each pass run
    in its turn there; everything else is the backend's (a :class:`~hrt_runtime.backend.SourceBackend`
    itself: its methods of the contract are written out, its attributes read from the backend)."""

    def __init__(self, backend, stop: Callable[[], bool], gate: Optional[PassGate] = None):
        self._backend, self._stop, self._gate = backend, stop, gate

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def _pass(self, positions: int, run: Callable, *args):
        if self._stop():
            raise Stopped("the translation was stopped between two decoder passes")
        if self._gate is None:
            return run(*args)
        self._gate.enter(positions)
        try:
            return run(*args)
        finally:
            self._gate.leave()

    def encode(self, src_tokens: np.ndarray):
        return self._pass(0, self._backend.encode, src_tokens)

    # the backend contract (hrt_runtime.backend.Backend), its parameters named as there
    def step(self, state, tokens: np.ndarray, step: int, logit_bias: np.ndarray, top: int = 1, scores: bool = True):
        return self._pass(int(tokens.size), self._backend.step, state, tokens, step, logit_bias, top, scores)

    def greedy_loop(self, encoded, start: int, max_len: int, min_len: int, biases, out_rows):
        positions = encoded.size * (max_len + 1)
        if self._gate is not None and positions > LOOP_POSITIONS_PER_TURN:
            return None  # the search makes the steps itself (the same result), each in its turn
        return self._pass(positions, self._backend.greedy_loop, encoded, start, max_len, min_len, biases, out_rows)

    def parallel(self, encoded, tokens, positions, queries, select, logit_bias, out_rows):
        return self._pass(
            int(tokens.size), self._backend.parallel, encoded, tokens, positions, queries, select, logit_bias, out_rows
        )

    def rows(self, ids: Optional[np.ndarray]):
        return self._backend.rows(ids)

    def stride_of(self, start: int) -> int:
        return self._backend.stride_of(start)

    def begin(self, encoded, rows: int, steps: int, start: int, out_rows):
        return self._backend.begin(encoded, rows, steps, start, out_rows)

    def reorder(self, state, index: np.ndarray, step: int, sentences: Optional[np.ndarray] = None):
        return self._backend.reorder(state, index, step, sentences)


def stoppable(backend, stop: Optional[Callable[[], bool]], gate: Optional[PassGate] = None):
    """``backend`` itself when nothing can stop it nor schedule its passes."""
    if stop is None and gate is None:
        return backend
    return StoppableBackend(backend, stop or (lambda: False), gate)
