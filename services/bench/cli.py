"""`mmlane bench` (the isolation benchmark) and `mmlane bench-server` (its in-process servers).

Kept light to import: `services/cli.py` builds its parser from here on every `mmlane` command,
so everything heavy (the model, matplotlib, tqdm) is imported when a bench actually runs.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from protocol.errors import FatalError
from services.bench.config import MODES, BenchConfig, load_bench_config

EXTRA_HINT = "mmlane bench needs the 'bench' extra: pip install -e '.[bench]' (matplotlib, tqdm)"


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--modes", type=_names, default=d.modes, metavar="M,M",
                   help=f"modes to run, in order (default: {','.join(MODES)})")
    p.add_argument("--model", metavar="DIR", help="local Hugging Face model directory "
                   "(default: the embedded tiny-qwen2-vl)")
    w = p.add_argument_group("workload")
    w.add_argument("--text-rate", type=float, default=d.text_rate, metavar="PER_S",
                   help=f"text requests/s, Poisson, in the idle and load phases ({d.text_rate:g})")
    w.add_argument("--text-words", type=int, default=d.text_words, metavar="N",
                   help=f"words per text prompt ({d.text_words})")
    w.add_argument("--image-rates", type=_floats, default=d.image_rates, metavar="R,R",
                   help="image requests/s, Poisson, one load phase each; the last is the "
                   f"saturating load the goals are judged at ({','.join(map(str, d.image_rates))})")
    w.add_argument("--image-sizes", type=_names, default=d.image_sizes, metavar="S,S",
                   help="generated JPEG sizes the image requests carry in turn: N or WxH "
                   f"({','.join(d.image_sizes)})")
    w.add_argument("--image", dest="image_files", action="append", default=[], metavar="FILE",
                   help="a real image file to send instead of generated ones (repeatable)")
    w.add_argument("--images-per-request", type=int, default=d.images_per_request, metavar="N")
    w.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help=f"output tokens per request ({d.max_tokens})")
    w.add_argument("--idle-seconds", dest="idle_s", type=float, default=d.idle_s,
                   metavar="S", help=f"idle phase length ({d.idle_s:g})")
    w.add_argument("--phase-seconds", dest="phase_s", type=float, default=d.phase_s,
                   metavar="S", help=f"length of each load phase ({d.phase_s:g})")
    w.add_argument("--drain-timeout", dest="drain_timeout_s", type=float,
                   default=d.drain_timeout_s, metavar="S",
                   help=f"how long a phase's last requests may take ({d.drain_timeout_s:g})")
    w.add_argument("--seed", type=int, default=d.seed)
    r = p.add_argument_group("tokenizer probe")
    r.add_argument("--probe-sizes", type=_names, default=d.probe_sizes, metavar="S,S",
                   help=f"image size of each probe phase's loops ({','.join(d.probe_sizes)})")
    r.add_argument("--probe-loops", type=int, default=d.probe_loops, metavar="N",
                   help=f"closed image loops during a probe phase ({d.probe_loops})")
    r.add_argument("--probe-seconds", dest="probe_s", type=float, default=d.probe_s,
                   metavar="S", help=f"length of each probe phase ({d.probe_s:g})")
    r.add_argument("--probe-idle-seconds", dest="probe_idle_s", type=float,
                   default=d.probe_idle_s, metavar="S")
    r.add_argument("--probe-interval-ms", type=float, default=d.probe_interval_ms, metavar="MS")
    s = p.add_argument_group("servers")
    s.add_argument("--pool-size", type=int, default=d.pool_size, metavar="N",
                   help=f"shared mode's one thread pool ({d.pool_size})")
    s.add_argument("--tokenizer-workers", type=int, default=d.tokenizer_workers, metavar="N",
                   help=f"split and mmlane tokenizer threads ({d.tokenizer_workers})")
    s.add_argument("--serve-args", type=shlex.split, default=[], metavar="'ARGS'",
                   help="extra `mmlane serve` arguments for mmlane's roles; every mode's engine "
                   "gets serve's engine arguments (e.g. '--torch-threads 1')")
    s.add_argument("--mmlane-endpoint", metavar="ADDR",
                   help="measure a running mmlane at this client address instead of starting one")
    s.add_argument("--startup-timeout", dest="startup_timeout_s", type=float,
                   default=d.startup_timeout_s, metavar="S")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=Path("mmlane-bench.json"), metavar="PATH",
                   help="results file (default mmlane-bench.json); schema: --schema")
    o.add_argument("--chart", type=Path, default=Path("mmlane-bench.png"), metavar="PATH",
                   help="chart file (default mmlane-bench.png)")
    o.add_argument("--run-dir", type=Path, metavar="DIR",
                   help="keep sockets and role logs here (default: a temp dir, removed)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--schema", action="store_true",
                   help="print the results file's JSON Schema and exit")


_CONFIG_ARGS = tuple(BenchConfig.__struct_fields__)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    return load_bench_config({name: getattr(args, name) for name in _CONFIG_ARGS
                              if hasattr(args, name)})


def run_bench(args: argparse.Namespace) -> int:
    from services.bench.results import BenchResult

    if args.schema:
        print(msgspec.json.format(msgspec.json.encode(msgspec.json.schema(BenchResult))).decode())
        return 0
    config = bench_config(args)
    _check_extra()
    from services.bench.report import chart, table
    from services.bench.run import run_bench as run

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="mmb-"))
    try:
        result = run(config, run_dir, progress=not args.no_progress)
    finally:
        if args.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    args.json.write_bytes(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
    chart(result, args.chart)
    print(table(result))
    print(f"\nresults: {args.json}, chart: {args.chart}")
    return 0


def _check_extra() -> None:
    """Fail before minutes of benchmarking, not after, when the extra is missing."""
    try:
        import matplotlib  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as exc:
        raise FatalError(f"{EXTRA_HINT} ({exc})", code="bad_config") from None


# ---------------------------------------------------------------- the in-process server role


def add_bench_server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", required=True, choices=["shared", "split"])
    p.add_argument("--model")
    for name in ("client", "output", "engine", "control"):
        p.add_argument(f"--{name}-endpoint", required=True)
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--tokenizer-workers", type=int, default=4)
    p.add_argument("--max-image-pixels", type=int, default=64_000_000)
    p.add_argument("--ready-endpoint")


def run_bench_server(args: argparse.Namespace) -> int:
    from services.bench.inproc import InProcessConfig, InProcessServer
    from services.common.config import load_config
    from services.common.lifecycle import run_role

    values: dict[str, Any] = {
        name: getattr(args, name) for name in InProcessConfig.__struct_fields__
    }
    config = load_config(InProcessConfig, values)
    return run_role("bench-server", lambda: InProcessServer(config), args.ready_endpoint)

