"""The MM worker role: one FIFO loop that turns `MMJob`s into fully rendered `EngineRequest`s.

    frontend ──MMJob──▶ job socket (PULL, bound) ──▶ loop ──EngineRequest──▶ engine (PUSH)
                                                      └──RequestFailed──▶ the job's `reply_to`

One thread does everything, one job at a time, so jobs leave in the order they arrived: the
order the sender cache will rely on. A job's bad input fails that job alone, with a clear error
sent to its frontend; an unreadable message on the job socket is counted, logged and dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import zmq

from protocol.codec import Codec
from protocol.errors import MMLaneError, RequestError, RetryableError
from protocol.messages import (
    EngineInput,
    EngineRequest,
    FrontendInput,
    MMJob,
    MMWorkerInput,
    RequestFailed,
)
from services.common.config import MMWorkerConfig
from services.common.sockets import ReplySockets, make_socket
from services.mm_worker.media import MediaPolicy, configure_pillow, decode_image, load_image_bytes
from services.mm_worker.render import check_job, render_request
from services.model import ImageItem, load_preprocessor, resolve_model_dir

log = logging.getLogger(__name__)

POLL_MS = 100
"""How long a wait on a socket lasts before the loop looks at the stop flag again."""
ENGINE_SEND_HWM = 8
"""Rendered requests queued toward the engine before the loop waits. Kept small: one 12 MP
photo is about 300 MB of float32 pixel values, held until ZMQ has sent it (copy=False)."""
SLOW_ENGINE_WARNING_S = 5.0


@dataclass
class MMWorkerCounters:
    """What the worker has done since it started (published by the stats issue, later)."""

    jobs: int = 0
    sent: int = 0
    invalid_messages: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    """Failed jobs by error code."""


class MMWorker:
    """The MM worker role (`endpoint`, `serve(stop)`, `close()`), built from its config."""

    def __init__(self, config: MMWorkerConfig) -> None:
        self.config = config
        self.endpoint = config.job_endpoint
        self.preprocessor = load_preprocessor(resolve_model_dir(config.model))
        self.media = MediaPolicy.from_config(config)
        self.counters = MMWorkerCounters()
        configure_pillow(config.max_image_pixels)
        self._job_codec: Codec[MMJob] = Codec(MMWorkerInput)
        self._engine_codec: Codec[Any] = Codec(EngineInput)
        self._reply_codec: Codec[Any] = Codec(FrontendInput)
        self._ctx = zmq.Context()
        with ExitStack() as undo:  # a failed bind or connect closes what was opened
            undo.callback(self._ctx.term)
            self._jobs = make_socket(self._ctx, zmq.PULL, config.job_endpoint, bind=True)
            undo.callback(self._jobs.close)
            self._engine = make_socket(
                self._ctx, zmq.PUSH, config.engine_endpoint, bind=False, hwm=ENGINE_SEND_HWM
            )
            undo.pop_all()
        self._replies = ReplySockets(self._ctx)
        log.info(
            "model %s (%s), engine at %s, file:// %s",
            self.preprocessor.model_id, self.preprocessor.family.name, config.engine_endpoint,
            f"under {self.media.allowed_media_dir}" if self.media.allowed_media_dir else "disabled",
        )

    def serve(self, stop: threading.Event) -> None:
        """Run the FIFO loop until `stop` is set."""
        threading.current_thread().name = "mm-worker-fifo"
        while not stop.is_set():
            job = self._next_job()  # 1. take the next job, in arrival order
            if job is None:
                continue
            try:
                check_job(
                    job,
                    image_token_id=self.preprocessor.image_token_id,
                    max_context=self.preprocessor.max_context,
                )
                encoded = self._load(job)  # 2. load every image's encoded bytes
                # 3. (later) hash each image and look it up in the sender cache; a hit
                #    sends the hash alone and skips step 4 for that image.
                items = self._process(encoded)  # 4. decode and run the image processor
                request = render_request(job, items, self.preprocessor)
            except Exception as exc:
                self._fail(job, exc)
                continue
            self._send(job, request, stop)  # 5. send one EngineRequest to the engine

    def close(self) -> None:
        """Close every socket (flushing within their linger) and the context."""
        self._replies.close()
        self._engine.close()
        self._jobs.close()
        self._ctx.term()

    # ------------------------------------------------------------ the steps

    def _next_job(self) -> MMJob | None:
        if not self._jobs.poll(POLL_MS):
            return None
        frames = self._jobs.recv_multipart(copy=False)
        try:
            job = self._job_codec.decode(frames)
        except RequestError as exc:  # no reply address is known: count, log, drop
            self.counters.invalid_messages += 1
            log.warning(
                "dropped an invalid message on the job socket (%d so far): %s",
                self.counters.invalid_messages, exc,
            )
            return None
        self.counters.jobs += 1
        return job

    def _load(self, job: MMJob) -> list[bytes]:
        return [
            load_image_bytes(image.url, index, self.media)
            for index, image in enumerate(job.images)
        ]

    def _process(self, encoded: list[bytes]) -> list[ImageItem]:
        return [self._process_image(index, data) for index, data in enumerate(encoded)]

    def _process_image(self, index: int, data: bytes) -> ImageItem:
        started = time.perf_counter()
        image = decode_image(data, index, self.config.max_image_pixels)
        decoded = time.perf_counter()
        try:
            item = self.preprocessor.process_image(image)
        except ValueError as exc:  # HF processors refuse bad sizes (e.g. extreme aspect ratios)
            raise RequestError(
                f"image {index}: the image processor refused it: {exc}", code="invalid_image"
            ) from exc
        log.debug(
            "image %d: %dx%d decoded in %.1f ms, processed in %.1f ms (%d tokens)",
            index, image.width, image.height, (decoded - started) * 1e3,
            (time.perf_counter() - decoded) * 1e3, item.num_tokens,
        )
        return item

    def _send(self, job: MMJob, request: EngineRequest, stop: threading.Event) -> None:
        """Hand the request to the engine, waiting (stop-aware) while the engine is behind."""
        frames = self._engine_codec.encode(request)
        waiting_since = time.monotonic()
        warned = False
        while not self._engine.poll(POLL_MS, zmq.POLLOUT):
            if stop.is_set():
                self._fail(job, RetryableError(
                    "the MM worker stopped before the engine took the request", code="overloaded"
                ))
                return
            if not warned and time.monotonic() - waiting_since > SLOW_ENGINE_WARNING_S:
                log.warning("engine %s is not reading; the FIFO waits", self.config.engine_endpoint)
                warned = True
        self._engine.send_multipart(frames, copy=False)
        self.counters.sent += 1

    def _fail(self, job: MMJob, exc: Exception) -> None:
        """Send the job's terminal error to its frontend; the loop serves on."""
        if isinstance(exc, MMLaneError):
            error = exc
            log.info("request %s failed (%s): %s", job.request_id, error.code, error.message)
        else:
            log.exception("request %s: internal error", job.request_id, exc_info=exc)
            error = MMLaneError(f"internal error in the MM worker: {type(exc).__name__}: {exc}")
        self.counters.failed[error.code] = self.counters.failed.get(error.code, 0) + 1
        reply = RequestFailed(request_id=job.request_id, error=error.to_info())
        try:
            self._replies.send(job.reply_to, self._reply_codec.encode(reply))
        except zmq.ZMQError as exc:  # e.g. a reply_to that is not a valid address
            log.warning("cannot reply to %r for request %s: %s", job.reply_to, job.request_id, exc)
