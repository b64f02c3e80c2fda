"""The MM worker role: one FIFO loop that turns `MMJob`s into fully rendered `EngineRequest`s.

Socket reading stays at the edge, on a thread that owns the job socket:

    mm-worker-input   job socket (PULL, bound) → decode → cancels applied to the queue at once,
                      a frontend's hello answered at once; jobs (their http(s) fetches started)
                      and engine-epoch notices → the queue
    mm-worker-fifo    1. take the head of the queue once its own fetches are done; load, hash,
    (serve)              start decoding and processing the images the engine lacks (inline, or
                         in the pool of `mm_processes` processes: services/mm_worker/pool.py)
                      2. the oldest started job, once its images are done: look up the sender
                         cache, send one EngineRequest to the engine (PUSH)
                      3. commit it to the sender cache; a failed job's RequestFailed goes to its
                         `reply_to` instead

One thread starts and finishes every job, finishing them in the order it started them, so jobs
leave in the order they arrived: the order the sender cache relies on, since each request is
committed to it right after its send, and looked up (step 2) only after every request before
it was committed. With a pool, up to two jobs per process are started ahead, so that the
processes stay busy while the oldest job is finished; without one, a job is started only when
the one before it has left, as a plain loop would. So that
neither a slow image server nor a big image holds up what comes behind it, jobs are received
into a bounded queue (`fetch_ahead_jobs`) while the loop works, and the fetches of their http(s)
images start on arrival (`MediaFetcher`, its own thread); the loop takes the head, waiting only
for the head's own fetches, and processes and commits strictly in arrival order. Engine-epoch
notices wait in the same queue, so they apply in their turn.
A job's bad input fails that job alone, with a clear error sent to its frontend; an unreadable
message on the job socket is counted, logged and dropped.

`CancelJobs` (its frontend no longer waits: the client went away, or the deadline passed) takes
the named jobs out of the queue: never processed, no reply, nothing committed to the sender
cache, the order of the others kept. A job that is no longer queued (being processed, done, or
not yet arrived) is not affected. The input thread applies a cancel as it reads it, even while
the loop processes a 12 MP image.

At SIGTERM the worker drains: the input thread keeps reading the job socket and answers each new
job at once with a retryable error, while the loop keeps processing the jobs it holds in order
until they are done or the drain timeout passes, then fails the rest with a retryable error.
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

from mmlane.common.feature_cache import capacity_bytes
from mmlane.common.lifecycle import (
    Stop,
    drain,
    lower_priority,
    refused_while_draining,
    unfinished_at_drain_timeout,
)
from mmlane.common.sockets import ReplySockets, Security, make_socket
from mmlane.common.stats import Metrics, log_totals
from mmlane.mm_worker.cache import ImageHasher, SenderCache
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.mm_worker.fetch import FetchPolicy, MediaFetcher
from mmlane.mm_worker.jobs import JobRenderer, StartedJob
from mmlane.mm_worker.media import MediaPolicy, configure_pillow, is_fetched
from mmlane.mm_worker.pool import PoolSlots, ProcessPool
from mmlane.model import load_preprocessor, resolve_model_dir
from mmlane.protocol import shm
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import MMLaneError, RequestError, RetryableError
from mmlane.protocol.messages import (
    CancelJobs,
    EngineEpoch,
    EngineInput,
    EngineRequest,
    FrontendInput,
    Hello,
    HelloReply,
    MMJob,
    MMWorkerInput,
    RequestFailed,
)

log = logging.getLogger(__name__)

POLL_MS = 100
"""How long a wait on a socket lasts before the loop looks at the stop flag again."""
ENGINE_SEND_HWM = 8
"""Rendered requests queued toward the engine before the loop waits. Kept small: one 12 MP
photo is about 300 MB of float32 pixel values, held until ZMQ has sent it (copy=False)."""
SLOW_ENGINE_WARNING_S = 5.0
SHM_MIN_BYTES = 1 << 20
"""Tensors this large go through shared memory to an engine on this host (`shm_transport_mb`):
above it two copies through a slot cost less than a ZMQ frame's way through the kernel."""
POOL_SLOTS_BYTES = 256 << 20
"""The pool's slots in all when no engine takes shared memory (its processes' results only
wait there for the worker to copy them out)."""
SHM_MAX_AGE_S = 60.0
"""A shared-memory slot the engine has not emptied by then is taken back: the engine is gone (a
live one empties it as the message arrives)."""


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
        lower_priority(config.image_nice)  # first: the threads and processes it starts inherit
        self.config = config
        self.endpoint = config.mm_worker_endpoint
        model_dir = resolve_model_dir(config.model)
        self.preprocessor = load_preprocessor(model_dir, config.image_backend)
        self.media = MediaPolicy.from_config(config)
        self.metrics = Metrics("mm-worker", config.ops.name)
        self.metrics.model = self.preprocessor.model_id
        configure_pillow(config.max_image_pixels)
        self._job_codec: Codec[MMJob | EngineEpoch | CancelJobs | Hello] = Codec(MMWorkerInput)
        self._started_ns = time.time_ns()  # tells a frontend's `Hello` which process answers
        self._ctx = zmq.Context()
        self._security = Security.of("mm-worker", config, self.metrics.counters)
        with ExitStack() as undo:  # a failed bind or connect closes what was opened
            undo.callback(self._ctx.term)
            undo.callback(self._security.close)
            self._jobs = make_socket(self._ctx, zmq.PULL, config.mm_worker_endpoint, bind=True,
                                     security=self._security)
            undo.callback(self._jobs.close)
            self._engine = make_socket(
                self._ctx, zmq.PUSH, config.engine_endpoint, bind=False, hwm=ENGINE_SEND_HWM,
                security=self._security, peer="engine",
            )
            undo.pop_all()
        # The loop's; the input thread has its own.
        self._failures = FrontendReplies(self._ctx, self._security)
        # The engine keeps one receiver cache per sender: name ours by host and bound address
        # (resolved, so two workers bound to 'tcp://host:*' get different names).
        bound = self._jobs.getsockopt_string(zmq.LAST_ENDPOINT)
        self.cache = SenderCache(f"{socket.gethostname()}/{bound}",
                                 capacity_bytes(config.mm_cache_gb))
        transport = shm_transport(config)
        tag = shm.sender_tag(self.cache.sender)
        reaped = shm.reap(tag)
        if reaped:
            log.info("unlinked %d shared-memory slot(s) a previous MM worker left", reaped)
        capacity = int(config.shm_transport_mb * 2**20) if transport else POOL_SLOTS_BYTES
        # With a pool, its processes hold the slots and the worker hands their views on;
        # without, the worker puts its own tensors into slots of its own.
        self.shm: shm.ShmWriter | None = None
        self._shm_views: shm.ShmViews | None = None
        to_engine: shm.ShmSender | None = None  # what the engine codec sends slots through
        if config.mm_processes > 1:
            self._shm_views = shm.ShmViews(SHM_MIN_BYTES if transport else None)
            to_engine = self._shm_views if transport else None
        elif transport:
            self.shm = to_engine = shm.ShmWriter(tag, threshold=SHM_MIN_BYTES,
                                                 capacity=capacity, max_age_s=SHM_MAX_AGE_S)
        self._engine_codec: Codec[Any] = Codec(EngineInput, shm_writer=to_engine)
        # What the hash stands for: the tensors, so every setting that changes them is in it.
        hasher = ImageHasher(config.mm_hash, self.preprocessor.model_id,
                             {**self.preprocessor.image_processor.to_dict(),
                              "mmlane_jpeg_draft": config.jpeg_draft})
        self.pool = (ProcessPool(model_dir, self.preprocessor.image_backend, self.media,
                                 config.mm_processes, PoolSlots(
                                     tag, capacity // config.mm_processes, SHM_MAX_AGE_S,
                                     self._shm_views))
                     if self._shm_views is not None else None)
        self.renderer = JobRenderer(self.preprocessor, self.media, self.cache, hasher,
                                    self.metrics, self.pool)
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
        self._queue_changed = threading.Condition()
        """Guards `_queue`; notified when an item comes or goes and when a fetch finishes."""
        self._started: collections.deque[StartedJob | EngineEpoch] = collections.deque()
        """Jobs started and not yet finished, and the notices between them, in arrival order
        (the loop's alone; guarded by `_queue_changed` for the counts other threads read)."""
        self._ahead = 2 * config.mm_processes if self.pool else 1
        self._turning = 0  # 1 while the loop starts or finishes a job off both queues
        # serve's: from its signal on, new jobs are refused
        self._stop = Stop(config.ops.drain_timeout_s)
        self._input_done = threading.Event()
        self._input: threading.Thread | None = None
        self.metrics.add_counters(self.cache.counters)
        for counters in (self.shm, self._shm_views):
            if counters is not None:
                self.metrics.add_counters(counters.counters)
        self.metrics.epoch = lambda: self.cache.epoch
        self.metrics.gauge("jobs_queued", lambda: len(self._queue))
        self.metrics.in_flight = lambda: len(self._queue) + len(self._started) + self._turning
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
        self._input = threading.Thread(target=self._input_loop, name="mm-worker-input",
                                       daemon=True)
        self._input.start()
        while not stop.is_set():
            self._turn()
        # Jobs arriving from now on are refused at once (`_take_message`).
        drain(stop, log, held=self._jobs_queued, turn=self._turn)
        self._stop_input()  # the last arrivals get their refusal too
        self._fail_queued(unfinished_at_drain_timeout("MM worker", stop))

    def _turn(self) -> None:
        """Finish the oldest started job if it is ready, start the next one if there is room;
        wait up to POLL_MS when neither can be done."""
        with self._queue_changed:
            if not self._queue_changed.wait_for(self._can_turn, POLL_MS / 1e3):
                return
            oldest = self._started.popleft() if self._oldest_ready() else None
            head = self._pop_head() if oldest is None and self._room() else None
            self._queue_changed.notify_all()  # room for the input thread
        self._turning = 1
        try:
            if oldest is not None:
                self._finish(oldest)
            elif head is not None:
                self._start(head)
        finally:
            self._turning = 0

    def _start(self, item: PendingJob | EngineEpoch) -> None:
        """Step 1 for one job: its failure is its alone."""
        if isinstance(item, EngineEpoch):
            self._add_started(item)
            return
        job = item.job
        self.metrics.observe("queue_wait", time.monotonic() - item.received_at)
        if job.deadline and job.deadline <= time.time():  # nobody waits for it any more
            self.metrics.counters["expired"] += 1
            self._fail(job, RetryableError(
                f"request {job.request_id} passed its deadline before the MM worker reached it",
                code="timeout",
            ))
            return
        try:
            started = self.renderer.start(job, item.fetches)
        except Exception as exc:
            self._fail(job, exc)
            return
        started.received_at = item.received_at
        for work in started.work.values():
            work.add_done_callback(self._wake)
        self._add_started(started)

    def _finish(self, item: StartedJob | EngineEpoch) -> None:
        """Steps 2-3 for the oldest started job (or a notice, applied in its turn)."""
        if isinstance(item, EngineEpoch):
            self.renderer.follow_engine_epoch(item.engine_epoch)
            return
        job = item.job
        try:
            request = self.renderer.finish(item)
        except Exception as exc:
            item.drop()
            self._fail(job, exc)
            return
        if self._send(job, request):  # 2. send one EngineRequest to the engine
            self.cache.commit(request)  # 3. commit it to the sender cache, in send order
            self.metrics.observe("mm_job", time.monotonic() - item.received_at)

    def close(self) -> None:
        """Close every socket (flushing within their linger) and the context."""
        self._stop_input()
        log_totals(self.metrics)
        if self.pool is not None:
            self.pool.close()
        self.fetcher.close()
        self._failures.close()
        self._engine.close()
        if self.shm is not None:
            self.shm.close()
        self._jobs.close()
        self._security.close()
        self._ctx.term()

    # ------------------------------------------------------------ the FIFO loop's side

    def _can_turn(self) -> bool:
        return self._oldest_ready() or (self._room() and self._head_ready())

    def _oldest_ready(self) -> bool:
        oldest = self._started[0] if self._started else None
        return oldest is not None and (isinstance(oldest, EngineEpoch) or oldest.ready())

    def _room(self) -> bool:
        return len(self._started) < self._ahead

    def _head_ready(self) -> bool:
        head = self._queue[0] if self._queue else None
        return head is not None and (isinstance(head, EngineEpoch) or head.ready())

    def _pop_head(self) -> PendingJob | EngineEpoch | None:
        return self._queue.popleft() if self._head_ready() else None

    def _add_started(self, item: StartedJob | EngineEpoch) -> None:
        with self._queue_changed:
            self._started.append(item)
            self._turning = 0  # counted in `_started` from now on

    def _wake(self, _: object) -> None:
        """A done-callback: an image finished, so the oldest job may be ready."""
        with self._queue_changed:
            self._queue_changed.notify_all()

    def _jobs_queued(self) -> int:
        with self._queue_changed:
            return sum(isinstance(item, PendingJob | StartedJob)
                       for item in (*self._queue, *self._started))

    def _fail_queued(self, error: MMLaneError) -> None:
        """At the end: every job still started or queued gets `error`."""
        with self._queue_changed:
            left = [*self._started, *self._queue]
            self._started, self._queue = collections.deque(), collections.deque()
        for item in left:
            if isinstance(item, StartedJob):
                item.drop()
                self._fail(item.job, error)
            elif isinstance(item, PendingJob):
                for fetch in item.fetches.values():
                    fetch.cancel()
                self._fail(item.job, error)

    # ------------------------------------------------------------ the input thread

    def _input_loop(self) -> None:
        """The mm-worker-input thread: reads the job socket, which it alone uses, into the queue
        while there is room (always, once draining: new jobs are refused, not queued); ends at
        `_stop_input`, after reading what has arrived by then."""
        replies = FrontendReplies(self._ctx, self._security)
        try:
            while not self._input_done.is_set():
                if self._wait_for_room() and self._jobs.poll(POLL_MS):
                    self._take_message(replies)
            while self._jobs.poll(0):
                self._take_message(replies)
        finally:
            replies.close()

    def _stop_input(self) -> None:
        self._input_done.set()
        if self._input is not None:
            self._input.join()

    def _wait_for_room(self) -> bool:
        """Whether the queue has room for one more message; waits up to POLL_MS for it."""
        with self._queue_changed:
            return self._queue_changed.wait_for(lambda: not self._full(), POLL_MS / 1e3)

    def _full(self) -> bool:
        """Whether the queue holds `fetch_ahead_jobs`; while draining it takes no new jobs, so
        the socket is read on regardless (the jobs there get their refusal at once)."""
        return not self._stop.is_set() and len(self._queue) >= self.config.fetch_ahead_jobs

    def _take_message(self, replies: FrontendReplies) -> None:
        """Read one message off the job socket: queue it, apply it (a cancel), answer it (a
        hello), refuse it (a job while draining) or drop it (invalid)."""
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
            return
        if isinstance(message, CancelJobs):
            self._cancel(message.request_ids)
            return
        if isinstance(message, EngineEpoch):
            self._enqueue(message)
            return
        if isinstance(message, Hello):
            replies.send(message.reply_to, HelloReply(peer=message.peer, started=self._started_ns))
            return
        counters["requests"] += 1
        if self._stop.is_set():
            counters["refused_draining"] += 1
            self._fail(message, refused_while_draining("MM worker"), replies)
            return
        self._enqueue(self._start_fetches(message, received_at))

    def _enqueue(self, item: PendingJob | EngineEpoch) -> None:
        with self._queue_changed:
            self._queue.append(item)
            self._queue_changed.notify_all()

    def _start_fetches(self, job: MMJob, received_at: float) -> PendingJob:
        fetches: dict[int, concurrent.futures.Future[bytes]] = {}
        for index, image in enumerate(job.images):
            scheme = image.url.partition(":")[0].lower()
            if is_fetched(image.url) and scheme in self.media.allowed_schemes:
                fetches[index] = fetch = self.fetcher.submit(image.url)
                fetch.add_done_callback(self._fetch_done())
                self.metrics.counters["fetches"] += 1
        return PendingJob(job, fetches, received_at)

    def _fetch_done(self) -> Callable[[concurrent.futures.Future[bytes]], None]:
        """A done-callback (on the fetcher's thread) that records how long a fetch took and
        wakes the loop, whose head may now be ready."""
        started = time.monotonic()

        def done(_: concurrent.futures.Future[bytes]) -> None:
            self.metrics.observe("fetch", time.monotonic() - started)
            with self._queue_changed:
                self._queue_changed.notify_all()

        return done

    def _cancel(self, request_ids: list[str]) -> None:
        """Take the named jobs out of the queue, unprocessed and unanswered (see the module
        docstring); ids not queued are ignored."""
        cancelled = set(request_ids)
        with self._queue_changed:
            found = [item for item in self._queue
                     if isinstance(item, PendingJob) and item.job.request_id in cancelled]
            for item in found:
                self._queue.remove(item)
            self._queue_changed.notify_all()  # the head may have changed
        for item in found:
            for fetch in item.fetches.values():
                fetch.cancel()
            self.metrics.counters["cancelled"] += 1
            log.info("request %s cancelled by its frontend: skipped", item.job.request_id)

    # ------------------------------------------------------------ the loop's sending side

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

    def _fail(self, job: MMJob, exc: Exception, replies: FrontendReplies | None = None) -> None:
        """Send the job's terminal error to its frontend (through `replies`, the calling
        thread's; the loop's by default); the loop serves on."""
        if isinstance(exc, MMLaneError):
            error = exc
            log.info("request %s failed (%s): %s", job.request_id, error.code, error.message)
        else:
            log.exception("request %s: internal error", job.request_id, exc_info=exc)
            error = MMLaneError(f"internal error in the MM worker: {type(exc).__name__}: {exc}")
        self.metrics.errors[error.code] += 1
        reply = RequestFailed(request_id=job.request_id, error=error.to_info())
        (replies or self._failures).send(job.reply_to, reply)


class FrontendReplies:
    """Sends replies to frontends: jobs' RequestFailed, and HelloReply. Sockets and codecs are
    not thread-safe: each thread that replies has its own."""

    def __init__(self, ctx: zmq.Context, security: Security) -> None:
        self._codec: Codec[Any] = Codec(FrontendInput)
        self._sockets = ReplySockets(ctx, security=security)

    def send(self, reply_to: str, reply: RequestFailed | HelloReply) -> None:
        try:
            sent = self._sockets.send(reply_to, self._codec.encode(reply))
        except zmq.ZMQError as exc:  # e.g. a reply_to that is not a valid address
            log.warning("cannot send a %s to %r: %s", type(reply).__name__, reply_to, exc)
            return
        if not sent:  # its queue is full: a frontend gone (one reply per job: no burst)
            log.warning("a %s to %s dropped: its queue is full", type(reply).__name__, reply_to)

    def close(self) -> None:
        self._sockets.close()


def shm_transport(config: MMWorkerConfig) -> bool:
    """Whether tensors go to the engine through shared memory (`shm_transport_mb`): not when the
    engine is reached over tcp, the setting is 0, or the host has no /dev/shm."""
    if not config.engine_endpoint.startswith("ipc://") or config.shm_transport_mb == 0:
        return False
    if not shm.available():
        log.warning("no writable %s: tensors go to the engine as ZMQ frames", shm.SHM_DIR)
        return False
    return True


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
