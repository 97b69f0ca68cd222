"""The listening side of ``hrt-serve``: a TCP site with a connection limit (``--max-connections``;
a connection beyond it is answered 503 and closed), HTTP parser errors answered as JSON in one
log line, a client that half-closes after a whole request still answered, and asyncio's
accept() errors at the file limit logged once a minute instead of once per refused accept."""

import asyncio
import json
import logging
import os
import resource
import socket
import time
from typing import Optional

try:  # the serve extra; hrt_runtime.serve's cli_main says how to install it
    from aiohttp import web
except ImportError:
    web = None

logger = logging.getLogger("hrt_runtime.serve")
access_log = logging.getLogger("hrt_runtime.serve.access")

# files kept free beside the connections and the files open at start (the model's, the logs): for
# the sockets of refused connections, and the files the libraries open later
FILE_MARGIN = 64
# how long a refused connection may stay open after its 503 (the client reads it, then closes)
REFUSED_LINGER_SECONDS = 1.0
# asyncio logs every accept() refused at the file limit: at most one such line per this many seconds
ACCEPT_ERROR_EVERY_SECONDS = 60.0
# after a client's end-of-file during its request, when to look whether the client is gone (its
# system reset the connection) or only stopped sending
GONE_PROBES_SECONDS = (0.05, 0.25, 1.0, 4.0)
# an answer a client must accept and may ignore before the real one (RFC 9110, 15.2)
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\n"
FILE_LIMIT_ADVICE = "raise the file limit (ulimit -n, or LimitNOFILE= in a systemd unit) or lower --max-connections"


def file_limit() -> Optional[int]:
    """The process's open-file limit (soft), ``None`` where it has none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def files_open() -> int:
    """The files this process has open now (0 where the system does not list them)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_limit(asked: int) -> int:
    """``--max-connections``, lowered with a warning to fit under the file limit, less the files
    open now and :data:`FILE_MARGIN`, so that the service answers 503 before accept() fails for
    want of a file."""
    limit = file_limit()
    kept = files_open() + FILE_MARGIN
    if limit is None or asked <= limit - kept:
        return asked
    fitted = max(1, limit - kept)
    logger.warning(
        "--max-connections %d does not fit the file limit of %d (ulimit -n) less %d files open or kept: "
        "%d connections at most; %s",
        asked,
        limit,
        kept,
        fitted,
        FILE_LIMIT_ADVICE,
    )
    return fitted


def _raw_json(status: int, reason: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(data)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


class Refused(asyncio.Protocol):
    """A connection beyond the limit: answered 503 at once, then closed when the client closes
    or after :data:`REFUSED_LINGER_SECONDS` (closing before the client's request is read would
    reset the connection and lose the answer); at once when half of :data:`FILE_MARGIN` such
    connections linger already, so that a flood of them does not take the files kept free."""

    def __init__(self, site: "ServiceSite"):
        self.site = site
        self.timer = None

    def connection_made(self, transport):
        self.site.lingering += 1
        message = f"the service has {self.site.max_connections} connections open (--max-connections); retry later"
        transport.write(_raw_json(503, "Service Unavailable", {"error": message}))
        if self.site.lingering > FILE_MARGIN // 2:
            transport.close()
        else:
            self.timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_SECONDS, transport.close)

    def data_received(self, data):  # the request is not read: it was answered already
        pass

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        self.site.lingering -= 1
        if self.timer is not None:
            self.timer.cancel()


if web is not None:

    class Connection(web.RequestHandler):
        """aiohttp's connection handler, with the service's answers where aiohttp's own are text:
        a request its parser refuses (a negative Content-Length, a header above 8 KiB, both
        Content-Length and Transfer-Encoding) gets JSON and one log line, not a traceback; and a
        client that half-closes after a whole request is still answered."""

        def __init__(self, site: "ServiceSite", *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.site = site

        def handle_error(self, request, status=500, exc=None, message=None):
            if status >= 500:  # a bug of the service: aiohttp's answer and its traceback
                return super().handle_error(request, status, exc, message)
            if request.writer.output_size > 0:
                raise ConnectionError("the answer had begun when the request was found malformed")
            text = message or getattr(exc, "message", None) or str(exc)
            access_log.info("request -: malformed HTTP from %s, %d: %s", request.remote, status, text)
            response = web.json_response({"error": f"malformed HTTP request: {text}"}, status=status)
            response.force_close()
            return response

        def eof_received(self):
            """A client's end of file during its request is a half-close (it only stopped sending:
            it is answered, then the connection closes) or a hang-up: an interim 100 answer tells
            them apart, as a client gone resets the connection then (its request is then stopped
            and counted abandoned, as aiohttp does at once). Without a request, it closes now."""
            idle = self._waiter is not None and not self._messages  # waiting for a next request
            if not self._request_count or idle:
                return None
            self.close()
            request = self._current_request
            if request is None or request.writer.output_size == 0:  # the answer not begun yet
                self.transport.write(INTERIM)
                for delay in GONE_PROBES_SECONDS:
                    self._loop.call_later(delay, self._abort_if_gone)
            return True

        def _abort_if_gone(self):
            transport = self.transport
            sock = None if transport is None else transport.get_extra_info("socket")
            if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                transport.abort()  # connection_lost: the handler is cancelled

        def connection_lost(self, exc):
            if self.site is not None:
                self.site.open -= 1
                self.site = None
            super().connection_lost(exc)

    class ServiceSite(web.BaseSite):
        """A TCP site of the runner's application whose connections are :class:`Connection`\\ s,
        at most ``max_connections`` at a time (more: :class:`Refused`)."""

        def __init__(self, runner, host: str, port: int, max_connections: int, idle_timeout: float):
            super().__init__(runner)
            self.host, self.port, self.idle_timeout = host, port, idle_timeout
            self.max_connections = connection_limit(max_connections)
            self.open = 0
            self.refused = 0
            self.lingering = 0  # refused connections not yet closed
            self._accept_error_logged = -ACCEPT_ERROR_EVERY_SECONDS

        @property
        def name(self) -> str:
            return f"http://{self.host}:{self.port}"

        @property
        def bound_port(self) -> int:
            return self._server.sockets[0].getsockname()[1]

        def _connection(self):
            if self.open >= self.max_connections:
                self.refused += 1
                return Refused(self)
            self.open += 1
            return Connection(
                self,
                self._runner.server,
                loop=asyncio.get_running_loop(),
                keepalive_timeout=self.idle_timeout,
                access_log=None,
            )

        async def start(self) -> None:
            await super().start()
            loop = asyncio.get_running_loop()
            previous = loop.get_exception_handler()

            def quieter(loop, context):
                if context.get("message") != "socket.accept() out of system resource":
                    return previous(loop, context) if previous else loop.default_exception_handler(context)
                if time.monotonic() - self._accept_error_logged >= ACCEPT_ERROR_EVERY_SECONDS:
                    self._accept_error_logged = time.monotonic()
                    logger.warning(
                        "accept() failed: %s (%d connections open); %s",
                        context.get("exception"),
                        self.open,
                        FILE_LIMIT_ADVICE,
                    )

            loop.set_exception_handler(quieter)
            self._server = await loop.create_server(self._connection, self.host, self.port)
