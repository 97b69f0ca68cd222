"""``hrt-serve FOLDER --port N``: an exported folder as a translation service over HTTP, on
aiohttp (``pip install "./runtime[serve]"``; no PyTorch), for callers that cannot link the runtime.

* ``POST /translate`` with ``{"text": ["line", ...], "beam": 5, ...}`` (any option of
  :meth:`hrt_runtime.Translator.translate` but ``batch_size``, and ``"timeout"``: seconds to its
  deadline) answers ``{"translations": [...]}``, one string per line, the strings
  ``Translator.translate`` gives for those lines; every error is ``{"error": "..."}``;
* ``GET /health`` answers ``{"status": "ok"}`` while the service takes requests, 503 while it drains;
* ``GET /info``: the model (kind, chunk sizes, positions, the export's parameter digest), the
  batching settings and counters.

**Admission by work, not bytes.** A request costs the decoder positions its options allow:
per line ``beam x`` (the length limit + 1) for a left-to-right search, HRT's stage II slots
beside, Mask-Predict's ``length_beam x iterations x`` its length (:mod:`hrt_runtime.work`). A
request of more than ``--max-request-positions`` is answered 413 with its figure; one that would
take the positions admitted and not yet answered beyond ``--max-positions-in-flight`` is told 503
and ``Retry-After``. Every request has a deadline (``--request-timeout`` after it arrives, or its
own shorter ``"timeout"``): then it is answered 504, and its work stops between two decoder steps,
as when its client goes away (aiohttp's handler cancellation: counted ``abandoned``) or the drain
ends. A batch stops once none of its requests waits for it; its arrays go with it.

Dynamic batching, as Triton's dynamic batcher: requests wait in one queue; a free worker takes
the oldest and, with it, every later waiting request with the same options, up to
``--max-batch`` sentences and ``--max-batch-positions`` positions, waiting at most
``--max-wait-ms`` (default 0) after the oldest arrived for more to come. ``--workers`` batches
run at once, each in a thread (the event loop keeps answering); with two or more, one worker
is kept for requests of one batch, so that long requests never hold every worker. Translations
are handed back to each request by position: a request never gets another's lines. The queue is
bounded (``--max-queue`` requests; then 503 and ``Retry-After``). Sentences of a request may be
translated in a batch with other requests' sentences: outputs do not depend on the batch (see
docs/deploy.md), except where ``max_len_a`` > 0 makes the length limit depend on the batch's
width (as in fairseq): such a request is batched alone, in the batches the Translator makes.

A long request is cut into the batches ``Translator.translate`` would make of it (``--max-batch``
sentences, ``--max-batch-tokens`` padded source tokens), cut again to ``--max-batch-positions``,
and goes back to the end of the queue after each of its batches, so other requests' batches
interleave with it. Repair and truncation warnings name the request and its own line numbers.

**Slow and hostile clients.** A connection without a whole request after ``--idle-timeout``
seconds is closed (aiohttp's keep-alive timeout, which also bounds headers sent slowly); a body
that takes longer than ``--body-timeout`` is answered 408; bodies above 16 MiB 413, JSON nested
too deep 400, unknown paths 404: all as JSON.

**Draining.** At SIGTERM (or SIGINT) the service keeps listening but takes no new request
(503, and ``/health`` 503 so that a load balancer sees it), translates what it has for at most
``--drain-seconds``, the request with the least work left first (so that requests finish instead
of all rotating to nothing), then answers the rest 503, stops the batches running and exits.

* ``GET /metrics``: the Prometheus text format (``prometheus_client``): requests by outcome,
  request latency and batch size histograms, queue depth, positions in flight, batches stopped,
  sentences and source tokens translated. ``/info``'s counters are the same numbers. Every request
  also gets one access-log line (id, lines, status, milliseconds).
"""

import asyncio
import collections
import concurrent.futures
import ctypes
import functools
import itertools
import json
import logging
import os
import signal
import sys
import time
from typing import Callable, Deque, Dict, List, Optional

import numpy as np

from hrt_runtime.options import (
    DECODING,
    SERVICE,
    SERVICE_BY_NAME,
    THREADS,
    Option,
    check_arguments,
    command_parser,
)
from hrt_runtime.text_input import repair_lines
from hrt_runtime.translator import CallOptions, Translator, batches_of
from hrt_runtime.work import Stopped, cut_by_positions

try:  # the serve extra (pip install "./runtime[serve]"); cli_main says how to install what is missing
    from aiohttp import web
except ImportError:
    web = None
try:
    import prometheus_client
except ImportError:
    prometheus_client = None

logger = logging.getLogger(__name__)
access_log = logging.getLogger(__name__ + ".access")

# the options a request may set: Translator.translate's, but the batching (the service's own), and its deadline
REQUEST_OPTIONS = tuple(o.name for o in DECODING if o.name not in ("batch_size", "max_tokens")) + ("timeout",)
OUTCOMES = ("200", "400", "408", "413", "503", "504", "abandoned", "500")
MAX_BODY_BYTES = 16 * 2**20

# after a batch of at least this many source tokens, freed memory goes back to the system
# (malloc_trim costs little beside such a batch: benchmarks/results/runtime-step-cost-cpu/README.md)
TRIM_AFTER_TOKENS = 4096


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, which gives the heap's free pages back to the system (``None``
    where there is no glibc: nothing to do there)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class Refused(Exception):
    """A request the service does not take now (503 with ``Retry-After``)."""


class QueueFull(Refused):
    pass


class Busy(Refused):
    pass


class ShuttingDown(Refused):
    pass


class DeadlinePassed(Exception):
    """A request whose deadline passed before its translations were all made (504)."""


def _shutting_down() -> ShuttingDown:
    return ShuttingDown("the service is shutting down; retry on another instance")


class _Request:
    """One admitted request: its encoded lines (``None``: empty), the parts not yet translated
    (lists of line indices, each a batch of its own) with their positions, its translations so
    far, and ``left``: the positions of its parts not yet finished (counted in flight)."""

    __slots__ = (
        "sources",
        "parts",
        "part_positions",
        "results",
        "options",
        "key",
        "future",
        "arrived",
        "left",
        "one_batch",
        "timer",
        "translated",
    )

    def __init__(self, sources, parts, part_positions, options: CallOptions, future: asyncio.Future):
        self.sources, self.options, self.key, self.future = sources, options, options, future
        self.parts: Deque[List[int]] = collections.deque(parts)
        self.part_positions: Deque[int] = collections.deque(part_positions)
        self.results = [""] * len(sources)
        self.arrived = time.monotonic()
        self.left = sum(part_positions)
        self.one_batch = len(parts) == 1
        self.timer: Optional[asyncio.TimerHandle] = None
        self.translated = 0

    @property
    def next_size(self) -> int:
        return len(self.parts[0])

    @property
    def queued_positions(self) -> int:
        return sum(self.part_positions)


class Metrics:
    """The service's series, in a registry of its own (one per application)."""

    def __init__(self, batcher: "Batcher"):
        p = prometheus_client
        self.registry = p.CollectorRegistry()
        r = self.registry
        self.requests = p.Counter(
            "hrt_serve_requests", "POST /translate requests answered, by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.latency = p.Histogram(
            "hrt_serve_request_seconds",
            "POST /translate: from the request's arrival to its answer",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.batch_size = p.Histogram(
            "hrt_serve_batch_sentences",
            "sentences per translated batch",
            buckets=tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < batcher.max_batch)
            + (batcher.max_batch,),
            registry=r,
        )
        self.queue = p.Gauge("hrt_serve_queue_requests", "requests waiting for a batch", registry=r)
        self.queue.set_function(lambda: len(batcher.queue))
        self.in_flight = p.Gauge(
            "hrt_serve_positions_in_flight", "decoder positions admitted and not yet answered", registry=r
        )
        self.in_flight.set_function(lambda: batcher.in_flight)
        self.stopped = p.Counter(
            "hrt_serve_stopped_batches", "batches stopped between two decoder steps: nobody waited for them", registry=r
        )
        self.sentences = p.Counter("hrt_serve_sentences", "sentences translated", registry=r)
        self.tokens = p.Counter("hrt_serve_source_tokens", "source tokens translated", registry=r)

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class Batcher:
    """Admits requests by their work, gathers them into batches (see the module's docstring) and
    translates ``workers`` batches at a time, each in a worker thread.

    :attr:`translate_batch` is what a worker thread calls on a batch: ``(sources, options,
    stop) -> translations`` (``stop()`` is asked between decoder steps and true when nobody
    waits for the batch any more). It is the Translator's; a test replaces it to hold a batch
    or record what was batched, and calls the one it replaced."""

    def __init__(
        self,
        translator: Translator,
        max_batch: int = SERVICE_BY_NAME["max_batch"].default,
        max_wait_ms: float = SERVICE_BY_NAME["max_wait_ms"].default,
        max_queue: int = SERVICE_BY_NAME["max_queue"].default,
        workers: int = SERVICE_BY_NAME["workers"].default,
        max_batch_positions: int = SERVICE_BY_NAME["max_batch_positions"].default,
        max_positions_in_flight: int = SERVICE_BY_NAME["max_positions_in_flight"].default,
    ):
        self.translator = translator
        self.max_batch = SERVICE_BY_NAME["max_batch"].check(max_batch)
        self.max_wait = SERVICE_BY_NAME["max_wait_ms"].check(max_wait_ms) / 1000.0
        self.max_queue = SERVICE_BY_NAME["max_queue"].check(max_queue)
        self.workers = SERVICE_BY_NAME["workers"].check(workers)
        self.max_batch_positions = SERVICE_BY_NAME["max_batch_positions"].check(max_batch_positions)
        self.max_positions_in_flight = SERVICE_BY_NAME["max_positions_in_flight"].check(max_positions_in_flight)
        self.queue: Deque[_Request] = collections.deque()
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
        self.in_flight = 0  # positions admitted and not yet answered
        self.metrics: Optional[Metrics] = None
        self.running: Dict[asyncio.Task, List[_Request]] = {}
        self.long_running = 0  # batches of requests of more than one batch, running
        self.closing = False  # SIGTERM: no new requests
        self.closed = False  # and, the drain time over, no new batch
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hrt-serve")
        self.translate_batch: Callable[[List[np.ndarray], CallOptions, Callable[[], bool]], List[str]] = self._translate

    def start(self):
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _poke(self):
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ admission

    async def translate(
        self, sources: List[Optional[np.ndarray]], options: CallOptions, positions: List[int], timeout: float
    ) -> List[str]:
        """Queue one request of encoded lines, costing ``positions`` per line; its translations,
        in its order, or :class:`DeadlinePassed` after ``timeout`` seconds. Cancelled (its client
        went away): it leaves the queue at once, and its batch stops if nobody else waits for it."""
        if self.closing:
            raise _shutting_down()
        if len(self.queue) >= self.max_queue:
            self.stats["rejected_full"] += 1
            raise QueueFull(
                f"the queue is full ({len(self.queue)} requests waiting, --max-queue {self.max_queue}); retry later"
            )
        cost = sum(positions)
        if self.in_flight and self.in_flight + cost > self.max_positions_in_flight:
            self.stats["rejected_busy"] += 1
            raise Busy(
                f"the service is busy: {self.in_flight} decoder positions in flight and this request's {cost} would "
                f"pass --max-positions-in-flight {self.max_positions_in_flight}; retry later"
            )
        self.stats["requests"] += 1
        self.stats["sentences"] += len(sources)
        parts = batches_of(sources, options)
        if not parts:  # only empty lines
            return [""] * len(sources)
        if self._mergeable(options):  # else its parts stay the Translator's batches (its outputs depend on them)
            parts = cut_by_positions(parts, positions, self.max_batch_positions)
        loop = asyncio.get_running_loop()
        request = _Request(
            sources, parts, [sum(positions[i] for i in part) for part in parts], options, loop.create_future()
        )
        self.in_flight += request.left
        request.timer = loop.call_later(timeout, self._expire, request, timeout)
        request.future.add_done_callback(lambda future: self._ended(request))
        self.queue.append(request)
        self._poke()
        return await request.future

    def _expire(self, request: _Request, timeout: float):
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

    def _ended(self, request: _Request):
        """A request answered, refused, expired or cancelled: it leaves the queue, its positions
        leave the count, and its batch stops if nobody else waits for it."""
        if request.timer is not None:
            request.timer.cancel()
        if request in self.queue:
            self.queue.remove(request)
        self.in_flight -= request.left
        request.left = 0
        self._poke()

    # ------------------------------------------------------------------ batching

    @staticmethod
    def _mergeable(options: CallOptions) -> bool:
        """Whether a request may share its batch with others: not with ``max_len_a`` > 0, where
        fairseq's length limit L = a x the batch's padded source width + b makes an output that
        reaches L depend on the other sentences of its batch; its parts alone are exactly the
        batches the Translator makes of its lines."""
        return options.search.max_len_a == 0

    def _may_start(self, request: _Request) -> bool:
        """With two workers or more, one is kept for requests of one batch."""
        return request.one_batch or self.workers == 1 or self.long_running < self.workers - 1

    def _head(self) -> Optional[_Request]:
        """The request a free worker serves next: the oldest it may start; while draining, the
        one with the least work left (so that requests finish rather than all rotating)."""
        order = sorted(self.queue, key=lambda r: r.queued_positions) if self.closing else self.queue
        return next((r for r in order if self._may_start(r)), None)

    def _wait_left(self, head: _Request) -> float:
        """Seconds ``head`` still waits for others to join its batch (``--max-wait-ms``)."""
        if not self._mergeable(head.options) or self.closing:
            return 0.0
        size = sum(r.next_size for r in self.queue if r.key == head.key)
        if size >= self.max_batch:
            return 0.0
        return self.max_wait - (time.monotonic() - head.arrived)

    def _take(self, head: _Request) -> List[_Request]:
        """``head`` and the later waiting requests of the same options whose next part fits in
        its batch (sentences and positions); they leave the queue."""
        taken, size, positions = [head], head.next_size, head.part_positions[0]
        if self._mergeable(head.options):
            for request in self.queue:
                if (
                    request is not head
                    and request.key == head.key
                    and request.one_batch == head.one_batch
                    and size + request.next_size <= self.max_batch
                    and positions + request.part_positions[0] <= self.max_batch_positions
                ):
                    taken.append(request)
                    size += request.next_size
                    positions += request.part_positions[0]
        for request in taken:
            self.queue.remove(request)
        return taken

    async def _next_batch(self) -> List[_Request]:
        while True:
            self._wake.clear()
            head = self._head() if self.queue and len(self.running) < self.workers and not self.closed else None
            if head is not None:
                wait = self._wait_left(head)
                if wait <= 0:
                    return self._take(head)
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

    async def _translate_batch(self, batch: List[_Request], long: bool):
        loop = asyncio.get_running_loop()
        parts = [request.parts.popleft() for request in batch]
        costs = [request.part_positions.popleft() for request in batch]
        sources = [request.sources[i] for request, part in zip(batch, parts) for i in part]
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(sources))

        def nobody_waits() -> bool:  # asked by the worker thread between decoder steps
            return all(request.future.done() for request in batch)

        try:
            out = await loop.run_in_executor(
                self._executor, self.translate_batch, sources, batch[0].options, nobody_waits
            )
        except Stopped:
            self.stats["stopped_batches"] += 1
            if self.metrics is not None:
                self.metrics.stopped.inc()
            return
        except Exception as e:  # noqa: BLE001 - handed to the requests of this batch
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(e)
            return
        finally:
            del self.running[asyncio.current_task()]
            self.long_running -= long
            for request, cost in zip(batch, costs):
                if not request.future.done():
                    request.left -= cost
                    self.in_flight -= cost
            self._poke()
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(sources))
            self.metrics.sentences.inc(len(sources))
            self.metrics.tokens.inc(sum(int(s.size) for s in sources))
        start = 0
        for request, part in zip(batch, parts):  # back by position: each request gets its own lines'
            for i, translation in zip(part, out[start : start + len(part)]):
                request.results[i] = translation
            start += len(part)
            request.translated += len(part)
            if request.future.done():  # cancelled or expired while its batch ran: no further batch
                continue
            if request.parts and self.closed:  # the drain time ran out during this batch
                request.future.set_exception(_shutting_down())
            elif request.parts:
                self.queue.append(request)  # behind the requests that came meanwhile
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

    async def drain(self, seconds: float):
        """Take no new request; translate what is admitted for at most ``seconds`` (the least
        work left first), then answer those left with :class:`ShuttingDown`, which stops their
        batches at the next decoder step."""
        self.closing = True
        self._poke()
        deadline = time.monotonic() + seconds
        while (self.queue or self.running) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.closed = True
        self._reject_all()

    def _reject_all(self):
        for request in [*self.queue, *itertools.chain.from_iterable(self.running.values())]:
            if not request.future.done():
                request.future.set_exception(_shutting_down())
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


BATCHER = web.AppKey("batcher", Batcher) if web is not None else "batcher"  # app[BATCHER]: the service's batcher
SETTINGS = web.AppKey("settings", dict) if web is not None else "settings"  # app[SETTINGS]: checked settings
# a request's id (its X-Request-Id, else a number) and its lines, for its access-log line
REQUEST_ID = web.RequestKey("id", str) if web is not None else "id"
REQUEST_LINES = web.RequestKey("lines", int) if web is not None else "lines"


def _json(body, status: int = 200, **headers):
    """A JSON answer in UTF-8 (translations unescaped)."""
    return web.json_response(
        body, status=status, headers=headers or None, dumps=lambda value: json.dumps(value, ensure_ascii=False)
    )


def _error(status: int, message: str, **headers):
    return _json({"error": message}, status, **headers)


def line_break_in(lines: List[str]) -> Optional[int]:
    """The index of the first line holding a line break (a request is one sentence per string:
    a break inside one would be translated as one sentence and come back cut)."""
    return next((i for i, line in enumerate(lines) if "\n" in line or "\r" in line), None)


def make_app(translator: Translator, **settings):
    """The aiohttp application of the service; ``settings``: :data:`hrt_runtime.options.SERVICE`'s
    (but ``port``), each checked, the others their defaults. Run it with handler cancellation on
    (:func:`runner_of`): a client that goes away then cancels its request."""
    unknown = sorted(set(settings) - {o.name for o in SERVICE if o.name != "port"})
    if unknown:
        raise TypeError(f"unknown setting {', '.join(map(repr, unknown))} of hrt-serve")
    s = {o.name: o.check(settings[o.name]) if o.name in settings else o.default for o in SERVICE if o.name != "port"}
    if s["max_request_positions"] > s["max_positions_in_flight"]:
        raise ValueError(
            f"--max-request-positions {s['max_request_positions']} > --max-positions-in-flight "
            f"{s['max_positions_in_flight']}: a request the first admits, the second could never take"
        )
    batcher = Batcher(
        translator,
        max_batch=s["max_batch"],
        max_wait_ms=s["max_wait_ms"],
        max_queue=s["max_queue"],
        workers=s["workers"],
        max_batch_positions=s["max_batch_positions"],
        max_positions_in_flight=s["max_positions_in_flight"],
    )
    metrics = batcher.metrics = Metrics(batcher) if prometheus_client is not None else None
    timeout_option = Option(
        "timeout", float, None, 0.001, s["request_timeout"], "seconds to the request's deadline", optional=True
    )
    config = translator.model.config
    ids = itertools.count(1)

    def prepare(lines: List[str], name: str):
        """A request's lines repaired and encoded, warnings naming it and its own line numbers."""
        return translator.encode_lines(list(repair_lines(lines, name=name)), name=name)

    def count(outcome: str, seconds: float):
        """The one count of a POST /translate's outcome: /info's counters and /metrics' series."""
        if outcome == "abandoned":
            batcher.stats["abandoned"] += 1
        if metrics is not None:
            metrics.requests.labels(outcome if outcome in OUTCOMES else "500").inc()
            metrics.latency.observe(seconds)

    @web.middleware
    async def observe(request, handler):
        """One access-log line per request; the outcome and latency of POST /translate; every
        error aiohttp raises itself (404, 405, a body above the limit) answered as JSON."""
        start = time.monotonic()
        given = request.headers.get("X-Request-Id", "")
        # the caller's id if it is one short printable word (it goes into a log line as it is)
        request[REQUEST_ID] = (
            given if 0 < len(given) <= 64 and given.isprintable() and " " not in given else str(next(ids))
        )
        request[REQUEST_LINES] = 0
        status = "500"
        try:
            try:
                response = await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                response = _error(e.status, e.reason if e.status != 413 else _too_large(request), **_kept(e))
            status = str(response.status)
            return response
        except asyncio.CancelledError:
            status = "abandoned"
            raise
        finally:
            seconds = time.monotonic() - start
            if request.path == "/translate" and request.method == "POST":
                count(status, seconds)
            access_log.info(
                "request %s: %s %s, %d lines, %s, %.1f ms",
                request[REQUEST_ID],
                request.method,
                request.path,
                request[REQUEST_LINES],
                status,
                1000 * seconds,
            )

    def _too_large(request) -> str:
        given = request.content_length
        return (
            f"the body is {'' if given is None else f'{given} bytes, '}more than {MAX_BODY_BYTES} bytes "
            f"({MAX_BODY_BYTES // 2**20} MiB); split the request"
        )

    def _kept(e) -> dict:
        return {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}

    async def translate(request):
        try:
            data = await asyncio.wait_for(request.read(), timeout=s["body_timeout"])
        except asyncio.TimeoutError:
            return _error(408, f"the body did not arrive within {s['body_timeout']:g} s (--body-timeout)")
        except ConnectionError:  # the client went away while sending it: as a hang-up later (abandoned)
            raise asyncio.CancelledError from None
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return _error(400, 'the body must be JSON: {"text": ["a sentence", ...], "beam": 5, ...}')
        except RecursionError:
            return _error(400, "the body's JSON is nested too deep")
        if not isinstance(body, dict) or "text" not in body:
            return _error(400, 'the body must be a JSON object with "text": a list of strings')
        text = body["text"]
        if isinstance(text, str):
            text = [text]
        if not isinstance(text, list) or not all(isinstance(line, str) for line in text):
            return _error(400, '"text" must be a list of strings (one sentence each)')
        request[REQUEST_LINES] = len(text)
        if len(text) > s["max_request_lines"]:
            return _error(
                413,
                f"{len(text)} lines in one request; at most {s['max_request_lines']} (--max-request-lines): split it",
            )
        broken = line_break_in(text)
        if broken is not None:
            return _error(
                400,
                f'"text" line {broken + 1} holds a line break; send one sentence per string (its translation is '
                "one string)",
            )
        unknown = sorted(set(body) - {"text", *REQUEST_OPTIONS})
        if unknown:
            return _error(400, f"unknown option {', '.join(map(repr, unknown))}; options: {', '.join(REQUEST_OPTIONS)}")
        try:
            timeout = timeout_option.check(body.get("timeout"))
            options = translator.options(
                batch_size=batcher.max_batch,
                max_tokens=s["max_batch_tokens"],
                **{k: v for k, v in body.items() if k not in ("text", "timeout")},
            )
        except (TypeError, ValueError) as e:
            return _error(400, str(e))
        if not text:
            return _json({"translations": []})
        # encoding a large request takes a while: in a thread, so that the loop keeps answering
        sources = await asyncio.get_running_loop().run_in_executor(
            None, prepare, text, f"request {request[REQUEST_ID]}"
        )
        tokens = sum(int(x.size) for x in sources if x is not None)
        if tokens > s["max_request_tokens"]:
            return _error(
                413,
                f"{tokens} source tokens in one request; at most {s['max_request_tokens']} (--max-request-tokens): "
                "split it",
            )
        positions = translator.positions(sources, options)
        if sum(positions) > s["max_request_positions"]:
            return _error(
                413,
                f"this request may cost {sum(positions)} decoder positions (lines x beam x the length limit its "
                f"options allow); at most {s['max_request_positions']} (--max-request-positions): send fewer lines, "
                "a smaller beam or a lower max_len_b",
            )
        try:
            translations = await batcher.translate(
                sources, options, positions, s["request_timeout"] if timeout is None else timeout
            )
        except Refused as e:
            return _error(503, str(e), **{"Retry-After": "1"})
        except DeadlinePassed as e:
            return _error(504, str(e))
        except ValueError as e:  # an option that only the batch's lengths refuse (min_len > max_len)
            return _error(400, str(e))
        return _json({"translations": translations})

    async def health(request):
        if batcher.closing:
            return _json({"status": "draining", "queued": len(batcher.queue)}, 503)
        return _json({"status": "ok", "queued": len(batcher.queue)})

    async def info(request):
        return _json(
            {
                "folder": os.path.abspath(translator.model.folder),
                "kind": config["kind"],
                "trained_chunk_sizes": config["trained_chunk_sizes"],
                "max_source_positions": config["max_source_positions"],
                "max_target_positions": config["max_target_positions"],
                "vocab_size": config["vocab_size"],
                "parameters_sha256": config.get("parameters_sha256"),
                "int8": bool(config.get("int8")),
                "options": list(REQUEST_OPTIONS),
                "batching": {name: value for name, value in s.items()},
                "stats": {**batcher.stats, "positions_in_flight": batcher.in_flight},
            }
        )

    async def scrape(request):
        if metrics is None:
            return _error(501, "GET /metrics needs prometheus_client: pip install './runtime[serve]'")
        return web.Response(body=metrics.text(), headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    async def on_startup(app):
        batcher.start()

    async def on_shutdown(app):  # the sites are closed: what is left may still be translated
        await batcher.drain(s["drain_seconds"])

    async def on_cleanup(app):
        await batcher.stop()

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[observe])
    app[BATCHER] = batcher
    app[SETTINGS] = s
    app.router.add_post("/translate", translate)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", scrape)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def runner_of(app):
    """The application's runner: handler cancellation on (a client that goes away cancels its
    request), connections idle (or sending their headers) for ``--idle-timeout`` closed, and a
    short wait for handlers at shutdown (the drain has answered every admitted request before)."""
    settings = app[SETTINGS]
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=settings["idle_timeout"],
        shutdown_timeout=5.0,
    )


async def serve(app, host: str, port: int, announce) -> None:
    """Bind, then ``announce(port)`` (the port it really has), then serve until SIGTERM or
    SIGINT; then drain while still listening (``/health`` 503, new requests 503), and stop. A
    bind error is raised as ``OSError`` before anything is announced."""
    runner = runner_of(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except (OSError, OverflowError) as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    announce(site._server.sockets[0].getsockname()[1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        await app[BATCHER].drain(app[SETTINGS]["drain_seconds"])
    finally:
        await runner.cleanup()


def cli_main(argv=None):
    p = command_parser(
        "hrt-serve",
        "Serve a folder written by fairseq-hrt-export over HTTP: "
        'POST /translate {"text": [...], options}, GET /health, GET /info, GET /metrics. Needs onnxruntime, '
        "numpy, sentencepiece, aiohttp and prometheus_client (pip install './runtime[serve]'); no PyTorch.",
        (*SERVICE, THREADS),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    access_log.setLevel(logging.INFO)
    missing = [name for name, module in (("aiohttp", web), ("prometheus_client", prometheus_client)) if module is None]
    if missing:
        p.exit(2, f"hrt-serve: error: the service needs {' and '.join(missing)}: pip install './runtime[serve]'\n")
    try:
        values = check_arguments(a, (*SERVICE, THREADS))
        translator = Translator(a.folder, threads=values["threads"])
        app = make_app(translator, **{o.name: values[o.name] for o in SERVICE if o.name != "port"})
    except (ValueError, FileNotFoundError, TypeError) as e:
        p.exit(2, f"hrt-serve: error: {e}\n")

    def announce(port: int):
        print(
            f"hrt-serve: {translator.model.config['kind']} model {a.folder} on http://{a.host}:{port} "
            f"(POST /translate, GET /health, GET /info, GET /metrics)",
            flush=True,
        )

    try:
        asyncio.run(serve(app, a.host, values["port"], announce))
    except OSError as e:
        print(f"hrt-serve: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
