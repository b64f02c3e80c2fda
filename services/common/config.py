"""Typed, validated configuration of every role. Unknown keys are rejected; each field says why.

The command line (`services/cli.py`) builds these with `load_config`, so a bad value fails at
startup with a message naming the setting.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from protocol.errors import FatalError
from services.common.feature_cache import capacity_bytes

C = TypeVar("C", bound=msgspec.Struct)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


_RUN_DIR: ContextVar[Path | None] = ContextVar("run_dir", default=None)


def default_run_dir() -> Path:
    """Where internal ipc:// sockets live unless addresses are given: `$MMLANE_RUN_DIR`, or
    the folder of `run_dir_defaults` while configs are built inside it."""
    return _RUN_DIR.get() or Path(
        os.environ.get("MMLANE_RUN_DIR") or Path(tempfile.gettempdir()) / "mmlane"
    )


@contextlib.contextmanager
def run_dir_defaults(run_dir: Path) -> Iterator[None]:
    """Configs built inside default their ipc:// sockets to `run_dir`: the launcher builds its
    children's configs as the children, started with MMLANE_RUN_DIR=RUN_DIR, would."""
    token = _RUN_DIR.set(run_dir)
    try:
        yield
    finally:
        _RUN_DIR.reset(token)


def ipc(name: str, run_dir: Path | None = None) -> str:
    return f"ipc://{(run_dir or default_run_dir()) / name}.sock"


def client_endpoint(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    return f"tcp://{host}:{port}"


def process_name(role: str, endpoint: str) -> str:
    """A name that tells this process from others of its role on one machine, from the address
    it serves on: 'frontend-8765' for tcp port 8765, 'mm-worker-2' for ipc://.../mm-worker-2.sock."""
    address = endpoint.partition("://")[2]
    if endpoint.startswith("ipc://"):
        stem = Path(address).stem
        return stem if stem.startswith(role) else f"{role}-{stem}"
    port = address.rpartition(":")[2]
    return f"{role}-{port}" if port.isdigit() else role


class OpsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a role is watched and stopped; the same settings for every role."""

    name: str = ""
    """What stats and health call this process; "": its role and port or socket name."""
    stats_endpoint: str = ""
    """Where the role binds its stats socket (PUB); "": ipc://RUN_DIR/stats-NAME.sock."""
    control_endpoint: str = ""
    """Where the role answers pings (ROUTER); "": ipc://RUN_DIR/control-NAME.sock."""
    stats_interval_s: float = 1.0
    """Seconds between two published Stats messages."""
    drain_timeout_s: float = 30.0
    """At SIGTERM: seconds to finish the requests held before failing them (retryable)."""

    def __post_init__(self) -> None:
        _positive(self, "stats_interval_s")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be 0 or more, got {self.drain_timeout_s}")

    def named(self, name: str) -> OpsConfig:
        """These settings with the default endpoints of the process called `name`."""
        name = self.name or name
        return msgspec.structs.replace(
            self, name=name, stats_endpoint=self.stats_endpoint or ipc(f"stats-{name}"),
            control_endpoint=self.control_endpoint or ipc(f"control-{name}"),
        )


class SecurityConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How this role's sockets to the other roles are secured: ZMQ CURVE on tcp (README,
    "Across hosts"), file permissions on ipc."""

    curve_keys: str = ""
    """Folder of CURVE keys (`mmlane keys`): this role's own pair (ROLE.key, ROLE.key_secret)
    and the public key of each role it accepts (engine.key, mm-worker.key, frontend.key). Its
    tcp sockets to other roles are then encrypted, and only peers holding an accepted key are
    served; "": plain tcp, allowed on loopback addresses only (unless insecure_tcp)."""
    insecure_tcp: bool = False
    """Allow binding plain tcp (no curve_keys) on a non-loopback address: anyone who can reach
    the port can submit work and read replies. For a network that is private by other means."""

    def __post_init__(self) -> None:
        if self.curve_keys and not Path(self.curve_keys).is_dir():
            raise ValueError(f"curve_keys {self.curve_keys!r} is not a directory")


IMAGE_NICE = 10
"""How many nice steps below the text lanes image work runs by default (`image_nice`): on the
2-core CPU VM, text under a stream of 12 MP photos took 1.5-2 ms less at the median, with as
many images done (BENCHMARKS.md, "Image work below text on shared cores"). Linux's SCHED_IDLE
measured no better, and would starve images while text fills the cores: at 10 they keep about
a tenth of a core."""


def check_nice(config: msgspec.Struct, name: str) -> None:
    if not 0 <= getattr(config, name) <= 19:
        raise ValueError(f"{name} must be 0 (off) to 19, got {getattr(config, name)}")


ImageBackend = Literal["auto", "pil", "torchvision"]
"""Which of transformers' image-processor backends renders images. 'pil' is the reference and
needs no torchvision; 'torchvision' is what vLLM's renderer uses, so pixels made with it equal
vLLM's own; 'auto' is transformers' choice: torchvision when it imports, else PIL."""


class MMWorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """Local Hugging Face model directory (its tokenizer and image processor are used)."""
    mm_worker_endpoint: str = ""
    """Where this MM worker binds its job socket (PULL); frontends connect. "": ipc://RUN_DIR/mm-worker.sock."""
    engine_endpoint: str = ""
    """The engine's request socket. "": ipc://RUN_DIR/engine.sock."""
    allowed_media_dir: str | None = None
    """file:// image paths are allowed only under this folder; None refuses every file:// URL."""
    max_image_pixels: int = 64_000_000
    """Images with more pixels are refused before the full decode (decompression-bomb guard)."""
    max_image_bytes: int = 64 * 1024 * 1024
    """Largest encoded image accepted, in bytes."""
    mm_cache_gb: float = 4.0
    """Capacity of the sender cache, in GiB of the tensors it stands for (the engine mirrors
    it); 0 turns the feature cache off for this worker."""
    mm_hash: Literal["blake3", "sha256"] = "blake3"
    """The hash that names an image in the caches (sha256 where FIPS requires it)."""
    allowed_media_schemes: list[str] = msgspec.field(default_factory=lambda: ["data", "https"])
    """URL schemes image URLs may use: any of data, https, http (file:// has its own rule,
    `allowed_media_dir`)."""
    allow_http_media: bool = False
    """Also allow plain http:// image URLs (adds http to `allowed_media_schemes`)."""
    allowed_media_domains: list[str] = []
    """When set, http(s) image hosts must be one of these domains or a subdomain of one."""
    allow_internal_media: bool = False
    """Allow image URLs that resolve to loopback or private addresses (link-local, multicast
    and reserved addresses stay refused)."""
    media_max_redirects: int = 3
    """Redirects followed when fetching an image; each target is checked again."""
    media_connect_timeout_s: float = 5.0
    """Seconds to open one connection to an image's host."""
    media_fetch_timeout_s: float = 20.0
    """Seconds one image fetch may take in all, retries included."""
    media_fetch_retries: int = 2
    """Retries, with backoff, after a timeout or a 5xx answer (never after another error)."""
    fetch_ahead_jobs: int = 64
    """Jobs received ahead of the one being processed, so their image fetches start early."""
    image_backend: ImageBackend = "auto"
    """The image processor's backend: auto (torchvision when it imports, as transformers and
    vLLM choose; else pil), pil (the reference; no torchvision needed) or torchvision."""
    mm_processes: int = 0
    """Processes that decode and process images for this worker, in order all the same (1: the
    worker's own thread does it); 0: one per 4 cores this process may use, at least 1."""
    jpeg_draft: bool = False
    """Decode a JPEG at least twice as large on both sides as the image processor resizes it
    to at 1/2, 1/4 or 1/8 of its size (libjpeg's reduce-on-decode), never below the processor's
    size and only where its tensor shapes and token count stay the same: about 2x less work
    per 12 MP photo for a 1 MP model, but NOT bit-exact (README; BENCHMARKS.md measures the
    difference). The image hash covers the setting, so a drafted image and the same bytes
    decoded exactly never share a hash in any cache (the engine's, vLLM's)."""
    shm_transport_mb: float = 1024.0
    """With an ipc:// engine endpoint (the engine on this host), tensors of 1 MiB or more go to
    the engine through shared-memory slots (/dev/shm, reused) rather than as ZMQ frames: at
    most this many MiB of slots; a tensor that finds none free and no room goes as a frame.
    0: frames only."""
    image_nice: int = IMAGE_NICE
    """Nice steps (0-19) below its own start this worker runs (every thread, and its image
    processes): where it shares cores with a frontend or an engine, their text work takes a
    core first, and images get what text leaves idle (at 10 about a tenth of a core that text
    fills). 0: off. Linux counts niceness per thread."""
    ops: OpsConfig = msgspec.field(default_factory=OpsConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        capacity_bytes(self.mm_cache_gb)
        check_nice(self, "image_nice")
        if self.shm_transport_mb < 0:
            raise ValueError(f"shm_transport_mb must be 0 or more, got {self.shm_transport_mb}")
        self.allowed_media_schemes = [s.lower() for s in self.allowed_media_schemes]
        if self.allow_http_media and "http" not in self.allowed_media_schemes:
            self.allowed_media_schemes.append("http")
        self.allowed_media_domains = [d.lower() for d in self.allowed_media_domains]
        unknown = set(self.allowed_media_schemes) - {"data", "https", "http"}
        if unknown:
            raise ValueError(f"allowed_media_schemes: unknown scheme(s) {sorted(unknown)} "
                             "(choose from data, https, http)")
        _positive(self, "media_connect_timeout_s", "media_fetch_timeout_s", "fetch_ahead_jobs")
        if self.mm_processes < 0:
            raise ValueError(f"mm_processes must be 0 (by the cores) or more, got "
                             f"{self.mm_processes}")
        self.mm_processes = self.mm_processes or max(1, len(os.sched_getaffinity(0)) // 4)
        if self.media_max_redirects < 0 or self.media_fetch_retries < 0:
            raise ValueError("media_max_redirects and media_fetch_retries must be 0 or more")
        self.mm_worker_endpoint = self.mm_worker_endpoint or ipc("mm-worker")
        self.ops = self.ops.named(process_name("mm-worker", self.mm_worker_endpoint))
        self.engine_endpoint = self.engine_endpoint or ipc("engine")
        _positive(self, "max_image_pixels", "max_image_bytes")
        if self.allowed_media_dir is not None and not Path(self.allowed_media_dir).is_dir():
            raise ValueError(f"allowed_media_dir {self.allowed_media_dir!r} is not a directory")


class FrontendConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """Local Hugging Face model directory (its tokenizer and chat template are used)."""
    host: str = DEFAULT_HOST
    """Host of the native client API (ROUTER, msgspec): it binds tcp://HOST:PORT."""
    port: int = DEFAULT_PORT
    """Port of the native client API."""
    output_endpoint: str = ""
    """Where this frontend binds the socket that engine and MM workers reply to (`reply_to`);
    "": ipc://RUN_DIR/reply-NAME.sock, NAME as in `ops.name` (e.g. frontend-8765)."""
    engine_endpoint: str = ""
    """The engine's request socket. "": ipc://RUN_DIR/engine.sock."""
    mm_worker_endpoint: list[str] = []
    """Job sockets of the MM workers (repeat the flag for several); jobs are spread over
    them. None: ipc://RUN_DIR/mm-worker.sock."""
    tokenizer_workers: int = 4
    """Threads that apply the chat template and tokenize."""
    max_images_per_request: int = 8
    """Requests with more images are refused."""
    request_timeout_s: float = 600.0
    """A request without its terminal reply after this long gets a 'timeout' error."""
    max_inflight_requests: int = 1024
    """Requests held at once; above it new ones get an 'overloaded' error."""
    max_stop_strings: int = 16
    """Stop strings a request may carry (OpenAI allows 4); each is scanned for on every token."""
    max_stop_string_chars: int = 256
    """Longest stop string accepted, in characters."""
    max_n: int = 16
    """Most choices (`n`) one HTTP request may ask for; each runs as its own request."""
    http_host: str = DEFAULT_HOST
    """Where the OpenAI-compatible HTTP API listens."""
    http_port: int = 8000
    """Port of the HTTP API; 0 disables it."""
    http_max_body_bytes: int = 128 * 1024 * 1024
    """Largest HTTP request body accepted (inline images included); larger gets a 413."""
    http_stream_write_timeout_s: float = 30.0
    """A streaming HTTP client that takes none of its stream for this long (its connection's
    buffers full) is disconnected and its request cancelled: a stalled reader holds nothing."""
    http_header_timeout_s: float = 10.0
    """A request's head (from a connection's opening, or the first byte sent to an idle one)
    must arrive within this many seconds, else a 408 and the connection is closed (slowloris)."""
    http_body_timeout_s: float = 30.0
    """Most seconds between two reads of a request's body, else a 408 and the connection is
    closed (nginx's client_body_timeout)."""
    http_keepalive_timeout_s: float = 5.0
    """An idle keep-alive HTTP connection is closed after this many seconds (vLLM's default)."""
    http_max_connections: int = 1024
    """Open HTTP connections at once; one more is answered 503 with Retry-After and closed."""
    http_rate_limit: float = 0.0
    """Requests a second each API key (without keys: each client address) may send to /v1;
    one over it gets a 429 with Retry-After. 0: no limit."""
    http_rate_burst: int = 10
    """With --http-rate-limit, requests a key may send at once before the rate applies."""
    api_key: list[str] = []
    """API keys a client must send (`Authorization: Bearer KEY`) on every /v1 route; with none
    (nor api_key_file) the HTTP API is open."""
    api_key_file: str = ""
    """A file of more API keys, one per line (blank lines ignored)."""
    ops: OpsConfig = msgspec.field(default_factory=OpsConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be 0 (off) or a port number, got {self.http_port}")
        _positive(self, "http_max_body_bytes", "http_stream_write_timeout_s",
                  "http_header_timeout_s", "http_body_timeout_s", "http_keepalive_timeout_s",
                  "http_max_connections", "http_rate_burst")
        if not self.http_rate_limit >= 0:
            raise ValueError(f"http_rate_limit must be 0 (off) or more, got "
                             f"{self.http_rate_limit}")
        self.ops = self.ops.named(process_name("frontend", self.client_endpoint))
        self.output_endpoint = self.output_endpoint or ipc(f"reply-{self.ops.name}")
        self.engine_endpoint = self.engine_endpoint or ipc("engine")
        self.mm_worker_endpoint = self.mm_worker_endpoint or [ipc("mm-worker")]
        _positive(
            self, "tokenizer_workers", "max_images_per_request", "request_timeout_s",
            "max_inflight_requests", "max_stop_strings", "max_stop_string_chars", "max_n",
        )
        self.api_keys()  # refuses an unreadable or empty key file now, by name

    @property
    def client_endpoint(self) -> str:
        return client_endpoint(self.host, self.port)

    def api_keys(self) -> list[str]:
        """api_key and the keys in api_key_file (read at startup, in __post_init__, and when the
        HTTP API starts). A key file that cannot be read or holds no key is refused with a
        ValueError: it would leave the API open by mistake."""
        keys = [key for key in self.api_key if key]  # an empty key would let "Bearer " in
        if not self.api_key_file:
            return keys
        try:
            lines = Path(self.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"api_key_file: cannot read {self.api_key_file}: {exc}") from exc
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:
            raise ValueError(f"api_key_file: {self.api_key_file} holds no key")
        return [*keys, *from_file]


def load_config(config_type: type[C], values: dict[str, Any]) -> C:
    """Build a config from settings, refusing unknown keys and bad values by name."""
    try:
        return msgspec.convert(values, config_type)
    except (msgspec.ValidationError, ValueError) as exc:
        raise FatalError(f"invalid {config_type.__name__}: {exc}", code="bad_config") from exc


def handed_config(config_type: type[C], config_json: str) -> C:
    """The config a parent handed a child process as `--config-json`: msgspec JSON, or "-" to
    read it from stdin (the launcher's way: a command line is visible to every user)."""
    text = sys.stdin.buffer.read() if config_json == "-" else config_json
    try:
        values = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise FatalError(f"invalid {config_type.__name__} JSON: {exc}", code="bad_config") from exc
    return load_config(config_type, values)


def _positive(config: msgspec.Struct, *names: str) -> None:
    for name in names:
        if not getattr(config, name) > 0:  # NaN too
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
