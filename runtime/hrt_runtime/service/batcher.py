"""The batcher of ``hrt-serve``: batches taken from the admitted requests, up to
``--max-running-batches`` of them in progress at once, each in a thread of its own, their
searches taking turns at every decoder pass (:mod:`.turns`: ``--workers`` passes at once, the
least work left first), and the drain at shutdown (the module docstring of
:mod:`hrt_runtime.serve` says how each behaves)."""

import asyncio
import concurrent.futures
import itertools
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from hrt_runtime.call_options import CallOptions
from hrt_runtime.options import SERVICE_BY_NAME
from hrt_runtime.service import batching
from hrt_runtime.service.admission import AdmissionQueue, default
from hrt_runtime.service.admitted import Admitted, shutting_down
from hrt_runtime.service.memory import trim_heap
from hrt_runtime.service.metrics import Metrics
from hrt_runtime.service.turns import BatchTurns, Turns
from hrt_runtime.translator import Translator
from hrt_runtime.work import Stopped

# after a batch of at least this many decoder positions, freed memory goes back to the system
# (malloc_trim costs little beside the work of such a batch)
TRIM_AFTER_POSITIONS = 16384


class Batcher(AdmissionQueue):
    """Gathers the admitted requests (:class:`.admission.AdmissionQueue`) into batches
    (:mod:`.batching`) and translates up to ``max_running_batches`` batches at once, each in a
    thread, their decoder passes ``workers`` at a time (:class:`.turns.Turns`).

    The batches in progress hold at most ``workers x max_batch_positions`` decoder positions,
    and a quarter of a batch more for batches of at most that size, so that short work always
    finds room beside long work (a batch never holds more than ``max_batch_positions``: a line
    that would is refused at admission).

    :attr:`translate_batch` is what a batch's thread calls: ``(sources, options, gate) ->
    translations`` (``gate``: the batch's :class:`.turns.BatchTurns`, where each decoder pass
    waits for its turn and which tells whether anybody still waits for the batch). It is the
    Translator's; a test replaces it to hold a batch or record what was batched, and calls the
    one it replaced."""

    def __init__(
        self,
        translator: Translator,
        max_batch: int = default("max_batch"),
        max_wait_ms: float = default("max_wait_ms"),
        max_queue: int = default("max_queue"),
        workers: int = default("workers"),
        max_batch_positions: int = default("max_batch_positions"),
        max_positions_in_flight: int = default("max_positions_in_flight"),
        max_client_share: float = default("max_client_share"),
        max_running_batches: int = default("max_running_batches"),
    ):
        self.translator = translator
        self.max_batch = SERVICE_BY_NAME["max_batch"].check(max_batch)
        self.max_wait = SERVICE_BY_NAME["max_wait_ms"].check(max_wait_ms) / 1000.0
        super().__init__(max_queue, max_batch_positions, max_positions_in_flight, max_client_share)
        self.workers = SERVICE_BY_NAME["workers"].check(workers)
        self.max_running_batches = SERVICE_BY_NAME["max_running_batches"].check(max_running_batches)
        self.turns = Turns(self.workers)
        self.metrics: Optional[Metrics] = None
        self.running: Dict[asyncio.Task, List[Admitted]] = {}
        self.gates: Dict[asyncio.Task, BatchTurns] = {}  # each batch in progress: its turns and worst case
        self._task: Optional[asyncio.Task] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.max_running_batches, thread_name_prefix="hrt-serve"
        )
        self.translate_batch: Callable[[List[np.ndarray], CallOptions, BatchTurns], List[str]] = self._translate

    def start(self):
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    # ------------------------------------------------------------------ batching

    @property
    def running_positions(self) -> int:
        """The worst case of the batches in progress (counted from the moment a batch is chosen:
        the next one is chosen before this one's task first runs)."""
        return sum(gate.positions for gate in self.gates.values())

    @property
    def short_batch(self) -> int:
        """The most positions a batch may have to use the room kept for short work."""
        return self.max_batch_positions // 4

    def _room(self, cost: int) -> int:
        """:func:`.batching.room` of a batch whose first part costs ``cost``, now."""
        in_progress = self.running_positions if self.running else None
        return batching.room(cost, in_progress, self.workers, self.max_batch_positions, self.short_batch)

    def _may_start(self, cost: int) -> bool:
        """Whether a batch whose first part costs ``cost`` starts now (:func:`.batching.may_start`)."""
        in_progress = [gate.positions for gate in self.gates.values()]
        return self._room(cost) > 0 and batching.may_start(cost, in_progress, self.short_batch, self.workers)

    async def _next_batch(self) -> List[Admitted]:
        while True:
            self._wake.clear()
            free = self.queue and len(self.running) < self.max_running_batches and not self.closed
            fits = lambda request: self._may_start(request.part_positions[0])  # noqa: E731
            head = batching.head_of(self.queue, fits, self.closing) if free else None
            if head is not None and self._gave_up(head):
                continue
            if head is not None:
                wait = 0.0
                if batching.mergeable(head.options) and not self.closing:
                    wait = batching.wait_left(self.queue, head, self.max_batch, self.max_wait)
                if wait <= 0:
                    return batching.take(self.queue, head, self.max_batch, self._room(head.part_positions[0]))
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
                continue
            await self._wake.wait()

    async def _run(self):
        while True:
            batch = await self._next_batch()
            cost = sum(request.part_positions[0] for request in batch)
            gate = BatchTurns(
                self.turns,
                cost,
                lambda batch=batch: all(request.future.done() for request in batch),
                long=cost > self.short_batch,
            )
            task = asyncio.get_running_loop().create_task(self._translate_batch(batch, gate))
            self.running[task], self.gates[task] = batch, gate

    async def _translate_batch(self, batch: List[Admitted], gate: BatchTurns):
        parts = [request.parts.popleft() for request in batch]
        costs = [request.part_positions.popleft() for request in batch]
        sources = [request.sources[i] for request, part in zip(batch, parts) for i in part]
        cost = gate.positions
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(sources))
        self.stats["largest_batch_positions"] = max(self.stats["largest_batch_positions"], cost)
        started = time.monotonic()
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.translate_batch, sources, batch[0].options, gate
            )
        except Stopped:
            self.stats["stopped_batches"] += 1
            self.pace.stopped(cost, time.monotonic() - started)
            if self.metrics is not None:
                self.metrics.stopped.inc()
            return
        except Exception as e:  # noqa: BLE001 - handed to the requests of this batch
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(e)
            return
        finally:
            gate.done()
            self._finished(batch, costs)
        # a finished batch only (a stopped one says nothing), by its passes' time: not its waits for turns
        self.pace.measured(cost, gate.busy)
        if self.metrics is not None:
            self.metrics.batch(sources)
        batching.hand_back(batch, parts, out)
        for request in batch:
            self._next_part(request)

    def _finished(self, batch: List[Admitted], costs: List[int]):
        """A batch's thread is free again and its positions leave the counts."""
        del self.running[asyncio.current_task()], self.gates[asyncio.current_task()]
        for request, cost in zip(batch, costs):
            if not request.future.done():
                self._release(request, cost)
        self._poke()

    def _next_part(self, request: Admitted):
        """After one of its batches: a request answered, queued again for its next part (behind
        the requests that came meanwhile), or refused when the drain time ran out."""
        if request.future.done():  # cancelled or expired while its batch ran: no further batch
            return
        if request.parts and self.closed:  # the drain time ran out during this batch
            request.future.set_exception(shutting_down())
        elif request.parts:
            self.queue.append(request)
        else:
            request.future.set_result(request.results)

    def _translate(self, sources, options: CallOptions, gate: BatchTurns) -> List[str]:
        stopped = True
        try:
            # lines of several requests: not named in messages
            out = self.translator.translate_sources(sources, options, name=None, gate=gate)
            stopped = False
            return out
        finally:  # a large batch's memory, or a stopped one's, back to the system
            if stopped or gate.positions >= TRIM_AFTER_POSITIONS:
                trim_heap()

    # ------------------------------------------------------------------ shutdown

    async def drain(self, seconds: float, arriving: Callable[[], int] = lambda: 0):
        """Take no new request; translate what is admitted for at most ``seconds`` (the least
        work left first), then answer those left with :class:`.admitted.ShuttingDown`, which
        stops their batches at the next decoder step. ``arriving()``: requests not yet admitted
        (a body still coming): waited for too, so that they are answered (503) on a service
        still listening."""
        self.closing = True
        self._poke()
        deadline = time.monotonic() + seconds
        while (self.queue or self.running or arriving()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.closed = True
        self._reject_all()

    def _reject_all(self):
        for request in [*self.queue, *itertools.chain.from_iterable(self.running.values())]:
            if not request.future.done():
                request.future.set_exception(shutting_down())
        self.queue.clear()

    async def stop(self):
        self.closing = self.closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._reject_all()
        if self.running:  # they stop at their next decoder step
            await asyncio.wait(list(self.running))
        self._executor.shutdown(wait=True)
