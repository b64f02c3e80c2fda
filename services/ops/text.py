"""How the tools write durations and small dicts as text (the same in `stats` and `top`)."""

from __future__ import annotations

from collections.abc import Mapping

from mmlane.common.sockets import CURVE_REFUSED
from mmlane.protocol.messages import Stats


def latency_text(seconds: float) -> str:
    """A latency at a useful precision: '0.42 ms', '12.3 ms', '1.25 s'."""
    if seconds < 0.01:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def ms_text(seconds: float) -> str:
    """A latency as a bare number of milliseconds, for columns headed 'ms': '0.27', '12.5',
    '1540'."""
    milliseconds = seconds * 1e3
    if milliseconds < 10:
        return f"{milliseconds:.2f}"
    if milliseconds < 1000:
        return f"{milliseconds:.1f}"
    return f"{milliseconds:.0f}"


def uptime_text(seconds: float) -> str:
    """'42s', '12m03s', '3h07m'."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def counts_text(counts: Mapping[str, int]) -> str:
    """'arrivals 0, running 2'; '-' when empty."""
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items())) or "-"


def errors_text(stats: Stats) -> str:
    """The errors by code, then the HTTP API's refusals, then the peers refused at the CURVE
    handshake: 'timeout 1; http refused model_not_found 2; curve refused 5'; '-' when there
    are none."""
    parts = [counts_text(stats.errors)] if stats.errors else []
    if stats.http_refused:
        parts.append(f"http refused {counts_text(stats.http_refused)}")
    if stats.counters.get(CURVE_REFUSED):
        parts.append(f"curve refused {stats.counters[CURVE_REFUSED]}")
    return "; ".join(parts) or "-"


def state_text(state: str, restarts: int) -> str:
    """'serving', or 'serving (restarted 2x)' for a process that `mmlane serve` restarted, or
    'restarting (restart 2)' for a role that serve restarts (see `Child.down_until`), then
    'starting (restart 2)' while it loads."""
    if state == "restarting" or (state == "starting" and restarts):
        return f"{state} (restart {restarts})"
    return f"{state} (restarted {restarts}x)" if restarts else state
