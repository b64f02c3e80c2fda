"""Which requests' unit runs next on the runner's thread, and which work is whose.

The runner's work is in two lanes:

    interactive  the prefill chunks of text-only requests, and every request's decode steps:
                 the units of the runner's own thread, which the scheduler picks
    bulk         the prefill chunks of requests with images: the units of the bulk lane's
                 thread, in arrival order, beside the runner's (runner.py), as images' vision
                 passes run on the vision lane's (vision_lane.py)

So a text request waits for no image's unit: only for the interactive unit under way, which
`--max-unit-ms` bounds while other interactive work is held (budget.py). The bulk and vision
lanes' threads run `--image-nice` steps below the runner's, so where cores are shared text
gets one first, and image work the rest.

Among the interactive requests, one that has not run yet goes first (a new text request waits
for no decode step), then the one that advanced least recently (round robin over decode steps and
the chunks of long text prompts). When that one is decoding, the decode steps of up to `max_batch`
decoding requests, least recently advanced first, run together as one unit (one batched forward
pass). A prefill unit is the first request's; the other requests in their prefill come after
it, in the same order, up to `max_batch` in all: the runner may fill what the unit's budget
leaves with their chunks (runner.py). The scheduler only chooses whose unit runs next: a
request's own units always run in order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from services.engine.hf.sequence import Sequence


class Lane(enum.Enum):
    INTERACTIVE = "interactive"
    BULK = "bulk"


def pick(sequences: Iterable[Sequence], *, max_batch: int = 1) -> list[Sequence] | None:
    """The interactive requests whose next unit runs now; None when there is no work. A decode
    batch, or a prefill unit's request and the others in their prefill after it; `max_batch`
    at most."""
    # New requests (last_run -1) first, then round robin.
    waiting = sorted(sequences, key=lambda seq: (seq.last_run, seq.handle))
    if not waiting:
        return None
    decoding = waiting[0].decoding
    return [seq for seq in waiting if seq.decoding is decoding][:max_batch]


def lane_of(seq: Sequence) -> Lane:
    """An image request's prompt work is bulk; everything else is interactive."""
    if seq.request.mm_items and not seq.decoding:
        return Lane.BULK
    return Lane.INTERACTIVE
