"""Which requests' unit runs next.

Two lanes share the engine's time:

    interactive  the prefill chunks of text-only requests, and every request's decode steps
    bulk         the prefill chunks of requests with images (and handing their images to the
                 vision lane, which runs the passes beside both: runner.py)

While only one lane has work, it runs. While both have, the lane that has had less than its
share of the time runs next: the bulk lane's share is BULK_SHARE, so image work always progresses
(no starvation) and a text request waits at most about one bulk unit at a time, which the
runner bounds by `--max-unit-ms` while interactive work is held (budget.py). Time is measured
per unit (stride scheduling over wall time); a lane that had no work starts even with the other,
never with credit saved while it was idle, and a tie goes to the interactive lane.

Within the interactive lane, a request that has not run yet goes first (a new text request waits
for no decode step), then the one that advanced least recently (round robin over decode steps and
the chunks of long text prompts). When that one is decoding, the decode steps of up to `max_batch`
decoding requests of the lane, least recently advanced first, run together as one unit (one
batched forward pass). Within the bulk lane, requests go in arrival order, so each image
finishes as early as it can. A prefill unit is the first request's; the lane's other requests in
their prefill come after it, in the lane's order, up to `max_batch` in all: the runner may fill
what the unit's budget leaves with their chunks (runner.py). The scheduler only chooses whose
unit runs next: a request's own units always run in order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from services.engine.hf.sequence import Sequence

BULK_SHARE = 0.25
"""The bulk lane's share of the engine's time while both lanes have work."""


class Lane(enum.Enum):
    INTERACTIVE = "interactive"
    BULK = "bulk"


class Scheduler:
    """Picks the request to advance by one unit, and keeps each lane's share of the time."""

    def __init__(self, *, bulk_share: float = BULK_SHARE) -> None:
        if not 0 < bulk_share < 1:
            raise ValueError(f"bulk_share must be in (0, 1), got {bulk_share}")
        self._weight = {Lane.INTERACTIVE: 1 - bulk_share, Lane.BULK: bulk_share}
        self._vtime = {Lane.INTERACTIVE: 0.0, Lane.BULK: 0.0}
        """Each lane's time so far divided by its share: the lane behind runs next."""
        self._active: set[Lane] = set()

    def pick(
        self, sequences: Iterable[Sequence], *, max_batch: int = 1
    ) -> tuple[list[Sequence], Lane] | None:
        """The requests whose next unit runs now, and their lane; None when there is no work.
        A decode batch, or a prefill unit's request and the others in their prefill after it;
        `max_batch` at most."""
        lanes: dict[Lane, list[Sequence]] = {Lane.INTERACTIVE: [], Lane.BULK: []}
        for seq in sequences:
            lanes[lane_of(seq)].append(seq)
        active = {lane for lane, waiting in lanes.items() if waiting}
        if not active:
            self._active = active
            return None
        self._start_even(active - self._active, active & self._active)
        self._active = active
        lane = min(active, key=lambda lane: (self._vtime[lane], lane is Lane.BULK))
        if lane is Lane.BULK:  # arrival order; none is decoding
            return sorted(lanes[lane], key=lambda seq: seq.handle)[:max_batch], lane
        # New requests (last_run -1) first, then round robin.
        waiting = sorted(lanes[lane], key=lambda seq: (seq.last_run, seq.handle))
        decoding = waiting[0].decoding
        return [seq for seq in waiting if seq.decoding is decoding][:max_batch], lane

    def _start_even(self, woken: set[Lane], running: set[Lane]) -> None:
        """A lane that gets work after having none starts even with the running one: neither
        credit nor debt carries over an idle spell."""
        if not woken:
            return
        lanes = running or woken
        start = min(self._vtime[lane] for lane in lanes)
        for lane in woken:
            self._vtime[lane] = start

    def charge(self, lane: Lane, seconds: float) -> None:
        """Account a unit's wall time to its lane."""
        self._vtime[lane] += seconds / self._weight[lane]


def lane_of(seq: Sequence) -> Lane:
    """An image request's prompt work is bulk; everything else is interactive."""
    if seq.request.mm_items and not seq.decoding:
        return Lane.BULK
    return Lane.INTERACTIVE
