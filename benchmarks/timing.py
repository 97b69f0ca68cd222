"""The one timing loop of the measuring scripts: :func:`time_runs`.

Every script that reports a speed times it here and reads its statistic (the benchmark's
mean, the shortlist sweep's median, ...) from the returned :class:`TimingResult`.
"""

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Mapping, Optional, Tuple, Union


@dataclass(frozen=True)
class TimingResult:
    """Seconds of each timed run (in order) and the last run's return value."""

    seconds: Tuple[float, ...]
    value: Any = field(default=None, compare=False, repr=False)

    @property
    def runs(self) -> int:
        return len(self.seconds)

    @property
    def total(self) -> float:
        return sum(self.seconds)

    @property
    def mean(self) -> float:
        return statistics.mean(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    @property
    def stdev(self) -> float:
        """Sample standard deviation (0.0 for a single run)."""
        return statistics.stdev(self.seconds) if len(self.seconds) > 1 else 0.0


def time_runs(
    fn: Union[Callable[[], Any], Mapping[Hashable, Callable[[], Any]]],
    warmup: int = 0,
    runs: int = 1,
    sync: Optional[Callable[[], None]] = None,
    before_each: Optional[Callable[[Hashable, int], None]] = None,
) -> Union[TimingResult, Dict[Hashable, TimingResult]]:
    """Call ``fn`` ``warmup`` times untimed, then ``runs`` times, each timed with
    :func:`time.perf_counter` (``sync``, e.g. ``torch.cuda.synchronize``, is called right
    before the clock starts and before it stops, so queued GPU work is counted).

    ``fn`` may be a mapping ``{name: callable}``: the runs then go round-robin (run r of every
    callable, then run r + 1; warm-ups likewise), so that a slow patch of a shared machine hits
    all of them alike, and the result is ``{name: TimingResult}``. ``before_each(name, r)`` is
    called (untimed) before each timed run (``name`` is None for a single callable).
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"time_runs: need runs >= 1 and warmup >= 0 (got runs={runs}, warmup={warmup})")
    single = callable(fn)
    fns = {None: fn} if single else dict(fn)
    for _ in range(warmup):
        for f in fns.values():
            f()
    seconds: Dict[Hashable, list] = {name: [] for name in fns}
    values: Dict[Hashable, Any] = {}
    for r in range(runs):
        for name, f in fns.items():
            if before_each is not None:
                before_each(name, r)
            if sync is not None:
                sync()
            start = time.perf_counter()
            values[name] = f()
            if sync is not None:
                sync()
            seconds[name].append(time.perf_counter() - start)
    results = {name: TimingResult(tuple(seconds[name]), values[name]) for name in fns}
    return results[None] if single else results
