"""The stats feed every watching tool shares: SUB sockets in, the last snapshots per process out.

One SUB socket per stats endpoint (not one socket connected to all), so each snapshot is known
by the address it came from, and a process that sends nothing can still be named. The feed keeps
each process's two latest snapshots: their difference is "the last window" (rates, windowed
latency quantiles), and the arrival time of the latest says whether the process still publishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import zmq

from mmlane.ops.discovery import Targets, connect, endpoint_label
from mmlane.protocol.messages import Stats

log = logging.getLogger(__name__)

ROLE_ORDER = ("frontend", "mm-worker", "engine")
# A process is stale once its last snapshot is older than this many of its publishing intervals
# (as it says, or as measured between its last two snapshots), and never sooner than MIN_STALE_S.
STALE_INTERVALS = 3
MIN_STALE_S = 3.0
# How often a long-running tool looks for new socket files under the run directory.
RESCAN_S = 2.0


def process_order(role: str, name: str) -> tuple[int, str, str]:
    """Sort key: processes in pipeline order (frontend, MM worker, engine), then by name."""
    rank = ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)
    return rank, role, name


@dataclass
class ProcessSnapshots:
    """What one stats socket has sent: its two latest snapshots and when the latest arrived."""

    endpoint: str
    latest: Stats | None = None
    previous: Stats | None = None
    received_at: float = 0.0
    """`time.monotonic()` when `latest` arrived."""
    received: int = 0

    def add(self, stats: Stats, now: float) -> None:
        self.previous, self.latest, self.received_at = self.latest, stats, now
        self.received += 1

    @property
    def role(self) -> str:
        return self.latest.role if self.latest else ""

    @property
    def name(self) -> str:
        """The name the process gives itself, or the one its socket file suggests."""
        return self.latest.name if self.latest else endpoint_label(self.endpoint)

    def window(self) -> tuple[Stats, Stats] | None:
        """(previous, latest) when both come from the same run of the process, so that every
        count in latest minus previous is what happened in between; None otherwise."""
        before, after = self.previous, self.latest
        if before is None or after is None or before.pid != after.pid:
            return None
        return (before, after) if after.uptime_s > before.uptime_s else None

    def fresh(self, now: float) -> bool:
        """Whether the process still publishes (see STALE_INTERVALS)."""
        return self.latest is not None and now - self.received_at <= self._stale_after()

    def _stale_after(self) -> float:
        window = self.window()
        interval = window[1].time - window[0].time if window else 0.0
        if self.latest is not None and self.latest.interval_s:
            interval = self.latest.interval_s
        return max(STALE_INTERVALS * interval, MIN_STALE_S)


class StatsFeed:
    """Subscribes to every stats socket of `targets` and files what arrives (not thread-safe)."""

    def __init__(self, targets: Targets) -> None:
        self.targets = targets
        self.processes: dict[str, ProcessSnapshots] = {}
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._endpoints: dict[zmq.Socket, str] = {}
        self._decoder = msgspec.msgpack.Decoder(Stats)
        self._followed_at = time.monotonic()
        self.follow()

    def __enter__(self) -> StatsFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    def follow(self) -> None:
        """Subscribe to endpoints not watched yet (a process started since, under the run dir)."""
        self._followed_at = time.monotonic()
        for endpoint in self.targets.endpoints():
            if endpoint not in self.processes:
                self._subscribe(endpoint)

    def ordered(self) -> list[ProcessSnapshots]:
        """Every watched process, in pipeline order."""
        return sorted(self.processes.values(), key=lambda p: process_order(p.role, p.name))

    def silent(self) -> list[ProcessSnapshots]:
        """The processes that have sent nothing yet."""
        return [process for process in self.ordered() if process.latest is None]

    def receive(self, timeout_s: float) -> list[Stats]:
        """Wait up to `timeout_s` for snapshots, file all that came, and return them."""
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        arrived: list[Stats] = []
        for sock in ready:
            arrived.extend(self._drain(sock, time.monotonic()))
        return arrived

    def receive_for(self, seconds: float) -> list[Stats]:
        """`receive` for `seconds` in all, following new sockets under the run dir meanwhile."""
        deadline = time.monotonic() + seconds
        arrived: list[Stats] = []
        while (remaining := deadline - time.monotonic()) > 0:
            if self.targets.discovering and time.monotonic() - self._followed_at > RESCAN_S:
                self.follow()
            arrived.extend(self.receive(min(remaining, RESCAN_S)))
        return arrived

    def wait_for(self, snapshots: int, timeout_s: float) -> None:
        """Receive until every process has sent `snapshots` snapshots, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while any(p.received < snapshots for p in self.processes.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.receive(remaining)

    def _subscribe(self, endpoint: str) -> None:
        sock = connect(self._ctx, zmq.SUB, endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._poller.register(sock, zmq.POLLIN)
        self._endpoints[sock] = endpoint
        self.processes[endpoint] = ProcessSnapshots(endpoint)

    def _drain(self, sock: zmq.Socket, now: float) -> list[Stats]:
        """Every snapshot waiting on `sock`, oldest first, filed under its endpoint."""
        process = self.processes[self._endpoints[sock]]
        arrived: list[Stats] = []
        while True:
            try:
                body = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return arrived
            try:
                stats = self._decoder.decode(body)
            except msgspec.DecodeError as exc:  # a newer or foreign publisher: skip, go on
                log.warning("unreadable snapshot from %s: %s", process.endpoint, exc)
                continue
            process.add(stats, now)
            arrived.append(stats)
