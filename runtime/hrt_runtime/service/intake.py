"""A ``POST /translate`` body turned into a request's work off the event loop: its JSON parsed,
its lines and options checked, then its lines tokenised, counting tokens as they come so that a
body above ``--max-request-tokens`` is refused once the count passes it, not after the whole
body. Small bodies go to a pool of their own, so that they never wait behind big ones; big ones
to a bounded pool that takes at most :data:`BIG_BODIES` at once (then 503), their JSON parsed in
a process of its own (:mod:`.parse`: CPython's ``json`` would hold the event loop meanwhile)."""

import asyncio
import concurrent.futures
import multiprocessing
import threading
from typing import Dict, List, NamedTuple, Optional

import numpy as np

from hrt_runtime.call_options import CallOptions
from hrt_runtime.options import Option
from hrt_runtime.service import body as request_body
from hrt_runtime.service import parse
from hrt_runtime.service.body import BadRequest
from hrt_runtime.service.memory import trim_heap
from hrt_runtime.text_input import LineWarnings, repair_lines
from hrt_runtime.translator import Translator

# a body up to this size is parsed and tokenised in a moment: the small pool
SMALL_BODY_BYTES = 64 * 1024
# threads tokenising big bodies, and big bodies taken at once (more: 503), so that a few big
# bodies neither hold every CPU nor queue without end
BIG_THREADS = 2
BIG_BODIES = 2 * BIG_THREADS


class Work(NamedTuple):
    """What a body asks for: its lines, options, ``"timeout"`` and the lines' source ids."""

    text: List[str]
    options: CallOptions
    timeout: Optional[float]
    sources: List[Optional[np.ndarray]]


class Intake:
    """Bodies made into :class:`Work` in two pools (small and big bodies). :attr:`prepare` is
    what a pool's thread runs on a body; a test replaces it to hold a body there."""

    def __init__(self, translator: Translator, settings: Dict, timeout: Option, max_batch: int):
        self.translator, self.settings, self.timeout, self.max_batch = translator, settings, timeout, max_batch
        self.small = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hrt-serve-small-body")
        self.big = concurrent.futures.ThreadPoolExecutor(BIG_THREADS, thread_name_prefix="hrt-serve-big-body")
        self.big_bodies = 0  # big bodies in the big pool (running or waiting for a thread)
        self._parser: Optional[concurrent.futures.ProcessPoolExecutor] = None  # started at the first big body
        self._parser_lock = threading.Lock()  # the big pool's threads start it once
        self.prepare = self._prepare

    async def work_of(self, data: bytes, name: str) -> Work:
        """The body's work, made in a pool thread; :class:`.body.BadRequest` when the body is
        refused, or 503 when :data:`BIG_BODIES` big bodies are being read already."""
        loop = asyncio.get_running_loop()
        if len(data) <= SMALL_BODY_BYTES:
            return await asyncio.wrap_future(self.small.submit(self.prepare, data, name))
        if self.big_bodies >= BIG_BODIES:
            raise BadRequest(
                503,
                f"{self.big_bodies} bodies above {SMALL_BODY_BYTES // 1024} KiB are being read already; retry later "
                "or send smaller requests",
                {"Retry-After": "1"},
            )
        self.big_bodies += 1
        future = self.big.submit(self._prepare_big, data, name)
        # counted until its thread is done, even when its client has gone away meanwhile
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._big_done))
        return await asyncio.wrap_future(future)

    def _big_done(self):
        self.big_bodies -= 1

    def _prepare_big(self, data: bytes, name: str) -> Work:
        try:
            return self.prepare(data, name)
        except BadRequest as e:  # a fresh one: the frames that hold the body's text and pieces go
            refusal = BadRequest(e.status, e.message, e.headers)
        trim_heap()  # what they held, back to the system
        raise refusal

    def _prepare(self, data: bytes, name: str) -> Work:
        s = self.settings
        if len(data) <= SMALL_BODY_BYTES:
            body = parse.checked_body(data, s["max_request_lines"], request_body.REQUEST_OPTIONS)
        else:
            body = self._parsed_apart(data)
        text = body["text"]
        options, timeout = request_body.options_of(
            body, self.translator, self.timeout, self.max_batch, s["max_batch_tokens"]
        )
        return Work(text, options, timeout, self.encode(text, name))

    def _parsed_apart(self, data: bytes) -> Dict:
        """A big body parsed and checked in the parsing process (started again if it died)."""
        with self._parser_lock:
            if self._parser is None:
                # spawned, not forked: a fork of a process running ONNX Runtime's threads may hang
                context = multiprocessing.get_context("spawn")
                self._parser = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
            parser = self._parser
        args = (data, self.settings["max_request_lines"], request_body.REQUEST_OPTIONS)
        try:
            return parser.submit(parse.checked_body, *args).result()
        except concurrent.futures.process.BrokenProcessPool:
            with self._parser_lock:
                if self._parser is parser:
                    self._parser = None
            raise BadRequest(503, "the body's parser stopped; retry later", {"Retry-After": "1"}) from None

    def encode(self, text: List[str], name: str) -> List[Optional[np.ndarray]]:
        """``Translator.encode_lines`` of the repaired lines (the same ids and warnings), but
        refused (413) as soon as the tokens counted pass ``--max-request-tokens``."""
        cap = self.settings["max_request_tokens"]
        warnings = LineWarnings(name, what="truncated")
        sources: List[Optional[np.ndarray]] = []
        tokens = 0
        for i, line in enumerate(repair_lines(text, name=name)):
            source = self.translator.encode(line, warnings, i + 1) if line.strip() else None
            sources.append(source)
            tokens += 0 if source is None else int(source.size)
            if tokens > cap:
                raise BadRequest(
                    413,
                    f"at least {tokens} source tokens in one request (in its first {i + 1} of {len(text)} lines); "
                    f"at most {cap} (--max-request-tokens): split it",
                )
        warnings.finish(len(text))
        return sources

    def stop(self):
        self.small.shutdown(wait=False, cancel_futures=True)
        self.big.shutdown(wait=False, cancel_futures=True)
        if self._parser is not None:
            self._parser.shutdown(wait=False, cancel_futures=True)
