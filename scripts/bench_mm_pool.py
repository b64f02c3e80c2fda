"""The MM worker's images/s with 1 and more image processes (`--mm-processes`), side by side.

    python scripts/bench_mm_pool.py [--images 24] [--processes 1,2] [--rounds 2]

Starts one MM worker per setting with this script standing in for the engine socket, pushes
`--images` jobs with a 4032x3024 JPEG each (the feature cache stays unused: the jobs carry no
engine epoch, so every image is decoded and processed), and times them out of the worker. The
settings alternate for `--rounds` rounds, so that a drift of the machine shows in both. Prints
the figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import BIG, LoneMMWorker, big_jpeg

from services.bench.images import data_uri
from services.model import resolve_model_dir


def images_per_s(run_dir: Path, model_dir: Path, url: str, images: int, processes: int) -> float:
    with LoneMMWorker(run_dir, model_dir, "--mm-processes", str(processes)) as lone:
        for warm in range(processes):  # every process has run the processor once
            lone.push(url, f"warm-{warm}")
        for _ in range(processes):
            lone.take()
        start = time.perf_counter()
        for i in range(images):
            lone.push(url, str(i))
        for _ in range(images):
            lone.take()
        return images / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--processes", default="1,2",
                        help="the --mm-processes settings to compare (default: 1,2)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = [int(n) for n in args.processes.split(",")]
    model_dir = resolve_model_dir(None)
    url = data_uri(big_jpeg())
    rates: dict[int, list[float]] = {n: [] for n in settings}
    with tempfile.TemporaryDirectory(prefix="mmp-") as tmp:
        for round_ in range(args.rounds):
            for n in settings:
                rate = images_per_s(Path(tmp) / f"{round_}-{n}", model_dir, url, args.images, n)
                rates[n].append(rate)
                print(f"round {round_ + 1}, --mm-processes {n}: {rate:6.2f} images/s")
    base = statistics.median(rates[settings[0]])
    print(f"\n{BIG[0]}x{BIG[1]} JPEG, {args.images} images per run, medians of {args.rounds}:")
    for n in settings:
        median = statistics.median(rates[n])
        print(f"  --mm-processes {n}: {median:6.2f} images/s  ({median / base:.2f}x)")


if __name__ == "__main__":
    main()
