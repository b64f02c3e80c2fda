"""`mmlane top`: every process and every lane's latency, live in the terminal (rich).

The view has two tables, laid out for a terminal of 100 columns or more. Processes: one row
each, with its state ('stale' once it stops publishing), queues, in-flight count, request rate
and errors by code. Lanes: each latency histogram, summed per role, with p50/p90/p99 in ms over
the last window and since start. "The last window" is the time between each process's two
latest snapshots (its --stats-interval), so rates and windowed quantiles need two snapshots;
until then they show '-'.

`--once` waits for two snapshots from every process (or --timeout), prints the view as plain
text and exits: 1 if a process sent nothing, else 0. Into a pipe or a file (stdout not a
terminal), the live view is plain text too: one view every --interval, each after a blank line,
until stopped (or, in a pipe whose reader has gone, with status 141). In a terminal, `q` quits
the live view.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator

from rich import box
from rich.console import Console, Group, JustifyMethod
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mmlane.ops.discovery import Targets, targets
from mmlane.ops.feed import ProcessSnapshots, StatsFeed
from mmlane.ops.lanes import Lane, lanes
from mmlane.ops.text import counts_text, errors_text, ms_text, state_text, uptime_text

KEY_POLL_S = 0.1
"""How often the live view looks for a key pressed (`q` quits)."""
# Columns the plain-text view (--once, output not a terminal) is laid out for.
PLAIN_WIDTH = 150
# The process table's columns that never wrap, and how each is aligned.
FIXED_PROCESS_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("role", "left"), ("name", "left"), ("pid", "right"), ("state", "left"), ("up", "right"),
    ("in\nflight", "right"),
)


def top_command(args: argparse.Namespace) -> int:
    where = targets(args, "stats")
    if args.once:
        where.require_endpoints()
    with StatsFeed(where) as feed:
        if args.once:
            return _print_once(feed, args.timeout)
        if not sys.stdout.isatty():
            return _print_every(feed, args.interval)
        return _show_live(feed, args.interval)


def _print_once(feed: StatsFeed, timeout_s: float) -> int:
    feed.wait_for(2, timeout_s)
    print(plain_text(render(feed, time.monotonic())), flush=True)
    return 1 if feed.silent() else 0


def _print_every(feed: StatsFeed, interval_s: float) -> int:
    try:
        while True:
            feed.receive_for(interval_s)
            print(plain_text(render(feed, time.monotonic())) + "\n", flush=True)
    except KeyboardInterrupt:
        return 0


def plain_text(view: Group) -> str:
    """The view as text without colour or trailing blanks, PLAIN_WIDTH wide (or the terminal's)."""
    width = None if sys.stdout.isatty() else PLAIN_WIDTH
    console = Console(width=width, color_system=None, highlight=False)
    with console.capture() as capture:
        console.print(view)
    return "\n".join(line.rstrip() for line in capture.get().splitlines())


def _show_live(feed: StatsFeed, interval_s: float) -> int:
    """The view in place, redrawn every interval, until `q` (or Ctrl-C)."""
    with _keys() as pressed, Live(render(feed, time.monotonic()), auto_refresh=False,
                                  transient=False) as live:
        try:
            while True:
                deadline = time.monotonic() + interval_s
                while (remaining := deadline - time.monotonic()) > 0:
                    feed.receive_for(min(remaining, KEY_POLL_S))
                    if "q" in pressed().lower():
                        return 0
                live.update(render(feed, time.monotonic()), refresh=True)
        except KeyboardInterrupt:
            return 0


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[], str]]:
    """The keys pressed since the last call, one at a time without Enter (the terminal in
    cbreak mode, restored on the way out); "" always when stdin is not a terminal."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield lambda: ""
        return

    def pressed() -> str:
        keys = b""
        while select.select([fd], [], [], 0)[0]:
            read = os.read(fd, 64)
            if not read:
                break
            keys += read
        return keys.decode(errors="replace")

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield pressed
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def render(feed: StatsFeed, now: float) -> Group:
    """The whole view: a header line, the process table and the lane table."""
    processes = feed.ordered()
    return Group(
        _header(feed.targets, processes, now),
        process_table(processes, now),
        lane_table(lanes(processes, now)),
    )


def _header(where: Targets, processes: list[ProcessSnapshots], now: float) -> Text:
    source = f"under {where.run_dir}" if where.discovering else "at " + ", ".join(where.connect)
    silent = sum(process.latest is None for process in processes)
    stale = sum(not process.fresh(now) for process in processes) - silent
    notes = []
    if stale:
        notes.append(f"{stale} stale")
    if silent:
        notes.append(f"{silent} silent")
    return Text(
        f"mmlane top  {time.strftime('%H:%M:%S')}  {len(processes)} "
        f"process{'' if len(processes) == 1 else 'es'} {source}"
        + (f"  ({', '.join(notes)})" if notes else "")
    )


def process_table(processes: list[ProcessSnapshots], now: float) -> Table:
    table = _table("processes")
    for column, justify in FIXED_PROCESS_COLUMNS:
        table.add_column(column, no_wrap=True, justify=justify)
    table.add_column("queues")  # queues and errors wrap when the terminal is narrow
    table.add_column("req/s", no_wrap=True, justify="right")
    table.add_column("errors")
    rates = {id(p): _request_rate(p) if p.fresh(now) else None for p in processes}
    for process in processes:
        table.add_row(*_process_row(process, now, _rate_text(process, processes, rates)))
    return table


def _rate_text(process: ProcessSnapshots, processes: list[ProcessSnapshots],
               rates: dict[int, float | None]) -> str:
    """The process's requests/s; where its role has several processes (MM workers behind one
    frontend), also its share of the role's requests: how evenly affinity routing spreads."""
    rate = rates[id(process)]
    if rate is None:
        return "-"
    role = process.latest.role if process.latest is not None else None
    peers = [rates[id(p)] for p in processes if p.latest is not None and p.latest.role == role]
    total = sum(r for r in peers if r is not None)
    if len(peers) < 2 or total <= 0:
        return f"{rate:.1f}"
    return f"{rate:.1f} ({rate / total:.0%})"


def _process_row(process: ProcessSnapshots, now: float, rate: str) -> list[str]:
    stats = process.latest
    if stats is None:
        return ["?", process.name, "-", "no data", "-", "-", process.endpoint, "-", "-"]
    fresh = process.fresh(now)
    state = (state_text(stats.state, stats.restarts) if fresh
             else f"stale {uptime_text(now - process.received_at)}")
    return [
        stats.role, stats.name, str(stats.pid), state, uptime_text(stats.uptime_s),
        str(stats.in_flight), counts_text(stats.queues), rate, errors_text(stats),
    ]


def _request_rate(process: ProcessSnapshots) -> float | None:
    """Requests per second over the last window, or None without one."""
    window = process.window()
    if window is None:
        return None
    before, after = window
    requests = after.counters.get("requests", 0) - before.counters.get("requests", 0)
    return requests / max(after.time - before.time, 1e-9)


def lane_table(all_lanes: list[Lane]) -> Table:
    table = _table("lane latency in ms: last window | since start")
    table.add_column("lane", no_wrap=True)
    table.add_column("role", no_wrap=True)
    for period in ("last", "total"):
        for column in ("n", "p50", "p90", "p99"):
            table.add_column(f"{column}\n{period}", no_wrap=True, justify="right")
    for lane in all_lanes:
        table.add_row(lane.name, lane.role, *_quantile_cells(lane, lane.last_window),
                      *_quantile_cells(lane, lane.since_start))
    return table


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                 collapse_padding=True)


def _quantile_cells(lane: Lane, counts: list[int] | None) -> list[str]:
    """n, p50, p90, p99 of `counts`; '-' where there is nothing to measure."""
    observations = sum(counts) if counts is not None else 0
    if counts is None or observations == 0:
        return ["-" if counts is None else "0", "-", "-", "-"]
    return [str(observations), *(ms_text(value) for value in lane.quantiles(counts))]
