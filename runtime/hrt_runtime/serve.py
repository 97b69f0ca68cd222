"""``hrt-serve FOLDER --port N``: an exported folder as a translation service over HTTP, on
aiohttp (``pip install "./runtime[serve]"``; no PyTorch), for callers that cannot link the runtime.

* ``POST /translate`` with ``{"text": ["line", ...], "beam": 5, ...}`` (any option of
  :meth:`hrt_runtime.Translator.translate` but ``batch_size``) answers ``{"translations":
  [...]}``, one string per line, the strings ``Translator.translate`` gives for those lines;
* ``GET /health`` answers ``{"status": "ok"}`` while the service takes requests;
* ``GET /info``: the model (kind, chunk sizes, positions, the export's parameter digest), the
  batching settings and counters.

Dynamic batching, as Triton's dynamic batcher: requests wait in one queue; the batcher takes the
oldest and, with it, every later waiting request with the same options, up to ``--max-batch``
sentences, waiting at most ``--max-wait-ms`` (default 0) after the oldest arrived for more to
come; requests that arrive while a batch is being translated wait for it and form the next. One
batch is translated at a time, in a worker thread (the event loop keeps answering), and its
translations are handed back to each request by position: a request never gets another's
lines. The queue is bounded (``--max-queue`` requests): a request that finds it full is
answered at once with 503 and ``Retry-After``, never dropped silently. Sentences of a request
may be translated in a batch with other requests' sentences: outputs do not depend on the
batch (see docs/deploy.md), except where ``max_len_a`` > 0 makes the length limit depend on the
batch's width (as in fairseq): such a request is batched alone.

Work per request is bounded and shared fairly: a request holds at most ``--max-request-lines``
lines and ``--max-request-tokens`` source tokens (else 413); it is cut into the batches
``Translator.translate`` would make of it with ``--max-batch`` sentences and
``--max-batch-tokens`` padded source tokens per batch, and a request with parts left goes back
to the end of the queue after each of its batches, so other requests' batches interleave with
a long one's. A client that disconnects
cancels its request (aiohttp's handler cancellation): it is dropped from the queue at once,
and one whose batch is running gets no further batch (counted as ``abandoned``). Repair and
truncation warnings name the request and its own line numbers, the first few one by one.
At SIGTERM the service stops listening, translates what is queued for at most
``--drain-seconds`` (and the batch then running), and answers the rest 503.

* ``GET /metrics``: the Prometheus text format (``prometheus_client``): requests by outcome,
  request latency and batch size histograms, queue depth, sentences and source tokens
  translated. Every request also gets one access-log line (id, lines, status, milliseconds).
"""

import argparse
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
from typing import Deque, List, Optional

import numpy as np

from hrt_runtime.options import DECODING, SERVICE, SERVICE_BY_NAME, THREADS, add_arguments, check_arguments
from hrt_runtime.text_input import repair_lines
from hrt_runtime.translator import CallOptions, Translator, batches_of

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

# the options a request may set: Translator.translate's, but the batching (the service's own)
REQUEST_OPTIONS = tuple(o.name for o in DECODING if o.name not in ("batch_size", "max_tokens"))
OUTCOMES = ("200", "400", "413", "503", "abandoned", "500")


# after a batch of at least this many source tokens, freed memory goes back to the system
# (malloc_trim: about 1.5 ms on a fragmented 100 MB heap, nothing beside such a batch)
TRIM_AFTER_TOKENS = 4096


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, which gives the heap's free pages back to the system (``None``
    where there is no glibc: nothing to do there)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class _Request:
    """One request in the queue: its encoded lines (``None``: empty), the parts not yet
    translated (lists of line indices, each a batch of its own), its translations so far."""

    __slots__ = ("sources", "parts", "results", "options", "key", "future", "arrived")

    def __init__(self, sources, parts: Deque[List[int]], options: CallOptions, future: asyncio.Future):
        self.sources, self.parts, self.options, self.key, self.future = sources, parts, options, options, future
        self.results = [""] * len(sources)
        self.arrived = time.monotonic()

    @property
    def next_size(self) -> int:
        return len(self.parts[0])


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
        self.sentences = p.Counter("hrt_serve_sentences", "sentences translated", registry=r)
        self.tokens = p.Counter("hrt_serve_source_tokens", "source tokens translated", registry=r)

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class Batcher:
    """Gathers queued requests into batches (see the module's docstring) and translates them
    one batch at a time in a worker thread."""

    def __init__(
        self,
        translator: Translator,
        max_batch: int = SERVICE_BY_NAME["max_batch"].default,
        max_wait_ms: float = SERVICE_BY_NAME["max_wait_ms"].default,
        max_queue: int = SERVICE_BY_NAME["max_queue"].default,
    ):
        self.translator = translator
        self.max_batch = SERVICE_BY_NAME["max_batch"].check(max_batch)
        self.max_wait = SERVICE_BY_NAME["max_wait_ms"].check(max_wait_ms) / 1000.0
        self.max_queue = SERVICE_BY_NAME["max_queue"].check(max_queue)
        self.queue: Deque[_Request] = collections.deque()
        self.stats = {
            "requests": 0,
            "sentences": 0,
            "batches": 0,
            "largest_batch": 0,
            "rejected_full": 0,
            "abandoned": 0,
        }
        self.metrics: Optional[Metrics] = None
        self.busy = False  # a batch is being translated
        self.closing = False  # SIGTERM: no new requests
        self.closed = False  # and, the drain time over, no new batch
        self._arrived: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hrt-serve")

    def start(self):
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def drain(self, seconds: float):
        """Take no new request; wait at most ``seconds`` for the queued ones (and the batch
        running then), then answer those left with :class:`ShuttingDown`."""
        self.closing = True
        deadline = time.monotonic() + seconds
        while (self.queue or self.busy) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.closed = True
        self._reject_queued()

    def _reject_queued(self):
        for request in list(self.queue):
            if not request.future.done():
                request.future.set_exception(ShuttingDown("the service is shutting down; retry on another instance"))
        self.queue.clear()

    async def stop(self):
        self.closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._reject_queued()
        self._executor.shutdown(wait=True)

    async def translate(self, sources: List[Optional[np.ndarray]], options: CallOptions) -> List[str]:
        """Queue one request of encoded lines; its translations, in its order. Cancelled (its
        client went away): it leaves the queue at once."""
        if self.closing:
            raise ShuttingDown("the service is shutting down; retry on another instance")
        if len(self.queue) >= self.max_queue:
            self.stats["rejected_full"] += 1
            raise QueueFull(
                f"the queue is full ({len(self.queue)} requests waiting, --max-queue {self.max_queue}); retry later"
            )
        self.stats["requests"] += 1
        self.stats["sentences"] += len(sources)
        parts = collections.deque(batches_of(sources, options))
        if not parts:  # only empty lines
            return [""] * len(sources)
        request = _Request(sources, parts, options, asyncio.get_running_loop().create_future())
        request.future.add_done_callback(lambda future: self._cancelled(request) if future.cancelled() else None)
        self.queue.append(request)
        self._arrived.set()
        return await request.future

    def _cancelled(self, request: _Request):
        self.stats["abandoned"] += 1
        if request in self.queue:
            self.queue.remove(request)

    @staticmethod
    def _mergeable(request: _Request) -> bool:
        """Whether a request may share its batch with others: not with ``max_len_a`` > 0, where
        fairseq's length limit L = a x the batch's padded source width + b makes an output that
        reaches L depend on the other sentences of its batch; its parts alone are exactly the
        batches the Translator makes of its lines."""
        return request.options.search.max_len_a == 0

    def _batch(self) -> List[_Request]:
        """The oldest waiting request and the later ones of the same options whose next part
        fits; they leave the queue (a request with parts left comes back at its end)."""
        first = self.queue[0]
        taken, size = [first], first.next_size
        if self._mergeable(first):
            for request in itertools.islice(self.queue, 1, None):
                if request.key == first.key and size + request.next_size <= self.max_batch:
                    taken.append(request)
                    size += request.next_size
        for request in taken:
            self.queue.remove(request)
        return taken

    def _ready(self) -> bool:
        first = self.queue[0]
        if not self._mergeable(first):
            return True
        size = sum(r.next_size for r in self.queue if r.key == first.key)
        return size >= self.max_batch or time.monotonic() - first.arrived >= self.max_wait

    async def _run(self):
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self._arrived.clear()
                await self._arrived.wait()
            while self.queue and not self._ready():
                self._arrived.clear()
                wait = self.max_wait - (time.monotonic() - self.queue[0].arrived)
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout=max(wait, 0.0))
                except asyncio.TimeoutError:
                    pass
            if not self.queue:  # its requests were cancelled while it waited
                continue
            batch = self._batch()
            parts = [request.parts.popleft() for request in batch]
            sources = [request.sources[i] for request, part in zip(batch, parts) for i in part]
            self.stats["batches"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(sources))
            self.busy = True
            try:
                out = await loop.run_in_executor(self._executor, self._translate, sources, batch[0].options)
            except Exception as e:  # noqa: BLE001 - handed to the requests of this batch
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(e)
                continue
            finally:
                self.busy = False
            if self.metrics is not None:
                self.metrics.batch_size.observe(len(sources))
                self.metrics.sentences.inc(len(sources))
                self.metrics.tokens.inc(sum(int(s.size) for s in sources))
            start = 0
            for request, part in zip(batch, parts):  # back by position: each request gets its own lines'
                for i, translation in zip(part, out[start : start + len(part)]):
                    request.results[i] = translation
                start += len(part)
                if request.future.done():  # cancelled while its batch ran: no further batch
                    continue
                if request.parts and self.closed:  # the drain time ran out during this batch
                    request.future.set_exception(
                        ShuttingDown("the service is shutting down; retry on another instance")
                    )
                elif request.parts:
                    self.queue.append(request)  # behind the requests that came meanwhile
                else:
                    request.future.set_result(request.results)

    def _translate(self, sources, options: CallOptions) -> List[str]:
        out = self.translator.translate_sources(sources, options, name=None)  # lines of several requests
        if sum(int(s.size) for s in sources) >= TRIM_AFTER_TOKENS:
            trim = _malloc_trim()
            if trim is not None:
                trim(0)
        return out


BATCHER = web.AppKey("batcher", Batcher) if web is not None else "batcher"  # app[BATCHER]: the service's batcher
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


def make_app(
    translator: Translator,
    max_batch: int = SERVICE_BY_NAME["max_batch"].default,
    max_wait_ms: float = SERVICE_BY_NAME["max_wait_ms"].default,
    max_batch_tokens: int = SERVICE_BY_NAME["max_batch_tokens"].default,
    max_queue: int = SERVICE_BY_NAME["max_queue"].default,
    max_request_lines: int = SERVICE_BY_NAME["max_request_lines"].default,
    max_request_tokens: int = SERVICE_BY_NAME["max_request_tokens"].default,
    drain_seconds: float = SERVICE_BY_NAME["drain_seconds"].default,
):
    """The aiohttp application of the service. Run it with handler cancellation on
    (:func:`serve`, or ``web.AppRunner(app, handler_cancellation=True)``): a client that goes
    away then cancels its request."""
    batcher = Batcher(translator, max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue)
    max_batch_tokens = SERVICE_BY_NAME["max_batch_tokens"].check(max_batch_tokens)
    max_request_lines = SERVICE_BY_NAME["max_request_lines"].check(max_request_lines)
    max_request_tokens = SERVICE_BY_NAME["max_request_tokens"].check(max_request_tokens)
    drain_seconds = SERVICE_BY_NAME["drain_seconds"].check(drain_seconds)
    metrics = batcher.metrics = Metrics(batcher) if prometheus_client is not None else None
    config = translator.model.config
    ids = itertools.count(1)

    def prepare(lines: List[str], name: str):
        """A request's lines repaired and encoded, warnings naming it and its own line numbers."""
        return translator.encode_lines(list(repair_lines(lines, name=name)), name=name)

    @web.middleware
    async def observe(request, handler):
        """One access-log line per request; the outcome and latency of POST /translate."""
        start = time.monotonic()
        given = request.headers.get("X-Request-Id", "")
        # the caller's id if it is one short printable word (it goes into a log line as it is)
        request[REQUEST_ID] = (
            given if 0 < len(given) <= 64 and given.isprintable() and " " not in given else str(next(ids))
        )
        request[REQUEST_LINES] = 0
        status = "500"
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        except web.HTTPException as e:
            status = str(e.status)
            raise
        except asyncio.CancelledError:
            status = "abandoned"
            raise
        finally:
            seconds = time.monotonic() - start
            if metrics is not None and request.path == "/translate" and request.method == "POST":
                metrics.requests.labels(status if status in OUTCOMES else "500").inc()
                metrics.latency.observe(seconds)
            access_log.info(
                "request %s: %s %s, %d lines, %s, %.1f ms",
                request[REQUEST_ID],
                request.method,
                request.path,
                request[REQUEST_LINES],
                status,
                1000 * seconds,
            )

    async def translate(request):
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, 'the body must be JSON: {"text": ["a sentence", ...], "beam": 5, ...}')
        if not isinstance(body, dict) or "text" not in body:
            return _error(400, 'the body must be a JSON object with "text": a list of strings')
        text = body["text"]
        if isinstance(text, str):
            text = [text]
        if not isinstance(text, list) or not all(isinstance(line, str) for line in text):
            return _error(400, '"text" must be a list of strings (one sentence each)')
        request[REQUEST_LINES] = len(text)
        if len(text) > max_request_lines:
            return _error(
                413, f"{len(text)} lines in one request; at most {max_request_lines} (--max-request-lines): split it"
            )
        unknown = sorted(set(body) - {"text", *REQUEST_OPTIONS})
        if unknown:
            return _error(400, f"unknown option {', '.join(map(repr, unknown))}; options: {', '.join(REQUEST_OPTIONS)}")
        try:
            options = translator.options(
                batch_size=batcher.max_batch,
                max_tokens=max_batch_tokens,
                **{k: v for k, v in body.items() if k != "text"},
            )
        except (TypeError, ValueError) as e:
            return _error(400, str(e))
        if not text:
            return _json({"translations": []})
        # encoding a large request takes a while: in a thread, so that the loop keeps answering
        sources = await asyncio.get_running_loop().run_in_executor(
            None, prepare, text, f"request {request[REQUEST_ID]}"
        )
        tokens = sum(int(s.size) for s in sources if s is not None)
        if tokens > max_request_tokens:
            return _error(
                413,
                f"{tokens} source tokens in one request; at most {max_request_tokens} (--max-request-tokens): split it",
            )
        try:
            translations = await batcher.translate(sources, options)
        except (QueueFull, ShuttingDown) as e:
            return _error(503, str(e), **{"Retry-After": "1"})
        except ValueError as e:  # an option that only the batch's lengths refuse (min_len > max_len)
            return _error(400, str(e))
        return _json({"translations": translations})

    async def health(request):
        if batcher.closing:
            return _json({"status": "shutting down", "queued": len(batcher.queue)}, 503)
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
                "batching": {
                    "max_batch": batcher.max_batch,
                    "max_wait_ms": batcher.max_wait * 1000.0,
                    "max_batch_tokens": max_batch_tokens,
                    "max_queue": batcher.max_queue,
                    "max_request_lines": max_request_lines,
                    "max_request_tokens": max_request_tokens,
                    "drain_seconds": drain_seconds,
                },
                "stats": dict(batcher.stats),
            }
        )

    async def scrape(request):
        if metrics is None:
            return _error(501, "GET /metrics needs prometheus_client: pip install './runtime[serve]'")
        return web.Response(body=metrics.text(), headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    async def on_startup(app):
        batcher.start()

    async def on_shutdown(app):  # the sites are closed: what is queued may still be translated
        await batcher.drain(drain_seconds)

    async def on_cleanup(app):
        await batcher.stop()

    app = web.Application(client_max_size=16 * 2**20, middlewares=[observe])
    app[BATCHER] = batcher
    app.router.add_post("/translate", translate)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", scrape)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def runner_of(app, drain_seconds: float):
    """The application's runner: handler cancellation on (a client that goes away cancels its
    request), and room at shutdown for the drain and one batch."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_seconds + 30)


async def serve(app, host: str, port: int, drain_seconds: float, announce) -> None:
    """Bind, then ``announce(port)`` (the port it really has), then serve until SIGTERM or
    SIGINT, then drain (``--drain-seconds``) and stop. A bind error is raised as ``OSError``
    before anything is announced."""
    runner = runner_of(app, drain_seconds)
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
    finally:
        await runner.cleanup()


def cli_main(argv=None):
    p = argparse.ArgumentParser(
        prog="hrt-serve",
        description="Serve a folder written by fairseq-hrt-export over HTTP: "
        'POST /translate {"text": [...], options}, GET /health, GET /info, GET /metrics. Needs onnxruntime, '
        "numpy, sentencepiece, aiohttp and prometheus_client (pip install './runtime[serve]'); no PyTorch.",
    )
    p.add_argument("folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    add_arguments(p, (*SERVICE, THREADS))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    access_log.setLevel(logging.INFO)
    missing = [name for name, module in (("aiohttp", web), ("prometheus_client", prometheus_client)) if module is None]
    if missing:
        p.exit(2, f"hrt-serve: error: the service needs {' and '.join(missing)}: pip install './runtime[serve]'\n")
    try:
        values = check_arguments(a, (*SERVICE, THREADS))
        translator = Translator(a.folder, threads=values["threads"])
        settings = {o.name: values[o.name] for o in SERVICE if o.name != "port"}
        app = make_app(translator, **settings)
    except (ValueError, FileNotFoundError, TypeError) as e:
        p.exit(2, f"hrt-serve: error: {e}\n")

    def announce(port: int):
        print(
            f"hrt-serve: {translator.model.config['kind']} model {a.folder} on http://{a.host}:{port} "
            f"(POST /translate, GET /health, GET /info, GET /metrics)",
            flush=True,
        )

    try:
        asyncio.run(serve(app, a.host, values["port"], values["drain_seconds"], announce))
    except OSError as e:
        print(f"hrt-serve: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
