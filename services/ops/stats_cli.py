"""`mmlane stats`: the raw Stats snapshots, as text for people or JSON for scripts.

    --once          one snapshot per process, then exit (1 if a process sent none in time)
    --once --json   exactly one JSON object: {"processes": [Stats, ...], "silent": [...]},
                    processes in pipeline order, silent ones named by name and endpoint
    (neither)       one line per snapshot as it arrives (JSON lines with --json), until Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec

from mmlane.ops.discovery import targets
from mmlane.ops.feed import ProcessSnapshots, StatsFeed
from mmlane.ops.text import counts_text, errors_text, latency_text, state_text, uptime_text
from mmlane.protocol.messages import Stats


def stats_command(args: argparse.Namespace) -> int:
    where = targets(args, "stats")
    where.require_endpoints()
    with StatsFeed(where) as feed:
        if args.once:
            return _print_once(feed, args.json, args.timeout)
        return _print_stream(feed, args.json)


def _print_once(feed: StatsFeed, as_json: bool, timeout_s: float) -> int:
    feed.wait_for(1, timeout_s)
    snapshots = [process.latest for process in feed.ordered() if process.latest is not None]
    silent = feed.silent()
    if as_json:
        print(json.dumps({
            "processes": [stats_json(stats) for stats in snapshots],
            "silent": [_silent_json(process) for process in silent],
        }))
    else:
        print("\n\n".join(snapshot_text(stats) for stats in snapshots))
    if silent:
        names = ", ".join(f"{process.name} ({process.endpoint})" for process in silent)
        print(f"mmlane stats: no snapshot within {timeout_s:g} s from {names}", file=sys.stderr)
        return 1
    return 0


def stats_json(stats: Stats) -> dict[str, Any]:
    """A snapshot as JSON-ready builtins; histograms as objects with named fields (on the wire
    they are arrays, which a script should not have to know the order of)."""
    histograms = {name: msgspec.structs.asdict(h) for name, h in stats.histograms.items()}
    return {**msgspec.to_builtins(stats), "histograms": histograms}


def _silent_json(process: ProcessSnapshots) -> dict[str, str]:
    return {"name": process.name, "endpoint": process.endpoint}


def _print_stream(feed: StatsFeed, as_json: bool) -> int:
    try:
        while True:
            for stats in feed.receive_for(1.0):
                print(json.dumps(stats_json(stats)) if as_json else _stats_line(stats),
                      flush=True)
    except KeyboardInterrupt:
        return 0


def snapshot_text(stats: Stats) -> str:
    """A few lines for one snapshot: who, state, queues, counters, errors, each histogram."""
    state = state_text(stats.state, stats.restarts)
    lines = [
        f"{stats.role} {stats.name}  pid {stats.pid}  {state}  up "
        f"{uptime_text(stats.uptime_s)}  in flight {stats.in_flight}  epoch {stats.epoch}",
        f"  queues    {counts_text(stats.queues)}",
        f"  counters  {counts_text(stats.counters)}",
        f"  errors    {errors_text(stats)}",
    ]
    for name, histogram in sorted(stats.histograms.items()):
        lines.append(
            f"  {name:<22} n {sum(histogram.counts):<7} p50 {latency_text(histogram.p50):>9}  "
            f"p90 {latency_text(histogram.p90):>9}  p99 {latency_text(histogram.p99):>9}"
        )
    return "\n".join(lines)


def _stats_line(stats: Stats) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(stats.time))
    state = state_text(stats.state, stats.restarts)
    return (
        f"{clock} {stats.role} {stats.name} pid {stats.pid} {state} "
        f"in_flight {stats.in_flight} requests {stats.counters.get('requests', 0)} "
        f"errors {sum(stats.errors.values())} queues [{counts_text(stats.queues)}]"
    )
