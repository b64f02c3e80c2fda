"""Lane latencies for `mmlane top`: each histogram summed over the processes of its role, over
the last window (the difference of each process's two latest snapshots) and since start.

Summing bucket counts and then taking `quantile` gives the quantiles of all the observations
together, which averaging each process's quantiles would not.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmlane.common.stats import quantile
from mmlane.ops.feed import ProcessSnapshots, process_order
from mmlane.protocol.messages import HistogramSnapshot, Stats

# Lanes in the order a request meets them; a histogram not named here comes after these.
LANE_ORDER = (
    "tokenize", "fetch", "decode", "process", "mm_job", "queue_wait", "engine_step", "first_token",
    "end_to_end",
)
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Lane:
    """One histogram name of one role, its bucket counts summed over that role's processes."""

    role: str
    name: str
    bounds: tuple[float, ...]
    since_start: list[int]
    last_window: list[int] | None = None
    """None while no process has two snapshots of one run to compare."""

    def add(self, counts: list[int], window: list[int] | None) -> None:
        self.since_start = _sum(self.since_start, counts)
        if window is not None:
            self.last_window = _sum(self.last_window or [0] * len(window), window)

    def quantiles(self, counts: list[int]) -> list[float]:
        """p50, p90 and p99 of `counts` (either of this lane's count lists)."""
        return [quantile(self.bounds, counts, q) for q in QUANTILES]


def lanes(processes: list[ProcessSnapshots], now: float) -> list[Lane]:
    """Every histogram of every process that has sent a snapshot, summed per role and name.
    Only fresh processes count in the last window: a stale one has no recent window."""
    by_key: dict[tuple[str, str, tuple[float, ...]], Lane] = {}
    for process in processes:
        if process.latest is None:
            continue
        window = process.window() if process.fresh(now) else None
        for name, histogram in process.latest.histograms.items():
            key = (process.role, name, tuple(histogram.bounds))
            lane = by_key.setdefault(key, Lane(*key, since_start=[0] * len(histogram.counts)))
            lane.add(histogram.counts, _window_counts(window, name, histogram))
    return sorted(by_key.values(), key=_lane_order)


def _window_counts(
    window: tuple[Stats, Stats] | None, name: str, histogram: HistogramSnapshot
) -> list[int] | None:
    """What histogram `name` counted between the window's two snapshots."""
    if window is None:
        return None
    before = window[0].histograms.get(name)
    if before is None:  # first observed inside the window
        return list(histogram.counts)
    if before.bounds != histogram.bounds:
        return None
    return [after - earlier for after, earlier in zip(histogram.counts, before.counts, strict=True)]


def _lane_order(lane: Lane) -> tuple[int, tuple[int, str, str], str]:
    base = lane.name.partition(":")[0]
    rank = LANE_ORDER.index(base) if base in LANE_ORDER else len(LANE_ORDER)
    return rank, process_order(lane.role, ""), lane.name


def _sum(left: list[int], right: list[int]) -> list[int]:
    return [a + b for a, b in zip(left, right, strict=True)]
