"""The in-process designs mmlane is measured against: `python -m bench server` (shared or split).

One process tokenizes and preprocesses images, then hands each request to the same real
`mmlane engine` process every mode uses, as vLLM's API server hands requests to its engine core.
The work is mmlane's own code (the frontend's `check_request` and `prompt_token_ids`, the MM
worker's `JobRenderer`, its feature cache off): only where it runs differs between the designs:

    shared  one ThreadPoolExecutor (`pool_size` threads) runs each request's whole preprocessing:
            chat template and tokenization, then, for an image request, loading, decoding and
            the HF image processor, as one task (vLLM before it isolated MM preprocessing)
    split   a tokenizer pool (`tokenizer_workers` threads) tokenizes every request; an image
            request then goes to a single-thread MM executor (vLLM after that change, and the
            same split as mmlane's, but in one process under one GIL)

The main thread owns every socket and loops: 1. read client requests (ROUTER, the native API,
so the bench's client is the same in every mode) and submit them to the tokenizer executor;
2. send the requests the executors finished to the engine, noting when (the exact handoff);
3. forward the engine's outputs to the clients, detokenized; 4. answer the bench's control
socket. A request whose text forges the image placeholder is refused by the tokenizer executor,
as mmlane's frontend refuses it: the bench's tokenizer probe.

The control socket is the bench's own (REQ/REP, msgspec): it turns the executor probe (a no-op
submitted to the tokenizer executor every interval, its start minus its submit time) on and off
and hands over the handoff times. It is test-harness wiring, not part of mmlane's wire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from bench.config import BenchConfig
from bench.loop import Mailbox, received
from mmlane.common.config import default_of
from mmlane.common.sockets import make_socket
from mmlane.frontend.config import FrontendConfig
from mmlane.frontend.detokenize import IncrementalDetokenizer
from mmlane.frontend.requests import check_request, prompt_token_ids
from mmlane.mm_worker.cache import ImageHasher, SenderCache
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.mm_worker.jobs import JobRenderer
from mmlane.mm_worker.media import MediaPolicy, configure_pillow
from mmlane.model import Preprocessor, load_preprocessor, resolve_model_dir
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import MMLaneError, RequestError
from mmlane.protocol.messages import (
    ChatError,
    ChatOutput,
    ChatRequest,
    ClientRequest,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    MMJob,
    RequestFailed,
)

log = logging.getLogger(__name__)

POLL_MS = 50
MAX_IMAGES = default_of(FrontendConfig, "max_images_per_request")
"""mmlane's frontend's default limit: every design refuses the same requests."""


class InProcessConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["shared", "split"]
    model: str | None = None
    client_endpoint: str
    """Where the native client API (ROUTER) binds."""
    output_endpoint: str
    """Where the engine's replies arrive (PULL, bound; the requests' `reply_to`)."""
    engine_endpoint: str
    control_endpoint: str
    """The bench's control socket (REP, bound)."""
    pool_size: int = default_of(BenchConfig, "pool_size")
    tokenizer_workers: int = default_of(FrontendConfig, "tokenizer_workers")
    max_image_pixels: int = default_of(MMWorkerConfig, "max_image_pixels")


# ---------------------------------------------------------------- the control socket


class ProbeStart(msgspec.Struct, tag="probe-start", frozen=True):
    """Start submitting a no-op to the tokenizer executor every `interval_ms`."""

    interval_ms: float


class ProbeStop(msgspec.Struct, tag="probe-stop", frozen=True):
    """Stop the executor probe; the reply is a `ProbeWaits`."""


class TakeHandoffs(msgspec.Struct, tag="handoffs", frozen=True):
    """The reply is a `Handoffs` with every handoff since the last `TakeHandoffs`."""


ControlRequest = ProbeStart | ProbeStop | TakeHandoffs


class ProbeWaits(msgspec.Struct, tag="waits", frozen=True):
    """The executor probe's waits since it started, in seconds."""

    waits_s: list[float]


class Handoffs(msgspec.Struct, tag="handoffs", frozen=True):
    """Client request id to the `time.monotonic()` at which its request went to the engine."""

    at: dict[str, float]


class Done(msgspec.Struct, tag="ok", frozen=True):
    """The control request was carried out."""


ControlReply = ProbeWaits | Handoffs | Done


# ---------------------------------------------------------------- mmlane's work, in process


def routed_message(
    pre: Preprocessor, request: ChatRequest, request_id: str, reply_to: str
) -> EngineRequest | MMJob:
    """What mmlane's frontend makes of a chat request: a text request for the engine, or a job
    for the MM lane (raises RequestError as the frontend refuses it)."""
    checked = check_request(request, max_images=MAX_IMAGES)
    token_ids = prompt_token_ids(pre, checked)
    if not checked.images:
        return EngineRequest(request_id=request_id, reply_to=reply_to,
                             prompt_token_ids=token_ids, sampling=checked.sampling)
    return MMJob(request_id=request_id, reply_to=reply_to, prompt_token_ids=token_ids,
                 images=checked.images, sampling=checked.sampling)


def job_renderer(pre: Preprocessor, max_image_pixels: int) -> JobRenderer:
    """The MM worker's renderer with its feature cache off (the bench's images are all new
    bytes, so no cache could hit), for inline data URIs."""
    media = MediaPolicy(allowed_media_dir=None,
                        max_image_bytes=default_of(MMWorkerConfig, "max_image_bytes"),
                        max_image_pixels=max_image_pixels)
    hasher = ImageHasher("blake3", pre.model_id, {})  # unused: a cache that is off hashes nothing
    return JobRenderer(pre, media, SenderCache("bench", capacity=0), hasher)


# ---------------------------------------------------------------- the server


@dataclass
class _Pending:
    client: bytes
    client_request_id: str
    detokenizer: IncrementalDetokenizer


_Finished = tuple[str, EngineRequest | MMLaneError]
"""What an executor hands back: a request id and its request for the engine, or the error that
stopped it."""


class InProcessServer:
    """The `shared` or `split` server (see the module docstring); a role for `run_role`."""

    def __init__(self, config: InProcessConfig) -> None:
        self.config = config
        self.endpoint = config.client_endpoint
        self._pre = load_preprocessor(resolve_model_dir(config.model))
        self._renderers = threading.local()  # a JobRenderer is made for one thread
        configure_pillow(config.max_image_pixels)
        self._inflight: dict[str, _Pending] = {}
        self._finished: Mailbox[_Finished] = Mailbox()
        self._handoffs: dict[str, float] = {}
        self._probe: _ExecutorProbe | None = None
        self._tokenizer_pool, self._mm_pool = self._executors(config)
        self._client_codec: Codec[Any] = Codec(ClientRequest)
        self._engine_codec: Codec[Any] = Codec(FrontendInput)
        self._control_encoder = msgspec.msgpack.Encoder()
        self._control_decoder = msgspec.msgpack.Decoder(ControlRequest)
        self._ctx = zmq.Context()
        self._engine = make_socket(self._ctx, zmq.PUSH, config.engine_endpoint, bind=False)
        self._output = make_socket(self._ctx, zmq.PULL, config.output_endpoint, bind=True)
        self._control = make_socket(self._ctx, zmq.REP, config.control_endpoint, bind=True)
        self._client = make_socket(self._ctx, zmq.ROUTER, config.client_endpoint, bind=True)

    @staticmethod
    def _executors(config: InProcessConfig) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        if config.mode == "shared":
            pool = ThreadPoolExecutor(config.pool_size, thread_name_prefix="bench-shared-pool")
            return pool, pool
        return (
            ThreadPoolExecutor(config.tokenizer_workers, thread_name_prefix="bench-tokenizer"),
            ThreadPoolExecutor(1, thread_name_prefix="bench-mm"),
        )

    def serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        for sock in (self._client, self._output, self._control):
            poller.register(sock, zmq.POLLIN)
        poller.register(self._finished.fd, zmq.POLLIN)
        while not stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            if self._client in ready:
                self._read_clients()  # 1
            if self._finished.fd in ready:
                self._send_finished()  # 2
            if self._output in ready:
                self._read_outputs()  # 3
            if self._control in ready:
                self._answer_control()  # 4

    def close(self) -> None:
        if self._probe is not None:
            self._probe.stop()
        self._tokenizer_pool.shutdown(wait=True, cancel_futures=True)
        self._mm_pool.shutdown(wait=True, cancel_futures=True)
        self._ctx.destroy(linger=0)
        self._finished.close()

    # ------------------------------------------------------------ 1. client requests

    def _read_clients(self) -> None:
        for frames in received(self._client):
            client = frames[0].bytes
            try:
                request = self._client_codec.decode(frames[1:])
            except RequestError as exc:
                self._reply(client, ChatError(request_id="", error=exc.to_info()))
                continue
            self._inflight[request.request_id] = _Pending(
                client, request.request_id, IncrementalDetokenizer(self._pre.decode)
            )
            self._tokenizer_pool.submit(self._guard(self._tokenize), request.request_id, request)

    # ------------------------------------------------------------ the executors' work

    def _tokenize(self, request_id: str, request: ChatRequest) -> None:
        """On the tokenizer executor: the frontend's work; then the images' turn."""
        message = routed_message(self._pre, request, request_id, self.config.output_endpoint)
        if isinstance(message, EngineRequest):
            self._finished.put((request_id, message))
        elif self.config.mode == "shared":  # the whole request is one task of the shared pool
            self._render_job(request_id, message)
        else:
            self._mm_pool.submit(self._guard(self._render_job), request_id, message)

    def _render_job(self, request_id: str, job: MMJob) -> None:
        """On the MM executor (split) or the shared pool: the MM worker's work."""
        renderer = getattr(self._renderers, "renderer", None)
        if renderer is None:
            renderer = self._renderers.renderer = job_renderer(
                self._pre, self.config.max_image_pixels
            )
        self._finished.put((request_id, renderer.render(job)))

    def _guard(self, work: Callable[..., None]) -> Callable[..., None]:
        """Run `work` on an executor thread; its exception becomes the request's error."""

        def run(request_id: str, *args: Any) -> None:
            try:
                work(request_id, *args)
            except MMLaneError as exc:
                self._finished.put((request_id, exc))
            except Exception as exc:  # template, tokenizer or image processor: the request's
                self._finished.put((request_id, RequestError(f"{exc}")))

        return run

    # ------------------------------------------------------------ 2. to the engine

    def _send_finished(self) -> None:
        for request_id, result in self._finished.take_all():
            if isinstance(result, MMLaneError):
                self._fail(request_id, result.to_info())
                continue
            self._engine.send_multipart(self._engine_codec.encode(result), copy=False)
            self._handoffs[request_id] = time.monotonic()

    # ------------------------------------------------------------ 3. replies

    def _read_outputs(self) -> None:
        for frames in received(self._output):
            message = self._engine_codec.decode(frames)
            if isinstance(message, RequestFailed):
                self._fail(message.request_id, message.error)
            else:
                self._forward(message)

    def _forward(self, output: EngineOutput) -> None:
        pending = self._inflight.get(output.request_id)
        if pending is None:
            return
        delta = pending.detokenizer.step(output.token_ids, final=output.finished)
        if output.finished:
            del self._inflight[output.request_id]
        self._reply(pending.client, ChatOutput(
            request_id=pending.client_request_id, token_ids=list(output.token_ids), text=delta,
            finished=output.finished, finish_reason=output.finish_reason,
            prompt_token_ids=output.prompt_token_ids,
        ))

    def _fail(self, request_id: str, error: Any) -> None:
        pending = self._inflight.pop(request_id, None)
        if pending is not None:
            self._reply(pending.client, ChatError(request_id=pending.client_request_id,
                                                  error=error))

    def _reply(self, client: bytes, message: ChatOutput | ChatError) -> None:
        try:
            self._client.send_multipart([client, *self._client_codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("reply to client dropped: %s", exc)

    # ------------------------------------------------------------ 4. control

    def _answer_control(self) -> None:
        request = self._control_decoder.decode(self._control.recv())
        reply: ControlReply
        if isinstance(request, ProbeStart):
            if self._probe is None:
                self._probe = _ExecutorProbe(self._tokenizer_pool, request.interval_ms / 1000)
            reply = Done()
        elif isinstance(request, ProbeStop):
            waits = self._probe.stop() if self._probe is not None else []
            self._probe = None
            reply = ProbeWaits(waits)
        else:
            reply, self._handoffs = Handoffs(self._handoffs), {}
        self._control.send(self._control_encoder.encode(reply))


class _ExecutorProbe:
    """Submits a no-op to an executor every `interval_s`; records each one's start - submit."""

    def __init__(self, executor: ThreadPoolExecutor, interval_s: float) -> None:
        self._executor = executor
        self._interval_s = interval_s
        self._waits: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-executor-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = time.perf_counter()
        while not self._stop.wait(max(0.0, due - time.perf_counter())):
            submitted = time.perf_counter()
            self._executor.submit(self._noop, submitted)
            due = max(due + self._interval_s, submitted)  # late: no burst to catch up

    def _noop(self, submitted: float) -> None:
        self._waits.append(time.perf_counter() - submitted)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return list(self._waits)
