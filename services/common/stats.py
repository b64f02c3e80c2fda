"""What every role measures, and the thread that publishes it and answers pings.

A role fills one `Metrics` from its own threads (counters, error counts, latency histograms,
queue-depth gauges); `StatsServer` runs on its own thread, so it keeps publishing and answering
while the role's main loop is busy (an MM worker in the middle of a 12 MP image):

    stats socket    PUB, bound at `stats_endpoint`: one `Stats` every `stats_interval_s`
    control socket  ROUTER, bound at `control_endpoint`: `Ping` → `Pong`

A histogram takes a short lock per observation (uncontended: well under a microsecond, beside
latencies of a millisecond and more), so its snapshot is consistent and no observation is lost.
Counters do not lock: the snapshot copies each dict in one C-level call (atomic under the GIL);
a counter that two threads bump at once (an error code counted by the engine's input and main
threads) could in a rare race lose an increment, so the frontend's HTTP thread counts its
refusals in a Counter that only it writes (`http_refused`). These numbers are for watching and
alerting, not for accounting.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from mmlane.common import memory
from mmlane.common.sockets import make_socket
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import ControlRequest, HistogramSnapshot, Ping, Pong, Stats

log = logging.getLogger(__name__)

# Upper bounds of the histogram buckets, in seconds; one more bucket holds everything above.
BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)


@dataclass
class Histogram:
    """How many observations fell at or below each bound (the last count: above every bound)."""

    bounds: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    total: float = 0.0
    largest: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), -1)
        with self._lock:  # a fetch's time may be observed on the fetcher's or the FIFO thread
            self.counts[index] += 1
            self.total += value
            self.largest = max(self.largest, value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, total = list(self.counts), self.total
        return HistogramSnapshot(
            bounds=list(self.bounds), counts=counts, total=total,
            p50=quantile(self.bounds, counts, 0.5), p90=quantile(self.bounds, counts, 0.9),
            p99=quantile(self.bounds, counts, 0.99),
        )

    def summary_ms(self) -> dict[str, float]:
        """Count, mean and largest value, in milliseconds (for a log line)."""
        count = self.count
        mean = self.total / count if count else 0.0
        return {"n": count, "mean": round(mean * 1e3, 2), "max": round(self.largest * 1e3, 2)}


def quantile(bounds: list[float] | tuple[float, ...], counts: list[int], q: float) -> float:
    """The q-quantile of bucketed observations, interpolated linearly inside its bucket (as
    Prometheus' histogram_quantile does); the overflow bucket answers its lower bound. 0 when
    there are none. Works on the difference of two snapshots' counts too (a window)."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            if index == len(bounds):
                return float(bounds[-1])
            lower = bounds[index - 1] if index else 0.0
            return lower + (bounds[index] - lower) * (rank - seen) / count
        seen += count
    return float(bounds[-1])


class Metrics:
    """One process's counters, error counts by code, histograms and queue gauges."""

    def __init__(self, role: str, name: str) -> None:
        self.role = role
        self.name = name
        self.started = time.monotonic()
        self.counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.http_refused: Counter[str] = Counter()
        """Requests the HTTP API refused before it submitted them, by code (its thread only)."""
        self.histograms: dict[str, Histogram] = {}
        self.state = "serving"
        self._gauges: dict[str, Callable[[], int]] = {}
        self._counter_sources: list[tuple[Mapping[str, int], str]] = []
        self.in_flight: Callable[[], int] = lambda: 0
        self.epoch: Callable[[], int] = lambda: 0
        self.exposition: Callable[[], str] = lambda: ""
        """Metrics of what the process hosts, in Prometheus' text format (`Stats.exposition`)."""
        self.model = ""
        """The id of the model this process has loaded; "" while none is."""
        self.interval_s = 0.0
        """How often the snapshots are published (set by the StatsServer that publishes them)."""
        self.restarts = 0
        """How often the launcher has restarted this role's process (see `run_role`)."""

    def observe(self, name: str, seconds: float) -> None:
        """Add one latency, in seconds, to histogram `name` ('name:label' for a labelled one)."""
        histogram = self.histograms.get(name)
        if histogram is None:
            histogram = self.histograms.setdefault(name, Histogram())
        histogram.observe(seconds)

    def gauge(self, name: str, read: Callable[[], int]) -> None:
        """Publish `read()` as the depth of queue `name` (called on the stats thread)."""
        self._gauges[name] = read

    def add_counters(self, source: Mapping[str, int], prefix: str = "") -> None:
        """Publish another object's counters (a cache's) beside ours, each name after
        `prefix` (where two objects' counts of the same name are to be told apart; without
        one, they add up: the two lanes' shared-memory writers)."""
        self._counter_sources.append((source, prefix))

    def snapshot(self) -> Stats:
        usage = memory.usage()
        memory.bound_freed_memory(usage)
        counters = {**self.counters, **memory.counters}
        for source, prefix in self._counter_sources:
            for name, count in dict(source).items():  # copied at once: another thread counts
                counters[prefix + name] = counters.get(prefix + name, 0) + count
        return Stats(
            role=self.role, name=self.name, pid=os.getpid(), epoch=self.epoch(),
            uptime_s=time.monotonic() - self.started, time=time.time(), state=self.state,
            in_flight=self.in_flight(),
            queues={name: read() for name, read in dict(self._gauges).items()},
            counters=counters, errors=dict(self.errors),
            histograms={name: h.snapshot() for name, h in dict(self.histograms).items()},
            interval_s=self.interval_s, restarts=self.restarts,
            http_refused=dict(self.http_refused), exposition=self.exposition(),
            memory=usage,
        )

    def pong(self) -> Pong:
        return Pong(role=self.role, name=self.name, pid=os.getpid(), state=self.state,
                    model=self.model, restarts=self.restarts)


FULL_COLLECTIONS: dict[str, int] = {"gc_full_collections": 0, "gc_full_pause_us": 0}
"""This process's full garbage collections (generation 2) since `count_full_collections`, and
the time they took. Python's collector stops the collecting thread, GIL held, for one; it walks
every object the generation holds (after startup: 400 000 in a frontend, 700 000 in an engine
with vLLM, 250-440 ms a walk), unless `run_role` froze them out of it."""
_full_started: list[float] = []


def count_full_collections() -> Mapping[str, int]:
    """Count full collections into FULL_COLLECTIONS from now on (once per process); it."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)
    return FULL_COLLECTIONS


def _on_collection(phase: str, info: dict[str, int]) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _full_started[:] = [time.perf_counter()]
    elif _full_started:
        FULL_COLLECTIONS["gc_full_collections"] += 1
        FULL_COLLECTIONS["gc_full_pause_us"] += int((time.perf_counter() - _full_started[0]) * 1e6)


def log_totals(metrics: Metrics) -> None:
    """Log the counters and latency summaries once, at stop (benchmarks read these lines)."""
    counters = metrics.snapshot().counters
    log.info("counters %s", json.dumps(counters, sort_keys=True))
    log.info("errors %s", json.dumps(dict(metrics.errors), sort_keys=True))
    log.info("latencies (ms) %s", json.dumps(
        {name: h.summary_ms() for name, h in sorted(metrics.histograms.items())}
    ))


_STOP_CHECK_MS = 100
"""How often the stats thread looks at its stop flag while it waits."""


class StatsServer:
    """Publishes `Stats` and answers `Ping` on its own thread (see the module docstring)."""

    def __init__(
        self, metrics: Metrics, *, stats_endpoint: str, control_endpoint: str, interval_s: float
    ) -> None:
        self.metrics = metrics
        self.interval_s = metrics.interval_s = interval_s
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        try:
            self._pub = make_socket(self._ctx, zmq.PUB, stats_endpoint, bind=True, linger_ms=0)
            self._control = make_socket(
                self._ctx, zmq.ROUTER, control_endpoint, bind=True, linger_ms=0
            )
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.stats_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.control_endpoint = self._control.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(
            target=self._run, name=f"{metrics.role}-stats", daemon=True
        )

    def start(self) -> StatsServer:
        self._thread.start()
        log.info("stats on %s every %.1f s, control on %s",
                 self.stats_endpoint, self.interval_s, self.control_endpoint)
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._ctx.destroy(linger=0)
        # A clean stop takes its socket files along, so the tools that search a run dir report
        # only processes that died (a kill -9 leaves them; a restart binds over them).
        for endpoint in (self.stats_endpoint, self.control_endpoint):
            if endpoint.startswith("ipc://"):
                Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)

    def _run(self) -> None:
        codec: Codec[Ping] = Codec(ControlRequest)
        encoder = msgspec.msgpack.Encoder()
        next_publish = time.monotonic()
        while not self._stop.is_set():
            wait_ms = min(_STOP_CHECK_MS, max(0, int((next_publish - time.monotonic()) * 1e3)))
            if self._control.poll(wait_ms + 1):
                self._answer(codec, encoder)
            if time.monotonic() >= next_publish:
                self._publish(encoder)
                next_publish = time.monotonic() + self.interval_s
        self._publish(encoder)  # the last state, e.g. 'draining' with its final counts

    def _answer(self, codec: Codec[Ping], encoder: msgspec.msgpack.Encoder) -> None:
        frames = self._control.recv_multipart()
        if len(frames) < 2:
            return
        peer, *envelope, body = frames  # envelope: the b"" delimiter a REQ socket adds
        try:
            codec.decode([body])
        except RequestError as exc:
            self.metrics.counters["invalid_control_messages"] += 1  # this thread's alone
            log.warning("dropped an unreadable control message: %s", exc)
            return
        self._control.send_multipart([peer, *envelope, encoder.encode(self.metrics.pong())])

    def _publish(self, encoder: msgspec.msgpack.Encoder) -> None:
        try:
            self._pub.send(encoder.encode(self.metrics.snapshot()), zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeps up: this snapshot is skipped, the next one goes
            pass
        except Exception:  # a bug in a gauge must not end the thread that answers health
            log.exception("cannot publish stats")
