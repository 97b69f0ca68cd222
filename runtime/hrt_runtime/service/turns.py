"""Scheduling at the decoder pass (iteration-level scheduling, as Orca's and vLLM's continuous
batching): every running batch's search asks for a turn before each of its decoder passes
(encoder, step, non-causal pass) and gives it back after; ``--workers`` passes run at once,
and a free turn goes to the waiting batch with the least work left (its worst case less the
positions its passes computed), the one that asked first on a tie. A long search so yields
between any two of its passes to the short ones that came meanwhile: it slows only itself, and
a short request never waits for more than the passes already running.

A batch waiting for its turn still stops at once when nobody waits for it any more (its
clients went away, their deadlines passed, the drain ended): its arrays go with its thread.
Turns are taken in worker threads; :class:`Turns` is thread-safe."""

import heapq
import itertools
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from hrt_runtime.work import Stopped

# how often a batch waiting for its turn asks whether it is still wanted (seconds): a stopped
# batch's memory goes back within this much
STOP_POLL_SECONDS = 0.05
# how long a batch that gave its turn back keeps the first claim on it over batches of more work
# left (seconds): between two passes its search runs its own Python (choosing tokens, reordering
# its state), and a long search must not slip a pass in at each of those gaps
CLAIM_SECONDS = 0.003


class Turns:
    """``workers`` decoder passes at once among all running batches (:class:`BatchTurns`), a
    free turn to the waiting batch with the least work left; a batch that just gave its turn
    back keeps the first claim on one for :data:`CLAIM_SECONDS` over batches with more left.
    While short batches are in progress, long ones hold at most ``workers - 1`` turns: one
    worker stays free for short work, which a long pass would otherwise hold up while short
    batches run their Python between passes."""

    def __init__(self, workers: int):
        self._workers = self._free = workers
        self._short = 0  # short batches in progress
        self._long_passes = 0  # turns held by long batches
        self._changed = threading.Condition()
        self._waiting: List[Tuple[int, int, "BatchTurns"]] = []  # a heap: (work left, ticket, batch)
        self._tickets = itertools.count()
        self._claims: Dict["BatchTurns", float] = {}  # batch -> until when it keeps its claim

    def take(self, batch: "BatchTurns") -> None:
        """Wait until ``batch`` may run its next pass; :class:`~hrt_runtime.work.Stopped` when
        nobody waits for it any more meanwhile."""
        with self._changed:
            entry = (batch.left, next(self._tickets), batch)
            heapq.heappush(self._waiting, entry)
            try:
                while True:
                    wait = self._wait_before(entry)
                    if wait is None:
                        break
                    if batch.stopped():
                        raise Stopped("the translation was stopped while it waited for its next decoder pass")
                    self._changed.wait(min(wait, STOP_POLL_SECONDS))
            except BaseException:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
                self._changed.notify_all()
                raise
            heapq.heappop(self._waiting)
            self._claims.pop(batch, None)
            self._free -= 1
            self._long_passes += batch.long
            if self._free:  # the next in line may run too
                self._changed.notify_all()

    def _wait_before(self, entry) -> Optional[float]:
        """``None``: ``entry`` takes a turn now; else how long to wait at most before asking again."""
        if not self._free or self._waiting[0] is not entry:
            return STOP_POLL_SECONDS
        if entry[2].long and self._short and self._long_passes >= self._workers - 1 > 0:
            return STOP_POLL_SECONDS  # the last worker stays free for short work
        now, left = time.monotonic(), entry[0]
        for claimant, until in list(self._claims.items()):
            if until <= now:
                del self._claims[claimant]
        claims = [until for claimant, until in self._claims.items() if claimant.left < left]
        if self._free > len(claims):
            return None
        return min(claims) - now

    def give(self, batch: "BatchTurns") -> None:
        """``batch``'s pass is over: its turn is free, and ``batch`` keeps the first claim on it."""
        with self._changed:
            self._free += 1
            self._long_passes -= batch.long
            self._claims[batch] = time.monotonic() + CLAIM_SECONDS
            self._changed.notify_all()

    def join(self, batch: "BatchTurns") -> None:
        """``batch`` is in progress."""
        with self._changed:
            self._short += not batch.long

    def forget(self, batch: "BatchTurns") -> None:
        """``batch`` makes no more passes: no claim of it holds anybody back."""
        with self._changed:
            self._short -= not batch.long
            self._claims.pop(batch, None)
            self._changed.notify_all()

    @property
    def waiting(self) -> int:
        """Batches waiting for a turn now."""
        with self._changed:
            return len(self._waiting)


class BatchTurns:
    """One running batch's side of :class:`Turns` (a :class:`hrt_runtime.work.PassGate`): its
    worst case (``positions``), its work left (``left``: less the positions its passes computed),
    whether anybody still waits for it (``stopped()``), whether it is ``long`` work (see
    :class:`Turns`) and the seconds its passes took
    (``busy``: its work, without the waits for its turns)."""

    def __init__(self, turns: Turns, positions: int, stopped: Callable[[], bool], long: bool = False):
        self.turns, self.positions, self.left, self.stopped = turns, positions, positions, stopped
        self.long, self._ended = long, False
        turns.join(self)
        self.busy = 0.0
        self.passes = 0
        self._began = 0.0

    def enter(self, positions: int) -> None:
        """Before a pass of ``positions`` decoder positions: wait for its turn."""
        if self.stopped():
            raise Stopped("the translation was stopped between two decoder passes")
        self.turns.take(self)
        self._began = time.monotonic()
        self.left = max(0, self.left - positions)

    def leave(self) -> None:
        """After the pass: the turn goes to the next."""
        self.busy += time.monotonic() - self._began
        self.passes += 1
        self.turns.give(self)

    def done(self) -> None:
        """The batch makes no more passes (once; again: nothing)."""
        if not self._ended:
            self._ended = True
            self.turns.forget(self)
