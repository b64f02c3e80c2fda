"""Process lifecycle shared by every role: logging, signals, and the startup handshake.

A role is any object with `endpoint`, `serve(stop)` and `close()`. `run_role` builds it, starts
its stats thread (when given the role's `OpsConfig`: the role then has `metrics`), reports
`Ready` (or `StartupFailed` with the reason) to the launcher's ready socket when one is given,
serves until SIGINT/SIGTERM, then closes it and returns the exit status. At the signal the
role's `serve` returns once it has drained (see each role's `drain_timeout_s`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from protocol.messages import Ready, StartupFailed
from services.common.config import OpsConfig
from services.common.stats import StatsServer


class Role(Protocol):
    endpoint: str

    def serve(self, stop: threading.Event) -> None: ...

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
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    service: Role | None = None
    stats: StatsServer | None = None
    try:
        service = build()
        if ops is not None:
            stats = StatsServer(
                service.metrics,  # type: ignore[attr-defined]  # the roles that take `ops` have it
                stats_endpoint=ops.stats_endpoint,
                control_endpoint=ops.control_endpoint, interval_s=ops.stats_interval_s,
            ).start()
    except Exception as exc:  # any startup failure is reported, not raised through
        message = f"{type(exc).__name__}: {exc}"
        log.error("failed to start: %s\n%s", message, traceback.format_exc())
        _announce(ready_endpoint, StartupFailed(role=role, pid=os.getpid(), message=message))
        if service is not None:
            service.close()
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


def _announce(ready_endpoint: str | None, message: Ready | StartupFailed) -> None:
    if not ready_endpoint:
        return
    ctx: zmq.Context = zmq.Context.instance()
    with ctx.socket(zmq.PUSH) as sock:
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(ready_endpoint)
        sock.send(msgspec.msgpack.encode(message))
