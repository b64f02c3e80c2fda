"""Percentiles, and the CPU time each process has used (read from /proc)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from bench.results import Latency


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest-rank rule on sorted values; values not empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def latency(seconds: Sequence[float]) -> Latency:
    """Percentiles in milliseconds of durations given in seconds (all null when none)."""
    if not seconds:
        return Latency(n=0)
    ms = [value * 1000 for value in seconds]
    return Latency(
        n=len(ms), p50_ms=percentile(ms, 50), p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99), mean_ms=sum(ms) / len(ms), max_ms=max(ms),
    )


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds() -> float | None:
    """CPU seconds every CPU of the machine has spent busy (not idle, not waiting for I/O) since
    boot; None when unknown (not Linux)."""
    try:
        with open("/proc/stat", "rb") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / _CLOCK_TICKS  # guest time is inside user time


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of every thread of process `pid` so far; None when unknown
    (the process is gone, or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # After the ")" that ends the command name: state is field 3, utime 14 and stime 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
