"""Every message that crosses an mmlane socket, one tagged union per socket direction.

    client  ──ClientRequest──▶ frontend (ROUTER)       ──ClientReply──▶ client
    frontend ──MMWorkerInput──▶ mm worker (PULL)
    frontend, mm worker ──EngineInput──▶ engine (PULL)
    engine, mm worker ──FrontendInput──▶ frontend output socket (PULL, address = `reply_to`)
    role ──LauncherInput──▶ launcher's ready socket (startup handshake)

Fields are only ever appended, and new fields get defaults (msgspec schema evolution). Arrays
(`np.ndarray` fields) never travel inside msgpack: the codec moves them to extra frames.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from protocol.errors import ErrorInfo

# ---------------------------------------------------------------- shared pieces


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """How to pick output tokens: greedy when temperature is 0, else seeded sampling."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


class ImageUrl(msgspec.Struct, kw_only=True, frozen=True):
    """Where an image comes from: a `data:image/...;base64,` URI or a `file://` path."""

    url: str
    uuid: str | None = None


# ---------------------------------------------------------------- client <-> frontend


class TextPart(msgspec.Struct, tag="text", tag_field="type", frozen=True):
    """A text content part, as in OpenAI chat messages."""

    text: str


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type", frozen=True):
    """An image content part, as in OpenAI chat messages."""

    image_url: ImageUrl


ContentPart = TextPart | ImagePart


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat turn; content is a plain string or a list of parts."""

    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class ChatRequest(msgspec.Struct, tag="chat", kw_only=True, frozen=True):
    """A chat completion request on the native API."""

    request_id: str
    messages: list[ChatMessage]
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


ClientRequest = ChatRequest


class ChatOutput(msgspec.Struct, tag="out", kw_only=True, frozen=True):
    """New output for a request: token ids and their text; the last one has `finished` set."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None


class ChatError(msgspec.Struct, tag="err", kw_only=True, frozen=True):
    """The terminal error for a request (`request_id` is empty when the request was unreadable)."""

    request_id: str
    error: ErrorInfo


ClientReply = ChatOutput | ChatError


# ---------------------------------------------------------------- frontend -> mm worker


class MMJob(msgspec.Struct, tag="job", kw_only=True, frozen=True, array_like=True, gc=False):
    """A tokenized prompt with one placeholder token per image, and where the images are."""

    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    images: list[ImageUrl]
    sampling: SamplingParams


MMWorkerInput = MMJob


# ---------------------------------------------------------------- frontend, mm worker -> engine


class MMItem(msgspec.Struct, kw_only=True, frozen=True, array_like=True, gc=False):
    """One preprocessed image: its processor tensors and where its tokens start in the prompt."""

    offset: int
    length: int
    tensors: dict[str, np.ndarray]


class EngineRequest(
    msgspec.Struct, tag="req", kw_only=True, frozen=True, array_like=True, gc=False
):
    """A fully rendered request: expanded prompt token ids plus preprocessed images."""

    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_items: list[MMItem] = []


EngineInput = EngineRequest


# ---------------------------------------------------------------- engine, mm worker -> frontend


class EngineOutput(
    msgspec.Struct, tag="out", kw_only=True, frozen=True, array_like=True, gc=False
):
    """New tokens for a request; the first carries the prompt as the engine received it."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None


class RequestFailed(msgspec.Struct, tag="err", kw_only=True, frozen=True, array_like=True):
    """The terminal error for a request, from whichever role failed it."""

    request_id: str
    error: ErrorInfo


FrontendInput = EngineOutput | RequestFailed


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
