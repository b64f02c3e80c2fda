"""The MM worker role: one FIFO loop that turns `MMJob`s into fully rendered `EngineRequest`s.

    frontend ──MMJob──▶ job socket (PULL, bound) ──▶ loop ──EngineRequest──▶ engine (PUSH)
                                                      └──RequestFailed──▶ the job's `reply_to`

One thread processes one job at a time, so jobs leave in the order they arrived: the order the
sender cache relies on, since each request is committed to it right after its send. So that a
slow image server never holds up the jobs behind it, jobs are received eagerly into a bounded
local queue (`fetch_ahead_jobs`) and the fetches of their http(s) images start on arrival
(`MediaFetcher`, its own thread); the loop then takes the head, waiting only for the head's own
fetches, and processes and commits strictly in arrival order. Engine-epoch notices wait in the
same queue, so they apply in their turn.
A job's bad input fails that job alone, with a clear error sent to its frontend; an unreadable
message on the job socket is counted, logged and dropped.

`CancelJobs` (its frontend no longer waits: the client went away, or the deadline passed) takes
the named jobs out of the queue: never processed, no reply, nothing committed to the sender
cache, the order of the others kept. A job that is no longer queued (being processed, done, or
not yet arrived) is not affected.

At SIGTERM the worker drains: it keeps reading the job socket and answers each new job at once
with a retryable error, keeps processing the jobs it holds in order until they are done or the
drain timeout passes, then fails the rest with a retryable error.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import zmq

from protocol.codec import Codec
from protocol.errors import MMLaneError, RequestError, RetryableError
from protocol.messages import (
    CancelJobs,
    EngineEpoch,
    EngineInput,
    EngineRequest,
    FrontendInput,
    MMJob,
    MMWorkerInput,
    RequestFailed,
)
from services.common.config import MMWorkerConfig
from services.common.feature_cache import capacity_bytes
from services.common.lifecycle import (
    Stop,
    drain,
    refused_while_draining,
    unfinished_at_drain_timeout,
)
from services.common.sockets import ReplySockets, make_socket
from services.common.stats import Metrics, log_totals
from services.mm_worker.cache import ImageHasher, SenderCache
from services.mm_worker.fetch import FetchPolicy, MediaFetcher
from services.mm_worker.jobs import JobRenderer
from services.mm_worker.media import MediaPolicy, configure_pillow, is_fetched
from services.model import load_preprocessor, resolve_model_dir

log = logging.getLogger(__name__)

POLL_MS = 100
"""How long a wait on a socket lasts before the loop looks at the stop flag again."""
ENGINE_SEND_HWM = 8
"""Rendered requests queued toward the engine before the loop waits. Kept small: one 12 MP
photo is about 300 MB of float32 pixel values, held until ZMQ has sent it (copy=False)."""
SLOW_ENGINE_WARNING_S = 5.0
HEAD_WAIT_MS = 5
"""While the head job waits for its fetches, how often the loop also takes in new jobs."""


@dataclass
class PendingJob:
    """A received job and the fetches of its http(s) images, by image index."""

    job: MMJob
    fetches: dict[int, concurrent.futures.Future[bytes]]
    received_at: float
    """When the job was taken off the socket (`time.monotonic()`)."""

    def ready(self) -> bool:
        return all(fetch.done() for fetch in self.fetches.values())


class MMWorker:
    """The MM worker role (`endpoint`, `serve(stop)`, `close()`), built from its config."""

    def __init__(self, config: MMWorkerConfig) -> None:
        self.config = config
        self.endpoint = config.mm_worker_endpoint
        self.preprocessor = load_preprocessor(resolve_model_dir(config.model))
        self.media = MediaPolicy.from_config(config)
        self.metrics = Metrics("mm-worker", config.ops.name)
        self.metrics.model = self.preprocessor.model_id
        configure_pillow(config.max_image_pixels)
        self._job_codec: Codec[MMJob | EngineEpoch | CancelJobs] = Codec(MMWorkerInput)
        self._engine_codec: Codec[Any] = Codec(EngineInput)
        self._reply_codec: Codec[Any] = Codec(FrontendInput)
        self._ctx = zmq.Context()
        with ExitStack() as undo:  # a failed bind or connect closes what was opened
            undo.callback(self._ctx.term)
            self._jobs = make_socket(self._ctx, zmq.PULL, config.mm_worker_endpoint, bind=True)
            undo.callback(self._jobs.close)
            self._engine = make_socket(
                self._ctx, zmq.PUSH, config.engine_endpoint, bind=False, hwm=ENGINE_SEND_HWM
            )
            undo.pop_all()
        self._replies = ReplySockets(self._ctx)
        # The engine keeps one receiver cache per sender: name ours by host and bound address
        # (resolved, so two workers bound to 'tcp://host:*' get different names).
        bound = self._jobs.getsockopt_string(zmq.LAST_ENDPOINT)
        self.cache = SenderCache(f"{socket.gethostname()}/{bound}",
                                 capacity_bytes(config.mm_cache_gb))
        hasher = ImageHasher(config.mm_hash, self.preprocessor.model_id,
                             self.preprocessor.image_processor.to_dict())
        self.renderer = JobRenderer(self.preprocessor, self.media, self.cache, hasher, self.metrics)
        self.fetcher = MediaFetcher(fetch_policy(config))
        policy = self.fetcher.policy
        log.info(
            "image URL schemes %s; fetch domains %s, internal addresses %s, %d redirects, "
            "timeouts %.1f s connect / %.1f s total, %d retries",
            ",".join(sorted(self.media.allowed_schemes)) or "none",
            ",".join(policy.allowed_domains) or "any",
            "allowed" if policy.allow_internal else "refused", policy.max_redirects,
            policy.connect_timeout_s, policy.total_timeout_s, policy.retries,
        )
        self._queue: collections.deque[PendingJob | EngineEpoch] = collections.deque()
        self._processing = 0  # 1 while the loop works on a job taken off the queue
        self._stop = Stop()  # serve's: from its signal on, new jobs are refused
        self.metrics.add_counters(self.cache.counters)
        self.metrics.epoch = lambda: self.cache.epoch
        self.metrics.gauge("jobs_queued", lambda: len(self._queue))
        self.metrics.in_flight = lambda: len(self._queue) + self._processing
        log.info(
            "model %s (%s), engine at %s, file:// %s, feature cache %s",
            self.preprocessor.model_id, self.preprocessor.family.name, config.engine_endpoint,
            f"under {self.media.allowed_media_dir}" if self.media.allowed_media_dir else "disabled",
            f"{config.mm_cache_gb} GiB ({config.mm_hash}, sender {self.cache.sender})"
            if config.mm_cache_gb > 0 else "off",
        )

    def serve(self, stop: Stop) -> None:
        """Run the FIFO loop until `stop` is set, then drain."""
        threading.current_thread().name = "mm-worker-fifo"
        self._stop = stop
        while not stop.is_set():
            self._turn()
        # Jobs arriving from now on are refused at once (`_next_message`).
        drain(stop, log, held=self._jobs_queued, turn=self._turn)
        self._receive()  # the last arrivals get their refusal too
        self._fail_queued(unfinished_at_drain_timeout("MM worker", stop))

    def _turn(self) -> None:
        self._receive()  # 1. take in arriving jobs; their image fetches start now
        head = self._ready_head()  # 2. the oldest job, once its own fetches are done
        if head is None:
            return
        self._processing = 1
        self.metrics.observe("queue_wait", time.monotonic() - head.received_at)
        try:
            self._process(head)
        finally:
            self._processing = 0

    def _process(self, head: PendingJob) -> None:
        """Steps 3-5 for one job, or its terminal error: it fails alone."""
        job = head.job
        if job.deadline and job.deadline <= time.time():  # nobody waits for it any more
            self.metrics.counters["expired"] += 1
            self._fail(job, RetryableError(
                f"request {job.request_id} passed its deadline before the MM worker reached it",
                code="timeout",
            ))
            return
        try:
            # 3. load, hash, look up the sender cache, decode and process the misses
            request = self.renderer.render(job, head.fetches)
        except Exception as exc:
            self._fail(job, exc)
            return
        if self._send(job, request):  # 4. send one EngineRequest to the engine
            self.cache.commit(request)  # 5. commit it to the sender cache, in send order
            self.metrics.observe("mm_job", time.monotonic() - head.received_at)

    def close(self) -> None:
        """Close every socket (flushing within their linger) and the context."""
        log_totals(self.metrics)
        self.fetcher.close()
        self._replies.close()
        self._engine.close()
        self._jobs.close()
        self._ctx.term()

    # ------------------------------------------------------------ the steps

    def _receive(self) -> None:
        """Take in the jobs that have arrived, up to `fetch_ahead_jobs` held, starting their
        fetches; waits up to POLL_MS when idle, HEAD_WAIT_MS while the head fetches."""
        head = self._queue[0] if self._queue else None
        wait_ms = POLL_MS if head is None else HEAD_WAIT_MS
        if isinstance(head, EngineEpoch) or (head is not None and head.ready()):
            wait_ms = 0
        if self._full():
            if isinstance(head, PendingJob):  # full: the head's fetches are all we wait for
                concurrent.futures.wait(list(head.fetches.values()), timeout=POLL_MS / 1e3)
            return
        if not self._jobs.poll(wait_ms):
            return
        while not self._full():
            message = self._next_message()
            if message is not None:
                self._queue.append(message)
            if not self._jobs.poll(0):
                return

    def _full(self) -> bool:
        """Whether the queue holds `fetch_ahead_jobs`; while draining it takes no new jobs, so
        the socket is read on regardless (the jobs there get their refusal at once)."""
        return not self._stop.is_set() and len(self._queue) >= self.config.fetch_ahead_jobs

    def _jobs_queued(self) -> int:
        return sum(isinstance(item, PendingJob) for item in self._queue)

    def _ready_head(self) -> PendingJob | None:
        """Pop the head once it can be processed; an engine-epoch notice is applied here."""
        while self._queue:
            head = self._queue[0]
            if isinstance(head, PendingJob):
                if not head.ready():
                    return None
                self._queue.popleft()
                return head
            self._queue.popleft()
            if self.cache.see_engine_epoch(head.engine_epoch):
                log.info("engine cache epoch %d: sender cache cleared, sender epoch %d",
                         head.engine_epoch, self.cache.epoch)
        return None

    def _start_fetches(self, job: MMJob, received_at: float) -> PendingJob:
        fetches: dict[int, concurrent.futures.Future[bytes]] = {}
        for index, image in enumerate(job.images):
            scheme = image.url.partition(":")[0].lower()
            if is_fetched(image.url) and scheme in self.media.allowed_schemes:
                fetches[index] = fetch = self.fetcher.submit(image.url)
                fetch.add_done_callback(self._fetch_timer())
                self.metrics.counters["fetches"] += 1
        return PendingJob(job, fetches, received_at)

    def _fetch_timer(self) -> Callable[[concurrent.futures.Future[bytes]], None]:
        """A done-callback that records how long a fetch took (runs on the fetcher's thread)."""
        started = time.monotonic()
        return lambda _: self.metrics.observe("fetch", time.monotonic() - started)

    def _fail_queued(self, error: MMLaneError) -> None:
        """At the end: every job still queued gets `error`."""
        while self._queue:
            head = self._queue.popleft()
            if isinstance(head, PendingJob):
                for fetch in head.fetches.values():
                    fetch.cancel()
                self._fail(head.job, error)

    def _cancel(self, request_ids: list[str]) -> None:
        """Take the named jobs out of the queue, unprocessed and unanswered (see the module
        docstring); ids not queued are ignored."""
        cancelled = set(request_ids)
        for item in list(self._queue):
            if isinstance(item, PendingJob) and item.job.request_id in cancelled:
                self._queue.remove(item)
                for fetch in item.fetches.values():
                    fetch.cancel()
                self.metrics.counters["cancelled"] += 1
                log.info("request %s cancelled by its frontend: skipped", item.job.request_id)

    def _next_message(self) -> PendingJob | EngineEpoch | None:
        """The next message on the job socket to queue (None: nothing to queue: it was invalid
        and dropped, a cancel applied at once, or a job refused while draining)."""
        frames = self._jobs.recv_multipart(copy=False)
        received_at = time.monotonic()
        counters = self.metrics.counters
        counters["bytes_in"] += sum(len(frame) for frame in frames)
        try:
            message = self._job_codec.decode(frames)
        except RequestError as exc:  # no reply address is known: count, log, drop
            counters["invalid_messages"] += 1
            log.warning(
                "dropped an invalid message on the job socket (%d so far): %s",
                counters["invalid_messages"], exc,
            )
            return None
        if isinstance(message, EngineEpoch):
            return message
        if isinstance(message, CancelJobs):
            self._cancel(message.request_ids)
            return None
        counters["requests"] += 1
        if self._stop.is_set():
            counters["refused_draining"] += 1
            self._fail(message, refused_while_draining("MM worker"))
            return None
        return self._start_fetches(message, received_at)

    def _send(self, job: MMJob, request: EngineRequest) -> bool:
        """Hand the request to the engine, waiting while the engine is behind (until the drain
        timeout, once stopping); False when it was not sent (the job got an error instead)."""
        frames = self._engine_codec.encode(request)
        waiting_since = time.monotonic()
        warned = False
        while not self._engine.poll(POLL_MS, zmq.POLLOUT):
            if self._stop.drain_expired():
                self._fail(job, unfinished_at_drain_timeout("MM worker", self._stop))
                return False
            if not warned and time.monotonic() - waiting_since > SLOW_ENGINE_WARNING_S:
                log.warning("engine %s is not reading; the FIFO waits", self.config.engine_endpoint)
                warned = True
        self._engine.send_multipart(frames, copy=False)
        self.metrics.counters["sent"] += 1
        self.metrics.counters["bytes_out"] += sum(len(frame) for frame in frames)
        return True

    def _fail(self, job: MMJob, exc: Exception) -> None:
        """Send the job's terminal error to its frontend; the loop serves on."""
        if isinstance(exc, MMLaneError):
            error = exc
            log.info("request %s failed (%s): %s", job.request_id, error.code, error.message)
        else:
            log.exception("request %s: internal error", job.request_id, exc_info=exc)
            error = MMLaneError(f"internal error in the MM worker: {type(exc).__name__}: {exc}")
        self.metrics.errors[error.code] += 1
        reply = RequestFailed(request_id=job.request_id, error=error.to_info())
        try:
            self._replies.send(job.reply_to, self._reply_codec.encode(reply))
        except zmq.ZMQError as exc:  # e.g. a reply_to that is not a valid address
            log.warning("cannot reply to %r for request %s: %s", job.reply_to, job.request_id, exc)


def fetch_policy(config: MMWorkerConfig) -> FetchPolicy:
    """The URL policy of http(s) image fetches, from the worker's settings."""
    return FetchPolicy(
        allowed_schemes=frozenset(config.allowed_media_schemes) & {"http", "https"},
        allowed_domains=tuple(d.lower().strip(".") for d in config.allowed_media_domains),
        allow_internal=config.allow_internal_media,
        max_redirects=config.media_max_redirects,
        connect_timeout_s=config.media_connect_timeout_s,
        total_timeout_s=config.media_fetch_timeout_s,
        max_bytes=config.max_image_bytes,
        retries=config.media_fetch_retries,
    )
