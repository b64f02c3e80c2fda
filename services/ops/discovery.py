"""Where the operator tools find mmlane's processes: one home for --connect and --run-dir.

Every role binds `stats-NAME.sock` and `control-NAME.sock` in its run directory unless told
otherwise, and `mmlane serve` puts its roles in `RUN_DIR/serve-PORT`, so a recursive search of
the default run directory finds every process started with default addresses on this machine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq

from mmlane.common.sockets import make_socket
from mmlane.protocol.errors import FatalError

SocketKind = Literal["stats", "control"]


@dataclass(frozen=True)
class Targets:
    """The sockets of one kind a tool watches: fixed addresses, or the files under `run_dir`."""

    kind: SocketKind
    connect: tuple[str, ...]
    run_dir: Path

    @property
    def discovering(self) -> bool:
        """True when the sockets are searched for (no --connect): the set may grow."""
        return not self.connect

    def endpoints(self) -> list[str]:
        """The addresses to connect to now: the given ones, or every socket file found."""
        if self.connect:
            return list(self.connect)
        found = self.run_dir.rglob(f"{self.kind}-*.sock")
        return [f"ipc://{path}" for path in sorted(found) if path.is_socket()]

    def require_endpoints(self) -> list[str]:
        """`endpoints()`, or FatalError saying where nothing was found."""
        endpoints = self.endpoints()
        if not endpoints:
            raise FatalError(
                f"no {self.kind} sockets ({self.kind}-*.sock) under {self.run_dir}: is mmlane "
                "running? Point at its run directory with --run-dir, or give --connect ADDR"
            )
        return endpoints


def targets(args: argparse.Namespace, kind: SocketKind) -> Targets:
    """The `Targets` of a tool's --connect and --run-dir arguments."""
    return Targets(kind=kind, connect=tuple(args.connect), run_dir=Path(args.run_dir))


def endpoint_label(endpoint: str) -> str:
    """What to call a process before it has said its name: NAME for .../stats-NAME.sock or
    .../control-NAME.sock, else the address itself."""
    if endpoint.startswith("ipc://"):
        stem = Path(endpoint[len("ipc://"):]).stem
        for prefix in ("stats-", "control-"):
            if stem.startswith(prefix):
                return stem[len(prefix):]
    return endpoint


def connect(ctx: zmq.Context, socket_type: int, endpoint: str) -> zmq.Socket:
    """A socket connected to `endpoint`, closed without lingering: a tool never waits to
    deliver. A malformed address (a --connect typo) becomes a FatalError naming it."""
    try:
        return make_socket(ctx, socket_type, endpoint, bind=False, linger_ms=0)
    except zmq.ZMQError as exc:
        raise FatalError(f"cannot connect to {endpoint!r}: {exc}") from exc
