"""Pipeline benchmark: text latency idle and under image load, and the MM worker's images/s.

    python scripts/bench_pipeline.py [--text-requests 50] [--image-clients 2] [--images 20]

1. Starts `mmlane serve` on the embedded model; measures text-only request latency (sequential,
   max_tokens=1) while idle, then while `--image-clients` clients keep 4032x3024 JPEG requests
   in flight back to back.
2. Starts one MM worker alone with this script standing in for the engine socket, pushes
   `--images` jobs with 4032x3024 JPEGs, and times them out of the worker (images/s); then runs
   the same decode + HF image processor calls in a loop in this process for comparison.
Prints the figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import (
    BIG,
    ImageLoad,
    big_jpeg,
    report,
    serving,
    text_latencies,
)

from bench.images import data_uri
from bench.inproc import job_renderer
from bench.throughput import LoneMMWorker
from mmlane.model import resolve_model_dir


def bench_serve(args: argparse.Namespace, run_dir: Path, url: str) -> None:
    with serving(run_dir) as endpoint:
        text_latencies(endpoint, 5)  # warm up
        idle = text_latencies(endpoint, args.text_requests)
        with ImageLoad(endpoint, url, args.image_clients) as load:
            loaded = text_latencies(endpoint, args.text_requests)
    report("text latency, idle", idle)
    report(f"text latency, {args.image_clients} image clients", loaded)
    print(f"{'':<40} ratio of p50 {statistics.median(loaded) / statistics.median(idle):.2f}x"
          f", image requests completed meanwhile: {load.completed}")


def bench_mm_worker(args: argparse.Namespace, model_dir: Path, run_dir: Path, jpeg: bytes) -> None:
    url = data_uri(jpeg)
    # The jobs carry no engine epoch (no engine replied yet), so the feature cache stays unused
    # and every job is decoded and processed.
    with LoneMMWorker(run_dir, model_dir) as lone:
        lone.push(url, "warm")
        lone.take()
        start = time.perf_counter()
        for i in range(args.images):
            lone.push(url, str(i))
        frame_bytes = 0
        for _ in range(args.images):
            frame_bytes = lone.take()
        worker = args.images / (time.perf_counter() - start)
        pre = lone.preprocessor

    renderer = job_renderer(pre, 64_000_000)
    start = time.perf_counter()
    for _ in range(args.images):  # the worker's own decode and processing
        renderer.process_image(0, jpeg)
    in_process = args.images / (time.perf_counter() - start)
    print(f"MM worker, {BIG[0]}x{BIG[1]} JPEG           {worker:8.2f} images/s"
          f"   ({frame_bytes / 1e6:.1f} MB per request to the engine)")
    print(f"in-process decode + HF processor loop {in_process:8.2f} images/s"
          f"   (worker / loop = {worker / in_process:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text-requests", type=int, default=50)
    parser.add_argument("--image-clients", type=int, default=2)
    parser.add_argument("--images", type=int, default=20)
    args = parser.parse_args()
    model_dir = resolve_model_dir(None)
    jpeg = big_jpeg()
    print(f"4032x3024 test JPEG: {len(jpeg) / 1e6:.1f} MB")
    with tempfile.TemporaryDirectory(prefix="mmb-") as tmp:
        bench_serve(args, Path(tmp), data_uri(jpeg))
        bench_mm_worker(args, model_dir, Path(tmp), jpeg)


if __name__ == "__main__":
    main()
