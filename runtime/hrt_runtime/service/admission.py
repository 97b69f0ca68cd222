"""Admission by work: the queue of admitted requests of ``hrt-serve``, the decoder positions they
may still cost (in flight), and each request's deadline. A request is refused now when the queue
is full, its work would pass ``--max-positions-in-flight``, or the service shuts down."""

import asyncio
import collections
from typing import Deque, List, Optional

import numpy as np

from hrt_runtime.call_options import CallOptions, batches_of
from hrt_runtime.options import SERVICE_BY_NAME
from hrt_runtime.service import batching
from hrt_runtime.service.admitted import Admitted, Busy, DeadlinePassed, QueueFull, shutting_down
from hrt_runtime.work import cut_by_positions


def default(name: str):
    """The default of a setting of :data:`hrt_runtime.options.SERVICE`."""
    return SERVICE_BY_NAME[name].default


class AdmissionQueue:
    """The admitted requests waiting for a batch (``queue``, oldest first), the positions
    admitted and not yet answered (``in_flight``), the service's counters (``stats``) and its
    state: ``closing`` (SIGTERM: no new requests) and ``closed`` (the drain time over: no new
    batch). :class:`.batcher.Batcher` takes its batches from here."""

    def __init__(
        self,
        max_queue: int = default("max_queue"),
        max_batch_positions: int = default("max_batch_positions"),
        max_positions_in_flight: int = default("max_positions_in_flight"),
    ):
        self.max_queue = SERVICE_BY_NAME["max_queue"].check(max_queue)
        self.max_batch_positions = SERVICE_BY_NAME["max_batch_positions"].check(max_batch_positions)
        self.max_positions_in_flight = SERVICE_BY_NAME["max_positions_in_flight"].check(max_positions_in_flight)
        self.queue: Deque[Admitted] = collections.deque()
        self.stats = {
            "requests": 0,
            "sentences": 0,
            "batches": 0,
            "largest_batch": 0,
            "rejected_full": 0,
            "rejected_busy": 0,
            "abandoned": 0,
            "deadline_passed": 0,
            "stopped_batches": 0,
        }
        self.in_flight = 0
        self.closing = False
        self.closed = False
        self._wake: Optional[asyncio.Event] = None  # set when a batch may be formed or a worker is free

    def _poke(self):
        if self._wake is not None:
            self._wake.set()

    def _admit(self, cost: int) -> None:
        """Refuse a request now (:class:`.admitted.Unavailable`) when the service closes, the
        queue is full, or its ``cost`` would pass the positions in flight."""
        if self.closing:
            raise shutting_down()
        if len(self.queue) >= self.max_queue:
            self.stats["rejected_full"] += 1
            raise QueueFull(
                f"the queue is full ({len(self.queue)} requests waiting, --max-queue {self.max_queue}); retry later"
            )
        if self.in_flight and self.in_flight + cost > self.max_positions_in_flight:
            self.stats["rejected_busy"] += 1
            raise Busy(
                f"the service is busy: {self.in_flight} decoder positions in flight and this request's {cost} would "
                f"pass --max-positions-in-flight {self.max_positions_in_flight}; retry later"
            )

    async def translate(
        self, sources: List[Optional[np.ndarray]], options: CallOptions, positions: List[int], timeout: float
    ) -> List[str]:
        """Queue one request of encoded lines, costing ``positions`` per line; its translations,
        in its order, or :class:`.admitted.DeadlinePassed` after ``timeout`` seconds. Cancelled
        (its client went away): it leaves the queue at once, and its batch stops if nobody else
        waits for it."""
        self._admit(sum(positions))
        self.stats["requests"] += 1
        self.stats["sentences"] += len(sources)
        parts = batches_of(sources, options)
        if not parts:  # only empty lines
            return [""] * len(sources)
        if batching.mergeable(options):  # else its parts stay the Translator's batches (its outputs depend on them)
            parts = cut_by_positions(parts, positions, self.max_batch_positions)
        loop = asyncio.get_running_loop()
        request = Admitted(
            sources, parts, [sum(positions[i] for i in part) for part in parts], options, loop.create_future()
        )
        self.in_flight += request.left
        request.timer = loop.call_later(timeout, self._expire, request, timeout)
        request.future.add_done_callback(lambda future: self._ended(request))
        self.queue.append(request)
        self._poke()
        return await request.future

    def _expire(self, request: Admitted, timeout: float):
        if request.future.done():
            return
        self.stats["deadline_passed"] += 1
        request.future.set_exception(
            DeadlinePassed(
                f"the request's deadline passed ({timeout:g} s after it arrived) with {request.translated} of "
                f"{len(request.sources)} lines translated; ask for less work (fewer lines, a smaller beam or "
                'max_len_b) or a longer "timeout" (at most --request-timeout)'
            )
        )

    def _ended(self, request: Admitted):
        """A request answered, refused, expired or cancelled: it leaves the queue, its positions
        leave the count, and its batch stops if nobody else waits for it."""
        if request.timer is not None:
            request.timer.cancel()
        if request in self.queue:
            self.queue.remove(request)
        self.in_flight -= request.left
        request.left = 0
        self._poke()
