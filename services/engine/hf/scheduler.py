"""Which requests' unit runs next on the runner's model thread.

A request that has not run yet goes first (a new text request waits for no decode step and no
image prompt's chunk), then the one that advanced least recently: round robin over decode
steps and prefill chunks, one chunk a unit, so a text request that arrives waits for one unit
at most. An image request counts as run when its images go to the vision lane, so its prompt's
chunks then take their turns as an old request's. When the one picked is decoding, the decode
steps of up to `max_batch` decoding requests, least recently advanced first, run together as
one unit (one batched forward pass). The scheduler only chooses whose unit runs next: a
request's own units always run in order.
"""

from __future__ import annotations

from collections.abc import Iterable

from mmlane.engine.hf.sequence import Sequence


def pick(sequences: Iterable[Sequence], *, max_batch: int) -> list[Sequence] | None:
    """The requests whose next unit runs now; None when there is no work. A decode batch of up
    to `max_batch`, or one request's prefill chunk."""
    waiting = sorted(sequences, key=lambda seq: (seq.last_run, seq.handle))
    if not waiting:
        return None
    if not waiting[0].decoding:
        return waiting[:1]
    return [seq for seq in waiting if seq.decoding][:max_batch]
