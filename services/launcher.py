"""`mmlane serve`: start engine, MM worker and frontend as child processes on one machine.

Startup waits for each child's `Ready` on a ready socket while watching for early exits: a child
that fails makes serve stop the others and exit 1 with that child's reason. Once all are ready,
serve prints one `ready` line with the client endpoint, then waits for SIGINT/SIGTERM (exit 0
after stopping every child) or for a child to die (exit 1).

Stopping is graceful, frontends first: a frontend drains while the MM worker and the engine
still serve its requests in flight; once it has exited every request has had its reply, so the
others then stop together (whatever they still hold, nobody waits for). Each child gets SIGTERM,
then its drain timeout plus `KILL_GRACE_S` to exit before SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import zmq

from protocol.errors import FatalError
from protocol.messages import LauncherInput, StartupFailed
from services.common.config import OpsConfig, default_run_dir, ipc
from services.common.lifecycle import setup_logging
from services.common.sockets import make_socket
from services.model import resolve_model_dir

KILL_GRACE_S = 10.0
"""How long after its drain timeout a stopping child may take to exit (closing its sockets,
logging its totals) before it is killed."""


class Child:
    """One role's process, the name it is known by, and the endpoint its `Ready` reported.

    With `log_dir`, the child's stderr (its log) goes to LOG_DIR/ROLE.log instead of ours. With
    `run_dir`, it is the child's $MMLANE_RUN_DIR: its default sockets (stats, control) go there.
    """

    def __init__(
        self, role: str, argv: list[str], log_dir: Path | None = None, run_dir: Path | None = None
    ) -> None:
        self.role = role
        self.endpoint: str | None = None
        self.stop_timeout_s = drain_timeout_s(argv) + KILL_GRACE_S
        """From SIGTERM to SIGKILL."""
        self.log_path = None if log_dir is None else log_dir / f"{role}.log"
        env = None if run_dir is None else {**os.environ, "MMLANE_RUN_DIR": str(run_dir)}
        with self.log_path.open("wb") if self.log_path else contextlib.nullcontext() as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.cli", role, *argv], stderr=stderr, env=env
            )

    def stop(self) -> None:
        """SIGTERM: the child drains, then exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def drain_timeout_s(argv: list[str]) -> float:
    """The --drain-timeout of a role's command line (the role's default when it has none, or
    one it cannot read: the role refuses that itself, naming it)."""
    default = OpsConfig().drain_timeout_s
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--drain-timeout", type=float, default=default)
    try:
        return parser.parse_known_args(argv)[0].drain_timeout
    except argparse.ArgumentError:
        return default


def _opt(name: str, value: object) -> list[str]:
    return [] if value is None else [f"--{name}", str(value)]


def _flag(name: str, value: bool) -> list[str]:
    return [f"--{name}"] if value else []


def child_argv(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, list[str]]:
    """The command line of each role, from serve's own arguments."""
    engine = args.engine_endpoint or ipc("engine", run_dir)
    mm_worker = args.mm_worker_endpoint or ipc("mm-worker", run_dir)
    common = [
        "--model", str(model_dir), "--engine-endpoint", engine,
        "--stats-interval", str(args.stats_interval), "--drain-timeout", str(args.drain_timeout),
    ]
    return {
        "engine": [
            *common, "--device", args.device,
            *_opt("max-queued-requests", args.max_queued_requests),
            *_opt("prefill-chunk-tokens", args.prefill_chunk_tokens),
            *_opt("max-batch", args.max_batch),
            *_opt("torch-threads", args.torch_threads),
            *_opt("mm-cache-gb", args.mm_cache_gb),
        ],
        "mm-worker": [
            *common, "--mm-worker-endpoint", mm_worker,
            *_opt("allowed-media-dir", args.allowed_media_dir),
            *_opt("max-image-pixels", args.max_image_pixels),
            *_opt("max-image-bytes", args.max_image_bytes),
            *_opt("mm-cache-gb", args.mm_cache_gb), *_opt("mm-hash", args.mm_hash),
            *_opt("allowed-media-schemes", args.allowed_media_schemes),
            *_opt("allowed-media-domains", args.allowed_media_domains or None),
            *_flag("allow-http-media", args.allow_http_media),
            *_flag("allow-internal-media", args.allow_internal_media),
            *_opt("media-max-redirects", args.media_max_redirects),
            *_opt("media-connect-timeout", args.media_connect_timeout),
            *_opt("media-fetch-timeout", args.media_fetch_timeout),
            *_opt("media-fetch-retries", args.media_fetch_retries),
        ],
        "frontend": [
            *common, "--mm-worker-endpoint", mm_worker,
            "--output-endpoint", ipc("frontend-0", run_dir),
            "--host", args.host, "--port", str(args.port),
            "--http-host", args.http_host, "--http-port", str(args.http_port),
            *_opt("http-max-body-bytes", args.http_max_body_bytes),
            *_opt("tokenizer-workers", args.tokenizer_workers),
            *_opt("max-images-per-request", args.max_images_per_request),
            *_opt("request-timeout", args.request_timeout),
            *_opt("max-inflight-requests", args.max_inflight_requests),
        ],
    }


def serve(args: argparse.Namespace) -> int:
    log = setup_logging("serve")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children: list[Child] = []
    # Under the default run dir, where `mmlane top`, `stats` and `health` look for processes.
    run_dir = Path(args.run_dir or default_run_dir() / f"serve-{args.port}")
    try:
        model_dir = resolve_model_dir(args.model)  # build the default model once, not per child
        children = start_roles(child_argv(args, model_dir, run_dir), run_dir,
                               args.startup_timeout, stop)
        if stop.is_set():
            return 0
        http = f", HTTP API http://{args.http_host}:{args.http_port}/v1" if args.http_port else ""
        print(
            f"mmlane ready: client endpoint tcp://{args.host}:{args.port}{http} "
            f"(model {model_dir})",
            flush=True,
        )
        return _watch(children, stop, log)
    except FatalError as exc:
        print(f"mmlane serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(children)
        if not args.run_dir:  # a folder we made for this run only
            shutil.rmtree(run_dir, ignore_errors=True)


def start_roles(
    roles: dict[str, list[str]],
    run_dir: Path,
    timeout_s: float,
    stop: threading.Event | None = None,
    log_dir: Path | None = None,
) -> list[Child]:
    """Start `mmlane ROLE ARGV` for each role and wait until every one reports ready.

    Each child logs to LOG_DIR/ROLE.log when `log_dir` is given, else to our stderr.
    Raises FatalError with the failing child's reason (after stopping the others) when a child
    reports a startup failure, exits, or is not ready within `timeout_s`.
    """
    ctx: zmq.Context = zmq.Context.instance()
    ready_endpoint = ipc(f"ready-{time.monotonic_ns()}", run_dir)
    children: list[Child] = []
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    with make_socket(ctx, zmq.PULL, ready_endpoint, bind=True, linger_ms=0) as sock:
        try:
            for role, argv in roles.items():
                argv = [*argv, "--ready-endpoint", ready_endpoint]
                children.append(Child(role, argv, log_dir, run_dir))
            _wait_ready(sock, children, stop or threading.Event(), timeout_s)
        except BaseException:
            stop_all(children)
            raise
    return children


def _wait_ready(
    sock: zmq.Socket, children: list[Child], stop: threading.Event, timeout_s: float
) -> None:
    decoder = msgspec.msgpack.Decoder(LauncherInput)
    waiting = {child.role: child for child in children}
    deadline = time.monotonic() + timeout_s
    while waiting and not stop.is_set():
        if sock.poll(100):
            message = decoder.decode(sock.recv())
            if isinstance(message, StartupFailed):
                raise FatalError(f"{message.role} failed to start: {message.message}")
            ready = waiting.pop(message.role, None)
            if ready is not None:
                ready.endpoint = message.endpoint
            continue
        for child in children:
            code = child.process.poll()
            if code is not None and not sock.poll(500):  # its StartupFailed may still be coming
                raise FatalError(f"{child.role} exited with status {code} during startup")
        if time.monotonic() > deadline:
            raise FatalError(f"{', '.join(sorted(waiting))} not ready after {timeout_s} s")


def _watch(children: list[Child], stop: threading.Event, log: logging.Logger) -> int:
    while not stop.wait(0.2):
        for child in children:
            code = child.process.poll()
            if code is not None:
                log.error("%s exited with status %s; stopping the others", child.role, code)
                return 1
    log.info("stopping")
    return 0


def stop_all(children: list[Child]) -> None:
    """Stop the frontends, then the others (see the module docstring)."""
    _stop_together([child for child in children if child.role == "frontend"])
    _stop_together([child for child in children if child.role != "frontend"])


def _stop_together(children: list[Child]) -> None:
    for child in children:
        child.stop()
    stopped_at = time.monotonic()
    for child in children:
        child.wait_or_kill(stopped_at + child.stop_timeout_s)
