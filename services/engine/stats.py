"""What the engine measures about its scheduling, kept as plain attributes.

Nothing publishes these yet: the stats socket (a later issue) reads `SchedulingStats` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bounds of the histogram buckets, in seconds; one more bucket holds everything above.
BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Histogram:
    """How many observations fell at or below each bound (the last count: above every bound)."""

    bounds: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    count: int = 0
    total: float = 0.0
    largest: float = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), -1)
        self.counts[index] += 1
        self.count += 1
        self.total += value
        self.largest = max(self.largest, value)

    def summary_ms(self) -> dict[str, float]:
        """Count, mean and largest value, in milliseconds (for a log line)."""
        mean = self.total / self.count if self.count else 0.0
        return {"n": self.count, "mean": round(mean * 1e3, 2), "max": round(self.largest * 1e3, 2)}


def _by(*names: str) -> dict[str, Histogram]:
    return {name: Histogram() for name in names}


@dataclass
class SchedulingStats:
    """Unit times by unit kind, and how long requests waited for their first unit, by kind."""

    unit_seconds: dict[str, Histogram] = field(
        default_factory=lambda: _by("vision", "prefill", "decode")
    )
    """Wall time of each unit of work, by kind."""
    queue_wait_seconds: dict[str, Histogram] = field(default_factory=lambda: _by("text", "image"))
    """From the engine's receipt of a request to the start of its first unit, by request kind."""

    def summary_ms(self) -> dict[str, dict[str, dict[str, float]]]:
        return {
            "unit": {kind: h.summary_ms() for kind, h in self.unit_seconds.items()},
            "queue_wait": {kind: h.summary_ms() for kind, h in self.queue_wait_seconds.items()},
        }
