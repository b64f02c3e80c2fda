"""`python -m bench` (the isolation benchmark) and `python -m bench server` (its in-process
server, which only the bench starts: `modes.COMMANDS`).

Run from a checkout (bench/ is not installed with mmlane). Everything heavy (the model,
matplotlib, tqdm) is imported when a bench actually runs, not for `--help`.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.config import BenchConfig, load_bench_config
from mmlane.common import cpu_wheels
from mmlane.common.settings import Settings
from mmlane.launcher import sigterm_as_interrupt
from mmlane.protocol.errors import FatalError, MMLaneError

Outputs = tuple[Callable[[Any, Path], None], Callable[[Any], str]]
"""A run's chart(result, path) and table(result)."""

EXTRA_HINT = "the bench needs the 'bench' extra: pip install -e '.[bench]' (matplotlib, tqdm)"


BENCH_SETTINGS = Settings(
    BenchConfig, exclude=("serve_args",), env=False,
    # The flags' names predate the fields', which the results file (its `settings`) keeps.
    renames={"image_files": "image", "idle_s": "idle_seconds", "phase_s": "phase_seconds",
             "probe_s": "probe_seconds", "probe_idle_s": "probe_idle_seconds"},
)


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure mmlane against in-process preprocessing designs (shared pool, "
        "split executors) side by side, or (--throughput) the MM lane's images/s per design; "
        "needs the 'bench' extra. Run from a checkout of mmlane.",
    )
    BENCH_SETTINGS.add_to(p)
    p.add_argument("--serve-args", type=shlex.split, metavar="'ARGS'",
                   help="extra `mmlane serve` arguments for mmlane's roles; every mode's engine "
                   "gets serve's engine arguments (e.g. '--torch-threads 1'; default: none)")
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
    return p


def bench_config(args: argparse.Namespace) -> BenchConfig:
    values = BENCH_SETTINGS.values(args)
    if args.serve_args:
        values["serve_args"] = args.serve_args
    return load_bench_config(values)


def run_bench(args: argparse.Namespace) -> int:
    from bench.results import BenchResult

    if args.schema:
        print(msgspec.json.format(msgspec.json.encode(msgspec.json.schema(BenchResult))).decode())
        return 0
    config = bench_config(args)
    _check_extra()
    cpu_wheels.apply()  # before transformers imports torchvision (vLLM CPU install: cpu_wheels.py)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="mmb-"))
    try:
        with sigterm_as_interrupt():  # the processes it started are stopped on the way out
            if config.throughput:
                from bench import throughput

                result: Any = throughput.run_throughput(config, run_dir)
                outputs: Outputs = (throughput.chart, throughput.table)
            else:
                from bench import report
                from bench.run import run_bench as run

                result = run(config, run_dir, progress=not args.no_progress)
                outputs = (report.chart, report.table)
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args else signal.SIGINT
        print(f"bench: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        if args.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    args.json.write_bytes(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
    chart, table = outputs
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


def server_parser() -> argparse.ArgumentParser:
    """Only the bench starts it (`modes.COMMANDS`), handing it its config as JSON on
    stdin, as `mmlane serve` hands a role its config."""
    p = argparse.ArgumentParser(prog="python -m bench server")
    p.add_argument("--config-json", required=True)
    p.add_argument("--ready-endpoint")
    return p


def run_bench_server(args: argparse.Namespace) -> int:
    cpu_wheels.apply()  # before transformers imports torchvision (vLLM CPU install: cpu_wheels.py)
    from bench.inproc import InProcessConfig, InProcessServer
    from mmlane.common.config import handed_config
    from mmlane.common.lifecycle import run_role

    config = handed_config(InProcessConfig, args.config_json)
    return run_role("bench-server", lambda: InProcessServer(config), args.ready_endpoint)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["server"]:
            return run_bench_server(server_parser().parse_args(argv[1:]))
        return run_bench(bench_parser().parse_args(argv))  # --help prints here
    except MMLaneError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
