"""The batcher of ``hrt-serve``: batches taken from the admitted requests, ``--workers`` of them
translated at a time in worker threads, and the drain at shutdown (the module docstring
of :mod:`hrt_runtime.serve` says how each behaves)."""

import asyncio
import concurrent.futures
import ctypes
import functools
import itertools
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from hrt_runtime.call_options import CallOptions
from hrt_runtime.options import SERVICE_BY_NAME
from hrt_runtime.service import batching
from hrt_runtime.service.admission import AdmissionQueue, default
from hrt_runtime.service.admitted import Admitted, shutting_down
from hrt_runtime.service.metrics import Metrics
from hrt_runtime.translator import Translator
from hrt_runtime.work import Stopped

# after a batch of at least this many source tokens, freed memory goes back to the system
# (malloc_trim costs little beside the work of such a batch)
TRIM_AFTER_TOKENS = 4096


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, which gives the heap's free pages back to the system (``None``
    where there is no glibc: nothing to do there)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class Batcher(AdmissionQueue):
    """Gathers the admitted requests (:class:`.admission.AdmissionQueue`) into batches
    (:mod:`.batching`) and translates ``workers`` batches at a time, each in a worker thread.

    :attr:`translate_batch` is what a worker thread calls on a batch: ``(sources, options,
    stop) -> translations`` (``stop()`` is asked between decoder steps and true when nobody
    waits for the batch any more). It is the Translator's; a test replaces it to hold a batch
    or record what was batched, and calls the one it replaced."""

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
    ):
        self.translator = translator
        self.max_batch = SERVICE_BY_NAME["max_batch"].check(max_batch)
        self.max_wait = SERVICE_BY_NAME["max_wait_ms"].check(max_wait_ms) / 1000.0
        super().__init__(max_queue, max_batch_positions, max_positions_in_flight, max_client_share)
        self.workers = SERVICE_BY_NAME["workers"].check(workers)
        self.metrics: Optional[Metrics] = None
        self.running: Dict[asyncio.Task, List[Admitted]] = {}
        self.long_running = 0  # batches of requests of more than one batch, running
        self._task: Optional[asyncio.Task] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hrt-serve")
        self.translate_batch: Callable[[List[np.ndarray], CallOptions, Callable[[], bool]], List[str]] = self._translate

    def start(self):
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    # ------------------------------------------------------------------ batching

    def _may_start(self, request: Admitted) -> bool:
        """With two workers or more, one is kept for requests of one batch."""
        return request.one_batch or self.workers == 1 or self.long_running < self.workers - 1

    async def _next_batch(self) -> List[Admitted]:
        while True:
            self._wake.clear()
            free = self.queue and len(self.running) < self.workers and not self.closed
            head = batching.head_of(self.queue, self._may_start, self.closing) if free else None
            if head is not None:
                wait = 0.0
                if batching.mergeable(head.options) and not self.closing:
                    wait = batching.wait_left(self.queue, head, self.max_batch, self.max_wait)
                if wait <= 0:
                    return batching.take(self.queue, head, self.max_batch, self.max_batch_positions)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
                continue
            await self._wake.wait()

    async def _run(self):
        while True:
            batch = await self._next_batch()
            long = not batch[0].one_batch
            task = asyncio.get_running_loop().create_task(self._translate_batch(batch, long))
            self.running[task] = batch
            self.long_running += long

    async def _translate_batch(self, batch: List[Admitted], long: bool):
        parts = [request.parts.popleft() for request in batch]
        costs = [request.part_positions.popleft() for request in batch]
        sources = [request.sources[i] for request, part in zip(batch, parts) for i in part]
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(sources))

        def nobody_waits() -> bool:  # asked by the worker thread between decoder steps
            return all(request.future.done() for request in batch)

        started = time.monotonic()
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.translate_batch, sources, batch[0].options, nobody_waits
            )
        except Stopped:
            self.stats["stopped_batches"] += 1
            self.pace.stopped(sum(costs), time.monotonic() - started)
            if self.metrics is not None:
                self.metrics.stopped.inc()
            return
        except Exception as e:  # noqa: BLE001 - handed to the requests of this batch
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(e)
            return
        finally:
            self._finished(batch, costs, long)
        self.pace.measured(sum(costs), time.monotonic() - started)  # a finished batch only: a stopped one says nothing
        if self.metrics is not None:
            self.metrics.batch(sources)
        batching.hand_back(batch, parts, out)
        for request in batch:
            self._next_part(request)

    def _finished(self, batch: List[Admitted], costs: List[int], long: bool):
        """A batch's worker is free again and its positions leave the count."""
        del self.running[asyncio.current_task()]
        self.long_running -= long
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

    def _translate(self, sources, options: CallOptions, stop) -> List[str]:
        stopped = True
        try:
            # lines of several requests: not named in messages
            out = self.translator.translate_sources(sources, options, name=None, stop=stop)
            stopped = False
            return out
        finally:  # a large batch's memory, or a stopped one's, back to the system
            if stopped or sum(int(s.size) for s in sources) >= TRIM_AFTER_TOKENS:
                trim = _malloc_trim()
                if trim is not None:
                    trim(0)

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
