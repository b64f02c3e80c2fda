"""`mmlane exporter`: serve the latest Stats of every process to Prometheus at /metrics.

A custom Collector turns each process's latest snapshot into metrics when Prometheus scrapes:

    mmlane_<histogram>_seconds{role,name[,kind]}  buckets from the snapshot's bounds, +Inf,
                                                  _sum, _count; `kind` for 'name:kind' keys
    mmlane_<counter>_total{role,name}             every counter of the snapshot
    mmlane_errors_total{role,name,code}           requests failed, by error code
    mmlane_queue_depth{role,name,queue}           each internal queue
    mmlane_in_flight{role,name}                   requests held, not yet answered
    mmlane_uptime_seconds{role,name}
    mmlane_up{role,name}                          1 while its stats are fresh, else 0

A process whose stats went stale exports `mmlane_up 0` only: its last numbers are no longer the
truth. The main thread reads the stats sockets (a zmq socket stays on one thread) and hands
copies of the snapshots to the collector, which prometheus_client's HTTP thread reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from protocol.errors import FatalError
from protocol.messages import HistogramSnapshot, Stats
from services.ops.discovery import targets
from services.ops.feed import ProcessSnapshots, StatsFeed

log = logging.getLogger(__name__)

LABELS = ["role", "name"]
# How long the main thread waits for snapshots before it looks at the stop flag again.
RECEIVE_S = 0.5


def metric_name(text: str) -> str:
    """`text` with every character outside [a-zA-Z0-9_] made an underscore."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


class StatsCollector(Collector):
    """The latest snapshot of each process, as Prometheus metrics (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processes: list[ProcessSnapshots] = []

    def update(self, processes: Iterable[ProcessSnapshots]) -> None:
        """Take copies of the feed's processes (called by the thread that owns the feed)."""
        copies = [dataclasses.replace(process) for process in processes]
        with self._lock:
            self._processes = copies

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            processes = self._processes
        now = time.monotonic()
        yield _up(processes, now)
        fresh = _one_per_name([p.latest for p in processes if p.latest and p.fresh(now)])
        yield from _gauges(fresh)
        yield from _counters(fresh)
        yield from _histograms(fresh)


def _up(processes: list[ProcessSnapshots], now: float) -> GaugeMetricFamily:
    up = GaugeMetricFamily(
        "mmlane_up", "1 while the process publishes its stats, 0 once they are stale", labels=LABELS
    )
    for process in processes:
        up.add_metric([process.role, process.name], 1.0 if process.fresh(now) else 0.0)
    return up


def _one_per_name(snapshots: list[Stats]) -> list[Stats]:
    """One snapshot per (role, name), the newest: two processes of one name (say, two
    `mmlane serve` found under one run dir) would make samples Prometheus refuses."""
    newest: dict[tuple[str, str], Stats] = {}
    for stats in sorted(snapshots, key=lambda s: s.time):
        if (stats.role, stats.name) in newest:
            log.warning("two processes are called %s %s: exporting pid %d only; give the "
                        "exporter one deployment's --run-dir", stats.role, stats.name, stats.pid)
        newest[(stats.role, stats.name)] = stats
    return list(newest.values())


def _gauges(snapshots: list[Stats]) -> Iterator[Metric]:
    in_flight = GaugeMetricFamily(
        "mmlane_in_flight", "Requests held and not yet answered", labels=LABELS
    )
    uptime = GaugeMetricFamily(
        "mmlane_uptime_seconds", "Seconds since the process started", labels=LABELS
    )
    queues = GaugeMetricFamily(
        "mmlane_queue_depth", "Depth of each internal queue", labels=[*LABELS, "queue"]
    )
    for stats in snapshots:
        in_flight.add_metric([stats.role, stats.name], stats.in_flight)
        uptime.add_metric([stats.role, stats.name], stats.uptime_s)
        for queue, depth in stats.queues.items():
            queues.add_metric([stats.role, stats.name, queue], depth)
    yield from (in_flight, uptime, queues)


def _counters(snapshots: list[Stats]) -> Iterator[Metric]:
    counters: dict[str, CounterMetricFamily] = {}
    errors = CounterMetricFamily(
        "mmlane_errors", "Requests the process failed, by error code", labels=[*LABELS, "code"]
    )
    for stats in snapshots:
        for counter, value in stats.counters.items():
            name = metric_name(counter)
            family = counters.get(name) or counters.setdefault(name, CounterMetricFamily(
                f"mmlane_{name}", f"Count of {counter} since the process started", labels=LABELS
            ))
            family.add_metric([stats.role, stats.name], value)
        for code, count in stats.errors.items():
            errors.add_metric([stats.role, stats.name, code], count)
    yield from (counters[name] for name in sorted(counters))
    yield errors


def _histograms(snapshots: list[Stats]) -> Iterator[Metric]:
    """One family per histogram name; 'name:kind' keys share their name's family, labelled."""
    groups: dict[str, list[tuple[Stats, str, HistogramSnapshot]]] = defaultdict(list)
    for stats in snapshots:
        for key, histogram in stats.histograms.items():
            base, _, kind = key.partition(":")
            groups[metric_name(base)].append((stats, kind, histogram))
    for base, entries in sorted(groups.items()):
        with_kind = any(kind for _, kind, _ in entries)
        family = HistogramMetricFamily(
            f"mmlane_{base}_seconds", f"Latency of {base}, in seconds",
            labels=[*LABELS, "kind"] if with_kind else LABELS,
        )
        for stats, kind, histogram in entries:
            labels = [stats.role, stats.name, *([kind] if with_kind else [])]
            family.add_metric(labels, _buckets(histogram), sum_value=histogram.total)
        yield family


def _buckets(histogram: HistogramSnapshot) -> list[tuple[str, float]]:
    """Cumulative counts per upper bound, ending with +Inf (Prometheus' `le` buckets)."""
    buckets: list[tuple[str, float]] = []
    seen = 0
    for bound, count in zip([*histogram.bounds, float("inf")], histogram.counts, strict=True):
        seen += count
        buckets.append((floatToGoString(bound), seen))
    return buckets


def exporter_command(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    where = targets(args, "stats")
    collector = StatsCollector()
    with StatsFeed(where) as feed:
        server = _serve(args.host, args.port, collector)
        source = f"under {where.run_dir}" if where.discovering else "at " + ", ".join(where.connect)
        print(f"mmlane exporter: serving http://{args.host}:{server.server_port}/metrics for "
              f"the stats sockets {source}", flush=True)
        try:
            while not stop.is_set():
                feed.receive_for(RECEIVE_S)
                collector.update(feed.ordered())
        finally:
            server.shutdown()
            server.server_close()
    return 0


def _serve(host: str, port: int, collector: StatsCollector) -> Any:
    """prometheus_client's HTTP server on its own thread, over a registry of our collector only."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise FatalError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    return server
