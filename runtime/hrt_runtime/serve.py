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

Scheduling at the decoder pass (continuous batching, as Orca's and vLLM's): requests wait in one
queue; the oldest whose next batch fits beside the batches in progress, with fewer than
``--workers`` batches of its kind (short, long) in progress, starts with every later
waiting request of the same options, up to ``--max-batch`` sentences and
``--max-batch-positions`` positions, waiting at most ``--max-wait-ms`` (default 0) after the
oldest arrived for more to come (Triton's dynamic batching). Up to ``--max-running-batches``
batches are in progress, each in a thread; their searches take turns at every decoder pass,
``--workers`` passes at once, the batch with the least work left first
(:mod:`hrt_runtime.service.turns`): a long request slows only itself. The batches in progress
hold at most ``--workers x --max-batch-positions`` positions and a quarter batch more for short
batches; a line that alone may cost more than a batch holds is refused (413). Translations
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
too deep 400, unknown paths 404, requests aiohttp's HTTP parser refuses 400: all as JSON. A body
is parsed, checked and tokenised off the event loop, big bodies in a bounded pool of their own
(:mod:`hrt_runtime.service.intake`); at most ``--max-connections`` connections are open, one
more is answered 503 (:mod:`hrt_runtime.service.listener`).

**Draining.** At SIGTERM (or SIGINT) the service keeps listening but takes no new request
(503, and ``/health`` 503 so that a load balancer sees it), translates what it has for at most
``--drain-seconds``, the request with the least work left first (so that requests finish instead
of all rotating to nothing), then answers the rest 503, stops the batches running and exits.

* ``GET /metrics``: the Prometheus text format (``prometheus_client``): requests by outcome,
  request latency and batch size histograms, queue depth, positions in flight, batches stopped,
  sentences and source tokens translated. ``/info``'s counters are the same numbers. Every request
  also gets one access-log line (id, lines, status, milliseconds).

The parts are in :mod:`hrt_runtime.service` (a request's body, admission, batching, the workers,
the metrics, the handlers); this module puts them together (:func:`make_app`) and runs them.
"""

import asyncio
import logging
import signal
import sys

from hrt_runtime.errors import Refused, RefusedType
from hrt_runtime.options import SERVICE, THREADS, check_arguments, command_parser
from hrt_runtime.service.batcher import Batcher
from hrt_runtime.service.body import MAX_BODY_BYTES
from hrt_runtime.service.handlers import Handlers, access_log
from hrt_runtime.service.listener import ServiceSite
from hrt_runtime.service.metrics import Metrics, prometheus_client
from hrt_runtime.translator import Translator

try:  # the serve extra (pip install "./runtime[serve]"); cli_main says how to install what is missing
    from aiohttp import web
except ImportError:
    web = None

BATCHER = web.AppKey("batcher", Batcher) if web is not None else "batcher"  # app[BATCHER]: the service's batcher
SETTINGS = web.AppKey("settings", dict) if web is not None else "settings"  # app[SETTINGS]: checked settings
HANDLERS = web.AppKey("handlers", Handlers) if web is not None else "handlers"  # app[HANDLERS]: its handlers


def checked_settings(settings: dict) -> dict:
    """``settings`` (:data:`hrt_runtime.options.SERVICE`'s, but ``port``) each checked, the
    others their defaults; refused in one message each."""
    names = {o.name for o in SERVICE if o.name != "port"}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise RefusedType(f"unknown setting {', '.join(map(repr, unknown))} of hrt-serve")
    s = {o.name: o.check(settings[o.name]) if o.name in settings else o.default for o in SERVICE if o.name in names}
    if s["max_request_positions"] > s["max_positions_in_flight"]:
        raise Refused(
            f"--max-request-positions {s['max_request_positions']} > --max-positions-in-flight "
            f"{s['max_positions_in_flight']}: a request the first admits, the second could never take"
        )
    return s


def make_app(translator: Translator, **settings):
    """The aiohttp application of the service; ``settings``: :func:`checked_settings`'. Run it
    with handler cancellation on (:func:`runner_of`): a client that goes away then cancels its
    request."""
    s = checked_settings(settings)
    batcher = Batcher(
        translator,
        max_batch=s["max_batch"],
        max_wait_ms=s["max_wait_ms"],
        max_queue=s["max_queue"],
        workers=s["workers"],
        max_batch_positions=s["max_batch_positions"],
        max_positions_in_flight=s["max_positions_in_flight"],
        max_client_share=s["max_client_share"],
        max_running_batches=s["max_running_batches"],
    )
    if prometheus_client is not None:
        batcher.metrics = Metrics(batcher.max_batch, lambda: len(batcher.queue), lambda: batcher.in_flight)
    handlers = Handlers(translator, batcher, batcher.metrics, s)

    async def on_startup(app):
        batcher.start()

    async def on_shutdown(app):  # the sites are closed: what is left may still be translated
        await batcher.drain(s["drain_seconds"], handlers.in_progress)

    async def on_cleanup(app):
        await batcher.stop()
        handlers.intake.stop()

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[handlers.middleware()])
    app[BATCHER] = batcher
    app[SETTINGS] = s
    app[HANDLERS] = handlers
    app.router.add_post("/translate", handlers.translate)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/info", handlers.info)
    app.router.add_get("/metrics", handlers.scrape)
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


def site_of(runner, host: str, port: int) -> ServiceSite:
    """The service's listener on ``host:port`` for a runner set up (:func:`runner_of`): at most
    ``--max-connections`` connections, parser errors as JSON (:mod:`.service.listener`)."""
    settings = runner.app[SETTINGS]
    return ServiceSite(runner, host, port, settings["max_connections"], settings["idle_timeout"])


async def serve(app, host: str, port: int, announce) -> None:
    """Bind, then ``announce(port)`` (the port it really has), then serve until SIGTERM or
    SIGINT; then drain while still listening (``/health`` 503, new requests 503; requests still
    arriving, as a slow client's, are waited for too), and stop. A bind error is raised as
    ``OSError`` before anything is announced."""
    runner = runner_of(app)
    await runner.setup()
    site = site_of(runner, host, port)
    try:
        await site.start()
    except (OSError, OverflowError) as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    announce(site.bound_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        await app[BATCHER].drain(app[SETTINGS]["drain_seconds"], app[HANDLERS].in_progress)
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
    except Refused as e:  # the runtime's refusals only: any other exception is a bug and keeps its traceback
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
