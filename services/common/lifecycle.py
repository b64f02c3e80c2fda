"""Process lifecycle shared by every role: logging, signals, and the startup handshake.

A role is any object with `endpoint`, `serve(stop)` and `close()`. `run_role` builds it, starts
its stats thread (when given the role's `OpsConfig`: the role then has `metrics`), reports
`Ready` (or `StartupFailed` with the reason) to the launcher's ready socket when one is given,
serves until SIGINT/SIGTERM, then closes it and returns the exit status.

The signal starts a graceful stop, the same in every role: its state turns 'draining' at once
(stats and health show it), it refuses new work with `refused_while_draining`, finishes what it
holds for up to `drain_timeout_s` (counted from the signal: `Stop.drain_expired`), fails what is
left with `unfinished_at_drain_timeout`, and `serve` returns once every request it held has had
its terminal reply. Both errors are retryable, code `DRAINING_CODE`: the request may succeed on
another instance, or on this one once it is back. So is `lost_in_restart`, for what a role held
when its process ended without a drain (a kill -9, a crash).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from mmlane.common.config import OpsConfig
from mmlane.common.stats import Metrics, StatsServer, count_full_collections
from mmlane.protocol.errors import RetryableError
from mmlane.protocol.messages import Ready, StartupFailed

RESTARTS_ENV = "MMLANE_RESTARTS"
"""How often `mmlane serve` has restarted this role's process (set in the child's environment);
the role publishes it in its stats and pings."""

DRAINING_CODE = "peer_restarted"
"""The error code of work a stopping role refuses or cannot finish: to the client, the process
that had its request is restarting."""


class Stop(threading.Event):
    """Set at SIGINT/SIGTERM: the role stops taking work and has `drain_timeout_s` from that
    moment to answer what it holds. Setting it also turns the role's `metrics` 'draining'."""

    def __init__(self, drain_timeout_s: float) -> None:
        super().__init__()
        self.drain_timeout_s = drain_timeout_s
        self.metrics: Metrics | None = None
        self._deadline = float("inf")

    def set(self) -> None:
        if not self.is_set():
            self._deadline = time.monotonic() + self.drain_timeout_s
            if self.metrics is not None:
                self.metrics.state = "draining"
        super().set()

    def drain_expired(self) -> bool:
        """Whether the drain timeout has passed since the stop (False before any stop)."""
        return time.monotonic() >= self._deadline


def drain(
    stop: Stop, log: logging.Logger, *, held: Callable[[], int], turn: Callable[[], None]
) -> None:
    """Run the role's loop (`turn`) while it holds work (`held`) and the drain timeout has not
    passed; the role then fails what is left."""
    count = held()
    log.info("draining %d requests (up to %g s)", count, stop.drain_timeout_s)
    started = time.monotonic()
    while held() and not stop.drain_expired():
        turn()
    left = held()
    if left:
        log.warning("drain timeout: failing %d unfinished requests", left)
    elif count:
        log.info("drained in %.1f s", time.monotonic() - started)


def refused_while_draining(role: str) -> RetryableError:
    """The error for new work that reaches a role after its stop began."""
    return RetryableError(f"the {role} is stopping and takes no new requests",
                          code=DRAINING_CODE)


def unfinished_at_drain_timeout(role: str, stop: Stop) -> RetryableError:
    """The error for held work still unfinished when the drain timeout ran out."""
    return RetryableError(
        f"the {role} stopped before the request finished (drain timeout "
        f"{stop.drain_timeout_s:g} s)", code=DRAINING_CODE,
    )


def lost_in_restart(peer: str) -> RetryableError:
    """The error for work a peer held when its process ended, found out once it is back (a
    frontend learns it from the peer's `HelloReply`)."""
    return RetryableError(f"the {peer} restarted (a new process) before the request finished",
                          code=DRAINING_CODE)


class Role(Protocol):
    endpoint: str

    def serve(self, stop: Stop) -> None: ...

    def close(self) -> None: ...


def setup_logging(role: str) -> logging.Logger:
    level = os.environ.get("MMLANE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"[{role}] %(levelname)s %(name)s: %(message)s")
    return logging.getLogger(role)


def run_role(
    role: str, build: Callable[[], Role], ready_endpoint: str | None, ops: OpsConfig | None = None
) -> int:
    """Build, announce, serve and stop one role; returns the process exit status."""
    log = setup_logging(role)
    stop = Stop(ops.drain_timeout_s if ops is not None else 0.0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    service: Role | None = None
    stats: StatsServer | None = None
    try:
        # While it builds (loads its model), the role answers stats and pings as 'starting'.
        stats = None if ops is None else _stats_server(Metrics(role, ops.name), ops, "starting")
        service = build()
        if ops is not None:
            metrics: Metrics = service.metrics  # type: ignore[attr-defined]  # roles given `ops` have it
            stop.metrics = metrics  # from the signal on, stats and health say 'draining'
            assert stats is not None
            stats.close()  # the built role's own takes its sockets over
            stats = None
            stats = _stats_server(metrics, ops)
        _freeze_startup_heap(log)
        if ops is not None:
            metrics.add_counters(count_full_collections())
    except Exception as exc:  # any startup failure is reported, not raised through
        message = f"{type(exc).__name__}: {exc}"
        log.error("failed to start: %s\n%s", message, traceback.format_exc())
        _announce(ready_endpoint, StartupFailed(role=role, pid=os.getpid(), message=message))
        if service is not None:
            service.close()
        if stats is not None:
            stats.close()
        return 1
    try:
        log.info("ready on %s", service.endpoint)
        _announce(ready_endpoint, Ready(role=role, pid=os.getpid(), endpoint=service.endpoint))
        service.serve(stop)
        log.info("stopped")
    finally:
        service.close()
        if stats is not None:
            stats.close()
    return 0


def lower_priority(steps: int) -> None:
    """Run the calling thread `steps` nice steps lower (at most 19). On Linux niceness is per
    thread: the others keep theirs, and threads and processes started from this one later
    inherit it."""
    if steps:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + steps))


def _freeze_startup_heap(log: logging.Logger) -> None:
    """Take what the role built (its modules, model, tokenizer: hundreds of thousands of
    objects that live as long as it does) out of garbage collection, as vLLM's API server does:
    else each full collection walks them all while the GIL is held, 250-440 ms here
    (stats.FULL_COLLECTIONS)."""
    gc.collect()  # what is garbage now is freed, not kept for good
    gc.freeze()
    log.info("%d objects built at startup are left out of garbage collection",
             gc.get_freeze_count())


def _stats_server(metrics: Metrics, ops: OpsConfig, state: str | None = None) -> StatsServer:
    """A started StatsServer for `metrics` on the role's stats and control sockets, with the
    restart count from $MMLANE_RESTARTS (and `state` unless None)."""
    metrics.restarts = int(os.environ.get(RESTARTS_ENV, "0"))
    if state is not None:
        metrics.state = state
    return StatsServer(metrics, stats_endpoint=ops.stats_endpoint,
                       control_endpoint=ops.control_endpoint,
                       interval_s=ops.stats_interval_s).start()


def _announce(ready_endpoint: str | None, message: Ready | StartupFailed) -> None:
    if not ready_endpoint:
        return
    ctx: zmq.Context = zmq.Context.instance()
    with ctx.socket(zmq.PUSH) as sock:
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(ready_endpoint)
        sock.send(msgspec.msgpack.encode(message))
