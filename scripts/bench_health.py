"""How fast every process answers a health ping, idle and while the MM worker is saturated.

Starts `mmlane serve` (with --http-port 0), pings every control socket `--pings` times while
idle, then sends `--images` 4032x3024 photos at once and pings again while the MM worker still
holds jobs (its `in_flight` from the stats it published meanwhile is printed). Prints
the answer times per role: median and largest, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import big_jpeg_url, serving

from mmlane.client import Client, user_message
from mmlane.ops.discovery import Targets
from mmlane.ops.feed import StatsFeed
from mmlane.ops.health import Answer, ping_all


def ping_rounds(run_dir: Path, rounds: int) -> list[Answer]:
    endpoints = Targets("control", (), run_dir).require_endpoints()
    answers: list[Answer] = []
    for _ in range(rounds):
        answers += ping_all(endpoints, timeout_s=5.0)
        time.sleep(0.2)
    return answers


def report(label: str, answers: list[Answer]) -> None:
    for role in ("frontend", "mm-worker", "engine"):
        times = [a.seconds * 1e3 for a in answers if a.role == role and not a.problem]
        missed = sum(1 for a in answers if a.role == role and a.problem)
        if times:
            print(f"{label:<6} {role:<10} n={len(times):<3} p50 {statistics.median(times):6.2f} ms"
                  f"  max {max(times):6.2f} ms  unanswered {missed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pings", type=int, default=10, help="ping rounds in each phase")
    parser.add_argument("--images", type=int, default=8, help="4032x3024 photos sent at once")
    args = parser.parse_args()
    url = big_jpeg_url()
    with tempfile.TemporaryDirectory(prefix="mmh-") as tmp:
        run_dir = Path(tmp)
        with serving(run_dir, "--http-port", "0", "--mm-cache-gb", "0") as endpoint:
            report("idle", ping_rounds(run_dir, args.pings))
            stats = Targets("stats", (), run_dir)
            with Client(endpoint, timeout_s=600) as client, StatsFeed(stats) as feed:
                ids = [client.submit([user_message("describe", [url])], max_tokens=2)
                       for _ in range(args.images)]
                time.sleep(1.0)
                busy = ping_rounds(run_dir, args.pings)
                held = [s.in_flight for s in feed.receive(1.0) if s.role == "mm-worker"]
                results = client.collect(ids)
            report("busy", busy)
            print(f"MM worker in_flight in its snapshots while pinged: {held}; "
                  f"{sum(r.error is None for r in results.values())}/{len(ids)} images answered")


if __name__ == "__main__":
    main()
