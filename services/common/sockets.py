"""The one socket factory, how it secures the sockets between roles (`Security`), and the cache
of sockets that send replies to `reply_to` addresses.

Between roles, tcp is ZMQ CURVE (libzmq's; pyzmq's ZAP authenticator) once a role has a keys
folder (`mmlane keys`); ipc relies on file permissions (folders made 0700, sockets 0600).
Keys are per role, not per process: every frontend holds frontend.key_secret, and a peer
connecting to a frontend's `reply_to` expects the server key frontend.key. So a scaled-out or
restarted process needs no new key anywhere, no message carries a key, and the server key a
client needs follows from the role it connects to (the engine, an MM worker, a frontend),
which every connection already knows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from mmlane.common.config import DEFAULT_HOST, SecurityConfig, is_loopback

log = logging.getLogger(__name__)

DEFAULT_HWM = 1000
DEFAULT_LINGER_MS = 1000  # long enough to flush the last replies at a graceful stop
ZAP_DOMAIN = "mmlane"
CURVE_REFUSED = "curve_refused"
"""The counter of peers refused at the CURVE handshake (their key is not accepted)."""
# A handshake that failed before ZAP was asked. A plain ZMQ peer meeting a CURVE server fails
# with PROTOCOL (mechanism mismatch) or, when its own check closed the connection first, with
# NO_DETAIL (EPIPE or ECONNRESET while the server's greeting is sent): about 1 in 4 on loopback.
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
REFUSAL_LOG_EVERY_S = 60.0
"""A refused key is logged again only after this long: its peer retries every 100 ms or so."""


class Security:
    """A role's rules for its sockets to other roles (`SecurityConfig`): with `curve_keys`, a
    bound tcp socket is a CURVE server whose ZAP handler (one per context, started at the first
    such bind) admits only the folder's public keys, counting each refused key in `refused`
    (`curve_refused`), as are the peers that fail the handshake before ZAP is asked (a plain
    tcp peer, a client expecting another server key, one that leaves mid-handshake: a
    `ROLE-handshakes` thread per bound socket reads its monitor); a connecting tcp socket is a
    CURVE client expecting the server key of the role it connects to. Without keys, plain tcp
    may bind only loopback addresses unless `insecure_tcp`. `close` stops those
    threads; call it before the context ends."""

    def __init__(self, role: str, config: SecurityConfig,
                 refused: Counter[str] | None = None) -> None:
        self.role = role
        self.insecure_tcp = config.insecure_tcp
        self._folder = Path(config.curve_keys) if config.curve_keys else None
        self._refused = refused if refused is not None else Counter()
        self._auth: ThreadAuthenticator | None = None
        self._refusals_logged: dict[bytes, float] = {}
        self._watchers: list[threading.Thread] = []
        self._closing = threading.Event()
        self._public, self._secret = self._own_keys() if self._folder else (b"", b"")
        self._accepted = (frozenset(zmq.auth.load_certificates(self._folder))
                          if self._folder else frozenset())

    @classmethod
    def of(cls, role: str, config: Any, refused: Counter[str]) -> Security:
        """The security of a role's config (its `security: SecurityConfig`)."""
        return cls(role, config.security, refused)

    @property
    def curve(self) -> bool:
        return self._folder is not None

    def secure(self, ctx: zmq.Context, sock: zmq.Socket, endpoint: str, *, bind: bool,
               peer: str) -> None:
        """Make `sock` a CURVE server (bind) or a client of a `peer` role's server, on tcp."""
        if not endpoint.startswith("tcp://"):
            return
        if not self.curve:
            host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
            if bind and not self.insecure_tcp and not is_loopback(host):
                raise OSError(
                    f"refusing to bind {endpoint}: plain tcp on a non-loopback address lets "
                    "anyone who reaches it submit work; give --curve-keys DIR (`mmlane keys`) "
                    "or --insecure-tcp")
            return
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self._public
        if bind:
            self._start_zap(ctx)
            sock.zap_domain = ZAP_DOMAIN.encode()
            sock.curve_server = True
            self._watch_handshakes(sock, endpoint)
        else:
            sock.curve_serverkey = self._server_key(peer)

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question (on its thread): is this client's public key accepted?"""
        if key in self._accepted:
            return True
        self._refused[CURVE_REFUSED] += 1
        now = time.monotonic()
        if now - self._refusals_logged.get(key, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
            if len(self._refusals_logged) > 1024:  # bounded: many keys, each still counted
                self._refusals_logged.clear()
            self._refusals_logged[key] = now
            log.warning("[%s] refused a peer at the CURVE handshake: key %s is not in %s "
                        "(%d refusals so far)", self.role, key.decode("ascii", "replace"),
                        self._folder, self._refused[CURVE_REFUSED])
        return False

    def close(self) -> None:
        self._closing.set()
        for watcher in self._watchers:
            watcher.join()
        self._watchers.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _watch_handshakes(self, sock: zmq.Socket, endpoint: str) -> None:
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        watcher = threading.Thread(target=self._count_failed_handshakes, args=(monitor, endpoint),
                                   name=f"{self.role}-handshakes", daemon=True)
        watcher.start()
        self._watchers.append(watcher)

    def _count_failed_handshakes(self, monitor: zmq.Socket, endpoint: str) -> None:
        """Until `close`: count each peer of `endpoint` whose handshake failed before ZAP (its
        socket's monitor is this thread's alone), logging the first of each minute."""
        logged_at = -REFUSAL_LOG_EVERY_S
        try:
            while not self._closing.is_set():
                if not monitor.poll(200):
                    continue
                event = recv_monitor_message(monitor)
                if not event["event"] & _HANDSHAKE_FAILED:
                    continue  # EVENT_MONITOR_STOPPED: the socket closed
                self._refused[CURVE_REFUSED] += 1
                if time.monotonic() - logged_at >= REFUSAL_LOG_EVERY_S:
                    logged_at = time.monotonic()
                    log.warning("[%s] refused a peer at %s: its handshake failed (a plain tcp "
                                "peer, one expecting another server key, or one that left "
                                "mid-handshake; %d refusals so far)",
                                self.role, endpoint, self._refused[CURVE_REFUSED])
        finally:
            monitor.close(linger=0)

    def _own_keys(self) -> tuple[bytes, bytes]:
        assert self._folder is not None
        path = self._folder / f"{self.role}.key_secret"
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise OSError(f"curve_keys: cannot read this role's secret key {path}: {exc}") from exc
        if not secret:
            raise OSError(f"curve_keys: {path} holds no secret key")
        return public, secret

    def _server_key(self, peer: str) -> bytes:
        assert self._folder is not None
        path = self._folder / f"{peer}.key"
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise OSError(f"curve_keys: cannot read the {peer}'s public key {path}: {exc}"
                          ) from exc
        return public

    def _start_zap(self, ctx: zmq.Context) -> None:
        if self._auth is not None:
            if self._auth.context is not ctx:
                raise RuntimeError("one Security serves the sockets of one zmq context")
            return
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
        self._auth.start()
        self._auth.thread.name = f"{self.role}-zap"
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)


def write_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """A new CURVE key pair for role `name` in `folder`: NAME.key (public) and NAME.key_secret
    (made 0600, the folder 0700 when created here); an existing pair is not overwritten."""
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists: remove it to make a new pair")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    secret.chmod(0o600)
    public.chmod(0o644)
    return public, secret


def make_socket(
    ctx: zmq.Context,
    socket_type: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int = DEFAULT_HWM,
    linger_ms: int = DEFAULT_LINGER_MS,
    monitor_events: int = 0,
    security: Security | None = None,
    peer: str = "",
) -> zmq.Socket:
    """Create a socket with our high-water marks and linger, bound or connected to `endpoint`.

    With `monitor_events` (`zmq.EVENT_*` flags), those events of the socket are monitored from
    before its bind or connect, so that its first connection is among them; read them from
    `sock.get_monitor_socket()` (`zmq.utils.monitor.recv_monitor_message`). A socket between
    roles gives its role's `security` and, connecting, the `peer` role it connects to: tcp is
    then CURVE, or plain on loopback only. An ipc socket's new folder is made 0700 and the
    socket file 0600."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if monitor_events:
        sock.get_monitor_socket(monitor_events)
    try:
        if security is not None:
            security.secure(ctx, sock, endpoint, bind=bind, peer=peer)
    except BaseException:
        sock.close(linger=0)
        raise
    if bind:
        _prepare_ipc_dir(endpoint)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot bind {endpoint}: {exc}") from exc
        _restrict_ipc_file(endpoint)
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


def free_tcp_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that is free on `host` right now (for benchmarks and local runs), and none
    this process was given before: two servers started together (vLLM alone and mmlane, in a
    test) would otherwise both get one port, free until the first of them binds it.

    It is drawn below the system's ephemeral range, where the system never hands out ports by
    itself: a port from `bind(0)` could go to any outgoing connection (an HTTP client's, say)
    before the server binds it. Another program may still take it; where the race matters,
    bind port 0 and read the port back (`bound_endpoint`)."""
    low, high = _FREE_PORT_RANGE
    for _ in range(1000):
        port = _random.randrange(low, high) if high > low else _bound_port_zero(host)
        if port in _GIVEN_PORTS:  # at most the host's ports: bounded
            continue
        with contextlib.suppress(OSError):
            if high > low:
                with socket.socket() as sock:
                    sock.bind((host, port))
            _GIVEN_PORTS.add(port)
            return port
    raise OSError(f"no free TCP port on {host} in {low}-{high - 1}")


def _bound_port_zero(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def _free_port_range() -> tuple[int, int]:
    """[low, high): the 10,000 ports below the ephemeral range (Linux), else empty (bind 0)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return (0, 0)
    return (max(1024, ephemeral_low - 10_000), ephemeral_low)


_FREE_PORT_RANGE = _free_port_range()
_random = random.Random()
_GIVEN_PORTS: set[int] = set()


def _prepare_ipc_dir(endpoint: str) -> None:
    """The socket's folder, made 0700 if it is new (an existing one, /tmp say, is left as is)."""
    if endpoint.startswith("ipc://"):
        Path(endpoint[len("ipc://"):]).parent.mkdir(mode=0o700, parents=True, exist_ok=True)


def _restrict_ipc_file(endpoint: str) -> None:
    """Only this user may connect to a bound ipc socket (abstract '@' names have no file)."""
    path = endpoint[len("ipc://"):]
    if endpoint.startswith("ipc://") and not path.startswith("@"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path, 0o600)


class ReplySockets:
    """PUSH sockets to the `reply_to` addresses of frontends, opened on first use (LRU-bounded).

    A send never blocks: it says whether the socket took the message, which it does not while
    the frontend's queue is full (a frontend gone, or one reading slower than replies come);
    the caller decides what then. With the role's `security`, a tcp `reply_to` is reached over
    CURVE, expecting the frontends' key.
    """

    def __init__(self, ctx: zmq.Context, *, max_peers: int = 64,
                 security: Security | None = None) -> None:
        self._ctx = ctx
        self._security = security
        self._max_peers = max_peers
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()

    def send(self, reply_to: str, frames: list[Any]) -> bool:
        sock = self._socket(reply_to)
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _socket(self, reply_to: str) -> zmq.Socket:
        sock = self._sockets.get(reply_to)
        if sock is None:
            sock = make_socket(self._ctx, zmq.PUSH, reply_to, bind=False,
                               security=self._security, peer="frontend")
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
