"""The HTTP API's bounds on its clients: connections, slow request heads, request rates.

aiohttp bounds a body's size, but not how long a client may take to send a request's head, nor
how many connections it may hold open, and it has no rate limit. Those are here, so that slow or
abusive clients (slowloris, floods of idle connections, one key's burst) cannot take what the
other clients need:

- `Connections` is the listening socket's protocol factory. Each connection gets a
  `_Guarded` protocol that hands everything to aiohttp's own, and refuses a connection over
  `http_max_connections` with a 503 (and `Retry-After`) before aiohttp sees it. A request head
  (from the connection's opening, or from the first byte sent to an idle connection, to aiohttp
  calling a handler) must arrive within `http_header_timeout_s`, else a 408 and the connection
  is closed; a connection idle after its answer is closed after `http_keepalive_timeout_s`. An
  answer given here closes in stages (RFC 9112 section 9.6): the write side is shut at once and
  what the client still sends is read and dropped for up to `LINGER_S`, since closing a socket
  that has unread bytes, or that gets more, makes the kernel send a reset, and a reset can lose
  the answer before the client reads it. A lingering connection no longer counts as open.
  (aiohttp's own keep-alive timer is set out of the way: it runs from a connection's opening or
  last answer, so it would cut a head in progress without a word.) The body's own bound
  (between two reads) is the API's: it reads the body.
- `RateLimiter` keeps a token bucket per key (API key, or client address without keys):
  `rate` requests a second with bursts of `burst` (`http_rate_limit`, `http_rate_burst`); a
  request over it waits for nothing but gets a 429 saying, in `Retry-After`, when a token is
  back.

Everything here runs on the HTTP API's event loop, the only thread that touches it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mmlane.common.stats import Metrics
from mmlane.frontend.config import FrontendConfig

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Seconds a 503 answer's `Retry-After` asks a client to wait before it tries again."""
LINGER_S = 2.0
"""Seconds a connection answered below aiohttp (408, 503) is still read after its write side is
shut, unless the client closes first (the module's docstring)."""
MAX_RATE_KEYS = 65536
"""Keys whose buckets are kept; the least recently seen is forgotten first (a forgotten key
starts again with a full bucket, so forgetting is only ever lenient)."""


def raw_response(status: int, reason: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes its connection, for answers given below aiohttp."""
    payload = json.dumps(body).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", "Connection: close",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class Connections:
    """The protocol factory of the HTTP API's listening socket (see the module's docstring)."""

    def __init__(self, inner: Callable[[], asyncio.Protocol], config: FrontendConfig, *,
                 metrics: Metrics, error_body: Callable[[str, str], dict[str, Any]]) -> None:
        self._inner = inner
        self.config = config
        """Its `http_max_connections`, `http_header_timeout_s` and `http_keepalive_timeout_s`."""
        self.metrics = metrics
        self.error_body = error_body
        self.open: dict[asyncio.Protocol, _Guarded] = {}
        """Each open connection's guard, by the aiohttp protocol it wraps."""

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self, self._inner)

    def handling(self, protocol: Any) -> None:
        """aiohttp calls a handler on this connection: its request head has arrived."""
        guard = self.open.get(protocol)
        if guard is not None:
            guard.handling(True)

    def handled(self, protocol: Any) -> None:
        """The handler returned: the connection is idle until the client's next byte."""
        guard = self.open.get(protocol)
        if guard is not None:
            guard.handling(False)


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, the connection bound, and one timer: the
    head's (a request is on its way), the keep-alive's (idle after an answer) or the linger's
    (answered here, closing)."""

    def __init__(self, connections: Connections, inner: Callable[[], asyncio.Protocol]) -> None:
        self._connections = connections
        self._make_inner = inner
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_for = ""
        """"head", "idle" or "linger": what the timer bounds ("": none is armed)."""
        self._busy = False
        self._lingering = False
        """Answered below aiohttp and shut for writing: what arrives is dropped."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        connections = self._connections
        if len(connections.open) >= connections.config.http_max_connections:
            connections.metrics.counters["http_connections_refused"] += 1
            log.warning("HTTP connection from %s refused: %d are open, the most allowed "
                        "(--http-max-connections)", transport.get_extra_info("peername"),
                        len(connections.open))
            self._answer_and_close(raw_response(503, "Service Unavailable", connections.error_body(
                f"the HTTP API holds the most connections it takes "
                f"({connections.config.http_max_connections}); try again", "overloaded"),
                {"Retry-After": retry_after(RETRY_AFTER_S)}))
            return
        self._inner = self._make_inner()
        connections.open[self._inner] = self
        self._arm("head")
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None or self._lingering:
            return
        if not self._busy and self._timer_for != "head":  # a request's first byte, when idle
            self._arm("head")
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is None or self._lingering:
            return None  # the transport closes
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._inner is not None:
            self._connections.open.pop(self._inner, None)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def handling(self, busy: bool) -> None:
        self._busy = busy
        self._disarm()
        if not busy:
            self._arm("idle")

    def _arm(self, what: str) -> None:
        self._disarm()
        config = self._connections.config
        seconds, then = (config.http_header_timeout_s, self._too_slow) if what == "head" \
            else (config.http_keepalive_timeout_s, self._idle_too_long)
        self._timer = asyncio.get_running_loop().call_later(seconds, then)
        self._timer_for = what

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_for = ""

    def _idle_too_long(self) -> None:
        self._timer, self._timer_for = None, ""
        if self._transport is not None:
            self._transport.close()

    def _too_slow(self) -> None:
        self._timer, self._timer_for = None, ""
        transport, connections = self._transport, self._connections
        if transport is None or transport.is_closing():
            return
        connections.metrics.counters["http_slow_heads"] += 1
        log.warning("HTTP connection from %s sent no whole request head in %g s "
                    "(--http-header-timeout): 408, closed", transport.get_extra_info("peername"),
                    connections.config.http_header_timeout_s)
        self._answer_and_close(raw_response(408, "Request Timeout", connections.error_body(
            f"no whole request head within {connections.config.http_header_timeout_s:g} s",
            "request_timeout")))

    def _answer_and_close(self, response: bytes) -> None:
        """Write `response`, shut the write side, and close once the client has or `LINGER_S`
        has passed (the module's docstring). The listener is plain TCP, whose transport can
        always shut its write side."""
        transport = self._transport
        assert transport is not None
        self._disarm()
        self._lingering = True
        if self._inner is not None:
            self._connections.open.pop(self._inner, None)
        transport.write(response)
        transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        self._timer_for = "linger"


class RateLimiter:
    """Token buckets by key: `rate` requests a second, `burst` at once (module docstring)."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate, self._burst = rate, burst
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """key -> (tokens, when they were counted)."""

    def wait_s(self, key: str) -> float:
        """Take a token for `key`: 0.0 if there was one, else the seconds until there is one
        (and nothing is taken)."""
        now = time.monotonic()
        tokens, then = self._buckets.pop(key, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - then) * self._rate)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self._rate
        self._buckets[key] = (tokens - 1.0 if wait == 0.0 else tokens, now)
        if len(self._buckets) > MAX_RATE_KEYS:
            self._buckets.popitem(last=False)
        return wait


def retry_after(wait_s: float) -> str:
    """`Retry-After` in whole seconds, rounded up: a client that waits that long gets through."""
    return str(max(1, math.ceil(wait_s)))
