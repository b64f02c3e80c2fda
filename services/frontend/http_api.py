"""The OpenAI-compatible HTTP API: aiohttp on its own thread and event loop, in the frontend.

    HTTP client ──POST /v1/chat/completions──▶ HttpApi ──ChatRequest──▶ client ROUTER (inproc)
                ◀── JSON, or SSE chunks ──────         ◀──ChatOutput / ChatError──

The API is a native client of the frontend's I/O thread: it sends `ChatRequest`s over one
inproc DEALER socket and reads the replies, so validation, admission, deadlines and the one
terminal reply per request are the I/O thread's, not repeated here. This module only maps
fields and errors between the OpenAI shape and the native one. A client that disconnects
before its reply cancels the request (`CancelChat`), which the frontend turns into an abort.

With API keys configured (`--api-key`, `--api-key-file`), every /v1 route needs
`Authorization: Bearer KEY`, else a 401 with code `invalid_api_key`, as OpenAI answers.

Routes: POST /v1/chat/completions (JSON, or `stream: true` as server-sent events ending with
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (this frontend's stats in Prometheus'
text format, the families `mmlane exporter` gives it; like /health, and like vLLM's /metrics,
outside the API keys: a scraper has none). Errors are OpenAI-style bodies,
`{"error": {"message", "type", "param", "code"}}`, with the status of the code
(`protocol.errors.CODES`). A request this module refuses itself, before it submits anything (bad
JSON, an unsupported field, an unknown model, an API key, a body too large), is counted by code
in `Metrics.http_refused`, written by this thread alone.

While the frontend drains (after SIGTERM), /health answers 503 so that load balancers send no
more, and new chat requests get the I/O thread's refusal (503, code `peer_restarted`); the
requests in flight are answered as usual.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from protocol.codec import Codec
from protocol.errors import CODES, ErrorInfo, FatalError, RequestError, http_status
from protocol.messages import (
    CancelChat,
    ChatError,
    ChatMessage,
    ChatOutput,
    ChatRequest,
    ClientReply,
    ClientRequest,
)
from services.common.lifecycle import DRAINING_CODE
from services.common.prometheus import OwnStatsCollector, registry_of
from services.common.stats import Metrics

log = logging.getLogger(__name__)

REJECTED_UNLESS_DEFAULT: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v in (None, 1),
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "logprobs": lambda v: not v,
    "top_logprobs": lambda v: not v,
    "stop": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "presence_penalty": lambda v: not v,
    "frequency_penalty": lambda v: not v,
    "logit_bias": lambda v: not v,
}
"""Fields we cannot honour: refused with a 400 naming them, unless they ask for the default."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_VLLM_SAMPLING = ("ignore_eos", "min_tokens", "stop_token_ids")
"""vLLM's extra sampling fields (`extra_body` in the openai client), passed on as they are."""
_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


class ApiError(Exception):
    """An error as this API answers it; the status is its code's, unless one is given."""

    def __init__(self, message: str, code: str, param: str | None = None, *,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.status = status or CODES[code].http_status


class HttpApi:
    """Serves the HTTP API on `host:port` from a thread named 'frontend-http'."""

    def __init__(
        self, *, ctx: zmq.Context, client_endpoint: str, host: str, port: int, model_id: str,
        max_body_bytes: int, alive: Callable[[], bool], draining: Callable[[], bool],
        api_keys: list[str], metrics: Metrics,
    ) -> None:
        self.model_id = model_id
        self._metrics = metrics
        self._prometheus = registry_of(OwnStatsCollector(metrics.snapshot))
        self._api_keys = [key.encode() for key in api_keys]
        self._client_endpoint = client_endpoint
        self._host, self._port = host, port
        self._max_body_bytes = max_body_bytes
        self._alive = alive
        self._draining = draining
        self._ctx = zmq.asyncio.Context.shadow(ctx)  # inproc needs the frontend's context
        self._codec: Codec[Any] = Codec(ClientRequest)
        self._reply_codec: Codec[Any] = Codec(ClientReply)
        self._waiting: dict[str, asyncio.Queue[ChatOutput | ChatError]] = {}
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="frontend-http", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start serving; raises FatalError when the address cannot be bound."""
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise FatalError(
                f"cannot serve HTTP on {self._host}:{self._port}: {self._error}", code="bad_config"
            ) from self._error
        log.info("HTTP API on http://%s:%d/v1", self._host, self.port)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._startup())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _startup(self) -> None:
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(self._client_endpoint)
        self._reader = asyncio.create_task(self._read_replies(), name="frontend-http-replies")
        app = web.Application(client_max_size=self._max_body_bytes,
                              middlewares=[self._check_api_key])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._prometheus_metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        self._reader.cancel()
        self._dealer.close(linger=0)

    # ------------------------------------------------------------ the I/O thread, as a client

    async def _read_replies(self) -> None:
        while True:
            frames = await self._dealer.recv_multipart(copy=False)
            try:
                reply = self._reply_codec.decode(frames)
            except RequestError as exc:
                log.warning("unreadable reply from the I/O thread: %s", exc)
                continue
            waiting = self._waiting.get(reply.request_id)
            if waiting is not None and isinstance(reply, ChatOutput | ChatError):
                waiting.put_nowait(reply)

    async def _submit(self, request: ChatRequest) -> asyncio.Queue[ChatOutput | ChatError]:
        replies: asyncio.Queue[ChatOutput | ChatError] = asyncio.Queue()
        self._waiting[request.request_id] = replies
        await self._dealer.send_multipart(self._codec.encode(request))
        return replies

    async def _cancel(self, request_id: str) -> None:
        log.info("HTTP client of %s went away: cancelling it", request_id)
        await self._dealer.send_multipart(self._codec.encode(CancelChat(request_id=request_id)))

    # ------------------------------------------------------------ routes

    @web.middleware
    async def _check_api_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every /v1 route needs one of the API keys, when there are any; /health stays open."""
        if not self._api_keys or not request.path.startswith("/v1/"):
            return await handler(request)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return self._refuse(ApiError(
                "no API key: send it as the header `Authorization: Bearer KEY`",
                "invalid_api_key"))
        if not _known_key(key.strip().encode(), self._api_keys):
            return self._refuse(ApiError("the API key is not valid", "invalid_api_key"))
        return await handler(request)

    def _refuse(self, error: ApiError) -> web.Response:
        """The answer to a request refused here, before it reached the I/O thread: counted."""
        self._metrics.http_refused[error.code] += 1
        return _error_response(error)

    async def _health(self, _: web.Request) -> web.Response:
        if self._draining():
            return _error_response(ApiError("the frontend is stopping (draining)", DRAINING_CODE))
        if self._alive():
            return web.json_response({"status": "ok"})
        return _error_response(ApiError("the frontend's I/O loop is not turning", "overloaded"))

    async def _prometheus_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._prometheus),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _: web.Request) -> web.Response:
        model = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "mmlane"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        try:
            body = await _read_json(http)
            request, stream, include_usage = self._to_native(body, f"http-{next(self._ids)}")
        except ApiError as exc:
            return self._refuse(exc)
        finished = False
        replies = await self._submit(request)
        try:
            first = await replies.get()
            if isinstance(first, ChatError):
                finished = True
                return _error_response(_from_info(first.error))
            if stream:
                response = await self._stream(http, request, first, replies, include_usage)
            else:
                response = await self._complete(first, replies)
            finished = True
            return response
        finally:
            del self._waiting[request.request_id]
            if not finished:  # the client went away (or we failed): stop the work downstream
                await asyncio.shield(self._cancel(request.request_id))

    async def _complete(
        self, first: ChatOutput, replies: asyncio.Queue[ChatOutput | ChatError]
    ) -> web.Response:
        text, count, output = first.text, len(first.token_ids), first
        prompt_tokens = len(first.prompt_token_ids or [])
        while not output.finished:
            reply = await replies.get()
            if isinstance(reply, ChatError):
                return _error_response(_from_info(reply.error))
            output = reply
            text += output.text
            count += len(output.token_ids)
        return web.json_response({
            "id": _completion_id(), "object": "chat.completion", "created": int(time.time()),
            "model": self.model_id,
            "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": _finish_reason(output.finish_reason), "logprobs": None,
            }],
            "usage": _usage(prompt_tokens, count),
        })

    async def _stream(
        self, http: web.Request, request: ChatRequest, first: ChatOutput,
        replies: asyncio.Queue[ChatOutput | ChatError], include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        })
        await response.prepare(http)
        chunk = _Chunks(_completion_id(), self.model_id)
        await _send_event(response, chunk.delta({"role": "assistant", "content": ""}))
        prompt_tokens, count = len(first.prompt_token_ids or []), 0
        output: ChatOutput | ChatError = first
        while True:
            if isinstance(output, ChatError):  # the status is sent already: an error event
                await _send_event(response, _error_body(_from_info(output.error)))
                break
            count += len(output.token_ids)
            if output.text:
                await _send_event(response, chunk.delta({"content": output.text}))
            if output.finished:
                await _send_event(response, chunk.delta({}, _finish_reason(output.finish_reason)))
                if include_usage:
                    await _send_event(response, chunk.usage(_usage(prompt_tokens, count)))
                break
            output = await replies.get()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ------------------------------------------------------------ the OpenAI request

    def _to_native(self, body: Any, request_id: str) -> tuple[ChatRequest, bool, bool]:
        """The native request for an OpenAI body, whether to stream, whether to send usage."""
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object", "invalid_request")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise ApiError(f"the model {model!r} does not exist; this server serves "
                           f"{self.model_id!r}", "model_not_found", "model")
        for name, is_default in REJECTED_UNLESS_DEFAULT.items():
            if name in body and not is_default(body[name]):
                raise ApiError(f"{name}: not supported by this server", "invalid_request", name)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        fields: dict[str, Any] = {
            "request_id": request_id, "messages": _messages(body.get("messages")),
            "max_tokens": 64 if max_tokens is None else max_tokens,
            "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
            "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
            "seed": body.get("seed"),
            **{name: body[name] for name in _VLLM_SAMPLING if body.get(name) is not None},
        }
        try:
            request = msgspec.convert(fields, ChatRequest)
        except msgspec.ValidationError as exc:
            raise ApiError(str(exc).replace("$.", ""), "invalid_request") from exc
        stream = body.get("stream") or False
        options = body.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(options, dict):
            raise ApiError("stream must be a boolean and stream_options an object",
                           "invalid_request", "stream")
        return request, stream, bool(options.get("include_usage"))


def _messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages: a non-empty list of messages is required",
                       "invalid_request", "messages")
    messages = []
    for index, message in enumerate(raw):
        if isinstance(message, dict) and message.get("role") in _ROLES:
            message = {**message, "role": _ROLES[message["role"]]}
        if isinstance(message, dict) and message.get("content") is None:
            message = {**message, "content": ""}
        try:
            messages.append(msgspec.convert(message, ChatMessage))
        except msgspec.ValidationError as exc:
            problem = str(exc).replace("`$", f"`messages[{index}]")
            raise ApiError(f"messages[{index}]: {problem}", "invalid_request",
                           f"messages[{index}]") from exc
    return messages


def _known_key(key: bytes, keys: list[bytes]) -> bool:
    """Whether `key` is one of `keys`, compared in constant time with every one of them, so that
    the answer's timing tells nothing about which key, or how much of one, matched."""
    return any([hmac.compare_digest(key, known) for known in keys])


async def _read_json(http: web.Request) -> Any:
    try:
        return json.loads(await http.read())
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(f"the request body is larger than {http.app._client_max_size} "
                       "bytes", "request_too_large") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", "invalid_request") from exc


# ---------------------------------------------------------------- the OpenAI response


class _Chunks:
    """Builds the `chat.completion.chunk` events of one streamed completion."""

    def __init__(self, completion_id: str, model: str) -> None:
        self.base = {"id": completion_id, "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model}

    def delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self.base, "choices": [choice]}

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage}


async def _send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _from_info(error: ErrorInfo) -> ApiError:
    return ApiError(error.message, error.code, _param_of(error), status=http_status(error))


def _param_of(error: ErrorInfo) -> str | None:
    """The request field an error names (its message starts with it), for `error.param`."""
    head = error.message.replace(":", " ").split(" ", 1)[0].removeprefix("sampling.")
    if head in ("image", "messages", "too"):  # image N: ..., too many images: ...
        return "messages"
    return head if head in ("max_tokens", "temperature", "top_p", *_VLLM_SAMPLING) else None


def _error_body(error: ApiError) -> dict[str, Any]:
    if error.status < 500:
        kind = "invalid_request_error"
    else:
        kind = "overloaded_error" if error.status in (503, 504) else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(_error_body(error), status=error.status)
