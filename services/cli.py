"""The `mmlane` command: one subcommand per role, the launcher, the client and the model builder."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from protocol.errors import MMLaneError
from services.bench.cli import add_bench_arguments, add_bench_server_arguments
from services.common.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    FrontendConfig,
    MMWorkerConfig,
    default_run_dir,
    load_config,
)
from services.common.lifecycle import run_role
from services.engine.config import EngineConfig


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", metavar="DIR",
        help="local Hugging Face model directory (default: the embedded tiny-qwen2-vl, built "
        "once into $MMLANE_HOME, default ~/.cache/mmlane)",
    )


def _add_ready(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready-endpoint", help=argparse.SUPPRESS)  # set by `mmlane serve`


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda[:N]"
    )
    g.add_argument(
        "--max-queued-requests", type=int, default=1024,
        help="requests the engine holds before answering 'overloaded'",
    )
    g.add_argument(
        "--prefill-chunk-tokens", type=int, default=64, metavar="N",
        help="the most tokens one unit of engine work takes: prompts prefill in chunks of N, "
        "vision-encoder passes run in slices of N image tokens (default 64; smaller: text "
        "waits less behind images, larger: less overhead per unit)",
    )
    g.add_argument(
        "--max-batch", type=int, default=16, metavar="N",
        help="the most requests one decode step runs together (default 16; 1: one at a time); "
        "each request's tokens are the same as when it runs alone",
    )
    g.add_argument(
        "--torch-threads", type=int, default=0, metavar="N",
        help="threads for one CPU torch operation (default 0: all cores but two, at least one, "
        "leaving room for the MM worker and the frontend)",
    )


def _add_mm_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mm worker")
    g.add_argument(
        "--allowed-media-dir", metavar="DIR",
        help="allow file:// image URLs under DIR (default: file:// is refused)",
    )
    g.add_argument(
        "--max-image-pixels", type=int, default=64_000_000,
        help="refuse larger images before decoding them (default 64 megapixels)",
    )
    g.add_argument(
        "--max-image-bytes", type=int, default=64 * 1024 * 1024,
        help="refuse larger encoded images, inline or fetched (default 64 MiB)",
    )
    g.add_argument(
        "--allowed-media-schemes", default="data,https", metavar="LIST",
        help="comma-separated image URL schemes: data, https, http (default data,https)",
    )
    g.add_argument(
        "--allow-http-media", action="store_true",
        help="also allow plain http:// image URLs",
    )
    g.add_argument(
        "--allowed-media-domains", default="", metavar="LIST",
        help="comma-separated domains http(s) image URLs must be in (default: any domain)",
    )
    g.add_argument(
        "--allow-internal-media", action="store_true",
        help="allow image URLs that resolve to loopback or private addresses",
    )
    g.add_argument("--media-max-redirects", type=int, default=3, metavar="N",
                   help="redirects followed per image fetch (default 3)")
    g.add_argument("--media-connect-timeout", type=float, default=5.0, metavar="S",
                   help="seconds to connect to an image's host (default 5)")
    g.add_argument("--media-fetch-timeout", type=float, default=20.0, metavar="S",
                   help="seconds one image fetch may take, retries included (default 20)")
    g.add_argument("--media-fetch-retries", type=int, default=2, metavar="N",
                   help="retries after a timeout or 5xx answer (default 2)")


def _add_cache_args(p: argparse.ArgumentParser, *, mm_worker: bool) -> None:
    g = p.add_argument_group("feature cache (MM worker and engine mirror each other)")
    g.add_argument(
        "--mm-cache-gb", type=float, default=4.0, metavar="GIB",
        help="capacity of the mirrored feature cache: each MM worker's sender cache and its "
        "receiver cache in the engine (GiB of processed tensors; 0 disables; default 4). Give "
        "every MM worker and the engine the same value",
    )
    if mm_worker:
        g.add_argument(
            "--mm-hash", choices=["blake3", "sha256"], default="blake3",
            help="the hash that names an image in the caches (default blake3)",
        )


def _add_frontend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frontend")
    g.add_argument("--host", default=DEFAULT_HOST, help="native client API host")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="native client API port")
    g.add_argument(
        "--http-port", type=int, default=int(os.environ.get("MMLANE_HTTP_PORT") or 8000),
        help="port of the OpenAI-compatible HTTP API (default 8000, or $MMLANE_HTTP_PORT; "
        "0 disables it)",
    )
    g.add_argument("--http-host", default=DEFAULT_HOST, help="HTTP API host")
    g.add_argument(
        "--http-max-body-bytes", type=int, default=128 * 1024 * 1024, metavar="N",
        help="largest HTTP request body, inline images included (default 128 MiB)",
    )
    g.add_argument("--tokenizer-workers", type=int, default=4, help="tokenizer threads")
    g.add_argument(
        "--max-images-per-request", type=int, default=8, help="refuse requests with more images"
    )
    g.add_argument(
        "--request-timeout", type=float, default=600.0,
        help="seconds before a request without a reply gets a 'timeout' error",
    )
    g.add_argument(
        "--max-inflight-requests", type=int, default=1024,
        help="requests held at once before answering 'overloaded'",
    )


def _add_ops_args(p: argparse.ArgumentParser, *, one_role: bool) -> None:
    g = p.add_argument_group("operations (stats, health, graceful stop)")
    if one_role:
        g.add_argument(
            "--stats-endpoint", metavar="ADDR",
            help="where to publish Stats (ZMQ PUB; default ipc://$MMLANE_RUN_DIR/stats-NAME.sock, "
            "NAME from the role and its port or socket, e.g. frontend-8765)",
        )
        g.add_argument(
            "--control-endpoint", metavar="ADDR",
            help="where to answer health pings (ZMQ ROUTER; default "
            "ipc://$MMLANE_RUN_DIR/control-NAME.sock)",
        )
    g.add_argument(
        "--stats-interval", type=float, default=1.0, metavar="S",
        help="seconds between two published Stats messages (default 1)",
    )
    g.add_argument(
        "--drain-timeout", type=float, default=30.0, metavar="S",
        help="at SIGTERM, seconds to finish held requests before failing them with a "
        "retryable error (default 30)",
    )


def _ops(args: argparse.Namespace) -> dict[str, object]:
    return {
        "stats_endpoint": args.stats_endpoint or "",
        "control_endpoint": args.control_endpoint or "",
        "stats_interval_s": args.stats_interval, "drain_timeout_s": args.drain_timeout,
    }


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return load_config(EngineConfig, {
        "model": args.model, "engine_endpoint": args.engine_endpoint or "",
        "max_queued_requests": args.max_queued_requests, "mm_cache_gb": args.mm_cache_gb,
        "hf": {
            "device": args.device, "prefill_chunk_tokens": args.prefill_chunk_tokens,
            "max_batch": args.max_batch, "torch_threads": args.torch_threads,
        },
        "ops": _ops(args),
    })


def mm_worker_config(args: argparse.Namespace) -> MMWorkerConfig:
    return load_config(MMWorkerConfig, {
        "model": args.model, "job_endpoint": args.mm_worker_endpoint or "",
        "engine_endpoint": args.engine_endpoint or "",
        "allowed_media_dir": args.allowed_media_dir, "max_image_pixels": args.max_image_pixels,
        "max_image_bytes": args.max_image_bytes, "mm_cache_gb": args.mm_cache_gb,
        "mm_hash": args.mm_hash,
        "allowed_media_schemes": _media_schemes(args),
        "allowed_media_domains": _split(args.allowed_media_domains),
        "allow_internal_media": args.allow_internal_media,
        "media_max_redirects": args.media_max_redirects,
        "media_connect_timeout_s": args.media_connect_timeout,
        "media_fetch_timeout_s": args.media_fetch_timeout,
        "media_fetch_retries": args.media_fetch_retries, "ops": _ops(args),
    })


def _split(text: str) -> list[str]:
    return [part.strip().lower() for part in text.split(",") if part.strip()]


def _media_schemes(args: argparse.Namespace) -> list[str]:
    schemes = _split(args.allowed_media_schemes)
    if args.allow_http_media and "http" not in schemes:
        schemes.append("http")
    return schemes


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    return load_config(FrontendConfig, {
        "model": args.model, "client_endpoint": f"tcp://{args.host}:{args.port}",
        "output_endpoint": args.output_endpoint or "",
        "engine_endpoint": args.engine_endpoint or "",
        "mm_worker_endpoints": args.mm_worker_endpoint or [],
        "tokenizer_workers": args.tokenizer_workers,
        "max_images_per_request": args.max_images_per_request,
        "request_timeout_s": args.request_timeout,
        "max_inflight_requests": args.max_inflight_requests,
        "http_host": args.http_host, "http_port": args.http_port,
        "http_max_body_bytes": args.http_max_body_bytes, "ops": _ops(args),
    })


def _lazy(target: str) -> Callable[[argparse.Namespace], int]:
    """The command function `target` ('module:function'), imported only when it runs: each
    command loads its own dependencies (torch, aiohttp, rich), not every command's."""

    def run(args: argparse.Namespace) -> int:
        module, _, function = target.partition(":")
        command: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(module), function
        )
        return command(args)

    return run


def _cmd_engine(args: argparse.Namespace) -> int:
    from services.engine import Engine

    config = engine_config(args)
    return run_role("engine", lambda: Engine(config), args.ready_endpoint, config.ops)


def _cmd_mm_worker(args: argparse.Namespace) -> int:
    from services.mm_worker import MMWorker

    config = mm_worker_config(args)
    return run_role("mm-worker", lambda: MMWorker(config), args.ready_endpoint, config.ops)


def _cmd_frontend(args: argparse.Namespace) -> int:
    from services.frontend import Frontend

    config = frontend_config(args)
    return run_role("frontend", lambda: Frontend(config), args.ready_endpoint, config.ops)


def _add_watch_args(p: argparse.ArgumentParser, kind: str) -> None:
    """Which processes an operator tool talks to (services/ops/discovery.py)."""
    g = p.add_argument_group(
        "which processes (default: every one whose socket is found under the run dir)"
    )
    g.add_argument(
        "--connect", action="append", default=[], metavar="ADDR",
        help=f"a process's {kind} socket, e.g. ipc:///tmp/mmlane/{kind}-engine.sock or "
        f"tcp://HOST:PORT (repeatable; default: every {kind}-*.sock under --run-dir)",
    )
    g.add_argument(
        "--run-dir", default=str(default_run_dir()), metavar="DIR",
        help="the folder searched, recursively, for the sockets (default: $MMLANE_RUN_DIR or "
        "/tmp/mmlane, here %(default)s; `mmlane serve` puts its own in serve-PORT there)",
    )


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from services.model import build_tiny_model

    out = build_tiny_model(args.out, family=args.family, seed=args.seed)
    print(out)
    return 0


def _add_endpoint_args(
    p: argparse.ArgumentParser, *names: str, repeatable: tuple[str, ...] = ()
) -> None:
    """One --NAME-endpoint option per name; those in `repeatable` may be given several times
    (their value is then a list)."""
    g = p.add_argument_group("internal addresses (default: ipc:// sockets in $MMLANE_RUN_DIR)")
    helps = {
        "engine": "the engine's request socket",
        "mm-worker": "the MM worker's job socket",
        "output": "this frontend's reply socket",
    }
    for name in names:
        if name in repeatable:
            g.add_argument(f"--{name}-endpoint", metavar="ADDR", action="append",
                           help=f"{helps[name]}; repeat it for several (they take turns)")
        else:
            g.add_argument(f"--{name}-endpoint", metavar="ADDR", help=helps[name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmlane",
        description="Multi-process preprocessing for vision-language model serving: the frontend "
        "tokenizes text, a FIFO MM worker preprocesses images, the engine runs the model.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int] | str, help_: str) -> Any:
        """A subcommand running `func`, or the 'module:function' it names (see `_lazy`)."""
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=_lazy(func) if isinstance(func, str) else func)
        return p

    p = add("serve", "services.launcher:serve",
            "run frontend, MM worker and engine on this machine")
    _add_model(p)
    _add_frontend_args(p)
    _add_mm_worker_args(p)
    _add_engine_args(p)
    _add_cache_args(p, mm_worker=True)
    _add_endpoint_args(p, "engine", "mm-worker")
    _add_ops_args(p, one_role=False)
    p.add_argument(
        "--run-dir", help="folder for the ipc:// sockets, stats and control ones included "
        "(default: $MMLANE_RUN_DIR/serve-PORT, $MMLANE_RUN_DIR defaulting to /tmp/mmlane)"
    )
    p.add_argument(
        "--startup-timeout", type=float, default=300.0,
        help="seconds to wait for every role to report ready",
    )

    p = add("frontend", _cmd_frontend, "run one frontend (client API, chat template, tokenizer)")
    _add_model(p)
    _add_frontend_args(p)
    _add_endpoint_args(p, "engine", "mm-worker", "output", repeatable=("mm-worker",))
    _add_ops_args(p, one_role=True)
    _add_ready(p)

    p = add("mm-worker", _cmd_mm_worker, "run one MM worker (FIFO image preprocessing)")
    _add_model(p)
    _add_mm_worker_args(p)
    _add_cache_args(p, mm_worker=True)
    _add_endpoint_args(p, "engine", "mm-worker")
    _add_ops_args(p, one_role=True)
    _add_ready(p)

    p = add("engine", _cmd_engine, "run the engine (the model, on CUDA when present, else CPU)")
    _add_model(p)
    _add_engine_args(p)
    _add_cache_args(p, mm_worker=False)
    _add_endpoint_args(p, "engine")
    _add_ops_args(p, one_role=True)
    _add_ready(p)

    p = add("chat", "services.client:chat_command",
            "send one chat request to a running mmlane and print the reply")
    p.add_argument("prompt", help="the user message")
    p.add_argument(
        "--endpoint", default=f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}",
        help="native API address (default: serve's default)",
    )
    p.add_argument(
        "--image", action="append", default=[], metavar="PATH_OR_URL",
        help="an image: a local path (read here and sent inline) or a data:/file:// URL; "
        "repeatable",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the reply")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")

    p = add("reset-cache", "services.client:reset_cache_command",
            "empty the feature caches of a running mmlane (engine and MM workers)")
    p.add_argument(
        "--endpoint", default=f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}",
        help="native API address (default: serve's default)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the reply")

    p = add("stats", "services.ops.stats_cli:stats_command",
            "print the stats the running processes publish")
    p.description = (
        "Print the Stats snapshots the running processes publish: one line per snapshot as they "
        "come, or (--once) one snapshot per process, exiting 1 if a process sends none in "
        "time."
    )
    p.add_argument("--once", action="store_true",
                   help="print one snapshot per process and exit (1 if one sent none in time)")
    p.add_argument("--json", action="store_true",
                   help='with --once, exactly one JSON object {"processes": [...], "silent": '
                   "[...]}, processes in pipeline order; without, one JSON object per line")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="with --once, seconds to wait for every process's snapshot (default 5)")
    _add_watch_args(p, "stats")

    p = add("top", "services.ops.top:top_command",
            "watch every process and the latency of every lane, live")
    p.description = (
        "Watch every process (state, uptime, in-flight requests, queue depths, requests/s, "
        "errors) and every lane's latency (p50/p90/p99 over the last window, i.e. between a "
        "process's two latest snapshots, and since start), live. A process that stops "
        "publishing shows as stale. Ctrl-C quits."
    )
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between two screen updates (default 1)")
    p.add_argument("--once", action="store_true",
                   help="wait for two snapshots of every process, print the view as plain text "
                   "and exit (1 if a process sent nothing)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="with --once, the longest wait for those snapshots (default 5)")
    _add_watch_args(p, "stats")

    p = add("health", "services.ops.health:health_command",
            "ping every process; exit 0 only if all serve")
    p.description = (
        "Ping every process's control socket at once and print a line per process. Exit 0 "
        "only if each answers within --timeout, is serving, and (engines) has its model "
        "loaded, and, when the sockets are discovered (no --connect), a frontend, an MM worker "
        "and an engine all answer. Else exit 1, naming what is wrong."
    )
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="seconds to wait for the answers (default 5)")
    _add_watch_args(p, "control")

    p = add("exporter", "services.ops.exporter:exporter_command",
            "serve the processes' stats to Prometheus")
    p.description = (
        "Serve the latest stats of every process to Prometheus at http://HOST:PORT/metrics: "
        "mmlane_<lane>_seconds histograms, mmlane_<counter>_total and mmlane_errors_total "
        "counters, mmlane_queue_depth, mmlane_in_flight, mmlane_uptime_seconds and mmlane_up "
        "gauges, labelled by role and name. Runs until SIGINT or SIGTERM."
    )
    p.add_argument("--port", type=int, default=9400, help="HTTP port (default 9400)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="HTTP host (default %(default)s; 0.0.0.0 to let a remote Prometheus in)")
    _add_watch_args(p, "stats")

    p = add(
        "tiny-model", _cmd_tiny_model, "write the embedded tiny model (built offline) to a folder"
    )
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--family", default="qwen2_vl", choices=["qwen2_vl", "llava"])
    p.add_argument("--seed", type=int, default=0)

    p = add("bench", "services.bench.cli:run_bench",
            "measure mmlane against in-process preprocessing designs "
            "(shared pool, split executors) side by side; needs the 'bench' extra")
    add_bench_arguments(p)
    # No help: unlisted. The in-process server `mmlane bench` starts for its shared/split modes.
    sub.add_parser("bench-server").set_defaults(func=_lazy("services.bench.cli:run_bench_server"))
    add_bench_server_arguments(sub.choices["bench-server"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MMLaneError as exc:
        print(f"mmlane {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
