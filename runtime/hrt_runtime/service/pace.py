"""What ``hrt-serve`` knows of its own pace, for admission: the decoder positions (as admitted:
each batch's worst case) one worker finishes a second, measured on its finished batches at each
scale, and the batches its deadlines stopped unfinished. Work that cannot finish by its deadline
is refused at once rather than run and thrown away (:meth:`Pace.refusal`)."""

import collections
from typing import Deque, Dict, List, Optional, Tuple

from hrt_runtime.service.admitted import CannotFinish

# the newest batch's weight in a measured pace: a few batches follow a change of load, one odd
# batch does not decide alone
PACE_WEIGHT = 0.25
# a pace is read for work within this many powers of two of the batches it was measured on: a
# batch's fixed cost weighs more the shorter it is, so a pace measured on short batches would
# refuse long work that runs several times faster a position
PACE_SCALE_BITS = 2
# the last batches stopped unfinished that admission remembers
STOPPED_KEPT = 16


class Pace:
    """``paces``: an exponentially weighted average of the positions a second of the finished
    batches of each scale (the bit length of their positions); ``unfinished``: the last batches
    stopped before they finished, as (positions, seconds run)."""

    def __init__(self):
        self.paces: Dict[int, float] = {}
        self.unfinished: Deque[Tuple[int, float]] = collections.deque(maxlen=STOPPED_KEPT)

    def measured(self, positions: int, seconds: float) -> None:
        """A batch of ``positions`` finished in ``seconds`` on one worker: the pace of its scale
        follows it."""
        if seconds <= 0 or positions <= 0:
            return
        pace, scale = positions / seconds, positions.bit_length()
        old = self.paces.get(scale)
        self.paces[scale] = pace if old is None else (1 - PACE_WEIGHT) * old + PACE_WEIGHT * pace

    def stopped(self, positions: int, seconds: float) -> None:
        """A batch of ``positions`` was stopped unfinished after ``seconds``: as much work with no
        longer a deadline cannot finish at this load either."""
        self.unfinished.append((positions, seconds))

    def pace_for(self, cost: int) -> Optional[float]:
        """The measured pace of the batches of the scale nearest ``cost``'s, within
        :data:`PACE_SCALE_BITS` (a larger one first); ``None``: none measured."""
        scale = cost.bit_length()
        near = [s for s in self.paces if abs(s - scale) <= PACE_SCALE_BITS]
        return self.paces[min(near, key=lambda s: (abs(s - scale), -s))] if near else None

    def alone(self, part_costs: List[int]) -> Optional[float]:
        """Seconds work of batches of ``part_costs`` needs on one worker at the measured paces of
        their scales (``None``: a scale not measured yet)."""
        paces = [self.pace_for(part) for part in part_costs]
        if None in paces:
            return None
        return sum(part / pace for part, pace in zip(part_costs, paces))

    def refusal(self, part_costs: List[int], timeout: float, ahead: int, workers: int) -> Optional[CannotFinish]:
        """Why work of batches of ``part_costs`` cannot finish within ``timeout`` (``None``: it
        may), so that it is refused rather than run and thrown away:
        a batch as large as one that was stopped unfinished after as long; or, at the pace
        measured at the scale of each of its batches, alone ``sum(part / pace)`` on one worker,
        behind the positions in flight that the passes serve first (``ahead``: those of no more
        work left), shared by the workers, ``(ahead + cost) / (pace x workers)`` (the pace of its
        largest batch). Work of a scale not measured yet is let in."""
        cost, largest = sum(part_costs), max(part_costs, default=0)
        for positions, seconds in self.unfinished:
            if largest >= positions and timeout <= seconds:
                return CannotFinish(
                    503,
                    f"this request may cost {cost} decoder positions; a batch of {positions} was stopped unfinished "
                    f"after {seconds:.3g} s, and its timeout is {timeout:g} s; retry later or ask for less work",
                )
        alone = self.alone(part_costs)
        if not part_costs or alone is None:
            return None
        pace = self.pace_for(largest)
        need = max(alone, (ahead + cost) / (pace * workers))
        if need <= timeout:
            return None
        figures = (
            f"this request may cost {cost} decoder positions; at the service's measured pace of {pace:.0f} "
            f"positions a second per worker"
        )
        if alone > timeout:
            return CannotFinish(
                413,
                f"{figures} it would need {alone:.3g} s even on an idle service, past its timeout of {timeout:g} s; "
                'ask for less work (fewer lines, a smaller beam or max_len_b) or a longer "timeout" '
                "(at most --request-timeout)",
            )
        return CannotFinish(
            503,
            f"{figures}, behind the {ahead} positions in flight served before it, it would need {need:.3g} s, past its "
            f"timeout of {timeout:g} s; retry later or ask for less work",
        )
