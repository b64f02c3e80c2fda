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
from typing import Any

import msgspec
import zmq

from protocol.errors import FatalError
from protocol.messages import LauncherInput, StartupFailed
from services.common.config import (
    DEFAULT_PORT,
    FrontendConfig,
    MMWorkerConfig,
    OpsConfig,
    default_run_dir,
    ipc,
    load_config,
    run_dir_defaults,
)
from services.common.lifecycle import setup_logging
from services.common.settings import Settings
from services.common.sockets import make_socket
from services.engine.config import EngineConfig

KILL_GRACE_S = 10.0
"""How long after its drain timeout a stopping child may take to exit (closing its sockets,
logging its totals) before it is killed."""


class ServeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`mmlane serve`: each role's settings (one flag sets a setting of that name in every
    role), and serve's own."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    mm_worker: MMWorkerConfig = msgspec.field(default_factory=MMWorkerConfig)
    frontend: FrontendConfig = msgspec.field(default_factory=FrontendConfig)
    run_dir: str | None = None
    """Folder for the ipc:// sockets, stats and control ones included; None:
    $MMLANE_RUN_DIR/serve-PORT ($MMLANE_RUN_DIR defaulting to /tmp/mmlane), removed at exit."""
    startup_timeout_s: float = 300.0
    """Seconds to wait for every role to report ready."""

    def __post_init__(self) -> None:
        self.frontend.mm_worker_endpoint = [self.mm_worker.mm_worker_endpoint]
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")

    def roles(self) -> dict[str, msgspec.Struct]:
        """Each child's config, by role."""
        return {"engine": self.engine, "mm-worker": self.mm_worker, "frontend": self.frontend}


SERVE_SETTINGS = Settings(
    ServeConfig,
    # Per process, so not one for all three; serve wires the frontend to its own MM worker.
    exclude=("name", "stats_endpoint", "control_endpoint", "frontend.mm_worker_endpoint",
             "frontend.output_endpoint"),
    no_env=("run-dir",),  # $MMLANE_RUN_DIR is the folder above serve's own (see default_run_dir)
)
"""`mmlane serve`'s flags (services/cli.py) and the command lines `serve_args` of the bench."""


def serve_config(values: dict[str, Any]) -> ServeConfig:
    """serve's validated config from its settings (`SERVE_SETTINGS.values`), the roles' default
    sockets in its run dir."""
    port = values.get("frontend", {}).get("port", DEFAULT_PORT)
    run_dir = values.get("run_dir") or str(default_run_dir() / f"serve-{port}")
    with run_dir_defaults(Path(run_dir)):
        return load_config(ServeConfig, {**values, "run_dir": run_dir})


class Child:
    """One role's process, started with its validated config, the name it is known by, and the
    endpoint its `Ready` reported.

    The config travels as msgspec JSON (`mmlane ROLE --config-json JSON`): the child decodes and
    validates it again, with no flag of its own. With `log_dir`, the child's stderr (its log)
    goes to LOG_DIR/ROLE.log instead of ours. With `run_dir`, it is the child's
    $MMLANE_RUN_DIR.
    """

    def __init__(
        self, role: str, config: msgspec.Struct, ready_endpoint: str,
        log_dir: Path | None = None, run_dir: Path | None = None,
    ) -> None:
        self.role = role
        self.config = config
        self.endpoint: str | None = None
        ops: OpsConfig | None = getattr(config, "ops", None)
        self.stop_timeout_s = (ops.drain_timeout_s if ops else 0.0) + KILL_GRACE_S
        """From SIGTERM to SIGKILL."""
        self.log_path = None if log_dir is None else log_dir / f"{role}.log"
        env = None if run_dir is None else {**os.environ, "MMLANE_RUN_DIR": str(run_dir)}
        argv = ["--config-json", msgspec.json.encode(config).decode(),
                "--ready-endpoint", ready_endpoint]
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


def serve(args: argparse.Namespace) -> int:
    from services.model import resolve_model_dir  # heavy (transformers): not for --help

    log = setup_logging("serve")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children: list[Child] = []
    values = SERVE_SETTINGS.values(args)
    run_dir: Path | None = None
    try:
        config = serve_config(values)
        run_dir = Path(str(config.run_dir))
        model_dir = resolve_model_dir(config.engine.model)  # build the default model once
        for role_config in config.roles().values():
            role_config.model = str(model_dir)  # type: ignore[attr-defined]
        children = start_roles(config.roles(), run_dir, config.startup_timeout_s, stop)
        if stop.is_set():
            return 0
        frontend = config.frontend
        http = (f", HTTP API http://{frontend.http_host}:{frontend.http_port}/v1"
                if frontend.http_port else "")
        print(f"mmlane ready: client endpoint {frontend.client_endpoint}{http} "
              f"(model {model_dir})", flush=True)
        return _watch(children, stop, log)
    except FatalError as exc:
        print(f"mmlane serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(children)
        if run_dir is not None and not values.get("run_dir"):  # a folder made for this run only
            shutil.rmtree(run_dir, ignore_errors=True)


def start_roles(
    roles: dict[str, msgspec.Struct],
    run_dir: Path,
    timeout_s: float,
    stop: threading.Event | None = None,
    log_dir: Path | None = None,
) -> list[Child]:
    """Start each role with its config and wait until every one reports ready.

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
            for role, config in roles.items():
                children.append(Child(role, config, ready_endpoint, log_dir, run_dir))
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
