"""Stats snapshots as Prometheus metrics: the one rendering behind `mmlane exporter` (every
process's latest snapshot) and the frontend's GET /metrics (its own current snapshot).

    mmlane_<histogram>_seconds{role,name[,kind]}  buckets from the snapshot's bounds, +Inf,
                                                  _sum, _count; `kind` for 'name:kind' keys
    mmlane_<counter>_total{role,name}             every counter of the snapshot
    mmlane_errors_total{role,name,code}           requests failed, by error code
    mmlane_http_refused_total{role,name,code}     requests the HTTP API refused before it
                                                  submitted them (frontend), by error code
    mmlane_queue_depth{role,name,queue}           each internal queue
    mmlane_in_flight{role,name}                   requests held, not yet answered
    mmlane_uptime_seconds{role,name}
    mmlane_memory_bytes{role,name,kind}           the process's memory (resident, anonymous,
                                                  heap_in_use, heap_free, heap_mapped)
    mmlane_up{role,name}                          1 while its stats are fresh, else 0

and, from the exporter, each process's own `Stats.exposition` (an engine on vLLM: vLLM's `vllm:`
series) with `role` and `name` added to every sample's labels.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mmlane.protocol.messages import HistogramSnapshot, Stats

log = logging.getLogger(__name__)

LABELS = ["role", "name"]


def metric_name(text: str) -> str:
    """`text` with every character outside [a-zA-Z0-9_] made an underscore."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


def families(up: Iterable[tuple[str, str, bool]], fresh: list[Stats], *,
             hosted: bool = False) -> Iterator[Metric]:
    """`mmlane_up` for each (role, name, is fresh), then every other family, from the `fresh`
    snapshots (the newest of each role and name); with `hosted`, their expositions too."""
    yield _up(up)
    snapshots = _one_per_name(fresh)
    yield from _gauges(snapshots)
    yield from _counters(snapshots)
    yield from _histograms(snapshots)
    if hosted:
        yield from _hosted(snapshots)


def _hosted(snapshots: list[Stats]) -> Iterator[Metric]:
    """The snapshots' expositions, each sample labelled with its process's role and name."""
    return labelled(({"role": stats.role, "name": stats.name}, stats.exposition)
                    for stats in snapshots if stats.exposition)


def labelled(expositions: Iterable[tuple[dict[str, str], str]]) -> Iterator[Metric]:
    """The families of several expositions (Prometheus' text format), one family per name, each
    sample with its exposition's labels added; a malformed exposition is left out (and
    logged)."""
    merged: dict[str, Metric] = {}
    for labels, text in expositions:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as exc:
            log.warning("malformed metrics of %s left out: %s", labels, exc)
            continue
        for family in parsed:
            into = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                         family.type, family.unit))
            into.samples += [sample._replace(labels={**sample.labels, **labels})
                             for sample in family.samples]
    yield from merged.values()


def vllm_series(text: str) -> str:
    """The lines of vLLM's own families (`vllm:...`, with their HELP and TYPE) of an exposition
    that holds others too (a `vllm serve`'s /metrics, or the registry of a process hosting
    vLLM)."""
    return "".join(f"{line}\n" for line in text.splitlines()
                   if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith("vllm:"))


def exposition(metrics: Iterable[Metric]) -> str:
    """`metrics` in Prometheus' text format."""

    class Fixed(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from metrics

    return generate_latest(registry_of(Fixed())).decode()


class OwnStatsCollector(Collector):
    """This process's current snapshot, `read()` at each scrape, as the exporter shows a process
    whose stats are fresh (the frontend's /metrics)."""

    def __init__(self, read: Callable[[], Stats]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        yield from families([(stats.role, stats.name, True)], [stats])


def registry_of(collector: Collector) -> CollectorRegistry:
    """A registry of `collector` alone (not prometheus_client's process-wide default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def _up(processes: Iterable[tuple[str, str, bool]]) -> GaugeMetricFamily:
    up = GaugeMetricFamily(
        "mmlane_up", "1 while the process publishes its stats, 0 once they are stale", labels=LABELS
    )
    for role, name, fresh in processes:
        up.add_metric([role, name], 1.0 if fresh else 0.0)
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
    memory = GaugeMetricFamily(
        "mmlane_memory_bytes", "The process's memory, by kind", labels=[*LABELS, "kind"]
    )
    for stats in snapshots:
        in_flight.add_metric([stats.role, stats.name], stats.in_flight)
        uptime.add_metric([stats.role, stats.name], stats.uptime_s)
        for queue, depth in stats.queues.items():
            queues.add_metric([stats.role, stats.name, queue], depth)
        for kind, size in stats.memory.items():
            memory.add_metric([stats.role, stats.name, kind], size)
    yield from (in_flight, uptime, queues, memory)


def _counters(snapshots: list[Stats]) -> Iterator[Metric]:
    counters: dict[str, CounterMetricFamily] = {}
    errors = CounterMetricFamily(
        "mmlane_errors", "Requests the process failed, by error code", labels=[*LABELS, "code"]
    )
    refused = CounterMetricFamily(
        "mmlane_http_refused", "Requests the HTTP API refused before it submitted them, by "
        "error code", labels=[*LABELS, "code"]
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
        for code, count in stats.http_refused.items():
            refused.add_metric([stats.role, stats.name, code], count)
    yield from (counters[name] for name in sorted(counters))
    yield from (errors, refused)


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
