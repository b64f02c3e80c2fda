"""Every message that crosses an mmlane socket, one tagged union per socket direction.

    client  ──ClientRequest──▶ frontend (ROUTER)       ──ClientReply──▶ client
    frontend ──MMWorkerInput──▶ mm worker (PULL)
    frontend, mm worker ──EngineInput──▶ engine (PULL)
    engine, mm worker ──FrontendInput──▶ frontend output socket (PULL, address = `reply_to`)
    role ──LauncherInput──▶ launcher's ready socket (startup handshake)
    role ──StatsMessage──▶ its stats socket (PUB, bound): `mmlane top`, the exporter, scripts
    tool ──ControlRequest──▶ role's control socket (ROUTER, bound) ──ControlReply──▶ tool

Fields are only ever appended, and new fields get defaults (msgspec schema evolution). Arrays
(`np.ndarray` fields) never travel inside msgpack: the codec moves them to extra frames.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from mmlane.protocol.errors import ErrorInfo
from mmlane.protocol.sampling import SamplingFields, SamplingParams

# ---------------------------------------------------------------- shared pieces


class ImageUrl(msgspec.Struct, kw_only=True, frozen=True):
    """Where an image or a video comes from: a `data:` URI (base64), an `https://` URL or a
    `file://` path; a client's `uuid` names its content in the caches."""

    url: str
    uuid: str | None = None


# ---------------------------------------------------------------- client <-> frontend


class TextPart(msgspec.Struct, tag="text", tag_field="type", frozen=True):
    """A text content part, as in OpenAI chat messages."""

    text: str


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type", frozen=True):
    """An image content part, as in OpenAI chat messages."""

    image_url: ImageUrl


class VideoPart(msgspec.Struct, tag="video_url", tag_field="type", frozen=True):
    """A video content part, as vLLM takes it in OpenAI chat messages."""

    video_url: ImageUrl


ContentPart = TextPart | ImagePart | VideoPart
CONTENT_TYPES = tuple(str(part.__struct_config__.tag) for part in (TextPart, ImagePart, VideoPart))
"""The content part types a message may hold, as the `type` field names them."""


class VideoSampling(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Which frames of a request's videos are kept (vLLM's per-request `mm_processor_kwargs`);
    None: the server's default. The MM worker bounds both (`max_video_frames`)."""

    fps: float | None = None
    """Frames kept per second of video (Qwen2-VL's default: 2)."""
    num_frames: int | None = None
    """At most this many frames kept."""


class ToolFunction(msgspec.Struct, kw_only=True, frozen=True):
    """The function a tool call calls: its name and its arguments, as JSON text (OpenAI's)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True, frozen=True):
    """An assistant's call of a tool, as in OpenAI chat messages."""

    id: str
    function: ToolFunction
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat turn; content is a plain string or a list of parts. An assistant's turn may
    carry the tool calls it made; a `tool` turn is a tool's result, for the call it names."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart]
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None


class RequestFields(SamplingFields, kw_only=True, frozen=True):
    """What chat and completion requests carry besides their prompt: the sampling fields, and
    the stop strings."""

    stop: list[str] = []
    """Strings that end the output's text just before the first of them to appear, with
    finish_reason "stop" (vLLM's `stop`, not included in the output). Not a sampling field:
    the frontend applies them where it turns tokens into text, because the engine sees token
    ids only (the vllm backend runs vLLM with detokenize=False, so vLLM could not apply them);
    on a match the frontend stops the request in the engine."""
    skip_special_tokens: bool = True
    """The output's text leaves out special tokens (vLLM's `skip_special_tokens`); false: it
    shows them (a Mistral tool call's [TOOL_CALLS] is one). The frontend applies it."""
    render: bool = False
    """Answer with the request as vLLM's scale-out API takes it (its GenerateRequest JSON, in
    `ChatOutput.rendered`: prompt ids after the images' expansion, the images' features,
    sampling) instead of running it: mmlane as the render tier in front of vLLM servers."""


class ChatRequest(RequestFields, tag="chat", kw_only=True, frozen=True):
    """A chat completion request on the native API."""

    request_id: str
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] = []
    """Tools the chat template offers the model, each an OpenAI tool object
    ({"type": "function", "function": {"name", "description", "parameters"}}). What the model
    answers stays text: the HTTP API parses its tool calls (services/frontend/tools.py)."""
    mm_processor_kwargs: VideoSampling = VideoSampling()
    """How the request's videos are sampled (vLLM's field of the same name)."""


class CompletionRequest(RequestFields, tag="completion", kw_only=True, frozen=True):
    """A plain completion on the native API: a text tokenized as it is (no chat template; the
    tokenizer's special tokens added, as vLLM's /v1/completions does) or prompt token ids."""

    request_id: str
    prompt: str | list[int]


class ResetCache(msgspec.Struct, tag="reset_cache", kw_only=True, frozen=True):
    """Empty the mirrored feature caches of the engine and of every MM worker (a new epoch)."""

    request_id: str


class CancelChat(msgspec.Struct, tag="cancel", kw_only=True, frozen=True):
    """The client no longer waits for this request: stop it downstream; no reply follows."""

    request_id: str


ClientRequest = ChatRequest | CompletionRequest | ResetCache | CancelChat


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token, its text as logprobs show it (each token decoded alone, as vLLM shows it) and
    its log probability."""

    token_id: int
    token: str
    logprob: float


class ChatLogprobs(msgspec.Struct, kw_only=True, frozen=True):
    """An output token's log probability, and the `logprobs` most likely tokens at its position,
    most likely first (whether or not the output token is among them)."""

    sampled: TokenLogprob
    top: list[TokenLogprob]


class ChatOutput(msgspec.Struct, tag="out", kw_only=True, frozen=True):
    """New output for a request: token ids and their text; the last one has `finished` set."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[ChatLogprobs] | None = None
    """One per token of `token_ids` when the request asked for `logprobs`; else None."""
    rendered: bytes = b""
    """A `render` request's one reply: the request as vLLM's GenerateRequest, JSON."""


class ChatError(msgspec.Struct, tag="err", kw_only=True, frozen=True):
    """The terminal error for a request (`request_id` is empty when the request was unreadable)."""

    request_id: str
    error: ErrorInfo


class CacheReset(msgspec.Struct, tag="cache_reset", kw_only=True, frozen=True):
    """The reply to `ResetCache`: the engine's caches are empty and `engine_epoch` is new."""

    request_id: str
    engine_epoch: int


ClientReply = ChatOutput | ChatError | CacheReset


# ---------------------------------------------------------------- frontend -> mm worker


class MMJob(msgspec.Struct, tag="job", kw_only=True, frozen=True, array_like=True, gc=False):
    """A tokenized prompt with one placeholder token per image and per video, and where the
    images and videos are."""

    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    images: list[ImageUrl]
    sampling: SamplingParams
    deadline: float = 0.0
    """Wall-clock time (`time.time()`) after which nobody waits for the reply; 0 = none."""
    engine_epoch: int = 0
    """The newest engine cache epoch the frontend has seen (0: none yet)."""
    mm_cache_invalidate: list[str] = []
    """mm_hashes to drop from the sender and receiver caches first (a resend after a miss)."""
    render: bool = False
    """Rendered only, not run (`RequestFields.render`)."""
    videos: list[ImageUrl] = []
    """Where the videos are, in prompt order (a job with any goes to the MM worker's video
    lane)."""
    video_sampling: VideoSampling = VideoSampling()
    """How its videos are sampled (`ChatRequest.mm_processor_kwargs`)."""


class EngineEpoch(msgspec.Struct, tag="engine_epoch", kw_only=True, frozen=True, array_like=True):
    """The engine has a new cache epoch: drop the sender cache before the next job."""

    engine_epoch: int


class CancelJobs(msgspec.Struct, tag="cancel", kw_only=True, frozen=True, array_like=True):
    """Nobody waits for these jobs any more (client gone, deadline passed): skip the ones not
    yet processed, without a reply."""

    request_ids: list[str]


class Hello(msgspec.Struct, tag="hello", kw_only=True, frozen=True, array_like=True):
    """Which process are you? A frontend sends it each time its socket to an MM worker or to the
    engine connects (again); the role answers at once with a `HelloReply` to `reply_to`."""

    reply_to: str
    peer: str
    """The frontend's name for the role it asks ('engine', 'mm-worker-0'), said back."""


MMWorkerInput = MMJob | EngineEpoch | CancelJobs | Hello


# ---------------------------------------------------------------- frontend, mm worker -> engine


VIDEO_PIXELS = "pixel_values_videos"
"""The tensor that makes an item a video's (`MMItem.is_video`)."""


class MMItem(msgspec.Struct, kw_only=True, frozen=True, array_like=True, gc=False):
    """One preprocessed image or video: its processor tensors and where its tokens start in
    the prompt."""

    offset: int
    length: int
    tensors: dict[str, np.ndarray]
    mm_hash: str = ""
    """The image's content hash; "" when the sender does not cache."""
    nbytes: int = 0
    """The tensors' size in bytes: what the item costs in the caches. When `tensors` is empty,
    the engine takes them from its receiver cache (or from an earlier item with the same hash)."""

    @property
    def is_video(self) -> bool:
        """Whether the item is a video (its tensors hold VIDEO_PIXELS), else an image."""
        return VIDEO_PIXELS in self.tensors


class MMCacheHeader(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """Which sender cache a request's items were committed to, so the engine can mirror it."""

    sender: str
    """The MM worker's identity: one receiver cache per sender."""
    sender_epoch: int
    """New at each start or clear of the sender cache; larger than the sender's previous."""
    engine_epoch: int
    """The engine epoch the sender cache was cleared for; another one means 'not in sync'."""
    seq: int
    """This commit's number within the sender epoch (0, 1, 2, ...): a gap means a lost message."""
    capacity: int
    """The sender cache's capacity in bytes; the receiver cache mirrors it."""
    invalidate: list[str] = []
    """mm_hashes both caches drop before touching and inserting this request's items."""


class EngineRequest(
    msgspec.Struct, tag="req", kw_only=True, frozen=True, array_like=True, gc=False
):
    """A fully rendered request: expanded prompt token ids plus preprocessed images."""

    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_items: list[MMItem] = []
    deadline: float = 0.0
    """Wall-clock time (`time.time()`) after which the engine drops the request with a
    'timeout' error instead of running more of it; 0 = none."""
    mm_cache: MMCacheHeader | None = None
    """Set by an MM worker whose sender cache is on; None for requests sent uncached."""
    render: bool = False
    """Answer with the request in vLLM's scale-out format instead of running it
    (`RequestFields.render`)."""


class AbortRequests(msgspec.Struct, tag="abort", kw_only=True, frozen=True, array_like=True):
    """Stop these requests and free what they hold (their frontend no longer waits for them)."""

    request_ids: list[str]


class ResetEngineCache(
    msgspec.Struct, tag="reset_cache", kw_only=True, frozen=True, array_like=True
):
    """Drop every receiver cache and start a new engine epoch; answered with EngineCacheReset."""

    request_id: str
    reply_to: str


EngineInput = EngineRequest | AbortRequests | ResetEngineCache | Hello


# ---------------------------------------------------------------- engine, mm worker -> frontend


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An output token's log probability and the `sampling.logprobs` most likely tokens at its
    position, most likely first, from the logits the token was sampled from."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class EngineOutput(
    msgspec.Struct, tag="out", kw_only=True, frozen=True, array_like=True, gc=False
):
    """New tokens for a request; the first carries the prompt as the engine received it."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    engine_epoch: int = 0
    """The engine's cache epoch when it sent this (0 from senders that are no engine)."""
    logprobs: list[TokenLogprobs] | None = None
    """One per token of `token_ids` when the request asked for `sampling.logprobs`; else None."""
    rendered: bytes = b""
    """A `render` request's one reply: the request as vLLM's GenerateRequest, JSON."""


class RequestFailed(msgspec.Struct, tag="err", kw_only=True, frozen=True, array_like=True):
    """The terminal error for a request, from whichever role failed it."""

    request_id: str
    error: ErrorInfo
    engine_epoch: int = 0
    """The engine's cache epoch when it sent this (0 from senders that are no engine)."""


class EngineCacheReset(
    msgspec.Struct, tag="cache_reset", kw_only=True, frozen=True, array_like=True
):
    """The engine dropped its receiver caches (a ResetEngineCache); its new epoch."""

    request_id: str
    engine_epoch: int


class HelloReply(msgspec.Struct, tag="hello", kw_only=True, frozen=True, array_like=True):
    """The answer to a `Hello`: which start of the role's process answers. Another `started`
    than before tells the frontend that the process it sent to before is gone, and with it
    every request that process held."""

    peer: str
    """The `Hello`'s `peer`."""
    started: int
    """When the process started (`time.time_ns()`): new at every start."""
    engine_epoch: int = 0
    """The engine's cache epoch when it sent this (0 from senders that are no engine)."""


FrontendInput = EngineOutput | RequestFailed | EngineCacheReset | HelloReply


# ---------------------------------------------------------------- role -> launcher


class Ready(msgspec.Struct, tag="ready", kw_only=True, frozen=True):
    """A role finished starting and serves on `endpoint`."""

    role: str
    pid: int
    endpoint: str


class StartupFailed(msgspec.Struct, tag="failed", kw_only=True, frozen=True):
    """A role could not start; `message` says why."""

    role: str
    pid: int
    message: str


LauncherInput = Ready | StartupFailed


# ---------------------------------------------------------------- role -> stats subscribers


class HistogramSnapshot(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """A latency histogram since the process started: counts per bucket, in seconds."""

    bounds: list[float]
    """Upper bounds of the buckets; `counts` has one more entry, for everything above."""
    counts: list[int]
    total: float
    """The sum of every observation, in seconds."""
    p50: float
    p90: float
    p99: float
    """Quantiles estimated from the buckets (0 when empty), in seconds."""


class Stats(msgspec.Struct, tag="stats", kw_only=True, frozen=True):
    """One process's state, published every `stats_interval_s` on its stats socket."""

    role: str
    """'frontend', 'mm-worker' or 'engine'."""
    name: str
    """Tells processes of one role apart, e.g. 'frontend-8765'."""
    pid: int
    epoch: int
    """The cache epoch the role works in (engine: its own; MM worker: its sender cache's;
    frontend: the newest engine epoch seen)."""
    uptime_s: float
    time: float
    """When the snapshot was taken (`time.time()`)."""
    state: str
    """'serving', 'draining', (an engine whose vLLM engine core died, until it exits)
    'backend died', or 'restarting': the process is gone and `mmlane serve`, which restarts
    it, publishes this for it (its pid then serve's)."""
    in_flight: int
    """Requests held and not yet answered."""
    queues: dict[str, int]
    """Depth of each internal queue, by name."""
    counters: dict[str, int]
    """Monotonic counts since start (requests, bytes_in, bytes_out, cache_hits, ...)."""
    errors: dict[str, int]
    """Requests failed by this process, by error code."""
    histograms: dict[str, HistogramSnapshot]
    """Latencies by name; 'name:label' splits one histogram by a label (e.g. queue_wait:text)."""
    interval_s: float = 0.0
    """Seconds until the next snapshot is due (0: not said): past a few, the process is stale."""
    restarts: int = 0
    """How often `mmlane serve` has restarted this role's process (while 'restarting': the
    number of the restart under way)."""
    http_refused: dict[str, int] = {}
    """Requests the frontend's HTTP API refused before it submitted them (bad JSON, an
    unsupported field, an unknown model, an API key, a body too large), by error code."""
    exposition: str = ""
    """Metrics of what the process hosts, in Prometheus' text format: an engine on vLLM, vLLM's
    own `vllm:` series (`mmlane exporter` adds the process's role and name to them)."""
    memory: dict[str, int] = {}
    """The process's memory in bytes, by kind (services/common/memory.py, `usage`): resident,
    its anonymous part, and glibc's heaps (in use, free but kept)."""


StatsMessage = Stats


# ---------------------------------------------------------------- tool <-> role control socket


class Ping(msgspec.Struct, tag="ping", kw_only=True, frozen=True):
    """Are you alive, and able to serve? Answered by a `Pong` from the role's stats thread."""


class Pong(msgspec.Struct, tag="pong", kw_only=True, frozen=True):
    """A role's answer to `Ping`."""

    role: str
    name: str
    pid: int
    state: str
    """As `Stats.state`."""
    model: str
    """The model the role has loaded (its id); "" when none is."""
    mm_cache_bytes: int = -1
    """The engine: the capacity of each MM worker's receiver cache, in bytes (-1: not an engine).
    An MM worker checks its own capacity against it at startup."""
    restarts: int = 0
    """As `Stats.restarts`."""


ControlRequest = Ping
ControlReply = Pong
