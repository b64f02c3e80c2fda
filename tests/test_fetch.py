"""Image fetching by URL: the address policy on the classifier, fetches from a loopback server.

No test connects anywhere but 127.0.0.1: refused addresses are refused before any connection.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from image_server import PNG, ImageServer
from mmlane.mm_worker.fetch import FetchPolicy, MediaFetcher, address_class, check_url
from mmlane.protocol.errors import RequestError


@pytest.mark.parametrize(
    "address, kind",
    [
        ("8.8.8.8", None), ("2606:4700:4700::1111", None),
        ("127.0.0.1", "loopback"), ("::1", "loopback"),
        ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
        ("100.64.0.1", "private"), ("fc00::1", "private"), ("::ffff:10.0.0.1", "private"),
        ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ],
)
def test_address_classes(address: str, kind: str | None) -> None:
    assert address_class(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize(
    "url, policy, match",
    [
        ("http://example.com/a.png", FetchPolicy(), "http scheme is not allowed"),
        ("ftp://example.com/a.png", FetchPolicy(), "ftp scheme is not allowed"),
        ("https://evil.com/a.png", FetchPolicy(allowed_domains=("images.com",)),
         "not in the allowed domains"),
        ("https://notimages.com/a.png", FetchPolicy(allowed_domains=("images.com",)),
         "not in the allowed domains"),
        ("https://10.0.0.8/a.png", FetchPolicy(), "private address 10.0.0.8"),
        ("https://[::1]/a.png", FetchPolicy(), "loopback address ::1"),
        ("https://169.254.169.254/latest", FetchPolicy(allow_internal=True), "link-local"),
        ("https:///a.png", FetchPolicy(), "no host"),
    ],
)
def test_refused_urls_name_the_rule(url: str, policy: FetchPolicy, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        check_url(url, policy)


@pytest.mark.parametrize(
    "url, policy",
    [
        ("https://images.com/a.png", FetchPolicy(allowed_domains=("images.com",))),
        ("https://cdn.images.com/a.png", FetchPolicy(allowed_domains=("images.com",))),
        ("https://93.184.216.34/a.png", FetchPolicy()),
        ("http://127.0.0.1:9/a.png",
         FetchPolicy(allowed_schemes=frozenset({"http"}), allow_internal=True)),
    ],
)
def test_allowed_urls_pass(url: str, policy: FetchPolicy) -> None:
    check_url(url, policy)


LOOPBACK = FetchPolicy(
    allowed_schemes=frozenset({"http"}), allow_internal=True, max_bytes=1_000_000,
    total_timeout_s=1.5, connect_timeout_s=1.0, retries=2, backoff_s=0.05,
)


@pytest.fixture(scope="module")
def fetcher() -> Iterator[MediaFetcher]:
    f = MediaFetcher(LOOPBACK)
    yield f
    f.close()


def test_fetches_an_image(fetcher: MediaFetcher, image_server: ImageServer) -> None:
    assert fetcher.submit(image_server.url("/image.png")).result(10) == PNG


def test_follows_an_allowed_redirect(fetcher: MediaFetcher, image_server: ImageServer) -> None:
    assert fetcher.submit(image_server.url("/to-image")).result(10) == PNG


def test_redirect_to_a_refused_address_is_refused(fetcher: MediaFetcher,
                                                  image_server: ImageServer) -> None:
    with pytest.raises(RequestError, match="link-local address 169.254.169.254"):
        fetcher.submit(image_server.url("/to-metadata")).result(10)


def test_too_many_redirects(fetcher: MediaFetcher, image_server: ImageServer) -> None:
    with pytest.raises(RequestError, match="more than 3 redirects"):
        fetcher.submit(image_server.url("/loop")).result(10)


@pytest.mark.parametrize("path", ["/huge-chunked", "/huge-declared"])
def test_body_over_the_cap_is_cut_off(fetcher: MediaFetcher, image_server: ImageServer,
                                      path: str) -> None:
    with pytest.raises(RequestError, match="larger than the 1000000-byte fetch limit") as info:
        fetcher.submit(image_server.url(path)).result(10)
    assert info.value.code == "image_too_large"


def test_a_server_that_never_answers_times_out(fetcher: MediaFetcher,
                                               image_server: ImageServer) -> None:
    start = time.monotonic()
    with pytest.raises(RequestError, match="longer than 1.5 s"):
        fetcher.submit(image_server.url("/never-answers")).result(10)
    assert time.monotonic() - start < 10  # bounded by the policy, not by the server


def test_5xx_is_retried_with_backoff(fetcher: MediaFetcher, image_server: ImageServer) -> None:
    assert fetcher.submit(image_server.url("/flaky")).result(10) == PNG
    assert image_server.hits["flaky"] == 3


def test_4xx_is_not_retried(fetcher: MediaFetcher, image_server: ImageServer) -> None:
    with pytest.raises(RequestError, match="HTTP 404"):
        fetcher.submit(image_server.url("/missing")).result(10)
    assert image_server.hits["missing"] == 1


def test_a_name_resolving_to_loopback_is_refused_without_the_opt_in(
    image_server: ImageServer,
) -> None:
    strict = MediaFetcher(FetchPolicy(allowed_schemes=frozenset({"http"})))
    try:
        with pytest.raises(RequestError, match="localhost resolves to loopback address"):
            strict.submit(f"http://localhost:{image_server.port}/image.png").result(10)
    finally:
        strict.close()
    assert image_server.hits.get("image.png", 0) <= 2  # the refused fetch never reached the server


# ---------------------------------------------------------------- https, on loopback only

FETCH_ONE = """
import sys
from mmlane.mm_worker.fetch import FetchPolicy, MediaFetcher
fetcher = MediaFetcher(FetchPolicy(allow_internal=True))
try:
    print(len(fetcher.submit(sys.argv[1]).result(20)))
finally:
    fetcher.close()
"""


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ImageServer, Path]]:
    """An https image server with a self-signed certificate for 127.0.0.1, and that cert."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = ImageServer(tls=context)
    yield server, cert
    server.close()


def test_https_fetch_verifies_the_certificate(tls_server: tuple[ImageServer, Path]) -> None:
    """Over https (the default scheme) an image arrives when its certificate is trusted (here
    through SSL_CERT_FILE, in a fresh process), and is refused with a clear error when not."""
    server, cert = tls_server
    url = server.url("/image.png")
    trusted = subprocess.run(
        [sys.executable, "-c", FETCH_ONE, url], capture_output=True, text=True, timeout=60,
        env={**os.environ, "SSL_CERT_FILE": str(cert)},
    )
    assert trusted.returncode == 0, trusted.stderr
    assert int(trusted.stdout) == len(PNG)
    untrusted = MediaFetcher(FetchPolicy(allow_internal=True))
    try:
        with pytest.raises(RequestError, match="certificate verify failed"):
            untrusted.submit(url).result(20)
    finally:
        untrusted.close()
