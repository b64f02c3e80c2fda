"""The OpenAI-compatible HTTP API: aiohttp on its own thread and event loop, in the frontend.

    HTTP client ──POST /v1/chat/completions──▶ HttpApi ──ChatRequest──────▶ client ROUTER
                ──POST /v1/completions───────▶         ──CompletionRequest─▶ (inproc)
                ◀── JSON, or SSE chunks ──────         ◀──ChatOutput / ChatError──

The API is a native client of the frontend's I/O thread: it sends native requests over one
inproc DEALER socket and reads the replies, so validation, admission, deadlines and the one
terminal reply per request are the I/O thread's, not repeated here. This module only maps
fields and errors between the OpenAI shape and the native one; both routes share that mapping
and differ only where a `_Route` says (the prompt field, the object names, the choice shape,
the shape of logprobs: chat's `content` entries, or a completion's legacy `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset` lists).
A client that disconnects before its reply cancels the request (`CancelChat`), which the
frontend turns into an abort; so does a streaming client that reads nothing for
`--http-stream-write-timeout` (its connection's buffers full): it is disconnected, counted
(`http_stalled_streams`), and holds no request.
Slow heads and bodies, idle and surplus connections, and per-key request rates are bounded
below the routes (http_limits.py; the body's bound is `_read_json`'s, as this module reads it).

With API keys configured (`--api-key`, `--api-key-file`), every /v1 route needs
`Authorization: Bearer KEY`, else a 401 with code `invalid_api_key`, as OpenAI answers.

Routes: POST /v1/chat/completions and POST /v1/completions (JSON, or `stream: true` as
server-sent events ending with `data: [DONE]`), GET /v1/models (each served name), POST /tokenize
and POST /detokenize (vLLM's, run on the frontend's tokenizer threads; like /v1, under the API
keys), GET /health, GET /metrics (this
frontend's stats in Prometheus' text format, the families `mmlane exporter` gives it; like
/health, and like vLLM's /metrics, outside the API keys: a scraper has none). A completion's
prompt is one text or one list of token ids (alone or as a list's only element); a batch of
several prompts is refused. Errors are OpenAI-style bodies,
`{"error": {"message", "type", "param", "code"}}`, with the status of the code
(`mmlane.protocol.errors.CODES`). A request this module refuses itself, before it submits
anything (bad JSON, an unsupported field, an unknown model, an API key, a body too large), is
counted by code in `Metrics.http_refused`, written by this thread alone.

`n` > 1 asks for n independent choices: the API sends n native requests (`parallel_requests`,
seeded as vLLM seeds its parallel samples) and merges their replies (`Choices`), each with its
choice's `index`; the usage sums the completion tokens of all and counts the prompt once. A
route serves them through `_choices`, which also cancels every unanswered choice when its
client goes away. An image request's images are processed once per MM worker the jobs go to:
the MM worker's feature cache answers its later copies (with the cache off, each copy is
fetched and processed again). `stop` strings are the frontend's (see `ChatRequest.stop`), so
they work with every engine backend.

/health answers 503 until the engine has answered the frontend (a vLLM engine loads its model
first: a load balancer or a readiness probe sends nothing before it serves, as with `vllm serve`),
and while the frontend drains (after SIGTERM), so that load balancers send no more; new chat
requests then get the I/O thread's refusal (503, code `peer_restarted`), and the requests in
flight are answered as usual.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import itertools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mmlane.common.lifecycle import DRAINING_CODE
from mmlane.common.prometheus import OwnStatsCollector, registry_of
from mmlane.common.stats import Metrics
from mmlane.frontend.config import FrontendConfig
from mmlane.frontend.http_limits import RETRY_AFTER_S, Connections, RateLimiter, retry_after
from mmlane.frontend.requests import detokenize, tokenize
from mmlane.frontend.tools import ToolUse, tool_format, tool_use
from mmlane.model import Preprocessor
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import (
    CODES,
    ErrorInfo,
    FatalError,
    RequestError,
    http_status,
    translate,
)
from mmlane.protocol.messages import (
    CONTENT_TYPES,
    CancelChat,
    ChatError,
    ChatLogprobs,
    ChatMessage,
    ChatOutput,
    ChatRequest,
    ClientReply,
    ClientRequest,
    CompletionRequest,
    TokenLogprob,
    VideoSampling,
)
from mmlane.protocol.sampling import MAX_LOGPROBS

log = logging.getLogger(__name__)
_T = TypeVar("_T")


REJECTED_UNLESS_DEFAULT: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: not v,  # OpenAI's older name of tools
    "function_call": lambda v: v in (None, "none"),
}
"""Fields we cannot honour: refused with a 400 naming them, unless they ask for the default."""
_AIOHTTP_KEEPALIVE_S = 7 * 24 * 3600.0
"""aiohttp's own keep-alive timer, set out of the way: `Connections` keeps the connections'."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPENAI_SAMPLING = ("presence_penalty", "frequency_penalty")
"""OpenAI's sampling fields passed on as they are (null: the default)."""
_VLLM_SAMPLING = ("ignore_eos", "min_tokens", "stop_token_ids", "repetition_penalty",
                  "skip_special_tokens")
"""vLLM's extra sampling (and output) fields (`extra_body` in the openai client), passed on as
they are."""
_OPENAI_NAMES = {"structured_outputs": "response_format"}
"""Native fields that OpenAI's API names otherwise, as errors name them to its clients (a
request's own names: `_client_names`)."""
_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


class ApiError(Exception):
    """An error as this API answers it; the status is its code's, unless one is given."""

    def __init__(self, message: str, code: str, param: str | None = None, *,
                 status: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.status = status or CODES[code].http_status
        self.retry_after_s = RETRY_AFTER_S if retry_after_s is None and self.status == 503 \
            else retry_after_s
        """When `Retry-After` tells the client to try again (a 503's or a 429's)."""


class _Stalled(Exception):
    """A streaming client read nothing for the write timeout."""


class HttpApi:
    """Serves the HTTP API on `config.http_host:http_port` from a thread named 'frontend-http',
    bounded by the config's `http_*` limits (http_limits.py)."""

    def __init__(
        self, config: FrontendConfig, *, ctx: zmq.Context, client_endpoint: str,
        model_names: list[str], pre: Preprocessor, tokenizers: Executor,
        alive: Callable[[], bool], draining: Callable[[], bool],
        engine_answered: Callable[[], bool], metrics: Metrics,
    ) -> None:
        self.model_names = model_names
        self.model_id = model_names[0]
        self._pre = pre
        self._tokenizers = tokenizers
        """The frontend's tokenizer threads, which /tokenize and /detokenize run on."""
        self._config = config
        self._tool_parser = tool_format(config.tool_call_parser, pre.family.tool_call_format,
                                        pre.tokenizer.get_vocab())
        """The tool-call format tool_choice 'auto' reads (None: none; 'auto' is refused)."""
        self._rates = RateLimiter(config.http_rate_limit, config.http_rate_burst) \
            if config.http_rate_limit else None
        self._metrics = metrics
        self._prometheus = registry_of(OwnStatsCollector(metrics.snapshot))
        self._api_keys = [key.encode() for key in config.api_keys()]
        self._client_endpoint = client_endpoint
        self._alive = alive
        self._draining = draining
        self._engine_answered = engine_answered
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
                f"cannot serve HTTP on {self._config.http_host}:{self._config.http_port}: "
                f"{self._error}", code="bad_config"
            ) from self._error
        log.info("HTTP API on http://%s:%d/v1", self._config.http_host, self.port)

    def stop_listening(self) -> None:
        """Take no more connections, while those open are served: with --http-reuse-port the
        host's other frontends get the new ones while this one drains (alone on its port, it
        keeps listening, so that its /health tells load balancers it is draining)."""
        if self._config.http_reuse_port and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._server.close)

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
        app = web.Application(client_max_size=self._config.http_max_body_bytes,
                              middlewares=[self._guard, self._openai_errors, self._check_api_key,
                                           self._rate_limit])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions/render", self._chat_render)
        app.router.add_post("/v1/completions/render", self._completions_render)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._prometheus_metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=1.0,
                                     keepalive_timeout=_AIOHTTP_KEEPALIVE_S)
        await self._runner.setup()
        assert self._runner.server is not None
        self._connections = Connections(
            self._runner.server, self._config, metrics=self._metrics,
            error_body=lambda message, code: _error_body(ApiError(message, code)))
        self._metrics.gauge("http_connections", lambda: len(self._connections.open))
        # The listening socket is ours rather than a web.TCPSite's, so that every connection
        # goes through `Connections`; the runner still closes the connections at its cleanup.
        # With http_reuse_port the frontends of a host share the port: Linux lets only sockets
        # that all set SO_REUSEPORT, under one effective UID, bind it, so another user's or an
        # unrelated program's listener there still refuses this one.
        self._server = await asyncio.get_running_loop().create_server(
            self._connections, self._config.http_host, self._config.http_port,
            reuse_port=self._config.http_reuse_port, start_serving=False)
        self.port = self._server.sockets[0].getsockname()[1]
        # The ZMQ socket only once the port is bound: one left open by a failed bind kept the
        # frontend's context from closing, so the frontend hung instead of failing to start.
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(self._client_endpoint)
        self._reader = asyncio.create_task(self._read_replies(), name="frontend-http-replies")
        await self._server.start_serving()

    async def _shutdown(self) -> None:
        self._server.close()
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

    @contextlib.asynccontextmanager
    async def _choices(self, requests: list[NativeRequest]) -> AsyncIterator[Choices]:
        """Send the requests (one per choice) and yield their replies; on the way out, cancel
        the ones without their terminal reply: the HTTP client went away, or one choice's error
        ended the others."""
        choices = Choices(requests)
        for request in requests:
            self._waiting[request.request_id] = choices.queue
        try:
            for request in requests:
                await self._dealer.send_multipart(self._codec.encode(request))
            yield choices
        finally:
            for request in requests:
                del self._waiting[request.request_id]
            if choices.open:  # stop the work downstream
                await asyncio.shield(self._cancel(sorted(choices.open)))

    async def _cancel(self, request_ids: list[str]) -> None:
        log.info("HTTP request ended before the replies of %s (its client went away, or "
                 "another choice failed): cancelling", ", ".join(request_ids))
        for request_id in request_ids:
            await self._dealer.send_multipart(
                self._codec.encode(CancelChat(request_id=request_id)))

    # ------------------------------------------------------------ routes

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A handler runs: its connection's request head has come (the head timer stops)."""
        self._connections.handling(request.protocol)
        try:
            return await handler(request)
        finally:
            self._connections.handled(request.protocol)

    @web.middleware
    async def _openai_errors(self, request: web.Request,
                             handler: Handler) -> web.StreamResponse:
        """aiohttp's own answers to an unknown route (404) and to a method a route does not
        take (405, with `Allow`) as OpenAI error bodies, as every other error here."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return self._refuse(ApiError(f"no route {request.path}", "invalid_request",
                                         status=404))
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            response = self._refuse(ApiError(
                f"{request.method} is not allowed on {request.path} (allowed: {allowed})",
                "invalid_request", status=405))
            response.headers["Allow"] = allowed
            return response

    @web.middleware
    async def _rate_limit(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """With `--http-rate-limit`, each API key (or client address, without keys) gets that
        many /v1 requests a second; a request over it gets a 429 with `Retry-After`."""
        if self._rates is None or not _keyed(request.path):
            return await handler(request)
        key = request.headers.get("Authorization", "") if self._api_keys else \
            f"address {request.remote}"
        wait = self._rates.wait_s(key)
        if wait:
            return self._refuse(ApiError(
                f"over the rate limit of {self._config.http_rate_limit:g} requests a second "
                f"(bursts of {self._config.http_rate_burst}); try again in {wait:.2f} s",
                "rate_limit_exceeded", retry_after_s=wait))
        return await handler(request)

    @web.middleware
    async def _check_api_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every /v1 route and /tokenize and /detokenize need one of the API keys, when there
        are any; /health and /metrics stay open."""
        if not self._api_keys or not _keyed(request.path):
            return await handler(request)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return self._refuse(ApiError(
                "no API key: send it as the header `Authorization: Bearer KEY`",
                "invalid_api_key"))
        if not _known_key(key.strip().encode(), self._api_keys):
            return self._refuse(ApiError("the API key is not valid", "invalid_api_key"))
        return await handler(request)

    async def _read_json(self, http: web.Request) -> Any:
        """The body as JSON, read with `--http-body-timeout` as the longest wait between two of
        its reads (a client that trickles its body is cut off with a 408) and no more than
        `--http-max-body-bytes` in all (a 413)."""
        limit, timeout = self._config.http_max_body_bytes, self._config.http_body_timeout_s
        if http.content_length is not None and http.content_length > limit:
            raise _too_large(limit)
        body = bytearray()
        while True:
            try:
                chunk = await asyncio.wait_for(http.content.readany(), timeout)
            except TimeoutError:
                self._metrics.counters["http_slow_bodies"] += 1
                raise ApiError(f"the request body stalled: nothing for {timeout:g} s "
                               "(--http-body-timeout)", "request_timeout") from None
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
        try:  # msgspec: 6x the standard library's speed on an image's 840 KB data URI
            return msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ApiError(f"the request body is not valid JSON: {exc}",
                           "invalid_request") from exc

    def _refuse(self, error: ApiError) -> web.Response:
        """The answer to a request refused here, before it reached the I/O thread: counted."""
        self._metrics.http_refused[error.code] += 1
        return _error_response(error)

    async def _health(self, _: web.Request) -> web.Response:
        if self._draining():
            return _error_response(ApiError("the frontend is stopping (draining)", DRAINING_CODE))
        if not self._engine_answered():
            return _error_response(ApiError(  # retryable: the code of a peer (re)starting
                "the engine has not answered yet (it is starting)", "peer_restarted"))
        if self._alive():
            return web.json_response({"status": "ok"})
        return _error_response(ApiError("the frontend's I/O loop is not turning", "overloaded"))

    async def _prometheus_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._prometheus),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _: web.Request) -> web.Response:
        """Each served name, as vLLM lists them (`root`: the model, `max_model_len`)."""
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "mmlane",
             "root": self._pre.model_id, "parent": None, "max_model_len": self._pre.max_context}
            for name in self.model_names]})

    async def _tokenize(self, http: web.Request) -> web.Response:
        """vLLM's /tokenize: a chat's `messages` (its `tools`; `add_generation_prompt`,
        default true) or a text `prompt` (`add_special_tokens`, default true) as the model's
        prompt ids, with their tokens' texts when `return_token_strs`."""
        try:
            body = await self._read_json(http)
            self._check_model(body)
            tools = self._tool_use({"tools": body.get("tools"), "tool_choice": "none"})
            request: NativeRequest = ChatRequest(
                request_id="tokenize", messages=_messages(body["messages"]),
                tools=tools.tools if tools else []) if "messages" in body else \
                CompletionRequest(request_id="tokenize", prompt=_prompt(body.get("prompt")))
            options = {name: _flag(body, name) for name in (
                "add_generation_prompt", "add_special_tokens", "return_token_strs")}
            ids = await self._on_tokenizers(
                tokenize, self._pre, request, add_generation_prompt=options[
                    "add_generation_prompt"], add_special_tokens=options["add_special_tokens"])
        except ApiError as exc:
            return self._refuse(exc)
        strs = self._pre.tokenizer.convert_ids_to_tokens(ids) \
            if options["return_token_strs"] else None
        return web.json_response({"count": len(ids), "max_model_len": self._pre.max_context,
                                  "tokens": ids, "token_strs": strs})

    async def _detokenize(self, http: web.Request) -> web.Response:
        """vLLM's /detokenize: `tokens` (ids) as one text, special tokens included."""
        try:
            body = await self._read_json(http)
            self._check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                    isinstance(token, int) and not isinstance(token, bool) for token in tokens):
                raise ApiError("tokens: a list of token ids is required", "invalid_request",
                               "tokens")
            text = await self._on_tokenizers(detokenize, self._pre, tokens)
        except ApiError as exc:
            return self._refuse(exc)
        return web.json_response({"prompt": text})

    async def _on_tokenizers(self, work: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """`work` run on the frontend's tokenizer threads; a failure (a template's, or an id
        outside the vocabulary) as the request's error, as for a chat request."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizers, functools.partial(work, *args, **kwargs))
        except Exception as exc:
            error = translate(exc, "cannot render prompt", default="invalid_request")
            raise ApiError(error.message, error.code, _param_of(error.to_info(), {})) from exc

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        return await self._answer(http, _CHAT)

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        return await self._answer(http, _COMPLETION)

    async def _chat_render(self, http: web.Request) -> web.Response:
        return await self._render(http, _CHAT)

    async def _completions_render(self, http: web.Request) -> web.Response:
        return await self._render(http, _COMPLETION)

    async def _render(self, http: web.Request, route: _Route) -> web.Response:
        """vLLM's render API (`vllm launch render`): the request rendered by the whole pipeline
        (template and tokenizer, the MM worker's images, their expansion) and written by the
        engine as vLLM's GenerateRequest, to be posted to a vLLM server's
        /inference/v1/generate, not run here; a completion's is a list of one, as vLLM's. A
        request for `n` choices is one GenerateRequest whose sampling asks vLLM for them, as
        vLLM's render answers it."""
        try:
            body = await self._read_json(http)
            asked = self._to_native(body, f"http-{next(self._ids)}", route, render=True)
            n = n_of(body, self._config.max_n)
        except ApiError as exc:
            return self._refuse(exc)
        async with self._choices([asked.request]) as choices:
            firsts = await choices.firsts()
        if isinstance(firsts, ChatError):
            return _error_response(_from_info(firsts.error, _client_names(body)))
        rendered = firsts[0].rendered if n == 1 else for_choices(firsts[0].rendered, n)
        return web.Response(body=rendered if route is _CHAT else b"[" + rendered + b"]",
                            content_type="application/json")

    async def _answer(self, http: web.Request, route: _Route) -> web.StreamResponse:
        try:
            body = await self._read_json(http)
            asked = self._to_native(body, f"http-{next(self._ids)}", route)
            n = n_of(body, self._config.max_n)
        except ApiError as exc:
            return self._refuse(exc)
        async with self._choices(parallel_requests(asked.request, n)) as choices:
            firsts = await choices.firsts()
            if isinstance(firsts, ChatError):
                return _error_response(_from_info(firsts.error, _client_names(body)))
            if asked.stream:
                return await self._stream(http, asked, choices, firsts, route)
            return await self._complete(asked, choices, firsts, route)

    async def _complete(self, asked: _Asked, choices: Choices,
                        firsts: list[ChatOutput], route: _Route) -> web.Response:
        gathered = await choices.gathered(firsts)
        if isinstance(gathered, ChatError):
            return _error_response(_from_info(gathered.error))
        answers = []
        for index, choice in enumerate(gathered):
            reason = _finish_reason(choice.finish_reason)
            content = route.choice(choice.text)
            if asked.tools is not None:
                message, reason = asked.tools.answer(choice.text, reason)
                content = {"message": message}
            answers.append({"index": index, **content, "finish_reason": reason,
                            "logprobs": route.logprobs_of(asked.request, choice.logprobs)})
        return web.json_response({
            "id": _completion_id(route), "object": route.object, "created": int(time.time()),
            "model": self.model_id, "choices": answers,
            "usage": _usage(prompt_tokens(firsts), sum(choice.tokens for choice in gathered)),
        })

    async def _stream(self, http: web.Request, asked: _Asked, choices: Choices,
                      firsts: list[ChatOutput], route: _Route) -> web.StreamResponse:
        request = asked.request
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        })
        await response.prepare(http)
        try:
            await self._stream_events(response, asked, choices, firsts, route)
        except _Stalled:  # the client reads nothing: cut it off; `_choices` cancels the rest
            self._metrics.counters["http_stalled_streams"] += 1
            log.warning("HTTP stream of %s: the client read nothing for %g s; closed",
                        request.request_id, self._config.http_stream_write_timeout_s)
            if http.transport is not None:
                http.transport.abort()
        except ConnectionResetError:  # the client went away mid-stream, as clients do
            log.info("HTTP stream of %s: the client went away", request.request_id)
        return response

    async def _stream_events(self, response: web.StreamResponse, asked: _Asked,
                             choices: Choices, firsts: list[ChatOutput], route: _Route) -> None:
        async def send(payload: dict[str, Any]) -> None:
            await self._write(response, b"data: " + json.dumps(payload).encode() + b"\n\n")

        chunk = _Chunks(route, self.model_id)
        if route.opening is not None:
            for index in range(len(firsts)):
                await send(chunk.choice(index, route.opening))
        completion_tokens = 0
        text_offsets = [0] * len(firsts)  # each choice's, where its next chunk's tokens start
        tools = [asked.tools.stream() if asked.tools else None for _ in firsts]
        async for index, output in choices.replies(firsts):
            if isinstance(output, ChatError):  # the status is sent already: an error event
                await send(_error_body(_from_info(output.error)))
                break
            completion_tokens += len(output.token_ids)
            stream = tools[index]
            if output.text or output.logprobs:  # each token's logprobs, text or not (as vLLM)
                contents = [route.delta(output.text)] if stream is None else \
                    [{"delta": delta} for delta in stream.feed(output.text)]
                logprobs = route.logprobs_of(asked.request, output.logprobs, text_offsets[index])
                if not contents and (logprobs is not None or stream is None):
                    contents = [route.closing]  # logprobs of tokens without text (yet)
                for number, content in enumerate(contents):
                    await send(chunk.choice(index, content,
                                            logprobs=logprobs if number == 0 else None))
                text_offsets[index] += _texts_length(output.logprobs or [])
            if output.finished:
                reason = _finish_reason(output.finish_reason)
                if stream is not None:
                    deltas, reason = stream.finish(reason)
                    for delta in deltas:
                        await send(chunk.choice(index, {"delta": delta}))
                await send(chunk.choice(index, route.closing, reason))
        else:
            if asked.include_usage:
                await send(chunk.usage(_usage(prompt_tokens(firsts), completion_tokens)))
        await self._write(response, b"data: [DONE]\n\n")
        await asyncio.wait_for(response.write_eof(), self._config.http_stream_write_timeout_s)

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        """Write to a stream; raises _Stalled when the client has read nothing for the write
        timeout (its connection's buffers full), so that it holds no request any longer."""
        try:
            await asyncio.wait_for(response.write(data), self._config.http_stream_write_timeout_s)
        except TimeoutError:
            raise _Stalled from None

    # ------------------------------------------------------------ the OpenAI request

    def _check_model(self, body: Any) -> None:
        """Refuse a body that is not a JSON object, or names a model not served here."""
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object", "invalid_request")
        model = body.get("model")
        if model is not None and model not in self.model_names:
            raise ApiError(f"the model {model!r} does not exist; this server serves "
                           f"{' and '.join(map(repr, self.model_names))}", "model_not_found",
                           "model")

    def _to_native(self, body: Any, request_id: str, route: _Route, *,
                   render: bool = False) -> _Asked:
        """The native request for an OpenAI body (`render`: to be rendered only), and what the
        answer is to be."""
        self._check_model(body)
        for name, is_default in {**REJECTED_UNLESS_DEFAULT, **route.refused}.items():
            if name in body and not is_default(body[name]):
                raise ApiError(f"{name}: not supported by this server", "invalid_request", name)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        tools = self._tool_use(body) if route is _CHAT else None
        tools_fields = _tools_fields(tools, body)
        fields: dict[str, Any] = {
            "request_id": request_id, "render": render, **route.prompt(body),
            "max_tokens": route.max_tokens if max_tokens is None else max_tokens,
            "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
            "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
            "seed": body.get("seed"),
            "logit_bias": _logit_bias(body.get("logit_bias")),
            "structured_outputs": _structured_outputs(body),
            **tools_fields,
            "logprobs": route.logprobs_asked(body),
            "stop": _stop_list(body.get("stop")),
            **{name: body[name] for name in (*_OPENAI_SAMPLING, *_VLLM_SAMPLING)
               if body.get(name) is not None},
        }
        if tools is not None and tools.keeps_special_tokens:  # vLLM's, whatever was asked
            fields["skip_special_tokens"] = False
        try:
            request = msgspec.convert(fields, route.native)
        except msgspec.ValidationError as exc:
            field = re.search(r"at `\$\.(\w+)", str(exc))
            raise ApiError(str(exc).replace("$.", ""), "invalid_request",
                           field.group(1) if field else None) from exc
        stream = body.get("stream") or False
        options = body.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(options, dict):
            raise ApiError("stream must be a boolean and stream_options an object",
                           "invalid_request", "stream")
        return _Asked(request, stream, bool(options.get("include_usage")), tools)

    def _tool_use(self, body: dict[str, Any]) -> ToolUse | None:
        try:
            return tool_use(body, self._tool_parser)
        except RequestError as exc:
            raise ApiError(exc.message, "invalid_request",
                           re.split(r"[:\[.]", exc.message, maxsplit=1)[0]) from exc


@dataclass(frozen=True)
class _Asked:
    """An OpenAI request, as the routes answer it."""

    request: NativeRequest
    stream: bool
    include_usage: bool
    """A streamed answer ends with a chunk of the usage."""
    tools: ToolUse | None
    """A chat's tool use (None: it has none): its choices' text is read for tool calls."""


def _tools_fields(tools: ToolUse | None, body: dict[str, Any]) -> dict[str, Any]:
    """The native fields of a chat's tool use: the tools, for the template, and the constraint
    of 'required' or a named function, which takes the place of the output's structure."""
    if tools is None:
        return {}
    constraint = tools.constraint()
    if constraint is None:
        return {"tools": tools.tools}
    structured = next(iter(_structured_fields(body)), None)
    if structured is not None:
        raise ApiError(f"{structured}: cannot be combined with tool_choice "
                       f"{tools.choice!r}, which gives the output its form", "invalid_request",
                       structured)
    return {"tools": tools.tools, "structured_outputs": constraint}


def _stop_list(stop: Any) -> Any:
    """OpenAI's `stop`, a string or a list of them, as the native list (checked there)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def n_of(body: dict[str, Any], max_n: int) -> int:
    """The number of choices an OpenAI body asks for (`n`, 1 when absent), at most `max_n`."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise ApiError(f"n: must be an integer in 1..{max_n}, got {n!r}", "invalid_request", "n")
    return n


def for_choices(rendered: bytes, n: int) -> bytes:
    """A rendered GenerateRequest (JSON) asking vLLM for `n` choices (its sampling's `n`; vLLM
    seeds choice i with seed + i, as `parallel_requests`); the rest of it, its images' items
    too, is copied as it is, not decoded."""
    fields = msgspec.json.decode(rendered, type=dict[str, msgspec.Raw])
    sampling = msgspec.json.decode(fields["sampling_params"], type=dict[str, Any])
    fields["sampling_params"] = msgspec.Raw(msgspec.json.encode({**sampling, "n": n}))
    return msgspec.json.encode(fields)


NativeRequest = ChatRequest | CompletionRequest


def parallel_requests(request: NativeRequest, n: int) -> list[NativeRequest]:
    """The native requests of one request for `n` choices, as vLLM's parallel sampling makes
    them: choice i's request id ends in `-i`, and with a seed it samples with seed + i (so
    choice 0 is the n=1 reply); without one, each choice draws its own."""
    if n == 1:
        return [request]
    return [msgspec.structs.replace(
        request, request_id=f"{request.request_id}-{index}",
        seed=None if request.seed is None else request.seed + index,
    ) for index in range(n)]


@dataclass
class Choice:
    """One choice's reply, gathered: its text, its number of tokens, why it ended, the logprobs
    of its tokens (when asked)."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[ChatLogprobs] = field(default_factory=list)


class Choices:
    """The replies to the requests of one API request's choices, each with its choice's index,
    in the order they come (`HttpApi._choices` sends the requests and fills `queue`)."""

    def __init__(self, requests: list[NativeRequest]) -> None:
        self._index = {request.request_id: index for index, request in enumerate(requests)}
        self.open = set(self._index)
        """The request ids whose terminal reply has not come yet."""
        self.queue: asyncio.Queue[ChatOutput | ChatError] = asyncio.Queue()
        self._early: collections.deque[tuple[int, ChatOutput]] = collections.deque()
        """Replies that came while `firsts` waited for another choice's first reply."""

    async def firsts(self) -> list[ChatOutput] | ChatError:
        """Each choice's first reply, in index order; or the first error, if one comes first
        (then the API answers with its status)."""
        firsts: dict[int, ChatOutput] = {}
        while len(firsts) < len(self._index):
            index, reply = await self._take()
            if isinstance(reply, ChatError):
                return reply
            if index in firsts:
                self._early.append((index, reply))
            else:
                firsts[index] = reply
        return [firsts[index] for index in range(len(firsts))]

    async def replies(
        self, firsts: list[ChatOutput]
    ) -> AsyncIterator[tuple[int, ChatOutput | ChatError]]:
        """The choices' replies from their first ones on, each with its index, until each choice
        has its terminal reply; an error ends them all (it comes last)."""
        for index, first in enumerate(firsts):
            yield index, first
        while self._early or self.open:
            index, reply = self._early.popleft() if self._early else await self._take()
            yield index, reply
            if isinstance(reply, ChatError):
                return

    async def gathered(self, firsts: list[ChatOutput]) -> list[Choice] | ChatError:
        """Every choice's whole reply, or the error that ended them."""
        choices = [Choice() for _ in firsts]
        async for index, reply in self.replies(firsts):
            if isinstance(reply, ChatError):
                return reply
            choice = choices[index]
            choice.text += reply.text
            choice.tokens += len(reply.token_ids)
            choice.finish_reason = reply.finish_reason
            choice.logprobs += reply.logprobs or []
        return choices

    async def _take(self) -> tuple[int, ChatOutput | ChatError]:
        reply = await self.queue.get()
        if isinstance(reply, ChatError) or reply.finished:
            self.open.discard(reply.request_id)
        return self._index[reply.request_id], reply


def prompt_tokens(firsts: list[ChatOutput]) -> int:
    """The prompt's length, counted once for all choices (their prompts are the same)."""
    return len(firsts[0].prompt_token_ids or [])


def _chat_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """A chat's native prompt fields: its messages, and how their videos are sampled (vLLM's
    `mm_processor_kwargs`: fps, num_frames)."""
    prompt: dict[str, Any] = {"messages": _messages(body.get("messages"))}
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is not None:
        taken = VideoSampling.__struct_fields__
        unknown = [str(key) for key in kwargs if key not in taken] \
            if isinstance(kwargs, dict) else []
        if unknown:
            raise ApiError(f"mm_processor_kwargs: {', '.join(unknown)} not supported by this "
                           f"server (it takes {', '.join(taken)})", "invalid_request",
                           "mm_processor_kwargs")
        prompt["mm_processor_kwargs"] = kwargs
    return prompt


def _messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages: a non-empty list of messages is required",
                       "invalid_request", "messages")
    messages = []
    for index, message in enumerate(raw):
        _check_content_types(message, index)
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


def _check_content_types(message: Any, index: int) -> None:
    """Refuse a content part of a type this server does not take, naming the ones it does."""
    content = message.get("content") if isinstance(message, dict) else None
    for number, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in CONTENT_TYPES:
            where = f"messages[{index}].content[{number}].type"
            raise ApiError(f"{where}: {kind[:40]!r} is not supported; the content part types "
                           f"are {', '.join(CONTENT_TYPES)}", "invalid_request", where)


def _logit_bias(raw: Any) -> Any:
    """OpenAI's logit_bias, whose keys are token ids as JSON strings, with int keys."""
    if not isinstance(raw, dict):
        return raw  # None, or the wrong type for msgspec to name
    try:
        return {int(token): bias for token, bias in raw.items()}
    except ValueError as exc:
        raise ApiError(f"logit_bias: its keys must be token ids, got {list(raw)}",
                       "invalid_request", "logit_bias") from exc


def _structured_outputs(body: dict[str, Any]) -> dict[str, Any] | None:
    """The native structured_outputs of a body (None: plain text), from whichever one of
    OpenAI's `response_format`, vLLM's `structured_outputs` and vLLM's older `guided_*` fields
    it sets."""
    given = _structured_fields(body)
    if len(given) > 1:
        raise ApiError(f"{given[1]}: only one of {', '.join(given)} may be set",
                       "invalid_request", given[1])
    if not given:
        return None
    if given[0] == "response_format":
        return _response_format(body["response_format"])
    if given[0] in _GUIDED:
        return _vllm_structured({_GUIDED[given[0]]: body[given[0]]}, given[0])
    return _vllm_structured(body["structured_outputs"], "structured_outputs")


def _structured_fields(body: dict[str, Any]) -> list[str]:
    """The fields a body sets of those that give the output a form: OpenAI's
    `response_format`, vLLM's `structured_outputs` and its older `guided_*`, in that order."""
    return [name for name in ("response_format", "structured_outputs", *_GUIDED)
            if body.get(name) is not None]


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
"""vLLM's older structured output fields, each one of `structured_outputs`'."""
_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object")


def _vllm_structured(raw: Any, name: str) -> dict[str, Any]:
    """vLLM's `structured_outputs` (or a `guided_*` field, as one of them), natively: a JSON
    schema may come as an object or as its JSON text."""
    if not isinstance(raw, dict):
        raise ApiError(f"{name} must be an object", "invalid_request", name)
    unknown = [key for key, value in raw.items() if key not in _STRUCTURED and value]
    if unknown:
        raise ApiError(f"{name}: {', '.join(unknown)} not supported by this server (it takes "
                       f"{', '.join(_STRUCTURED)})", "invalid_request", name)
    fields = {key: raw[key] for key in _STRUCTURED if raw.get(key) is not None}
    if isinstance(fields.get("json"), dict | bool):
        fields["json"] = json.dumps(fields["json"])
    return fields


def _response_format(response_format: Any) -> dict[str, Any] | None:
    """The native structured_outputs for OpenAI's response_format (None: plain text)."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError("response_format: json_schema.schema must be a JSON schema object",
                           "invalid_request", "response_format")
        return {"json": json.dumps(schema)}
    raise ApiError("response_format: type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", "invalid_request", "response_format")


def _chat_logprobs_asked(body: dict[str, Any]) -> int | None:
    """The native `logprobs` of chat's `logprobs` (a boolean) and `top_logprobs` (how many most
    likely tokens, 0..MAX_LOGPROBS, only with logprobs true: as vLLM and OpenAI refuse)."""
    logprobs, top = body.get("logprobs") or False, _logprobs_count(body, "top_logprobs")
    if not isinstance(logprobs, bool):
        raise ApiError(f"logprobs must be a boolean, got {logprobs!r}", "invalid_request",
                       "logprobs")
    if top and not logprobs:
        raise ApiError("top_logprobs needs logprobs set to true", "invalid_request",
                       "top_logprobs")
    return (top or 0) if logprobs else None


def _completion_logprobs_asked(body: dict[str, Any]) -> int | None:
    """The native `logprobs` of a completion's `logprobs`: how many most likely tokens to show
    beside each output token, 0..MAX_LOGPROBS, as OpenAI's legacy API and vLLM take it; null or
    absent: no logprobs. Where this differs from vLLM: it also takes -1 (the whole vocabulary,
    then refused unless its --max-logprobs allows that many), `true` (as 1) and an integral
    float such as 2.0; here they are 400s, as other values outside 0..MAX_LOGPROBS."""
    return _logprobs_count(body, "logprobs")


def _logprobs_count(body: dict[str, Any], name: str) -> int | None:
    """The body's field `name`, a number of most likely tokens (0..MAX_LOGPROBS), or None."""
    count = body.get(name)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                              or not 0 <= count <= MAX_LOGPROBS):
        raise ApiError(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {count!r}",
                       "invalid_request", name)
    return count


def _prompt(raw: Any) -> Any:
    """A completion's one prompt, a text or token ids, alone or as a list's only element (the
    native request checks its type)."""
    if raw is None:
        raise ApiError("prompt: a text or a list of token ids is required", "invalid_request",
                       "prompt")
    if isinstance(raw, list) and raw and all(isinstance(one, str | list) for one in raw):
        if len(raw) > 1:
            raise ApiError(f"prompt: a batch of {len(raw)} prompts is not supported; send one "
                           "prompt per request", "invalid_request", "prompt")
        [raw] = raw
    return raw


def _flag(body: dict[str, Any], name: str) -> bool:
    """A boolean option of /tokenize, true unless set false (`return_token_strs`: false)."""
    value = body.get(name, name != "return_token_strs")
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean, got {value!r}", "invalid_request", name)
    return value


def _keyed(path: str) -> bool:
    """Whether a route needs an API key (when there are keys) and counts against the rate."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def _known_key(key: bytes, keys: list[bytes]) -> bool:
    """Whether `key` is one of `keys`, compared in constant time with every one of them, so that
    the answer's timing tells nothing about which key, or how much of one, matched."""
    return any([hmac.compare_digest(key, known) for known in keys])


# ---------------------------------------------------------------- the two routes


@dataclass(frozen=True)
class _Route:
    """What differs between /v1/chat/completions and /v1/completions; the rest is shared."""

    native: type[ChatRequest] | type[CompletionRequest]
    prompt: Callable[[dict[str, Any]], dict[str, Any]]
    """The native request's prompt field, from the OpenAI body."""
    refused: dict[str, Callable[[Any], bool]]
    """The route's own fields refused unless default, beside REJECTED_UNLESS_DEFAULT."""
    max_tokens: int
    """max_tokens when the body sets none (OpenAI's default for the route)."""
    object: str
    chunk_object: str
    id_prefix: str
    choice: Callable[[str], dict[str, Any]]
    """A complete answer's choice content, for its text."""
    delta: Callable[[str], dict[str, Any]]
    """A stream chunk's choice content, for new text."""
    opening: dict[str, Any] | None
    """The first chunk's choice content, sent before any text (chat: the role); None: none."""
    closing: dict[str, Any]
    """The choice content of the chunk that carries the finish reason."""
    logprobs_asked: Callable[[dict[str, Any]], int | None]
    """The native `logprobs` (how many most likely tokens, None: no logprobs), from the body."""
    logprobs: Callable[[list[ChatLogprobs], int, int], dict[str, Any]]
    """A choice's (or a chunk's) `logprobs`, for the logprobs of its tokens, the native
    `logprobs` asked for and the offset in the choice's text where its first token starts."""

    def logprobs_of(self, request: NativeRequest, positions: list[ChatLogprobs] | None,
                    text_offset: int = 0) -> dict[str, Any] | None:
        """A choice's (or a chunk's) `logprobs`: None unless the request asked for them."""
        if request.logprobs is None:
            return None
        return self.logprobs(positions or [], request.logprobs, text_offset)


_CHAT = _Route(
    native=ChatRequest, prompt=lambda body: _chat_prompt(body),
    refused={}, max_tokens=64, object="chat.completion", chunk_object="chat.completion.chunk",
    id_prefix="chatcmpl",
    choice=lambda text: {"message": {"role": "assistant", "content": text}},
    delta=lambda text: {"delta": {"content": text}},
    opening={"delta": {"role": "assistant", "content": ""}}, closing={"delta": {}},
    logprobs_asked=_chat_logprobs_asked,
    logprobs=lambda positions, top, _: {"content": openai_logprobs(positions, top)},
)
_COMPLETION = _Route(
    native=CompletionRequest, prompt=lambda body: {"prompt": _prompt(body.get("prompt"))},
    refused={"echo": lambda v: not v, "suffix": lambda v: not v,
             "best_of": lambda v: v in (None, 1), "tools": lambda v: not v,
             "tool_choice": lambda v: v in (None, "none")},
    max_tokens=16, object="text_completion", chunk_object="text_completion", id_prefix="cmpl",
    choice=lambda text: {"text": text}, delta=lambda text: {"text": text},
    opening=None, closing={"text": ""},
    logprobs_asked=_completion_logprobs_asked,
    logprobs=lambda positions, top, text_offset: completion_logprobs(positions, top, text_offset),
)


# ---------------------------------------------------------------- the OpenAI response


class _Chunks:
    """Builds the chunk events of one streamed answer."""

    def __init__(self, route: _Route, model: str) -> None:
        self.base = {"id": _completion_id(route), "object": route.chunk_object,
                     "created": int(time.time()), "model": model}

    def choice(self, index: int, content: dict[str, Any], finish_reason: str | None = None, *,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"index": index, **content, "finish_reason": finish_reason,
                  "logprobs": logprobs}
        return {**self.base, "choices": [choice]}

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage}


def openai_logprobs(positions: list[ChatLogprobs], top_logprobs: int) -> list[dict[str, Any]]:
    """OpenAI's logprobs of output tokens, an entry per token, as vLLM's OpenAI server writes
    them (`_create_chat_logprobs` in its serving_chat): the token's text, its logprob (at least
    -9999) and the text's UTF-8 bytes, and `top_logprobs` entries of that shape. Those are vLLM's:
    the output token first, then the most likely others, `top_logprobs` entries in all; so only
    a sampled token outside the most likely ones is out of order (and pushes the last out)."""
    return [{**_logprob_entry(position.sampled),
             "top_logprobs": [_logprob_entry(entry)
                              for entry in _vllm_top(position)[:top_logprobs]]}
            for position in positions]


def completion_logprobs(positions: list[ChatLogprobs], logprobs: int,
                        text_offset: int) -> dict[str, Any]:
    """A completion's logprobs in OpenAI's legacy shape, as vLLM's OpenAI server writes them
    (`_create_completion_logprobs` in its completion serving): per output token its text, its
    logprob (at least -9999), a dict of text to logprob of the output token first, then the
    `logprobs` most likely others (so `logprobs` + 1 entries when the output token is not among
    those; two tokens of the same text share one entry, the later one's), and its `text_offset`,
    from `text_offset` on by the lengths of the texts before it (the prompt is not echoed, so
    the first token of a choice is at 0, and a streamed chunk's first token goes on from the
    previous chunk's last). A stop string ends the text but not the tokens, which go on through
    the one that completed it (as vLLM's): their offsets may lie past the text's end. Where
    this differs from vLLM: a stream's chunk that carries a choice's finish reason comes after
    its last token's, with `logprobs` null, as chat's (vLLM's rides on the last token's)."""
    tokens = [position.sampled.token for position in positions]
    return {
        "text_offset": list(itertools.accumulate(map(len, tokens), initial=text_offset))[:-1],
        "token_logprobs": [_shown_logprob(position.sampled) for position in positions],
        "tokens": tokens,
        "top_logprobs": [{entry.token: _shown_logprob(entry)
                          for entry in _vllm_top(position)[: logprobs + 1]}
                         for position in positions],
    }


def _vllm_top(position: ChatLogprobs) -> list[TokenLogprob]:
    sampled = position.sampled
    return [sampled, *[entry for entry in position.top if entry.token_id != sampled.token_id]]


def _logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": _shown_logprob(entry),
            "bytes": list(entry.token.encode("utf-8", errors="replace"))}


def _shown_logprob(entry: TokenLogprob) -> float:
    """A logprob as JSON can carry it: -inf (a masked token) as OpenAI's -9999, as vLLM."""
    return max(entry.logprob, -9999.0)


def _texts_length(positions: list[ChatLogprobs]) -> int:
    """The length of the texts of the tokens whose logprobs these are (see text_offset)."""
    return sum(len(position.sampled.token) for position in positions)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _completion_id(route: _Route) -> str:
    return f"{route.id_prefix}-{uuid.uuid4().hex}"


def _from_info(error: ErrorInfo, names: dict[str, str] = _OPENAI_NAMES) -> ApiError:
    """The API's error for a native one, naming a field as `names` says the client sent it."""
    message = error.message
    head, colon, rest = message.removeprefix("sampling.").partition(":")
    if head in names:
        message = names[head] + colon + rest
    return ApiError(message, error.code, _param_of(error, names), status=http_status(error))


def _client_names(body: dict[str, Any]) -> dict[str, str]:
    """What the client calls the native fields that several of its fields may set."""
    return {"structured_outputs": next(iter(_structured_fields(body)), "response_format")}


def _param_of(error: ErrorInfo, names: dict[str, str]) -> str | None:
    """The request field an error names (its message starts with it), for `error.param`."""
    if error.message.startswith("prompt: "):  # a completion's prompt ("prompt too long" is not)
        return "prompt"
    head = error.message.replace(":", " ").split(" ", 1)[0].removeprefix("sampling.")
    if head in ("image", "video", "messages", "too"):  # image N: ..., too many images: ...
        return "messages"
    if head.startswith("mm_processor_kwargs"):  # mm_processor_kwargs.fps: ...
        return "mm_processor_kwargs"
    named = ("max_tokens", "temperature", "top_p", "logit_bias", "stop", "tokens",
             *_OPENAI_SAMPLING, *_VLLM_SAMPLING)
    return names.get(head) or (head if head in named else None)


def _error_body(error: ApiError) -> dict[str, Any]:
    if error.status == 429:
        kind = "requests"  # OpenAI's type for its rate limits
    elif error.status < 500:
        kind = "invalid_request_error"
    else:
        kind = "overloaded_error" if error.status in (503, 504) else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}


def _error_response(error: ApiError) -> web.Response:
    # A 503 (overloaded, draining, a peer restarting) and a 429 say when to try again, as HTTP
    # has it. An answer before the whole body was read (408, 413) closes the connection: what is
    # left of the body cannot be told from a next request.
    headers = {"Retry-After": retry_after(error.retry_after_s)} \
        if error.retry_after_s is not None else None
    response = web.json_response(_error_body(error), status=error.status, headers=headers)
    if error.status in (408, 413):
        response.force_close()
    return response


def _too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is larger than {limit} bytes", "request_too_large")
