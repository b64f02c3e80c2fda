"""Which request's unit runs next.

Today's policy is round-robin: each round, every request in progress advances by one unit, so a
text request waits at most one unit of each image request, never a whole image request. Within
a round the cheapest units go first (decode steps, then short prefills, then vision passes), so
the first token of a text request arriving next to an image does not wait for that image's
encoder pass; ties keep arrival order.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.engine.sequence import Sequence, Unit


def plan_round(sequences: Iterable[Sequence], prefill_chunk_tokens: int | None) -> list[Sequence]:
    """The requests to advance this round, in the order to advance them (one unit each)."""
    return sorted(sequences, key=lambda seq: _cost(seq.next_unit(prefill_chunk_tokens)))


def _cost(unit: Unit) -> tuple[int, int]:
    return (unit.kind, unit.tokens)
