"""A repeated 12 MP image end to end: its first request against the repeats, engine caches off/on.

    python scripts/bench_repeat.py [--repeats 10] [--rounds 2]

Runs `mmlane serve` on the embedded model with each of SETTINGS in turn (`--rounds` times each,
alternating): the engine's encoder cache off, and on (the default). Sends the
same 4032x3024 JPEG (a data URI) as a chat with `max_tokens` 1, one request at a time: once (the
first: decoded, processed, sent whole, encoded, prefilled), then `--repeats` times (feature-cache
hits: sent as its hash; with the encoder cache on, the engine skips the vision pass). Prints
the first request's time, the
repeats' median and the ratio for each serve. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import big_jpeg_url, serving

from mmlane.client import Client, user_message

SETTINGS = {
    "encoder cache off": ["--encoder-cache-gb", "0"],
    "encoder cache": [],
}


def seconds_per_request(endpoint: str, url: str, count: int) -> list[float]:
    times = []
    with Client(endpoint, timeout_s=300) as client:
        for _ in range(count):
            started = time.perf_counter()
            result = client.chat([user_message("what is it?", [url])], max_tokens=1)
            times.append(time.perf_counter() - started)
            assert result.error is None, result.error
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="requests after the first")
    parser.add_argument("--rounds", type=int, default=2, help="serves of each setting, in turn")
    args = parser.parse_args()
    url = big_jpeg_url()
    for round_ in range(args.rounds):
        for name, serve_args in SETTINGS.items():
            with tempfile.TemporaryDirectory() as run_dir, serving(
                Path(run_dir), *serve_args
            ) as endpoint:
                first, *repeats = seconds_per_request(endpoint, url, 1 + args.repeats)
            median = statistics.median(repeats)
            print(f"round {round_ + 1} {name:>22}: first {first * 1000:7.1f} ms,"
                  f" repeats p50 {median * 1000:6.1f} ms (n={len(repeats)}),"
                  f" {first / median:5.2f}x faster", flush=True)


if __name__ == "__main__":
    main()
