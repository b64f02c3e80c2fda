"""Engine scheduling benchmark: text latency idle and while clients stream 12 MP images.

    python scripts/bench_engine.py [--chunks 128] [--serve-arg=--FLAG=VALUE ...]
                                   [--text-requests 100]
                                   [--image-clients 2] [--max-tokens 1] [--rate 0]
                                   [--torch-threads N]

For each `--prefill-chunk-tokens` value in `--chunks` (128: the default; 1000000: every prompt
one chunk), runs `mmlane serve --prefill-chunk-tokens N --mm-cache-gb 0` (and each
`--serve-arg`, e.g. `--image-nice=0`)
on the embedded model twice: once idle, once while
`--image-clients` clients each keep a 4032x3024 JPEG request in flight back to back (the
feature cache is off, so every image is decoded, processed and encoded as a stream of distinct
photos would be). Each time it sends `--text-requests`
text-only chat requests and prints their latency p50/p90/p99, then the roles' own account from
their logs: the engine's unit times by kind, its queue
wait (receipt to first unit) and first token (receipt to first token) by request kind, and
the frontend's tokenize and end-to-end (accepted to reply) times by kind. Asserts nothing.
Run it in another checkout (an older commit) to compare code, as its flags allow.

Text requests go one at a time by default (closed loop, as bench_pipeline.py sends them). That
under-samples busy moments when waits are long: a request that waits 100 ms for a vision pass is
one sample for the whole pass. `--rate R` sends them instead at Poisson arrivals, R per second,
whatever is in flight (open loop), so each lands at a random moment of the engine's work.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from bench_common import ImageLoad, big_jpeg_url, report, serving, text_latencies

from mmlane.client import Client, user_message
from mmlane.protocol.errors import RetryableError


def open_loop_latencies(endpoint: str, count: int, rate: float, max_tokens: int) -> list[float]:
    """Seconds for each of `count` text requests sent at Poisson arrivals, `rate` per second."""
    arrivals = random.Random(0)
    submitted: dict[str, float] = {}
    latencies: list[float] = []
    with Client(endpoint) as client:
        next_send = time.monotonic()
        while len(latencies) < count:
            if len(submitted) + len(latencies) < count and time.monotonic() >= next_send:
                messages = [user_message(f"Quick question number {len(submitted)}?")]
                submitted[client.submit(messages, max_tokens=max_tokens)] = time.monotonic()
                next_send += arrivals.expovariate(rate)
                continue
            try:
                result = client.next_finished(deadline=next_send)
            except RetryableError:  # nothing finished before the next send is due
                continue
            latencies.append(time.monotonic() - submitted.pop(result.request_id))
    return latencies


ACCOUNTS = {"engine": ("engine_step", "queue_wait", "first_token"),
            "frontend": ("tokenize", "end_to_end")}
"""What `print_account` shows of each role's latency summaries."""


def latency_account(log_dir: Path, role: str) -> dict:
    """A role's latency summaries, from the line it logs at stop."""
    marker = "latencies (ms) "
    for line in role_log(log_dir, role):
        if marker in line:
            return json.loads(line.split(marker, 1)[1])
    return {}


def role_log(log_dir: Path, role: str) -> list[str]:
    return (log_dir / f"{role}.log").read_text(errors="replace").splitlines()


def print_account(log_dir: Path) -> None:
    for role, groups in ACCOUNTS.items():
        account = latency_account(log_dir, role)
        for group in groups:
            parts = [
                f"{name.partition(':')[2] or name} n={s['n']} mean {s['mean']:.2f} "
                f"max {s['max']:.1f}"
                for name, s in account.items()
                if name.partition(":")[0] == group and s["n"]
            ]
            print(f"    {role} {group:<11} (ms)  " + "; ".join(parts))


def run_phase(args: argparse.Namespace, tmp: Path, chunk: int, url: str | None) -> None:
    def measure(endpoint: str) -> list[float]:
        if args.rate:
            return open_loop_latencies(endpoint, args.text_requests, args.rate, args.max_tokens)
        return text_latencies(endpoint, args.text_requests, args.max_tokens)

    name = f"chunk {chunk}, " + (f"{args.image_clients} image clients" if url else "idle")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{chunk}-{bool(url)}-", dir=tmp))  # repeats apart
    log_dir = run_dir.with_name(f"{run_dir.name}-logs")
    serve_args = ["--prefill-chunk-tokens", str(chunk), "--mm-cache-gb", "0"]
    serve_args += args.serve_arg
    if args.torch_threads is not None:
        serve_args += ["--torch-threads", str(args.torch_threads)]
    with serving(run_dir, *serve_args, log_dir=log_dir) as endpoint:
        text_latencies(endpoint, 5, args.max_tokens)  # warm up
        if url is None:
            latencies = measure(endpoint)
        else:
            started = time.monotonic()
            with ImageLoad(endpoint, url, args.image_clients) as load:
                latencies = measure(endpoint)
            rate = load.completed / (time.monotonic() - started)
            name += f" ({load.completed} images done, {rate:.2f}/s)"
    report(name, latencies)
    print_account(log_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", default="128",
                        help="comma-separated --prefill-chunk-tokens values to compare "
                             "(default: %(default)s)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a further `mmlane serve` flag, as --serve-arg=--FLAG=VALUE")
    parser.add_argument("--text-requests", type=int, default=100)
    parser.add_argument("--image-clients", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=1, help="of each text request")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="text requests per second at Poisson arrivals (0: one at a time)")
    parser.add_argument("--torch-threads", type=int,
                        help="the engine's --torch-threads (default: serve's default)")
    args = parser.parse_args()
    url = big_jpeg_url()
    with tempfile.TemporaryDirectory(prefix="mmb-") as tmp:
        for chunk in (int(c) for c in args.chunks.split(",")):
            run_phase(args, Path(tmp), chunk, None)
            run_phase(args, Path(tmp), chunk, url)


if __name__ == "__main__":
    main()
