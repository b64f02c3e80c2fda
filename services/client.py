"""A Python client for mmlane's native API (ZMQ DEALER, msgspec), and the `mmlane chat` command."""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from mmlane.common.sockets import make_socket
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import MMLaneError, RequestError, RetryableError, from_info
from mmlane.protocol.messages import (
    CacheReset,
    CancelChat,
    ChatError,
    ChatLogprobs,
    ChatMessage,
    ChatRequest,
    ClientReply,
    CompletionRequest,
    ImagePart,
    ImageUrl,
    ResetCache,
    TextPart,
    VideoPart,
    VideoSampling,
)


@dataclass
class ChatResult:
    """A finished reply: the whole text and tokens, and the prompt as the engine received it."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    error: MMLaneError | None = None
    logprobs: list[ChatLogprobs] | None = None
    """One per output token when the request asked for `logprobs`."""

    def to_json(self) -> dict:
        if self.error is not None:
            return {"error": {"code": self.error.code, "message": self.error.message}}
        return {
            "text": self.text, "token_ids": self.token_ids,
            "finish_reason": self.finish_reason, "prompt_token_ids": self.prompt_token_ids,
        }


def image_url(source: str, default_type: str = "image/png") -> ImageUrl:
    """A `data:`/`file://`/http(s) URL as given, or a local file read here and sent inline (as
    its name's media type, else `default_type`)."""
    if source.startswith(("data:", "file://", "http://", "https://")):
        return ImageUrl(url=source)
    path = Path(source)
    mime = mimetypes.guess_type(path.name)[0] or default_type
    return ImageUrl(url=f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}")


def user_message(prompt: str, images: Sequence[str] = (),
                 videos: Sequence[str] = ()) -> ChatMessage:
    """A user's turn: its images, its videos, then its text (as vLLM's examples put them)."""
    parts: list = [ImagePart(image_url=image_url(src)) for src in images]
    parts += [VideoPart(video_url=image_url(src, "video/mp4")) for src in videos]
    parts.append(TextPart(text=prompt))
    return ChatMessage(role="user", content=parts)


class Client:
    """Sends chat and completion requests and gathers their streamed replies. One socket; not
    thread-safe."""

    def __init__(self, endpoint: str, *, timeout_s: float = 600.0) -> None:
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, endpoint, bind=False, linger_ms=0)
        self._codec: Codec[ClientReply] = Codec(ClientReply)
        self._timeout_s = timeout_s
        self._partial: dict[str, ChatResult] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    def submit(self, messages: list[ChatMessage], **sampling: object) -> str:
        """Send one chat request without waiting; returns its request id."""
        request_id = uuid.uuid4().hex
        self.send_raw(self._codec.encode(ChatRequest(
            request_id=request_id, messages=messages, **sampling  # type: ignore[arg-type]
        )))
        return request_id

    def submit_completion(self, prompt: str | list[int], **sampling: object) -> str:
        """Send one completion request (a text, or token ids) without waiting; returns its
        request id."""
        request_id = uuid.uuid4().hex
        self.send_raw(self._codec.encode(CompletionRequest(
            request_id=request_id, prompt=prompt, **sampling  # type: ignore[arg-type]
        )))
        return request_id

    def cancel(self, request_id: str) -> None:
        """Stop a submitted request; no reply to it follows."""
        self.send_raw(self._codec.encode(CancelChat(request_id=request_id)))

    def send_raw(self, frames: list) -> None:
        """Send frames as they are (tests use it for malformed messages)."""
        self._sock.send_multipart(frames, copy=False)

    def collect(self, request_ids: list[str]) -> dict[str, ChatResult]:
        """Wait for the terminal reply of each request id."""
        deadline = time.monotonic() + self._timeout_s
        waiting = set(request_ids)
        done: dict[str, ChatResult] = {}
        while waiting:
            result = self.next_finished(deadline)
            done[result.request_id] = result
            waiting.discard(result.request_id)
        return done

    def next_finished(self, deadline: float | None = None) -> ChatResult:
        """Wait for whichever request finishes next (replies to others are kept meanwhile)."""
        deadline = deadline or time.monotonic() + self._timeout_s
        while True:
            result, ended = self.receive(deadline)
            if ended:
                return result

    def receive(self, deadline: float | None = None) -> tuple[ChatResult, bool]:
        """Wait for the next reply to any request (a streamed piece or its end): that request's
        result so far, and whether the reply ended it."""
        reply = self._recv(deadline or time.monotonic() + self._timeout_s)
        result = self._partial.setdefault(reply.request_id, ChatResult(reply.request_id))
        ended = _apply(result, reply)
        if ended:
            del self._partial[reply.request_id]
        return result, ended

    def reset_cache(self) -> None:
        """Empty the feature caches of the engine and of every MM worker; raises on error.

        When it returns the engine's caches are empty; each MM worker empties its own before
        its next job. Requests in flight meanwhile still get their replies.
        """
        request_id = uuid.uuid4().hex
        self.send_raw(self._codec.encode(ResetCache(request_id=request_id)))
        self._result(request_id)

    def chat(self, messages: list[ChatMessage], **sampling: object) -> ChatResult:
        """Send one chat request and wait for its reply; raises the reply's error."""
        return self._result(self.submit(messages, **sampling))

    def complete(self, prompt: str | list[int], **sampling: object) -> ChatResult:
        """Send one completion request and wait for its reply; raises the reply's error."""
        return self._result(self.submit_completion(prompt, **sampling))

    def _result(self, request_id: str) -> ChatResult:
        result = self.collect([request_id])[request_id]
        if result.error is not None:
            raise result.error
        return result

    def _recv(self, deadline: float) -> ClientReply:
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self._sock.poll(remaining_ms):
            raise RetryableError(f"no reply within {self._timeout_s} s", code="timeout")
        return self._codec.decode(self._sock.recv_multipart(copy=False))


def _apply(result: ChatResult, reply: ClientReply) -> bool:
    """Fold one reply into its result; True when it was the terminal one."""
    if isinstance(reply, ChatError):
        result.error = from_info(reply.error)
        return True
    if isinstance(reply, CacheReset):
        result.finish_reason = "cache_reset"
        return True
    result.text += reply.text
    result.token_ids.extend(reply.token_ids)
    if reply.prompt_token_ids is not None:
        result.prompt_token_ids = reply.prompt_token_ids
    if reply.logprobs is not None:
        result.logprobs = [*(result.logprobs or []), *reply.logprobs]
    if reply.finished:
        result.finish_reason = reply.finish_reason
    return reply.finished


def reset_cache_command(args: argparse.Namespace) -> int:
    """`mmlane reset-cache`: empty the feature caches of a running mmlane."""
    try:
        with Client(args.endpoint, timeout_s=args.timeout) as client:
            client.reset_cache()
    except MMLaneError as exc:
        print(f"error ({exc.code}): {exc.message}", file=sys.stderr)
        return 1
    print("feature caches reset")
    return 0


def chat_command(args: argparse.Namespace) -> int:
    """`mmlane chat`: one request, the reply printed as text or as one JSON object."""
    try:
        message = user_message(args.prompt, args.image, args.video)
        sampling = VideoSampling(fps=args.video_fps, num_frames=args.video_frames)
        with Client(args.endpoint, timeout_s=args.timeout) as client:
            result = client.chat(
                [message], max_tokens=args.max_tokens, temperature=args.temperature,
                seed=args.seed, mm_processor_kwargs=sampling,
            )
    except MMLaneError as exc:
        result = ChatResult("", error=exc)
    except OSError as exc:
        result = ChatResult("", error=RequestError(f"cannot read a file: {exc}", code="bad_image"))
    if args.json:
        print(json.dumps(result.to_json()))
    elif result.error is not None:
        print(f"error ({result.error.code}): {result.error.message}", file=sys.stderr)
    else:
        print(result.text)
    return 1 if result.error is not None else 0
