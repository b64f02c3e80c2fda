"""Fetching images by http(s) URL without opening the network behind the server.

Policy (`FetchPolicy`), applied to the first URL and again to every redirect:
  - the scheme must be allowed (https by default; plain http is opt-in);
  - the host must be in `allowed_domains` (a domain or any subdomain) when that list is set;
  - every address the host resolves to is classified: loopback and private addresses are refused
    unless `allow_internal`; link-local (cloud metadata lives there), multicast, reserved and
    unspecified addresses are always refused. The connection goes to the checked addresses, so a
    second DNS answer cannot swap them (the check is inside the resolver aiohttp connects with);
  - at most `max_redirects` redirects; a connect timeout per connection and a total timeout for
    the whole fetch, retries included; a byte cap enforced while streaming the body;
  - retries with exponential backoff on timeouts and 5xx answers only.
Every refusal raises RequestError naming the rule. `MediaFetcher` runs fetches on its own thread
and event loop, so the FIFO loop only waits for results it needs, in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket
import threading
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from mmlane.protocol.errors import RequestError

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class FetchPolicy:
    """What an image URL may point at, and how long and how much a fetch may take."""

    allowed_schemes: frozenset[str] = frozenset({"https"})
    allowed_domains: tuple[str, ...] = ()
    """Empty: any domain. Otherwise each host must equal one of these or be a subdomain."""
    allow_internal: bool = False
    """Allow loopback and private addresses (link-local and the rest stay refused)."""
    max_redirects: int = 3
    connect_timeout_s: float = 5.0
    total_timeout_s: float = 20.0
    max_bytes: int = 64 * 1024 * 1024
    retries: int = 2
    backoff_s: float = 0.2


def address_class(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The kind of non-public address this is ('loopback', 'private', ...), or None if public."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for kind in ("unspecified", "loopback", "link_local", "multicast", "reserved", "private"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    if not address.is_global:
        return "private"  # shared address space and other non-global ranges
    return None


def check_address(address: str, policy: FetchPolicy, host: str) -> None:
    """Refuse an address the policy does not allow; the message names the rule."""
    kind = address_class(ipaddress.ip_address(address))
    if kind is None or (policy.allow_internal and kind in ("loopback", "private")):
        return
    hint = " (allowed with --allow-internal-media)" if kind in ("loopback", "private") else ""
    raise RequestError(
        f"{host} resolves to {kind} address {address}, which is refused{hint}",
        code="media_not_allowed",
    )


def check_url(url: str, policy: FetchPolicy) -> str:
    """Check scheme, host and (for IP literals) address; returns the host."""
    parts = urlsplit(url)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in policy.allowed_schemes:
        allowed = ", ".join(sorted(policy.allowed_schemes)) or "none"
        raise RequestError(
            f"{scheme or 'no'} scheme is not allowed for image URLs (allowed: {allowed})",
            code="media_not_allowed",
        )
    if not host:
        raise RequestError(f"image URL has no host: {url[:200]}", code="invalid_image")
    if policy.allowed_domains and not any(
        host == d or host.endswith("." + d) for d in policy.allowed_domains
    ):
        raise RequestError(f"host {host} is not in the allowed domains", code="media_not_allowed")
    try:
        check_address(host, policy, host)  # an IP literal is never resolved, so check it here
    except ValueError:
        pass  # a name: checked on every address it resolves to
    return host


class PolicyResolver(AbstractResolver):
    """Resolves with the system resolver, then refuses any address the policy does not allow."""

    def __init__(self, policy: FetchPolicy) -> None:
        self._policy = policy
        self._resolver = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._resolver.resolve(host, port, family)
        for result in results:
            check_address(result["host"], self._policy, host)
        return results

    async def close(self) -> None:
        await self._resolver.close()


class _Retry(Exception):
    """A timeout or 5xx answer: worth another try."""


async def fetch(session: aiohttp.ClientSession, url: str, policy: FetchPolicy) -> bytes:
    """Fetch an image's bytes under `policy`, or raise RequestError naming what went wrong."""
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await _fetch_with_retries(session, url, policy)
    except TimeoutError as exc:
        raise RequestError(
            f"fetching {_short(url)} took longer than {policy.total_timeout_s} s",
            code="fetch_failed",
        ) from exc


async def _fetch_with_retries(
    session: aiohttp.ClientSession, url: str, policy: FetchPolicy
) -> bytes:
    for attempt in range(policy.retries + 1):
        try:
            return await _fetch_once(session, url, policy)
        except _Retry as exc:
            if attempt == policy.retries:
                raise RequestError(
                    f"fetching {_short(url)} failed after {attempt + 1} tries: {exc}",
                    code="fetch_failed",
                ) from exc
            await asyncio.sleep(policy.backoff_s * 2**attempt)
    raise AssertionError("unreachable")


async def _fetch_once(session: aiohttp.ClientSession, url: str, policy: FetchPolicy) -> bytes:
    for _ in range(policy.max_redirects + 1):
        check_url(url, policy)
        try:  # a refused address raises RequestError from inside PolicyResolver, as it is
            async with session.get(url, allow_redirects=False) as response:
                if response.status in _REDIRECTS and "Location" in response.headers:
                    url = urljoin(url, response.headers["Location"])
                    continue
                return await _read_body(response, url, policy)
        except (aiohttp.ServerTimeoutError, aiohttp.ServerDisconnectedError) as exc:
            raise _Retry(f"{type(exc).__name__}") from exc
        except aiohttp.ClientError as exc:
            raise RequestError(f"fetching {_short(url)} failed: {exc}",
                               code="fetch_failed") from exc
    raise RequestError(
        f"more than {policy.max_redirects} redirects fetching the image", code="media_not_allowed"
    )


async def _read_body(response: aiohttp.ClientResponse, url: str, policy: FetchPolicy) -> bytes:
    if response.status >= 500:
        raise _Retry(f"HTTP {response.status}")
    if response.status != 200:
        raise RequestError(f"fetching {_short(url)}: HTTP {response.status}", code="fetch_failed")
    declared = response.content_length
    if declared is not None and declared > policy.max_bytes:
        raise _too_large(url, policy)
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > policy.max_bytes:  # a missing or lying Content-Length is caught here
            raise _too_large(url, policy)
    return bytes(body)


def _too_large(url: str, policy: FetchPolicy) -> RequestError:
    return RequestError(
        f"the file at {_short(url)} is larger than the {policy.max_bytes}-byte fetch limit",
        code="image_too_large",
    )


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."


class MediaFetcher:
    """Runs fetches on a named thread with its own event loop; `submit` returns a Future."""

    def __init__(self, policy: FetchPolicy) -> None:
        self.policy = policy
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="mm-worker-fetch", daemon=True
        )
        self._thread.start()
        self._session: aiohttp.ClientSession = self._call(self._open_session())

    async def _open_session(self) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.policy.connect_timeout_s,
            sock_read=self.policy.total_timeout_s,
        )
        connector = aiohttp.TCPConnector(resolver=PolicyResolver(self.policy), limit=32)
        return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)

    def submit(self, url: str, max_bytes: int | None = None) -> concurrent.futures.Future[bytes]:
        """Fetch `url` under the policy; `max_bytes` in place of the policy's (a video's)."""
        policy = self.policy if max_bytes is None else replace(self.policy, max_bytes=max_bytes)
        return asyncio.run_coroutine_threadsafe(fetch(self._session, url, policy), self._loop)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self._call(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
