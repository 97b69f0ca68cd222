"""Admission by work: the queue of admitted requests of ``hrt-serve``, the decoder positions they
may still cost (in flight), each client's part of them, the service's measured pace and each
request's deadline. A request is refused now when one of its batches would hold more than
``--max-batch-positions`` (a line that alone costs more), the queue is full, its work would pass
``--max-positions-in-flight`` or its client's share of it (``--max-client-share``), it could not
finish before its deadline at the measured pace, or the service shuts down."""

import asyncio
import collections
import time
from typing import Deque, Dict, List, Optional, Sequence, Set

import numpy as np

from hrt_runtime.call_options import CallOptions, batches_of
from hrt_runtime.options import SERVICE_BY_NAME
from hrt_runtime.service import batching
from hrt_runtime.service.admitted import (
    Admitted,
    Busy,
    CannotFinish,
    DeadlinePassed,
    OverShare,
    QueueFull,
    shutting_down,
)
from hrt_runtime.service.pace import Pace
from hrt_runtime.work import cut_by_positions


def default(name: str):
    """The default of a setting of :data:`hrt_runtime.options.SERVICE`."""
    return SERVICE_BY_NAME[name].default


def refuse_oversized_batches(parts: List[List[int]], part_costs: Sequence[int], max_batch_positions: int) -> None:
    """No batch holds more than ``--max-batch-positions`` (the memory bound of every batch): a
    part that would (one line that alone costs more, or a batch that ``max_len_a`` keeps whole)
    is refused at once, 413 with its figure."""
    for part, cost in zip(parts, part_costs):
        if cost > max_batch_positions:
            if len(part) == 1:
                lines = f"line {part[0] + 1}"
            else:  # kept whole: max_len_a > 0 makes the length limit the batch's
                lines = f"the batch of {len(part)} lines from line {min(part) + 1} (max_len_a > 0 keeps it whole)"
            raise CannotFinish(
                413,
                f"{lines} may cost {cost} decoder positions (beam x the length limit its options allow), "
                f"more than a batch holds (--max-batch-positions {max_batch_positions}): ask for a "
                "smaller beam, min_len or max_len_b",
            )


class AdmissionQueue:
    """The admitted requests waiting for a batch (``queue``, oldest first), the positions
    admitted and not yet answered (``in_flight``), the service's counters (``stats``) and its
    state: ``closing`` (SIGTERM: no new requests) and ``closed`` (the drain time over: no new
    batch). :class:`.batcher.Batcher` takes its batches from here.

    ``pace``: what the finished and stopped batches say of the service's pace (:class:`.pace.Pace`);
    ``held``: the positions in flight of each client; ``admitted``: the requests not yet answered."""

    workers = 1  # batches translated at once (the batcher's --workers): the pace of the whole service

    def __init__(
        self,
        max_queue: int = default("max_queue"),
        max_batch_positions: int = default("max_batch_positions"),
        max_positions_in_flight: int = default("max_positions_in_flight"),
        max_client_share: float = default("max_client_share"),
    ):
        self.max_client_share = SERVICE_BY_NAME["max_client_share"].check(max_client_share)
        self.max_queue = SERVICE_BY_NAME["max_queue"].check(max_queue)
        self.max_batch_positions = SERVICE_BY_NAME["max_batch_positions"].check(max_batch_positions)
        self.max_positions_in_flight = SERVICE_BY_NAME["max_positions_in_flight"].check(max_positions_in_flight)
        self.queue: Deque[Admitted] = collections.deque()
        self.stats = {
            "requests": 0,
            "sentences": 0,
            "batches": 0,
            "largest_batch": 0,
            "largest_batch_positions": 0,
            "rejected_full": 0,
            "rejected_busy": 0,
            "rejected_share": 0,
            "rejected_deadline": 0,
            "abandoned": 0,
            "deadline_passed": 0,
            "stopped_batches": 0,
        }
        self.in_flight = 0
        self.held: Dict[str, int] = {}
        self.admitted: Set[Admitted] = set()
        self.pace = Pace()
        self.closing = False
        self.closed = False
        self._wake: Optional[asyncio.Event] = None  # set when a batch may be formed or a worker is free

    def _poke(self):
        if self._wake is not None:
            self._wake.set()

    def _admit(self, part_costs: List[int], timeout: float, client: Optional[str]) -> None:
        """Refuse a request now (:class:`.admitted.Unavailable`, :class:`.admitted.CannotFinish`)
        when the service closes, the queue is full, its cost (``part_costs``: its batches')
        would pass the positions in flight or its ``client``'s share of them, or it could not
        finish within ``timeout``."""
        cost = sum(part_costs)
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
        self._check_share(cost, client)
        refusal = self.pace.refusal(part_costs, timeout, self.ahead_of(cost), self.workers)
        if refusal is not None:
            self.stats["rejected_deadline"] += 1
            raise refusal

    def ahead_of(self, cost: int) -> int:
        """The positions in flight that the decoder passes serve before work of ``cost``: those
        of the requests with no more work left (a pass goes to the least work left first)."""
        return sum(request.left for request in self.admitted if request.left <= cost)

    def _check_share(self, cost: int, client: Optional[str]) -> None:
        """A client's first request is admitted whatever it costs (as on an idle service), so a
        share below --max-request-positions still lets every request through one at a time."""
        held = self.held.get(client, 0) if client is not None else 0
        share = int(self.max_client_share * self.max_positions_in_flight)
        if held and held + cost > share:
            self.stats["rejected_share"] += 1
            raise OverShare(
                f"this client ({client}) holds {held} decoder positions in flight and this request's {cost} would "
                f"pass its share, --max-client-share {self.max_client_share:g} of --max-positions-in-flight "
                f"{self.max_positions_in_flight} ({share} positions); retry when its requests are answered"
            )

    async def translate(
        self,
        sources: List[Optional[np.ndarray]],
        options: CallOptions,
        positions: List[int],
        timeout: float,
        client: Optional[str] = None,
    ) -> List[str]:
        """Queue one request of encoded lines, costing ``positions`` per line, from ``client``
        (its address; ``None``: no share kept); its translations, in its order, or
        :class:`.admitted.DeadlinePassed` after ``timeout`` seconds. Cancelled (its client went
        away): it leaves the queue at once, and its batch stops if nobody else waits for it."""
        parts = batches_of(sources, options)
        if parts and batching.mergeable(options):  # else they stay the Translator's batches (outputs depend on them)
            parts = cut_by_positions(parts, positions, self.max_batch_positions)
        part_costs = [sum(positions[i] for i in part) for part in parts]
        refuse_oversized_batches(parts, part_costs, self.max_batch_positions)
        self._admit(part_costs, timeout, client)
        self.stats["requests"] += 1
        self.stats["sentences"] += len(sources)
        if not parts:  # only empty lines
            return [""] * len(sources)
        loop = asyncio.get_running_loop()
        request = Admitted(sources, parts, part_costs, options, loop.create_future())
        self.in_flight += request.left
        self.admitted.add(request)
        if client is not None:
            request.client = client
            self.held[client] = self.held.get(client, 0) + request.left
        request.deadline = request.arrived + timeout
        request.timer = loop.call_later(timeout, self._expire, request, timeout)
        request.future.add_done_callback(lambda future: self._ended(request))
        self.queue.append(request)
        self._poke()
        return await request.future

    def _gave_up(self, request: Admitted) -> bool:
        """Whether ``request``, about to start its next batch, can no longer finish by its
        deadline, even alone at the measured pace: then it is answered now (503) and leaves the
        queue, rather than start work that would be thrown away."""
        now = time.monotonic()
        need = self.pace.alone(list(request.part_positions))
        if need is None or now + need <= request.deadline:
            return False
        self.stats["rejected_deadline"] += 1
        self.queue.remove(request)
        request.future.set_exception(
            CannotFinish(
                503,
                f"this request's work left, {request.queued_positions} decoder positions, would need "
                f"{need:.3g} s at the service's measured pace, and its deadline is "
                f"{max(0.0, request.deadline - now):.3g} s away ({request.translated} of "
                f"{len(request.sources)} lines translated); retry later or ask for less work",
            )
        )
        return True

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
        self.admitted.discard(request)
        self._release(request, request.left)
        self._poke()

    def _release(self, request: Admitted, positions: int) -> None:
        """``positions`` of ``request`` done or given up: they leave the count and its client's."""
        if not positions:  # nothing left of it (its client's entry may be gone already)
            return
        request.left -= positions
        self.in_flight -= positions
        if request.client is not None:
            held = self.held[request.client] - positions
            if held:
                self.held[request.client] = held
            else:
                del self.held[request.client]
