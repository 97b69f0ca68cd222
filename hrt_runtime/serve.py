"""``hrt-serve FOLDER --port N``: an exported folder as a translation service over HTTP, on
aiohttp (``pip install .[serve]``; no PyTorch), for callers that cannot link the runtime.

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
answered at once with 503 and ``Retry-After``, never dropped silently. A client that
disconnects while it waits is skipped (or its answer dropped); the others are not affected.
Sentences of a request may be translated in a batch with other requests' sentences: outputs do
not depend on the batch (see docs/deploy.md), except where ``max_len_a`` > 0 makes the length
limit depend on the batch's width (as in fairseq): such a request is batched alone.
"""

import argparse
import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import time
from typing import List, Optional

from hrt_runtime.options import DECODING
from hrt_runtime.translator import CallOptions, Translator

try:
    from aiohttp import web
except ImportError:  # the optional extra is missing: cli_main says how to install it
    web = None

logger = logging.getLogger(__name__)

# the options a request may set: Translator.translate's, but the batching (the service's own)
REQUEST_OPTIONS = tuple(o.name for o in DECODING if o.name not in ("batch_size", "max_tokens"))


class QueueFull(Exception):
    pass


class _Request:
    __slots__ = ("lines", "options", "key", "future", "arrived")

    def __init__(self, lines: List[str], options: CallOptions, key, future: asyncio.Future):
        self.lines, self.options, self.key, self.future = lines, options, key, future
        self.arrived = time.monotonic()


class Batcher:
    """Gathers queued requests into batches (see the module's docstring) and translates them
    one batch at a time in a worker thread."""

    def __init__(self, translator: Translator, max_batch: int = 64, max_wait_ms: float = 0.0, max_queue: int = 256):
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        self.translator = translator
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait_ms / 1000.0, max_queue
        self.queue: "collections.deque[_Request]" = collections.deque()
        self.stats = {
            "requests": 0,
            "sentences": 0,
            "batches": 0,
            "largest_batch": 0,
            "rejected_full": 0,
            "abandoned": 0,
        }
        self._arrived: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hrt-serve")

    def start(self):
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for request in self.queue:
            if not request.future.done():
                request.future.set_exception(RuntimeError("the service is shutting down"))
        self.queue.clear()
        self._executor.shutdown(wait=True)

    async def translate(self, lines: List[str], options: CallOptions) -> List[str]:
        """Queue one request; its translations, in its order."""
        if len(self.queue) >= self.max_queue:
            self.stats["rejected_full"] += 1
            raise QueueFull(
                f"the queue is full ({len(self.queue)} requests waiting, --max-queue {self.max_queue}); retry later"
            )
        future = asyncio.get_running_loop().create_future()
        self.queue.append(_Request(lines, options, options, future))
        self.stats["requests"] += 1
        self.stats["sentences"] += len(lines)
        self._arrived.set()
        return await future

    @staticmethod
    def _mergeable(request: _Request) -> bool:
        """Whether a request may share its batch with others: not with ``max_len_a`` > 0, where
        fairseq's length limit L = a x the batch's padded source width + b makes an output that
        reaches L depend on the other sentences of its batch; alone it is exactly the
        Translator's answer for its lines."""
        return request.options.search.max_len_a == 0

    def _batch(self) -> List[_Request]:
        """The oldest waiting request and the later ones of the same options that fit."""
        first = self.queue[0]
        if not self._mergeable(first):
            self.queue.popleft()
            return [first]
        taken, size = [], 0
        for request in list(self.queue):
            if request.key != first.key:
                continue
            if taken and size + len(request.lines) > self.max_batch:
                break
            taken.append(request)
            size += len(request.lines)
        for request in taken:
            self.queue.remove(request)
        return taken

    def _ready(self) -> bool:
        first = self.queue[0]
        if not self._mergeable(first):
            return True
        size = sum(len(r.lines) for r in self.queue if r.key == first.key)
        return size >= self.max_batch or time.monotonic() - first.arrived >= self.max_wait

    async def _run(self):
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self._arrived.clear()
                await self._arrived.wait()
            while not self._ready():
                self._arrived.clear()
                wait = self.max_wait - (time.monotonic() - self.queue[0].arrived)
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout=max(wait, 0.0))
                except asyncio.TimeoutError:
                    pass
            batch = [r for r in self._batch() if not r.future.done()]  # a disconnected client's request: skipped
            self.stats["abandoned"] += sum(1 for r in batch if r.future.cancelled())
            if not batch:
                continue
            lines = [line for r in batch for line in r.lines]
            options = batch[0].options
            self.stats["batches"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(lines))
            try:
                out = await loop.run_in_executor(self._executor, self._translate, lines, options)
            except Exception as e:  # noqa: BLE001 - handed to the requests of this batch
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            start = 0
            for r in batch:  # back by position: each request gets its own lines' translations
                if not r.future.done():
                    r.future.set_result(out[start : start + len(r.lines)])
                else:
                    self.stats["abandoned"] += 1
                start += len(r.lines)

    def _translate(self, lines: List[str], options: CallOptions) -> List[str]:
        return self.translator.translate_buffer(lines, options, name="request")


BATCHER = web.AppKey("batcher", Batcher) if web is not None else "batcher"  # app[BATCHER]: the service's batcher


def _json(body, status: int = 200, **headers):
    """A JSON answer in UTF-8 (translations unescaped)."""
    return web.json_response(
        body, status=status, headers=headers or None, dumps=lambda value: json.dumps(value, ensure_ascii=False)
    )


def _error(status: int, message: str, **headers):
    return _json({"error": message}, status, **headers)


def make_app(
    translator: Translator,
    max_batch: int = 64,
    max_wait_ms: float = 0.0,
    max_queue: int = 256,
    max_request_lines: int = 256,
):
    """The aiohttp application of the service (``web.run_app(make_app(...))``)."""
    batcher = Batcher(translator, max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue)
    config = translator.model.config

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
        if len(text) > max_request_lines:
            return _error(
                413, f"{len(text)} lines in one request; at most {max_request_lines} (--max-request-lines): split it"
            )
        unknown = sorted(set(body) - {"text", *REQUEST_OPTIONS})
        if unknown:
            return _error(400, f"unknown option {', '.join(map(repr, unknown))}; options: {', '.join(REQUEST_OPTIONS)}")
        try:
            options = translator.options(batch_size=max_batch, **{k: v for k, v in body.items() if k != "text"})
        except (TypeError, ValueError) as e:
            return _error(400, str(e))
        if not text:
            return _json({"translations": []})
        try:
            translations = await batcher.translate(text, options)
        except QueueFull as e:
            return _error(503, str(e), **{"Retry-After": "1"})
        except ValueError as e:  # an option that only the batch's lengths refuse (min_len > max_len)
            return _error(400, str(e))
        return _json({"translations": translations})

    async def health(request):
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
                    "max_queue": batcher.max_queue,
                    "max_request_lines": max_request_lines,
                },
                "stats": dict(batcher.stats),
            }
        )

    async def on_startup(app):
        batcher.start()

    async def on_cleanup(app):
        await batcher.stop()

    app = web.Application(client_max_size=16 * 2**20)
    app[BATCHER] = batcher
    app.router.add_post("/translate", translate)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def cli_main(argv=None):
    p = argparse.ArgumentParser(
        prog="hrt-serve",
        description="Serve a folder written by fairseq-hrt-export over HTTP: "
        'POST /translate {"text": [...], options}, GET /health, GET /info. Needs onnxruntime, '
        "numpy, sentencepiece and aiohttp (pip install .[serve]); no PyTorch.",
    )
    p.add_argument("folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime's threads per batch")
    p.add_argument("--max-batch", type=int, default=64, help="sentences per batch, at most")
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=0.0,
        help="how long the oldest waiting request waits for others to join its batch (0: none; requests "
        "that arrive while a batch is translated form the next one, which measured best on 2 CPU "
        "cores: benchmarks/results/serve-mini-cpu)",
    )
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting, at most (then 503)")
    p.add_argument("--max-request-lines", type=int, default=256, help="lines in one request, at most (then 413)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    if web is None:
        p.exit(2, "hrt-serve: error: the service needs aiohttp: pip install .[serve] (or pip install aiohttp)\n")
    try:
        translator = Translator(a.folder, threads=a.threads)
        if a.max_request_lines < 1:
            raise ValueError(f"--max-request-lines must be >= 1, got {a.max_request_lines}")
        app = make_app(
            translator,
            max_batch=a.max_batch,
            max_wait_ms=a.max_wait_ms,
            max_queue=a.max_queue,
            max_request_lines=a.max_request_lines,
        )
    except (ValueError, FileNotFoundError, TypeError) as e:
        p.exit(2, f"hrt-serve: error: {e}\n")
    print(
        f"hrt-serve: {translator.model.config['kind']} model {a.folder} on http://{a.host}:{a.port} "
        f"(POST /translate, GET /health, GET /info)",
        flush=True,
    )
    web.run_app(app, host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    cli_main()
