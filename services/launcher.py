"""`mmlane serve`: start engine, MM worker and frontend as child processes on one machine.

Startup waits for each child's `Ready` on a ready socket while watching for early exits: a child
that fails makes serve stop the others and exit 1 with that child's reason. Once all are ready,
serve prints one `ready` line with the client endpoint, then supervises its children until
SIGINT/SIGTERM (exit 0 after stopping every child).

Supervision: a child that exits while serve runs is restarted with the same config (so a
frontend keeps its ports), after `restart_backoff_s`, doubled for each further exit within
`crash_loop_window_s`, once the socket files it had bound are removed. The child learns how
often it was restarted from $MMLANE_RESTARTS and publishes it (stats, health, top). Until its
restart, serve stands in for it on its stats and control sockets (`Child.down_until`): the
tools see the role in state 'restarting', with the number of the restart under way, not a
silent one. A role that exits `crash_loop_limit` times within the window stops serve (exit 1)
with a message naming it and quoting its last log lines. Its peers recover as under
supervisord: the frontend fails at once what a restarted MM worker or engine held (it learns of
the new process from the role's `HelloReply`), and the new process's new cache epoch heals the
mirrored cache. Each child runs in a process group of its own, and what is left of the group
when the child exits (vLLM's engine core and workers under a killed engine role) is killed with
it, before the restart.

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
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec
import zmq

from mmlane.common.config import (
    OpsConfig,
    default_run_dir,
    ipc,
    load_config,
    run_dir_defaults,
    usable_cores,
)
from mmlane.common.lifecycle import RESTARTS_ENV, setup_logging
from mmlane.common.model_dir import resolve_model_dir
from mmlane.common.settings import Settings
from mmlane.common.sockets import make_socket, write_keys
from mmlane.common.stats import Metrics, StatsServer
from mmlane.engine.config import EngineConfig
from mmlane.frontend.config import DEFAULT_PORT, FrontendConfig
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.protocol.errors import FatalError
from mmlane.protocol.messages import LauncherInput, StartupFailed

log = logging.getLogger("serve")  # the logger of `setup_logging("serve")`

KILL_GRACE_S = 10.0
"""How long after its drain timeout a stopping child may take to exit (closing its sockets,
logging its totals) before it is killed."""

LOG_TAIL_LINES = 20
"""How many of a child's last log lines serve quotes when the child's role crash-loops."""

BOUND_ENDPOINTS = {
    "engine": ("engine_endpoint",), "mm-worker": ("mm_worker_endpoint",),
    "frontend": ("output_endpoint",),
}
"""The config fields of each role's sockets that it binds, besides its stats and control ones."""


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
    restart_backoff_s: float = 0.5
    """Seconds before a role that exited is restarted; doubled for each further exit within
    `crash_loop_window_s`."""
    crash_loop_limit: int = 5
    """A role that exits this many times within `crash_loop_window_s` stops serve instead of
    being restarted again (1: any exit stops serve)."""
    crash_loop_window_s: float = 60.0
    """The window, in seconds, over which a role's exits are counted (`crash_loop_limit`)."""
    throwaway_keys: bool = False
    """Make a new CURVE key pair for each role in RUN_DIR/keys (removed at exit) and give it to
    the children, as --curve-keys would: CURVE between serve's own roles
    on tcp, with no keys to distribute."""

    def __post_init__(self) -> None:
        self.frontend.mm_worker_endpoint = [self.mm_worker.mm_worker_endpoint]
        for name in ("startup_timeout_s", "crash_loop_window_s", "crash_loop_limit"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.restart_backoff_s < 0:
            raise ValueError(f"restart_backoff_s must be 0 or more, got {self.restart_backoff_s}")
        if self.throwaway_keys and self.engine.security.curve_keys:
            raise ValueError("throwaway_keys and curve_keys: give one of them")

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
    engine = values.get("engine", {})
    mm_worker = values.get("mm_worker", {})
    if engine.get("backend") == "vllm-remote" and not engine.get("vllm", {}).get(
            "encoder_lane") and not mm_worker.get("mm_processes"):
        # No model on this host: its cores are the preprocessing tier's (image work niced).
        mm_worker = {**mm_worker, "mm_processes": usable_cores()}
    with run_dir_defaults(Path(run_dir)):
        return load_config(ServeConfig, {**values, "mm_worker": mm_worker, "run_dir": run_dir})


class Child:
    """One role's process, started with its validated config, the name it is known by, and the
    endpoint its `Ready` reported.

    The config travels as msgspec JSON on the child's stdin (`mmlane ROLE --config-json -`), not
    on its command line, where `ps` would show its secrets (API keys): the child decodes and
    validates it again, with no flag of its own. With `log_dir`, the child's stderr (its log)
    goes to LOG_DIR/ROLE.log instead of ours; without, it passes through us, and we keep its
    last lines (`log_tail`). With `run_dir`, it is the child's $MMLANE_RUN_DIR. With `command`,
    that program runs the role instead of `mmlane ROLE` (the benchmark's in-process server).
    """

    def __init__(
        self, role: str, config: msgspec.Struct, ready_endpoint: str,
        log_dir: Path | None = None, run_dir: Path | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.role = role
        self.config = config
        self.endpoint: str | None = None
        ops: OpsConfig | None = getattr(config, "ops", None)
        self.stop_timeout_s = (ops.drain_timeout_s if ops else 0.0) + KILL_GRACE_S
        """From SIGTERM to SIGKILL."""
        self.log_path = None if log_dir is None else log_dir / f"{role}.log"
        self.restarts = 0
        self.exits: deque[float] = deque()
        """When it exited while serve ran, within the crash-loop window."""
        self.restart_at: float | None = None
        """When the exited process is due to be restarted; None while it runs."""
        self._stand_in: StatsServer | None = None
        """While it is down: what answers for it on its stats and control sockets."""
        self._tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._log_thread: threading.Thread | None = None
        self._env = {**os.environ, **({} if run_dir is None else {"MMLANE_RUN_DIR": str(run_dir)})}
        program = command or [sys.executable, "-m", "mmlane.cli", role]
        self._argv = [*program, "--config-json", "-"]
        self._config_json = msgspec.json.encode(config)
        self.process = self._start(["--ready-endpoint", ready_endpoint])

    def _start(self, extra: list[str]) -> subprocess.Popen:
        env = {**self._env, RESTARTS_ENV: str(self.restarts)}
        argv = [*self._argv, *extra]
        if self.log_path is not None:
            with self.log_path.open("wb") as log_file:
                return self._handed_config(_popen(argv, env, log_file))
        process = self._handed_config(_popen(argv, env, subprocess.PIPE))
        self._log_thread = threading.Thread(
            target=self._pass_log, args=(process.stderr,), name=f"{self.role}-log", daemon=True
        )
        self._log_thread.start()
        return process

    def _handed_config(self, process: subprocess.Popen) -> subprocess.Popen:
        """Write the config to the new process's stdin and close it (a child that died at once
        reports that through its exit status, not here)."""
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError), process.stdin:
            process.stdin.write(self._config_json)
        return process

    def _pass_log(self, stream: IO[bytes]) -> None:
        """Copy the child's log to our stderr, keeping its last lines."""
        for line in stream:
            self._tail.append(line.decode(errors="replace").rstrip())
            with contextlib.suppress(OSError):  # our stderr gone: still drain, or the child blocks
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()

    def log_tail(self) -> list[str]:
        """The child's last LOG_TAIL_LINES log lines (none with a `log_dir`: see its file)."""
        return list(self._tail)

    def down_until(self, restart_at: float) -> None:
        """The process exited and restarts at `restart_at`; until then, publish its stats and
        answer its pings as a process in state 'restarting' would, on its sockets, with the
        number of the restart under way (pid: serve's)."""
        self.restart_at = restart_at
        ops: OpsConfig = self.config.ops  # type: ignore[attr-defined]
        metrics = Metrics(self.role, ops.name)
        metrics.state, metrics.restarts = "restarting", self.restarts + 1
        self._remove_socket_files()
        try:
            self._stand_in = StatsServer(
                metrics, stats_endpoint=ops.stats_endpoint, control_endpoint=ops.control_endpoint,
                interval_s=ops.stats_interval_s,
            ).start()
        except OSError as exc:  # e.g. its tcp port taken meanwhile: the tools see no answer
            log.warning("cannot stand in for %s while it is down: %s", self.role, exc)

    def _end_stand_in(self) -> None:
        if self._stand_in is not None:
            self._stand_in.close()
            self._stand_in = None

    def restart(self) -> None:
        """Start the role again with its config, once the socket files it bound are gone; it
        reports no `Ready` (serve is past startup)."""
        self._end_stand_in()
        self._remove_socket_files()
        self.restarts += 1
        self.restart_at = None
        self.process = self._start([])

    def _remove_socket_files(self) -> None:
        for path in self.socket_files():
            path.unlink(missing_ok=True)

    def socket_files(self) -> list[Path]:
        """The ipc:// socket files this child binds (a kill -9 leaves them behind)."""
        ops: OpsConfig = self.config.ops  # type: ignore[attr-defined]
        fields = BOUND_ENDPOINTS.get(self.role, ())
        endpoints = [ops.stats_endpoint, ops.control_endpoint,
                     *(getattr(self.config, name) for name in fields)]
        return [Path(e[len("ipc://"):]) for e in endpoints if e.startswith("ipc://")]

    def end_group(self) -> None:
        """SIGKILL what is left of the exited child's process group: the processes it started
        that would outlive it (vLLM's engine core and workers after a `kill -9` of the engine
        role), holding memory and devices its restart needs."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM: the child drains, then exits (one that is down: nothing stands in for it)."""
        self._end_stand_in()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.end_group()
        if self._log_thread is not None:  # its last lines reach our stderr before we exit
            self._log_thread.join(timeout=1.0)


def _popen(argv: list[str], env: dict[str, str], stderr: Any) -> subprocess.Popen:
    # Its own process group, so that what it starts (vLLM's engine core and workers) can be
    # ended with it: see `Child.end_group`.
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=stderr, env=env,
                            start_new_session=True)


def _give_throwaway_keys(config: ServeConfig, folder: Path) -> None:
    """A new key pair per role in `folder` (a killed serve's old ones removed first), and every
    child's curve_keys pointing to it."""
    shutil.rmtree(folder, ignore_errors=True)
    for role, role_config in config.roles().items():
        write_keys(folder, role)
        role_config.security.curve_keys = str(folder)  # type: ignore[attr-defined]


def serve(args: argparse.Namespace) -> int:
    log = setup_logging("serve")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children: list[Child] = []
    values = SERVE_SETTINGS.values(args)
    run_dir: Path | None = None
    keys: Path | None = None
    try:
        config = serve_config(values)
        run_dir = Path(str(config.run_dir))
        model_dir = resolve_model_dir(config.engine.model)  # build the default model once
        for role_config in config.roles().values():
            role_config.model = str(model_dir)  # type: ignore[attr-defined]
        if config.throwaway_keys:
            keys = run_dir / "keys"
            _give_throwaway_keys(config, keys)
        children = start_roles(config.roles(), run_dir, config.startup_timeout_s, stop)
        if stop.is_set():
            return 0
        frontend = config.frontend
        http = (f", HTTP API http://{frontend.http_host}:{frontend.http_port}/v1"
                if frontend.http_port else "")
        print(f"mmlane ready: client endpoint {frontend.client_endpoint}{http} "
              f"(model {model_dir})", flush=True)
        return _supervise(children, config, stop, log)
    except FatalError as exc:
        print(f"mmlane serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(children)
        if keys is not None:
            shutil.rmtree(keys, ignore_errors=True)
        if run_dir is not None and not values.get("run_dir"):  # a folder made for this run only
            shutil.rmtree(run_dir, ignore_errors=True)


def start_roles(
    roles: dict[str, msgspec.Struct],
    run_dir: Path,
    timeout_s: float,
    stop: threading.Event | None = None,
    log_dir: Path | None = None,
    commands: Mapping[str, Sequence[str]] | None = None,
) -> list[Child]:
    """Start each role with its config and wait until every one reports ready.

    Each child logs to LOG_DIR/ROLE.log when `log_dir` is given, else to our stderr. A role
    named in `commands` runs that program (see `Child`), any other `mmlane ROLE`.
    Raises FatalError with the failing child's reason (after stopping the others) when a child
    reports a startup failure, exits, or is not ready within `timeout_s`.
    """
    ctx: zmq.Context = zmq.Context.instance()
    ready_endpoint = ipc(f"ready-{time.monotonic_ns()}", run_dir)
    children: list[Child] = []
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with make_socket(ctx, zmq.PULL, ready_endpoint, bind=True, linger_ms=0) as sock:
            for role, config in roles.items():
                command = (commands or {}).get(role)
                with _interrupt_held():  # a started process is in `children` before it ends us
                    children.append(Child(role, config, ready_endpoint, log_dir, run_dir,
                                          command))
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


def _supervise(
    children: list[Child], config: ServeConfig, stop: threading.Event, log: logging.Logger
) -> int:
    """Restart each child that exits until the stop (see the module docstring); raises
    FatalError when one crash-loops."""
    while not stop.wait(0.2):
        now = time.monotonic()
        for child in children:
            if child.restart_at is None and child.process.poll() is not None:
                child.end_group()
                child.down_until(now + _backoff(child, config, now, log))
            elif child.restart_at is not None and now >= child.restart_at:
                log.info("restarting %s (restart %d)", child.role, child.restarts + 1)
                child.restart()
    log.info("stopping")
    return 0


def _backoff(child: Child, config: ServeConfig, now: float, log: logging.Logger) -> float:
    """Count the child's exit and return how long to wait before its restart; raises
    FatalError once its role exits `crash_loop_limit` times within the window."""
    child.exits.append(now)
    while child.exits[0] < now - config.crash_loop_window_s:
        child.exits.popleft()
    status, count = child.process.returncode, len(child.exits)
    if count >= config.crash_loop_limit:
        tail = "\n".join(f"  {line}" for line in child.log_tail())
        raise FatalError(
            f"{child.role} exited {count} times within {config.crash_loop_window_s:g} s (last "
            f"status {status}); not restarting it. Its last log lines:\n{tail}"
        )
    delay = config.restart_backoff_s * 2 ** (count - 1)
    log.error("%s exited with status %s; restarting it in %.1f s", child.role, status, delay)
    return delay


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Meanwhile SIGTERM raises KeyboardInterrupt(signum), as Ctrl-C does, so that a tool that
    started roles (each in a session of its own, which no signal to the tool's process group
    reaches) stops them in its `finally` blocks when `timeout` or a supervisor ends it. Either
    signal waits while `start_roles` starts a process, until the process is on its list."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Held(threading.local):
    depth = 0
    signum: int | None = None
    """The signal that came while held, raised when the hold ends."""


_held = _Held()
"""The main thread's (where signal handlers run): set by `_interrupt_held`."""


def _interrupt(signum: int, frame: object) -> None:
    if _held.depth:
        _held.signum = _held.signum or signum
        return
    raise KeyboardInterrupt(signum)


@contextlib.contextmanager
def _interrupt_held() -> Iterator[None]:
    """Meanwhile `_interrupt` only notes its signal; it raises when the block ends."""
    _held.depth += 1
    try:
        yield
    finally:
        _held.depth -= 1
    if not _held.depth and _held.signum is not None:
        signum, _held.signum = _held.signum, None
        raise KeyboardInterrupt(signum)


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
