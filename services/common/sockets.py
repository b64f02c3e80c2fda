"""The one socket factory, and the cache of sockets that send replies to `reply_to` addresses."""

from __future__ import annotations

import logging
import socket
from collections import OrderedDict
from pathlib import Path
from typing import Any

import zmq

log = logging.getLogger(__name__)

DEFAULT_HWM = 1000
DEFAULT_LINGER_MS = 1000  # long enough to flush the last replies at a graceful stop


def make_socket(
    ctx: zmq.Context,
    socket_type: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int = DEFAULT_HWM,
    linger_ms: int = DEFAULT_LINGER_MS,
    monitor_events: int = 0,
) -> zmq.Socket:
    """Create a socket with our high-water marks and linger, bound or connected to `endpoint`.

    With `monitor_events` (`zmq.EVENT_*` flags), those events of the socket are monitored from
    before its bind or connect, so that its first connection is among them; read them from
    `sock.get_monitor_socket()` (`zmq.utils.monitor.recv_monitor_message`)."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if monitor_events:
        sock.get_monitor_socket(monitor_events)
    if bind:
        _prepare_ipc_dir(endpoint)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot bind {endpoint}: {exc}") from exc
    else:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:  # e.g. a malformed reply_to: do not leak the socket
            sock.close(linger=0)
            raise
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:
    """The address `sock` was last bound to, as bound: `tcp://HOST:0` (or `:*`) comes back with
    the port the system chose, so a role or test binds a free port without racing for it."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (for benchmarks and local runs). Another
    process may take it before it is bound: where the race matters, bind port 0 and read the
    port back (`bound_endpoint`)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _prepare_ipc_dir(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        Path(endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)


class ReplySockets:
    """PUSH sockets to the `reply_to` addresses of frontends, opened on first use (LRU-bounded).

    A send never blocks: if a frontend is gone and its queue is full, the reply is dropped and
    logged, since nobody is left to read it.
    """

    def __init__(self, ctx: zmq.Context, *, max_peers: int = 64) -> None:
        self._ctx = ctx
        self._max_peers = max_peers
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()

    def send(self, reply_to: str, frames: list[Any]) -> bool:
        sock = self._socket(reply_to)
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("reply to %s dropped: peer not reading", reply_to)
            return False

    def _socket(self, reply_to: str) -> zmq.Socket:
        sock = self._sockets.get(reply_to)
        if sock is None:
            sock = make_socket(self._ctx, zmq.PUSH, reply_to, bind=False)
            self._sockets[reply_to] = sock
            if len(self._sockets) > self._max_peers:
                _, oldest = self._sockets.popitem(last=False)
                oldest.close()
        self._sockets.move_to_end(reply_to)
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
