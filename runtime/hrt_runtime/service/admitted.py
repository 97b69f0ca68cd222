"""One admitted ``POST /translate`` request as the batcher holds it, and the exceptions that end a
request without its translations."""

import asyncio
import collections
import time
from typing import Deque, List, Optional

from hrt_runtime.call_options import CallOptions


class Unavailable(Exception):
    """A request the service does not take now (503 with ``Retry-After``)."""


class QueueFull(Unavailable):
    pass


class Busy(Unavailable):
    pass


class ShuttingDown(Unavailable):
    pass


class OverShare(Unavailable):
    """A client that already holds its share of the positions in flight (``--max-client-share``)."""


class CannotFinish(Exception):
    """A request whose worst case could not finish before its deadline at the service's measured
    pace: 413 when it could not even on an idle service, else 503 (the work ahead of it)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class DeadlinePassed(Exception):
    """A request whose deadline passed before its translations were all made (504)."""


def shutting_down() -> ShuttingDown:
    return ShuttingDown("the service is shutting down; retry on another instance")


class Admitted:
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
        "deadline",
        "left",
        "timer",
        "translated",
        "client",
    )

    def __init__(self, sources, parts, part_positions, options: CallOptions, future: asyncio.Future):
        self.sources, self.options, self.key, self.future = sources, options, options, future
        self.parts: Deque[List[int]] = collections.deque(parts)
        self.part_positions: Deque[int] = collections.deque(part_positions)
        self.results = [""] * len(sources)
        self.arrived = time.monotonic()
        self.deadline = float("inf")  # time.monotonic() of its deadline
        self.left = sum(part_positions)
        self.timer: Optional[asyncio.TimerHandle] = None
        self.translated = 0
        self.client: Optional[str] = None  # whose share of the positions in flight it holds

    @property
    def next_size(self) -> int:
        return len(self.parts[0])

    @property
    def queued_positions(self) -> int:
        return sum(self.part_positions)
