"""The HTTP side of ``hrt-serve``: ``POST /translate``, ``GET /health``, ``GET /info``,
``GET /metrics``, and the middleware that logs every request in one line, counts the outcome
of each ``POST /translate`` and answers aiohttp's own errors as JSON."""

import asyncio
import itertools
import json
import logging
import os
import time
from typing import Dict, Optional

from hrt_runtime.errors import Refused
from hrt_runtime.integrity import FolderChanged
from hrt_runtime.service import body as request_body
from hrt_runtime.service.admitted import CannotFinish, DeadlinePassed, Unavailable
from hrt_runtime.service.batcher import Batcher
from hrt_runtime.service.body import MAX_BODY_BYTES, REQUEST_OPTIONS, BadRequest
from hrt_runtime.service.intake import Intake
from hrt_runtime.service.metrics import Metrics, prometheus_client
from hrt_runtime.translator import Translator

try:  # the serve extra; hrt_runtime.serve's cli_main says how to install it
    from aiohttp import web
except ImportError:
    web = None

# one line per request, under the name the service always logged it with (docs/deploy.md)
access_log = logging.getLogger("hrt_runtime.serve.access")

# a request's id (its X-Request-Id, else a number) and its lines, for its access-log line
REQUEST_ID = web.RequestKey("id", str) if web is not None else "id"
REQUEST_LINES = web.RequestKey("lines", int) if web is not None else "lines"


def json_answer(body, status: int = 200, **headers):
    """A JSON answer in UTF-8 (translations unescaped)."""
    return web.json_response(
        body, status=status, headers=headers or None, dumps=lambda value: json.dumps(value, ensure_ascii=False)
    )


def error_answer(status: int, message: str, **headers):
    return json_answer({"error": message}, status, **headers)


def request_id(given: str, ids) -> str:
    """The caller's ``X-Request-Id`` if it is one short printable word (it goes into a log line
    as it is), else the next of ``ids``."""
    return given if 0 < len(given) <= 64 and given.isprintable() and " " not in given else str(next(ids))


def _too_large(request) -> str:
    given = request.content_length
    return (
        f"the body is {'' if given is None else f'{given} bytes, '}more than {MAX_BODY_BYTES} bytes "
        f"({MAX_BODY_BYTES // 2**20} MiB); split the request"
    )


def _kept(e) -> dict:
    return {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}


class Handlers:
    """The service's handlers over one translator, its batcher, its series (``None``: no
    ``prometheus_client``) and its checked settings."""

    def __init__(self, translator: Translator, batcher: Batcher, metrics: Optional[Metrics], settings: Dict):
        self.translator, self.batcher, self.metrics, self.settings = translator, batcher, metrics, settings
        self.timeout = request_body.timeout_option(settings["request_timeout"])
        self.ids = itertools.count(1)
        self.intake = Intake(translator, settings, self.timeout, batcher.max_batch)
        self.arriving = 0  # POST /translate requests not yet admitted or refused (a drain waits for them)

    def in_progress(self) -> int:
        return self.arriving

    def middleware(self):
        @web.middleware
        async def observe(request, handler):
            return await self.observe(request, handler)

        return observe

    def count(self, outcome: str, seconds: float):
        """The one count of a POST /translate's outcome: /info's counters and /metrics' series."""
        if outcome == "abandoned":
            self.batcher.stats["abandoned"] += 1
        if self.metrics is not None:
            self.metrics.count(outcome, seconds)

    async def observe(self, request, handler):
        """One access-log line per request; the outcome and latency of POST /translate; every
        error aiohttp raises itself (404, 405, a body above the limit) answered as JSON."""
        start = time.monotonic()
        request[REQUEST_ID] = request_id(request.headers.get("X-Request-Id", ""), self.ids)
        request[REQUEST_LINES] = 0
        status = "500"
        try:
            try:
                response = await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                response = error_answer(e.status, e.reason if e.status != 413 else _too_large(request), **_kept(e))
            status = str(response.status)
            return response
        except asyncio.CancelledError:
            status = "abandoned"
            raise
        finally:
            seconds = time.monotonic() - start
            if request.path == "/translate" and request.method == "POST":
                self.count(status, seconds)
            access_log.info(
                "request %s: %s %s, %d lines, %s, %.1f ms",
                request[REQUEST_ID],
                request.method,
                request.path,
                request[REQUEST_LINES],
                status,
                1000 * seconds,
            )

    async def _read(self, request) -> bytes:
        """The body, within ``--body-timeout``."""
        seconds = self.settings["body_timeout"]
        try:
            return await asyncio.wait_for(request.read(), timeout=seconds)
        except asyncio.TimeoutError:
            raise BadRequest(408, f"the body did not arrive within {seconds:g} s (--body-timeout)") from None
        except ConnectionError:  # the client went away while sending it: as a hang-up later (abandoned)
            raise asyncio.CancelledError from None

    async def translate(self, request):
        self.arriving += 1
        try:
            return await self._translate(request)
        except BadRequest as e:
            return error_answer(e.status, e.message, **e.headers)
        finally:
            self.arriving -= 1

    async def _translate(self, request):
        s = self.settings
        # the body parsed, checked and tokenised in the intake's pools: the loop keeps answering
        text, options, timeout, sources = await self.intake.work_of(
            await self._read(request), f"request {request[REQUEST_ID]}"
        )
        request[REQUEST_LINES] = len(text)
        if not text:
            return json_answer({"translations": []})
        positions = self.translator.positions(sources, options)
        request_body.check_positions(positions, s["max_request_positions"])
        try:
            translations = await self.batcher.translate(
                sources, options, positions, s["request_timeout"] if timeout is None else timeout, request.remote
            )
        except Unavailable as e:
            return error_answer(503, str(e), **{"Retry-After": "1"})
        except CannotFinish as e:  # 413: never within its timeout; 503: not behind the work admitted now
            return error_answer(e.status, str(e), **({"Retry-After": "1"} if e.status == 503 else {}))
        except DeadlinePassed as e:
            return error_answer(504, str(e))
        except FolderChanged as e:  # the served folder written over in place: no mixed model, ever
            logging.getLogger(__name__).error("%s", e)
            return error_answer(503, str(e))
        except Refused as e:  # an option that only the batch's lengths refuse (min_len > max_len)
            return error_answer(400, str(e))
        return json_answer({"translations": translations})

    async def health(self, request):
        if self.batcher.closing:
            return json_answer({"status": "draining", "queued": len(self.batcher.queue)}, 503)
        return json_answer({"status": "ok", "queued": len(self.batcher.queue)})

    async def info(self, request):
        config = self.translator.model.config
        return json_answer(
            {
                # the folder's name, not the server's path; the hash says which model it is
                "folder": os.path.basename(os.path.normpath(self.translator.model.folder)),
                "kind": config["kind"],
                "trained_chunk_sizes": config["trained_chunk_sizes"],
                "max_source_positions": config["max_source_positions"],
                "max_target_positions": config["max_target_positions"],
                "vocab_size": config["vocab_size"],
                "parameters_sha256": config.get("parameters_sha256"),
                "int8": bool(config.get("int8")),
                "options": list(REQUEST_OPTIONS),
                "batching": dict(self.settings),
                "stats": {
                    **self.batcher.stats,
                    "positions_in_flight": self.batcher.in_flight,
                    "batches_running": len(self.batcher.running),
                    "positions_running": self.batcher.running_positions,
                },
            }
        )

    async def scrape(self, request):
        if self.metrics is None:
            return error_answer(501, "GET /metrics needs prometheus_client: pip install './runtime[serve]'")
        return web.Response(body=self.metrics.text(), headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})
