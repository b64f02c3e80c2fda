"""`mmlane exporter`: serve the latest Stats of every process to Prometheus at /metrics.

A custom Collector turns each process's latest snapshot into metrics when Prometheus scrapes,
with the families of services/common/prometheus.py (the frontend's GET /metrics gives its own).

A process whose stats went stale exports `mmlane_up 0` only: its last numbers are no longer the
truth. The main thread reads the stats sockets (a zmq socket stays on one thread) and hands
copies of the snapshots to the collector, which prometheus_client's HTTP thread reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from mmlane.common.prometheus import families, registry_of
from mmlane.ops.discovery import targets
from mmlane.ops.feed import ProcessSnapshots, StatsFeed
from mmlane.protocol.errors import FatalError

# How long the main thread waits for snapshots before it looks at the stop flag again.
RECEIVE_S = 0.5


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
        fresh = [p.latest for p in processes if p.latest and p.fresh(now)]
        yield from families([(p.role, p.name, p.fresh(now)) for p in processes], fresh,
                            hosted=True)


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
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry_of(collector))
    except OSError as exc:
        raise FatalError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    return server
