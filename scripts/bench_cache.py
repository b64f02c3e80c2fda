"""Feature-cache benchmark: one repeated 4032x3024 JPEG through an MM worker, cache on and off.

    python scripts/bench_cache.py [--requests 20]

Starts one `mmlane mm-worker` with this script standing in for its engine (bench_common's
`LoneMMWorker`), with `--mm-cache-gb 0` and then with its default (0.25 GiB), and sends the
same image (a data URI) `--requests` times, one job at a time, each job carrying an engine
epoch as a frontend's jobs do once the engine has replied; then the same with the client naming
the image by a uuid. For each job it measures the time from sending the job to receiving the
rendered EngineRequest (the MM worker's time per request, moving the job's 7.3 MB data URI
included) and the bytes of that EngineRequest, all frames. The first job of a cached run is the
miss that fills the cache; the figures are of the others. It also times mm_hash of the JPEG
alone and the base64 decoding of its data URI. Prints the figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_common import BIG, big_jpeg

from bench.images import data_uri
from bench.throughput import LoneMMWorker
from mmlane.mm_worker.cache import ImageHasher
from mmlane.model import resolve_model_dir

ENGINE_EPOCH = 1  # what the jobs of a frontend carry once the engine has replied
RUNS = [  # name, --mm-cache-gb, the image's uuid
    ("cache off", 0.0, None),
    ("cache on", 4.0, None),
    ("on, uuid", 4.0, "photo-1"),
]


def per_request(
    lone: LoneMMWorker, url: str, count: int, uuid: str | None
) -> tuple[list[float], list[int]]:
    """Seconds and bytes sent to the engine for each of `count` jobs, sent one at a time."""
    seconds, sizes = [], []
    for i in range(count):
        start = time.perf_counter()
        lone.push(url, f"r{i}", uuid=uuid, engine_epoch=ENGINE_EPOCH)
        sizes.append(lone.take())
        seconds.append(time.perf_counter() - start)
    return seconds, sizes


def bench(
    model_dir: Path, run_dir: Path, url: str, cache_gb: float, count: int, uuid: str | None
) -> tuple[float, int, list[float], list[int]]:
    with LoneMMWorker(run_dir, model_dir, "--mm-cache-gb", str(cache_gb)) as lone:
        first, first_size = per_request(lone, url, 1, uuid)  # the miss that fills the cache
        seconds, sizes = per_request(lone, url, count, uuid)
    return first[0], first_size[0], seconds, sizes


def ms_per_call(call: Callable[[], object], repeat: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) * 1000 / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    model_dir = resolve_model_dir(None)
    jpeg = big_jpeg()
    url = data_uri(jpeg)
    print(f"{BIG[0]}x{BIG[1]} test JPEG: {len(jpeg) / 1e6:.1f} MB, {args.requests} requests each")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="mmc-") as tmp:
        for n, (name, gb, uuid) in enumerate(RUNS):
            rows[name] = bench(model_dir, Path(tmp) / str(n), url, gb, args.requests, uuid)
    for name, (first, first_size, seconds, sizes) in rows.items():
        ms = [s * 1000 for s in seconds]
        print(f"{name:<10} per request: median {statistics.median(ms):7.1f} ms, mean "
              f"{statistics.mean(ms):7.1f} ms, {statistics.median(sizes):>11,.0f} bytes to the "
              f"engine  (first request {first * 1000:.1f} ms, {first_size:,} bytes)")
    off = rows["cache off"]
    for name in ("cache on", "on, uuid"):
        on = rows[name]
        print(f"cache off / {name}: {statistics.median(off[2]) / statistics.median(on[2]):.1f}x "
              f"the time, {statistics.median(off[3]) / statistics.median(on[3]):,.0f}x the bytes")
    blake3 = ImageHasher("blake3", model_dir.name, {})
    sha256 = ImageHasher("sha256", model_dir.name, {})
    payload = url.partition(",")[2]
    print(f"in-process: mm_hash of the JPEG {ms_per_call(lambda: blake3.of_bytes(jpeg)):.1f} ms "
          f"(blake3), {ms_per_call(lambda: sha256.of_bytes(jpeg)):.1f} ms (sha256); base64 "
          f"decoding of its data URI {ms_per_call(lambda: base64.b64decode(payload)):.1f} ms")


if __name__ == "__main__":
    main()
