"""Which waiting requests start next as one batch (Triton's dynamic batching: the oldest request
that fits beside the batches in progress and every later one of the same options that fits
with it), and how a batch's translations go back to its requests. Pure functions of the queue:
the batcher (:mod:`.batcher`) owns the queue, the batches in progress and the clock."""

import time
from typing import Callable, Iterable, List, Optional, Sequence

from hrt_runtime.call_options import CallOptions
from hrt_runtime.service.admitted import Admitted


def mergeable(options: CallOptions) -> bool:
    """Whether a request may share its batch with others: not with ``max_len_a`` > 0, where
    fairseq's length limit L = a x the batch's padded source width + b makes an output that
    reaches L depend on the other sentences of its batch; its parts alone are exactly the
    batches the Translator makes of its lines."""
    return options.search.max_len_a == 0


def head_of(
    queue: Iterable[Admitted], may_start: Callable[[Admitted], bool], least_work_first: bool
) -> Optional[Admitted]:
    """The request whose next part starts next: the oldest that may start (its part fits beside
    the batches in progress); while draining (``least_work_first``), the one with the least work
    left (so that requests finish rather than all rotating)."""
    order = sorted(queue, key=lambda r: r.queued_positions) if least_work_first else queue
    return next((r for r in order if may_start(r)), None)


def room(cost: int, in_progress: Optional[int], workers: int, max_batch_positions: int, short_batch: int) -> int:
    """The positions a batch whose first part costs ``cost`` may hold if it starts now beside
    batches in progress of ``in_progress`` positions (``None``: none in progress, anything
    fits); 0: it may not start. The batches in progress hold at most ``workers x
    max_batch_positions``, and ``short_batch`` more for batches of at most ``short_batch``."""
    if in_progress is None:
        return max_batch_positions
    left = workers * max_batch_positions - in_progress
    if cost > left and cost <= short_batch:
        left = min(short_batch, left + short_batch)
    return min(left, max_batch_positions) if cost <= left else 0


def may_start(cost: int, in_progress: Iterable[int], short_batch: int, workers: int) -> bool:
    """Whether a batch of ``cost`` that fits starts beside the batches in progress (their
    positions): fewer than ``workers`` of them are of its kind (short: at most ``short_batch``
    positions; long: more). Short work so starts at once beside long work, whose turns it takes
    first; beside short work it waits for a batch to end, and the requests that came meanwhile
    then share one batch (a larger batch does more work a pass than several small ones taking
    turns)."""
    short = cost <= short_batch
    return sum(1 for positions in in_progress if (positions <= short_batch) == short) < workers


def wait_left(queue: Iterable[Admitted], head: Admitted, max_batch: int, max_wait: float) -> float:
    """Seconds ``head`` still waits for others to join its batch (``--max-wait-ms``): none once
    the requests of its options fill a batch."""
    size = sum(r.next_size for r in queue if r.key == head.key)
    if size >= max_batch:
        return 0.0
    return max_wait - (time.monotonic() - head.arrived)


def take(queue, head: Admitted, max_batch: int, max_positions: int) -> List[Admitted]:
    """``head`` and the later waiting requests of the same options whose next part fits in
    its batch (``max_batch`` sentences, ``max_positions`` positions); they leave ``queue``."""
    taken, size, positions = [head], head.next_size, head.part_positions[0]
    if mergeable(head.options):
        for request in queue:
            if (
                request is not head
                and request.key == head.key
                and size + request.next_size <= max_batch
                and positions + request.part_positions[0] <= max_positions
            ):
                taken.append(request)
                size += request.next_size
                positions += request.part_positions[0]
    for request in taken:
        queue.remove(request)
    return taken


def hand_back(batch: Sequence[Admitted], parts: Sequence[List[int]], translations: Sequence[str]) -> None:
    """A batch's translations to its requests by position: each request gets its own lines'."""
    start = 0
    for request, part in zip(batch, parts):
        for i, translation in zip(part, translations[start : start + len(part)]):
            request.results[i] = translation
        start += len(part)
        request.translated += len(part)
