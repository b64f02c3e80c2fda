"""The frontend role's settings. Import-light (no torch, no tokenizer): the CLI and the launcher
read it without loading the model."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from mmlane.common.config import (
    DEFAULT_HOST,
    OpsConfig,
    SecurityConfig,
    _positive,
    ipc,
    is_loopback,
    process_name,
)

DEFAULT_PORT = 8765
"""The native client API's port (`port`), which `mmlane chat` and `reset-cache` reach by default."""


class FrontendConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """Local Hugging Face model directory (its tokenizer and chat template are used)."""
    served_model_name: list[str] = []
    """Names the HTTP API serves the model under (aliases: all are listed and taken as
    `model`); replies report the first. None: the model directory's name."""
    tool_call_parser: Literal["auto", "hermes", "mistral", "none"] = "auto"
    """How the HTTP API reads tool calls out of the model's text (as vLLM's
    --tool-call-parser): 'auto' is the model family's format (hermes for Qwen2-VL and
    Qwen2.5-VL, mistral for Mistral 3, none known for the others); 'hermes': `<tool_call>
    {"name", "arguments"}</tool_call>`; 'mistral': `[TOOL_CALLS] [{"name", "arguments"}]`;
    'none': tool_choice 'auto' is refused. 'required' and a named function work with every
    model (the output is constrained to the calls' JSON)."""
    chat_template: str = ""
    """A Jinja chat template to use instead of the model's: a file's path, or the template
    itself (as vLLM's --chat-template). "": the model's own."""
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
    tokenizer_cache_words: int = 4096
    """Words each tokenizing thread keeps the tokens of (the tokenizers library's word cache,
    first come first kept; 0: none). The frontend tokenizes on min(tokenizer_workers, cores)
    threads; a cached word costs up to 8 KB (a 256-character one), so together they hold at
    most about threads x this x 8 KB (4 x 4096: 128 MiB; ordinary words take a tenth)."""
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
    """Where the OpenAI-compatible HTTP API listens; an address other than a loopback one needs
    API keys (api_key, api_key_file) or insecure_http."""
    http_port: int = 8000
    """Port of the HTTP API; 0 disables it."""
    http_reuse_port: bool = False
    """Let the frontends of this host that are given it too listen on the same http_port
    (SO_REUSEPORT, Linux); the kernel spreads new connections over them. Off, a port already
    taken refuses the frontend at startup; on, so does one taken by another user or by a
    process without SO_REUSEPORT, but not by another deployment's frontends: give each its own."""
    insecure_http: bool = False
    """Allow the HTTP API on a non-loopback http_host without API keys: anyone who can reach
    the port can use the model. For a network that is private by other means."""
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
        if self.tokenizer_cache_words < 0:
            raise ValueError(f"tokenizer_cache_words must be 0 (none) or more, got "
                             f"{self.tokenizer_cache_words}")
        _positive(
            self, "tokenizer_workers", "max_images_per_request", "request_timeout_s",
            "max_inflight_requests", "max_stop_strings", "max_stop_string_chars", "max_n",
        )
        keys = self.api_keys()  # refuses an unreadable or empty key file now, by name
        if self.http_port and not (keys or self.insecure_http or is_loopback(self.http_host)):
            raise ValueError(
                f"http_host {self.http_host!r} is not a loopback address, and without an API "
                f"key anyone who reaches port {self.http_port} can use the model: give "
                "--api-key or --api-key-file, or --insecure-http")
        if any(not name.strip() for name in self.served_model_name):
            raise ValueError(f"served_model_name: a name must not be empty, got "
                             f"{self.served_model_name}")
        self.template()  # refuses an unreadable template file now

    def template(self) -> str | None:
        """The chat template `chat_template` gives (None: the model's own): a file's text, or
        the setting itself when it reads as a template (it holds `{`, `}` or a line break), as
        vLLM's --chat-template; ValueError for a file that cannot be read."""
        if not self.chat_template:
            return None
        try:
            return Path(self.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            if any(char in self.chat_template for char in "{}\n"):
                return self.chat_template
            raise ValueError(f"chat_template: cannot read the file {self.chat_template}: "
                             f"{exc}") from exc

    @property
    def client_endpoint(self) -> str:
        """The native client API's address, tcp://HOST:PORT."""
        return f"tcp://{self.host}:{self.port}"

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
