"""The frontend process: one I/O thread owns every socket; a thread pool renders and tokenizes.

The I/O loop, in order, each turn:
  1. read client requests (ROUTER), validate them and hand them to the tokenizer pool;
  2. take finished tokenizations and route them: text-only to the engine, images to an MM worker;
  3. read replies from the engine and MM workers, detokenize and forward them to the client;
  4. read the monitors of its sockets to them (a disconnection, a connection: say hello);
  5. fail requests whose deadline passed.
Every accepted request is held in `_inflight` until exactly one terminal reply has gone out.

The OpenAI-compatible HTTP API (`http_api.HttpApi`, its own thread and event loop) is one more
client of this loop: it connects to the client ROUTER over inproc and sends native requests, so
every request, whichever API it came by, goes through the same checks, deadlines and replies.
A request the frontend ends before the engine does (a `CancelChat`, e.g. from an HTTP client
that went away, a passed deadline, or a stop string in its text) is stopped downstream:
`AbortRequests` to the engine, and for an image request `CancelJobs` to its MM worker, which
skips the job if it has not processed it yet.

At SIGTERM the frontend drains: new requests (native and HTTP) are refused at once with a
retryable error and /health answers 503, while the requests in flight are served until they
finish or the drain timeout passes; the rest then get a retryable error and are stopped
downstream.

A restarted peer is noticed at once, and what its old process held fails then, not at the
deadline. The frontend monitors its sockets to the engine and to each MM worker; at each
(re)connection it sends a `Hello`, and the role answers with its process's start. A new start
behind a socket that was disconnected means its old process is gone: every request sent there
before the disconnection and not yet answered gets one retryable `peer_restarted` and is stopped
downstream, as for a cancel. Requests sent after the disconnection went to the new process (ZMQ
queued them while the peer was down) and are left alone. What an MM worker held: its image
requests without an engine output yet (some may have reached the engine: they are aborted there).
What the engine held: every request sent before, image requests whose MM worker may not yet have
handed them on included, since the frontend cannot tell where those were. This needs nothing of
`mmlane serve`: under supervisord or k8s it works the same.

The mirrored feature cache needs three things from the frontend: it passes the newest engine
cache epoch it has seen (from any engine reply) to the MM workers, on every job and in an
`EngineEpoch` notice when it changes; it resends a job once, to the same MM worker, when the
engine answers it with a cache miss; and it turns a client's `ResetCache` into the engine's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jinja2
import zmq
from msgspec.structs import replace
from zmq.utils.monitor import recv_monitor_message

from mmlane.common.config import usable_cores
from mmlane.common.feature_cache import is_epoch
from mmlane.common.lifecycle import (
    Stop,
    drain,
    lost_in_restart,
    refused_while_draining,
    unfinished_at_drain_timeout,
)
from mmlane.common.sockets import Security, bound_endpoint, make_socket
from mmlane.common.stats import Metrics, log_totals
from mmlane.frontend.config import FrontendConfig
from mmlane.frontend.detokenize import OutputText, TokenTexts, space_marker
from mmlane.frontend.http_api import HttpApi
from mmlane.frontend.requests import (
    CheckedRequest,
    check_request,
    check_stop,
    prompt_token_ids,
)
from mmlane.model import Preprocessor, load_preprocessor, resolve_model_dir
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import (
    CacheMissError,
    ErrorInfo,
    FatalError,
    InternalError,
    MMLaneError,
    RequestError,
    RetryableError,
    translate,
)
from mmlane.protocol.messages import (
    AbortRequests,
    CacheReset,
    CancelChat,
    CancelJobs,
    ChatError,
    ChatLogprobs,
    ChatOutput,
    ChatRequest,
    ClientRequest,
    CompletionRequest,
    EngineCacheReset,
    EngineEpoch,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    Hello,
    HelloReply,
    ImageUrl,
    MMJob,
    RequestFailed,
    ResetCache,
    ResetEngineCache,
    TokenLogprob,
)

log = logging.getLogger(__name__)

_POLL_MS = 50
_STALLED_S = 5.0
"""An I/O loop that has not turned for this long makes /health answer 503."""
_PEER_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
MAX_TOKEN_ID = 2**32 - 1
"""The largest token id a tokenizer takes (Hugging Face tokenizers holds ids as u32)."""


@dataclass
class InFlight:
    """A request accepted from a client and not yet answered."""

    client: bytes
    client_request_id: str
    deadline: float
    checked: CheckedRequest | None
    """None for a ResetCache request."""
    text: OutputText
    """Its output's text so far, cut at its stop strings."""
    job: MMJob | None = None
    """The job as sent to MM worker number `worker`, kept to resend it after a cache miss; None
    again once the engine answers it (no MM worker holds it then)."""
    worker: int = 0
    resent: bool = False
    sent: int | None = None
    """The number of its last send to the engine or an MM worker (`Frontend._sends`); None
    while it is tokenized."""
    accepted_at: float = field(default_factory=time.monotonic)
    token_texts: TokenTexts | None = None
    """The texts of its logprobs' tokens, made with its first output that has logprobs."""


@dataclass
class Peer:
    """A role the frontend sends to (the engine, an MM worker), and the process behind it."""

    name: str
    """Its name in our `Hello` ('engine', 'mm-worker-0')."""
    sock: zmq.Socket
    started: int = 0
    """The `HelloReply.started` of its process; 0 before the first."""
    lost_before: int = 0
    """`Frontend._sends` at its last disconnection: what was sent before it may be lost."""
    connected: bool = True
    """False from a disconnection until it connects again (unknown at first: taken as up)."""

    @property
    def events(self) -> zmq.Socket:
        """The monitor of `sock`: its (re)connections and disconnections."""
        return self.sock.get_monitor_socket()


@dataclass(frozen=True)
class Tokenized:
    """What a tokenizer thread hands back: prompt token ids, or the error that stopped it."""

    request_id: str
    seconds: float
    """How long rendering the template and tokenizing took."""
    token_ids: list[int] | None = None
    error: MMLaneError | None = None


def _with_template(pre: Preprocessor, template: str | None) -> Preprocessor:
    """`pre` with `template` (--chat-template) as its chat template; FatalError when it is not
    a Jinja template."""
    if template is None:
        return pre
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise FatalError(f"chat_template: not a Jinja template: {exc} (line {exc.lineno})",
                         code="bad_config") from exc
    return dataclasses.replace(pre, chat_template=template)


class Frontend:
    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.endpoint = config.client_endpoint
        # The tokenizers library tokenizes on rayon's threads, one per core unless told, each
        # with a word cache of its own (docs/ARCHITECTURE.md, "Memory"): no more threads than
        # the tokenizer workers, set before its first batch starts them.
        os.environ.setdefault("RAYON_NUM_THREADS", str(
            min(config.tokenizer_workers, usable_cores())))
        self._pre = _with_template(load_preprocessor(resolve_model_dir(config.model)),
                                   config.template())
        self._pre.bound_word_cache(config.tokenizer_cache_words)
        model_names = config.served_model_name or [self._pre.model_id]
        self._space_marker = space_marker(self._pre.tokenizer)  # for TokenTexts
        self._ctx = zmq.Context()
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{id(self):x}"
        self._inflight: dict[str, InFlight] = {}
        self._sends = 0  # messages sent for requests to the engine and MM workers (`InFlight.sent`)
        self._tokenizing = 0  # requests handed to the tokenizer pool and not yet back
        self.metrics = Metrics("frontend", config.ops.name)
        self.metrics.model = model_names[0]
        self.metrics.epoch = lambda: self._engine_epoch
        self.metrics.in_flight = lambda: len(self._inflight)
        self.metrics.gauge("tokenizing", lambda: self._tokenizing)
        self._security = Security.of("frontend", config, self.metrics.counters)
        self._engine_epoch = 0  # the newest engine cache epoch seen; MM workers follow it
        self._tokenized: queue.SimpleQueue[Tokenized] = queue.SimpleQueue()
        self._wake_endpoint = f"inproc://frontend-wake-{self._prefix}"
        self._wake_local = threading.local()
        self._client_codec: Codec[ClientRequest] = Codec(ClientRequest)
        self._output_codec: Codec[FrontendInput] = Codec(FrontendInput)
        self._open_sockets()
        self._pool = ThreadPoolExecutor(
            config.tokenizer_workers, thread_name_prefix="frontend-tokenizer"
        )
        self._last_turn = time.monotonic()
        # serve's: from its signal on, new requests are refused
        self._stop = Stop(config.ops.drain_timeout_s)
        self.http: HttpApi | None = None
        if config.http_port:
            self.http = HttpApi(
                config, ctx=self._ctx, client_endpoint=self._http_endpoint,
                model_names=model_names, pre=self._pre, tokenizers=self._pool,
                alive=lambda: time.monotonic() - self._last_turn < _STALLED_S,
                draining=lambda: self._stop.is_set(),
                engine_answered=lambda: bool(self._peers["engine"].started),
                metrics=self.metrics,
            )
            try:
                self.http.start()
            except Exception:
                self._pool.shutdown(wait=False)
                self._security.close()
                self._ctx.destroy(linger=0)
                raise

    def _open_sockets(self) -> None:
        c = self.config
        self._wake = make_socket(self._ctx, zmq.PULL, self._wake_endpoint, bind=True)
        self._output = make_socket(self._ctx, zmq.PULL, c.output_endpoint, bind=True,
                                   security=self._security)
        self._engine = make_socket(self._ctx, zmq.PUSH, c.engine_endpoint, bind=False,
                                   monitor_events=_PEER_EVENTS, security=self._security,
                                   peer="engine")
        # One socket per MM worker: a resend after a cache miss must reach the same worker,
        # whose sender cache the engine's receiver cache mirrors.
        self._mm_workers = [
            make_socket(self._ctx, zmq.PUSH, endpoint, bind=False, monitor_events=_PEER_EVENTS,
                        security=self._security, peer="mm-worker")
            for endpoint in c.mm_worker_endpoint
        ]
        self._worker_peers = [Peer(f"mm-worker-{i}", sock)
                              for i, sock in enumerate(self._mm_workers)]
        self._peers = {peer.name: peer for peer in [Peer("engine", self._engine),
                                                    *self._worker_peers]}
        # The client socket binds last: once clients can reach us, everything else is ready.
        self._client = make_socket(self._ctx, zmq.ROUTER, c.client_endpoint, bind=True)
        self.endpoint = bound_endpoint(self._client)  # port 0: the port it got (for Ready)
        self._http_endpoint = f"inproc://frontend-http-{self._prefix}"
        self._client.bind(self._http_endpoint)  # the HTTP API's way in

    # ------------------------------------------------------------------ the I/O loop

    def serve(self, stop: Stop) -> None:
        self._stop = stop
        poller = zmq.Poller()
        for sock in (self._client, self._wake, self._output,
                     *(peer.events for peer in self._peers.values())):
            poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            self._turn(poller)
        if self.http is not None:
            self.http.stop_listening()
        # Requests arriving from now on are refused at once (`_accept`).
        drain(stop, log, held=lambda: len(self._inflight), turn=lambda: self._turn(poller))
        self._read_clients()  # the last arrivals get their refusal too
        self._fail_unfinished(unfinished_at_drain_timeout("frontend", stop))

    def _turn(self, poller: zmq.Poller) -> None:
        self._last_turn = time.monotonic()
        ready = dict(poller.poll(_POLL_MS))
        if self._client in ready:
            self._read_clients()
        if self._wake in ready:
            self._route_tokenized()
        if self._output in ready:
            self._read_outputs()
        for peer in self._peers.values():
            if peer.events in ready:
                self._read_peer_events(peer)
        self._expire(time.monotonic())

    def _fail_unfinished(self, error: MMLaneError) -> None:
        """At the end of the drain: fail every request still in flight, and stop it downstream."""
        left = dict(self._inflight)
        for request_id in left:
            self._fail(request_id, error)
        self._stop_downstream(left)

    def _read_clients(self) -> None:
        while True:
            try:
                frames = self._client.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._accept(frames[0].bytes, frames[1:])

    def _accept(self, client: bytes, frames: list) -> None:
        self.metrics.counters["bytes_in"] += sum(len(frame) for frame in frames)
        try:
            request = self._client_codec.decode(frames)
        except RequestError as exc:
            log.warning("unreadable client message: %s", exc)
            self.metrics.errors[exc.code] += 1
            self._reply(client, ChatError(request_id="", error=exc.to_info()))
            return
        if isinstance(request, CancelChat):
            self._cancel(client, request.request_id)
            return
        if self._stop.is_set():
            self.metrics.counters["refused_draining"] += 1
            error = refused_while_draining("frontend")
            self.metrics.errors[error.code] += 1
            self._reply(client, ChatError(request_id=request.request_id, error=error.to_info()))
            return
        if isinstance(request, ResetCache):
            self._reset_cache(client, request)
            return
        try:
            checked = self._admit(request)
        except MMLaneError as exc:
            self.metrics.errors[exc.code] += 1
            self._reply(client, ChatError(request_id=request.request_id, error=exc.to_info()))
            return
        self.metrics.counters["requests"] += 1
        self._tokenizing += 1
        request_id = f"{self._prefix}-{next(self._ids)}"
        deadline = time.monotonic() + self.config.request_timeout_s
        decode = self._pre.decode if request.skip_special_tokens else \
            functools.partial(self._pre.decode, skip_special_tokens=False)
        text = OutputText(decode, stop=request.stop, min_tokens=request.min_tokens)
        self._inflight[request_id] = InFlight(client, request.request_id, deadline, checked,
                                              text)
        self._pool.submit(self._tokenize, request_id, checked)

    def _admit(self, request: ChatRequest | CompletionRequest) -> CheckedRequest:
        if len(self._inflight) >= self.config.max_inflight_requests:
            raise RetryableError(
                f"frontend overloaded: {len(self._inflight)} requests in flight "
                f"(max_inflight_requests={self.config.max_inflight_requests})",
                code="overloaded",
            )
        check_stop(request.stop, max_strings=self.config.max_stop_strings,
                   max_chars=self.config.max_stop_string_chars)
        return check_request(request, max_images=self.config.max_images_per_request)

    # ------------------------------------------------------------------ tokenizer pool

    def _tokenize(self, request_id: str, checked: CheckedRequest) -> None:
        """Runs on a pool thread: make the prompt's token ids (a chat: render the template and
        tokenize; a completion: tokenize its text or check its ids), hand the result back."""
        started = time.monotonic()
        token_ids: list[int] | None = None
        error: MMLaneError | None = None
        try:
            token_ids = prompt_token_ids(self._pre, checked)
        except Exception as exc:  # a template or tokenizer failure is this request's fault
            error = translate(exc, "cannot render prompt", default="invalid_request")
        seconds = time.monotonic() - started
        self._tokenized.put(Tokenized(request_id, seconds, token_ids, error))
        self._wake_socket().send(b"", zmq.NOBLOCK)

    def _wake_socket(self) -> zmq.Socket:
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = make_socket(self._ctx, zmq.PUSH, self._wake_endpoint, bind=False, linger_ms=0)
            self._wake_local.sock = sock
        return sock

    def _route_tokenized(self) -> None:
        while True:
            try:
                self._wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while not self._tokenized.empty():
            result = self._tokenized.get_nowait()
            self._tokenizing -= 1
            self.metrics.observe("tokenize", result.seconds)  # here: one writer per histogram
            pending = self._inflight.get(result.request_id)
            if pending is None:  # timed out meanwhile
                continue
            if result.error is not None:
                self._fail(result.request_id, result.error)
            else:
                self._dispatch(result.request_id, pending, result.token_ids or [])

    def _dispatch(self, request_id: str, pending: InFlight, token_ids: list[int]) -> None:
        checked = pending.checked
        assert checked is not None  # only chat and completion requests are tokenized
        reply_to = self.config.output_endpoint
        # Our deadline, as wall-clock time for the other processes: past it they drop the work.
        deadline = time.time() + (pending.deadline - time.monotonic())
        message: MMJob | EngineRequest
        if checked.has_media:
            message = MMJob(
                request_id=request_id, reply_to=reply_to, prompt_token_ids=token_ids,
                images=checked.images, sampling=checked.sampling, deadline=deadline,
                engine_epoch=self._engine_epoch, render=checked.render, videos=checked.videos,
                video_sampling=checked.video_sampling,
            )
            pending.job, pending.worker = message, self._worker_for(checked.first_media)
            sock = self._mm_workers[pending.worker]
        else:
            message = EngineRequest(
                request_id=request_id, reply_to=reply_to, prompt_token_ids=token_ids,
                sampling=checked.sampling, deadline=deadline, render=checked.render,
            )
            sock = self._engine
        self._number_send(pending)
        try:
            sock.send_multipart(self._client_codec.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            lane = "the MM worker" if checked.has_media else "the engine"
            self._fail(request_id, translate(exc, f"cannot send to {lane}"))

    def _worker_for(self, image: ImageUrl) -> int:
        """The MM worker for a job, by its first image's affinity key, so that a repeated image
        goes where the sender cache holds it; the next connected one while that one is down."""
        count = len(self._worker_peers)
        first = affinity_key(image) % count
        for index in (first + step for step in range(count)):
            if self._worker_peers[index % count].connected:
                return index % count
        return first  # none is up: ZMQ keeps the job for when it is back, or it times out

    # ------------------------------------------------------------------ replies

    def _read_outputs(self) -> None:
        while True:
            try:
                frames = self._output.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = self._output_codec.decode(frames)
            except RequestError as exc:
                self._count_invalid_reply(exc)
                continue
            try:
                self._take_reply(message)
            except Exception as exc:  # a faulty peer's reply must not end the I/O loop
                self._count_invalid_reply(exc)
                self._fail_on_invalid_reply(message, exc)

    def _take_reply(self, message: FrontendInput) -> None:
        self._see_engine_epoch(message.engine_epoch)
        if isinstance(message, EngineCacheReset):
            self._cache_was_reset(message)
        elif isinstance(message, HelloReply):
            self._peer_said_hello(message)
        elif isinstance(message, RequestFailed):
            if message.request_id in self._inflight:
                self._on_failed(message.request_id, message.error)
        else:
            self._forward_output(message)

    def _count_invalid_reply(self, exc: Exception) -> None:
        self.metrics.counters["invalid_messages"] += 1
        log.warning("dropped an invalid reply (%d so far): %s",  # a bug of ours: its traceback
                    self.metrics.counters["invalid_messages"], exc,
                    exc_info=not isinstance(exc, MMLaneError))

    def _fail_on_invalid_reply(self, message: FrontendInput, exc: Exception) -> None:
        """The request an invalid reply was for fails with what was wrong, and is stopped
        downstream: its engine or MM worker is not to be trusted with it any more."""
        request_id = getattr(message, "request_id", "")  # a HelloReply names none
        pending = self._inflight.get(request_id)
        if pending is None:
            return
        self._fail(request_id, translate(exc, "invalid reply from the engine or MM worker"))
        self._stop_downstream({request_id: pending})

    def _on_failed(self, request_id: str, error: ErrorInfo) -> None:
        """A terminal error; a first cache miss is not one: the job goes out again."""
        pending = self._inflight[request_id]
        if error.code == CacheMissError.default_code and pending.job and not pending.resent:
            self._resend(request_id, pending, error.mm_hashes)
            return
        if error.code == CacheMissError.default_code:
            self.metrics.counters["cache_miss_errors"] += 1
        self._finish_with_error(request_id, error)

    def _resend(self, request_id: str, pending: InFlight, invalidate: list[str]) -> None:
        """Send the job again to the same MM worker, those hashes dropped from both caches."""
        assert pending.job is not None
        pending.job = replace(
            pending.job, engine_epoch=self._engine_epoch, mm_cache_invalidate=invalidate
        )
        pending.resent = True
        self._number_send(pending)
        self.metrics.counters["cache_miss_resends"] += 1
        log.info("request %s: cache miss on %d image(s); resent (%d resends so far)",
                 request_id, len(invalidate), self.metrics.counters["cache_miss_resends"])
        sock = self._mm_workers[pending.worker]
        try:
            sock.send_multipart(self._client_codec.encode(pending.job), zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            self._fail(request_id, translate(exc, "cannot send to the MM worker"))

    def _see_engine_epoch(self, epoch: int) -> None:
        """Follow a newer engine cache epoch, and tell every MM worker at once."""
        # 0 (not from an engine), one we have passed, or one no engine makes (a faulty peer's)
        if epoch <= self._engine_epoch or not is_epoch(epoch):
            return
        self._engine_epoch = epoch
        self.metrics.counters["engine_epochs"] += 1
        log.info("engine cache epoch %d", epoch)
        notice = self._client_codec.encode(EngineEpoch(engine_epoch=epoch))
        for sock in self._mm_workers:
            try:
                sock.send_multipart(notice, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # its next job carries the epoch anyway
                pass

    # ------------------------------------------------------------------ restarted peers

    def _number_send(self, pending: InFlight) -> None:
        pending.sent = self._sends
        self._sends += 1

    def _read_peer_events(self, peer: Peer) -> None:
        """Say hello at each (re)connection; remember where the sends stood at a disconnection."""
        while True:
            try:
                event = recv_monitor_message(peer.events, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                peer.lost_before, peer.connected = self._sends, False
                log.info("%s at %s disconnected", peer.name, event["endpoint"].decode())
            elif event["event"] == zmq.EVENT_CONNECTED:
                peer.connected = True
                hello = Hello(reply_to=self.config.output_endpoint, peer=peer.name)
                try:
                    peer.sock.send_multipart(self._client_codec.encode(hello), zmq.NOBLOCK)
                except zmq.Again:  # its restart, if it was one, shows at the request timeout
                    log.warning("%s queue full: no hello sent", peer.name)

    def _peer_said_hello(self, hello: HelloReply) -> None:
        """A new process behind a peer: fail what its old process held (see the module
        docstring)."""
        peer = self._peers.get(hello.peer)
        if peer is None:  # not a name we gave
            return
        if peer.started and hello.started != peer.started:
            lost = {rid: p for rid, p in self._inflight.items() if self._held_by(p, peer)}
            log.warning("%s restarted (a new process): failing the %d requests it held",
                        peer.name, len(lost))
            self.metrics.counters["peer_restarts"] += 1
            error = lost_in_restart(peer.name)
            for request_id in lost:
                self._fail(request_id, error)
            self._stop_downstream(lost)
        peer.started = hello.started

    def _held_by(self, pending: InFlight, peer: Peer) -> bool:
        """Whether `peer`'s old process may have held this request: sent to it (the engine: any
        request) before its disconnection."""
        if pending.sent is None or pending.sent >= peer.lost_before:
            return False
        if peer.sock is self._engine:
            return True
        return pending.job is not None and self._worker_peers[pending.worker] is peer

    # ------------------------------------------------------------------ reset cache

    def _reset_cache(self, client: bytes, request: ResetCache) -> None:
        """Ask the engine for a new cache epoch; MM workers clear their caches as they learn it."""
        request_id = f"{self._prefix}-{next(self._ids)}"
        deadline = time.monotonic() + self.config.request_timeout_s
        pending = InFlight(client, request.request_id, deadline, None,
                           OutputText(self._pre.decode))
        self._inflight[request_id] = pending
        self._number_send(pending)
        reset = ResetEngineCache(request_id=request_id, reply_to=self.config.output_endpoint)
        try:
            self._engine.send_multipart(self._client_codec.encode(reset), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._fail(request_id, RetryableError("engine queue full", code="overloaded"))

    def _cache_was_reset(self, message: EngineCacheReset) -> None:
        pending = self._inflight.pop(message.request_id, None)
        if pending is None:  # timed out meanwhile
            return
        self.metrics.counters["cache_resets"] += 1
        reply = CacheReset(request_id=pending.client_request_id, engine_epoch=message.engine_epoch)
        self._reply(pending.client, reply)

    def _forward_output(self, output: EngineOutput) -> None:
        pending = self._inflight.get(output.request_id)
        if pending is None:
            return
        self._check_output_ids(output)
        pending.job = None  # the engine has it: no MM worker holds it any more
        shown = output.token_ids
        if pending.checked is not None:  # a stop token adds no text (see `shown_ids`)
            shown = pending.checked.shown_ids(shown, output.finish_reason,
                                              self._pre.eos_token_ids)
        text, stopped_after = pending.text.step(shown, final=output.finished)
        token_ids, finished, reason = list(output.token_ids), output.finished, output.finish_reason
        if stopped_after is not None:  # a stop string ended the text: usage counts to its token
            token_ids, finished, reason = token_ids[:stopped_after], True, "stop"
        reply = ChatOutput(
            request_id=pending.client_request_id, token_ids=token_ids, text=text,
            finished=finished, finish_reason=reason, prompt_token_ids=output.prompt_token_ids,
            logprobs=None if output.logprobs is None
            else self._chat_logprobs(pending, output)[: len(token_ids)],
            rendered=output.rendered,
        )
        if finished:
            del self._inflight[output.request_id]
            self._observe_end(pending)
        if finished and not output.finished:  # the engine would go on: stop it there
            self.metrics.counters["stop_strings"] += 1
            self._stop_downstream({output.request_id: pending})
        self._reply(pending.client, reply)

    def _check_output_ids(self, output: EngineOutput) -> None:
        """Refuse token ids that no tokenizer takes, on which decoding would raise: only a
        faulty engine sends them, and the request fails naming them. (Ids past the tokenizer's
        end are fine: a model's padded vocabulary has them, and they decode to nothing.)"""
        ids = [*output.token_ids,
               *(token for position in output.logprobs or [] for token in position.top_token_ids)]
        outside = [token for token in ids if not 0 <= token <= MAX_TOKEN_ID]
        if outside:
            raise InternalError(
                f"the engine sent token id {outside[0]}, not a token id (0..{MAX_TOKEN_ID})"
            )

    def _chat_logprobs(self, pending: InFlight, output: EngineOutput) -> list[ChatLogprobs]:
        """The logprobs of the output's new tokens, with the tokens' texts (see TokenTexts)."""
        if pending.token_texts is None:
            pending.token_texts = TokenTexts(self._pre.tokenizer, self._space_marker)
        texts, chat = pending.token_texts, []
        # Not strict: lists of unequal length from a faulty peer give fewer entries, no crash.
        for token_id, position in zip(output.token_ids, output.logprobs or [], strict=False):
            sampled, *top = texts.position([token_id, *position.top_token_ids])
            chat.append(ChatLogprobs(
                sampled=TokenLogprob(token_id, sampled, position.logprob),
                top=[TokenLogprob(*entry) for entry in zip(
                    position.top_token_ids, top, position.top_logprobs, strict=False)],
            ))
            texts.advance(token_id)
        return chat

    def _observe_end(self, pending: InFlight) -> None:
        lane = "image" if pending.checked and pending.checked.has_media else "text"
        self.metrics.observe(f"end_to_end:{lane}", time.monotonic() - pending.accepted_at)

    def _fail(self, request_id: str, error: MMLaneError) -> None:
        self._finish_with_error(request_id, error.to_info())

    def _finish_with_error(self, request_id: str, error: ErrorInfo) -> None:
        pending = self._inflight.pop(request_id)
        self.metrics.errors[error.code] += 1
        self._observe_end(pending)
        self._reply(pending.client, ChatError(request_id=pending.client_request_id, error=error))

    def _cancel(self, client: bytes, client_request_id: str) -> None:
        """The client no longer waits: drop the request here and stop it downstream."""
        found = {rid: p for rid, p in self._inflight.items()
                 if p.client == client and p.client_request_id == client_request_id}
        for request_id in found:
            del self._inflight[request_id]
            self.metrics.counters["cancelled"] += 1
        self._stop_downstream(found)

    def _stop_downstream(self, dropped: dict[str, InFlight]) -> None:
        """Tell the engine to drop these requests, and each image job's MM worker to skip the
        job if it is still queued there. A job the MM worker hands over after the engine's abort
        went by is refused by the engine on arrival (it remembers early aborts); any reply that
        still comes is ignored here. A request still being tokenized was sent nowhere: its
        tokens are dropped when they come, and nobody downstream is told."""
        dropped = {rid: pending for rid, pending in dropped.items() if pending.sent is not None}
        if not dropped:
            return
        self._send_notice(self._engine, AbortRequests(request_ids=list(dropped)), "engine")
        jobs_by_worker: dict[int, list[str]] = {}
        for request_id, pending in dropped.items():
            if pending.job is not None:
                jobs_by_worker.setdefault(pending.worker, []).append(request_id)
        for worker, request_ids in jobs_by_worker.items():
            self._send_notice(self._mm_workers[worker], CancelJobs(request_ids=request_ids),
                              f"MM worker {worker}")

    def _send_notice(self, sock: zmq.Socket, notice: AbortRequests | CancelJobs,
                     peer: str) -> None:
        try:
            sock.send_multipart(self._client_codec.encode(notice), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("%s queue full: %d requests not stopped there (their deadline ends "
                        "them)", peer, len(notice.request_ids))

    def _expire(self, now: float) -> None:
        expired = {rid: p for rid, p in self._inflight.items() if p.deadline <= now}
        for request_id in expired:
            self._fail(
                request_id,
                RetryableError(
                    f"no reply within request_timeout_s={self.config.request_timeout_s}",
                    code="timeout",
                ),
            )
        self._stop_downstream(expired)  # the engine and MM workers free them now

    def _reply(self, client: bytes, message: ChatOutput | ChatError | CacheReset) -> None:
        frames = self._client_codec.encode(message)
        self.metrics.counters["bytes_out"] += sum(len(frame) for frame in frames)
        try:
            self._client.send_multipart([client, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # client gone (ROUTER drops unknown peers) or not reading
            log.warning("reply to client dropped: %s", exc)

    def close(self) -> None:
        log_totals(self.metrics)
        if self.http is not None:
            self.http.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._security.close()
        self._ctx.destroy(linger=500)


AFFINITY_TAIL = 4096
"""Characters of an image's URL (its end) that its affinity key covers, with the URL's length."""


def affinity_key(image: ImageUrl) -> int:
    """Which MM worker an image goes to is this modulo the number of workers: the same for the
    same image, in every frontend. The client's uuid when it names the image, else its URL: the
    end of a data URI is the end of the encoded image, and hashing all of a 7 MB URI on the
    I/O loop would cost milliseconds (a key shared by two images only sends both to one worker).
    """
    text = image.uuid if image.uuid is not None else image.url
    return zlib.crc32(f"{len(text)}:{text[-AFFINITY_TAIL:]}".encode())
