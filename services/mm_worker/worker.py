"""The MM worker role: two FIFO lanes that turn `MMJob`s into fully rendered `EngineRequest`s.

Socket reading stays at the edge, on a thread that owns the job socket:

    mm-worker-input   job socket (PULL, bound) → decode → cancels applied to the queues at once,
                      a frontend's hello answered at once; jobs (their http(s) fetches started)
                      to their lane's queue, engine-epoch notices to both
    mm-worker-fifo    the image lane (services/mm_worker/lane.py): jobs with images only, their
    (serve)           images decoded and processed inline or in the pool of `mm_processes`
                      processes (services/mm_worker/pool.py)
    mm-worker-video   the video lane: every job with a video (its images too), decoded and
                      processed in the same pool (at most `video_processes` videos at once), or
                      inline on that thread when there is none

Each lane takes its jobs in arrival order, finishes them in the order it started them and sends
each one's EngineRequest on a socket of its own, committing it to a sender cache of its own: to
the engine, each lane is a sender (its own name, epoch and seq, so one receiver cache each), and
the mirrored cache's invariant holds per lane. A video takes seconds to decode; in a lane of its
own it never holds an image job behind it. A job with both goes to the video lane whole, so that
its items commit together, in one lane's order. Nothing orders one lane against the other: an
image job sent after a video job may reach the engine first (invariant 2 holds per lane).

With a pool, up to two jobs per process a lane may use are started ahead (`mm_processes` for the
image lane, `video_processes` for the video lane), so that the processes stay busy while the oldest
job is finished. Without one, the image lane starts a job only when the one before it has left, as a
plain loop would, and the video lane's videos go to `video_processes` threads of its own (two jobs
started ahead per thread), which decode while its thread finishes the oldest. So that neither a slow
image server nor a big image holds up what comes behind it, jobs are received into bounded queues
(`fetch_ahead_jobs` each) while the lanes work, and the fetches of their http(s) images and videos
start on arrival (`MediaFetcher`, its own thread); a lane takes its head, waiting only for the
head's own fetches. While the image lane's queue is full the input thread waits (ZMQ holds what
comes); a video job that finds the video lane's queue full is refused at once (`overloaded`), so
videos never hold images back there either.
Engine-epoch notices wait in both queues, so they apply in their turn.
A job's bad input fails that job alone, with a clear error sent to its frontend; an unreadable
message on the job socket is counted, logged and dropped.

`CancelJobs` (its frontend no longer waits: the client went away, or the deadline passed) takes
the named jobs out of the queues: never processed, no reply, nothing committed to a sender
cache, the order of the others kept. A job that is no longer queued (being processed, done, or
not yet arrived) is not affected. The input thread applies a cancel as it reads it, even while
a lane processes a 12 MP image or a long video.

At SIGTERM the worker drains: the input thread keeps reading the job socket and answers each new
job at once with a retryable error, while each lane keeps processing the jobs it holds in order
until they are done or the drain timeout passes, then fails the rest with a retryable error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import zmq

from mmlane.common.feature_cache import capacity_bytes
from mmlane.common.lifecycle import (
    Stop,
    drain,
    lower_priority,
    refused_while_draining,
    unfinished_at_drain_timeout,
)
from mmlane.common.sockets import Security, make_socket
from mmlane.common.stats import Metrics, log_totals
from mmlane.mm_worker.cache import ImageHasher, SenderCache
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.mm_worker.fetch import FetchPolicy, MediaFetcher
from mmlane.mm_worker.jobs import JobRenderer, VideoRendering
from mmlane.mm_worker.lane import FrontendReplies, Lane, PendingJob
from mmlane.mm_worker.media import MediaPolicy, configure_pillow, is_fetched
from mmlane.mm_worker.pool import PoolSlots, ProcessPool
from mmlane.model import load_preprocessor, resolve_model_dir
from mmlane.model.video import videos_of
from mmlane.protocol import shm
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import RequestError, RetryableError
from mmlane.protocol.messages import (
    CancelJobs,
    EngineEpoch,
    EngineInput,
    Hello,
    HelloReply,
    MMJob,
    MMWorkerInput,
)

log = logging.getLogger(__name__)

POLL_MS = 100
"""How long a wait on a socket lasts before the loop looks at the stop flag again."""
ENGINE_SEND_HWM = 8
"""Rendered requests queued toward the engine before the loop waits. Kept small: one 12 MP
photo is about 300 MB of float32 pixel values, held until ZMQ has sent it (copy=False)."""
SHM_MIN_BYTES = 1 << 20
"""Tensors this large go through shared memory to an engine on this host (`shm_transport_mb`):
above it two copies through a slot cost less than a ZMQ frame's way through the kernel."""
POOL_SLOTS_BYTES = 256 << 20
"""The pool's slots in all when no engine takes shared memory (its processes' results only
wait there for the worker to copy them out)."""
SHM_MAX_AGE_S = 60.0
"""A shared-memory slot the engine has not emptied this long after it was sent is taken back:
the engine is gone (a live one empties it as the message arrives). A pool process's result is
aged from when its lane sends it, not while it waits for its job's turn."""
VIDEO_SENDER = "#video"
"""Appended to the worker's sender name for its video lane's sender cache."""


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
        self._closing = ExitStack()  # what `close` closes, last opened first
        self._closing.callback(self._ctx.term)
        self._closing.callback(self._security.close)
        with ExitStack() as undo:  # a failed bind or connect closes what was opened
            undo.callback(self._closing.close)
            self._jobs = make_socket(self._ctx, zmq.PULL, config.mm_worker_endpoint, bind=True,
                                     security=self._security)
            self._closing.callback(self._jobs.close)
            self.image_lane = self._image_lane(model_dir)
            self.video_lane = self._video_lane(model_dir)
            undo.pop_all()
        self.cache = self.image_lane.cache  # the image lane's: its epoch is the role's
        self.renderer = self.image_lane.renderer
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
        # serve's: from its signal on, new jobs are refused
        self._stop = Stop(config.ops.drain_timeout_s)
        self._input_done = threading.Event()
        self._input: threading.Thread | None = None
        self.metrics.epoch = lambda: self.cache.epoch
        self.metrics.gauge("jobs_queued", self.image_lane.queued)
        if self.video_lane is not None:
            self.metrics.gauge("video_jobs_queued", self.video_lane.queued)
        self.metrics.in_flight = lambda: sum(lane.in_flight() for lane in self._lanes)
        log.info(
            "model %s (%s), engine at %s, file:// %s, feature cache %s, videos %s",
            self.preprocessor.model_id, self.preprocessor.family.name, config.engine_endpoint,
            f"under {self.media.allowed_media_dir}" if self.media.allowed_media_dir else "disabled",
            f"{config.mm_cache_gb} GiB ({config.mm_hash}, sender {self.cache.sender})"
            if config.mm_cache_gb > 0 else "off",
            "in a lane of their own" if self.video_lane is not None else "not taken (family)",
        )

    @property
    def _lanes(self) -> list[Lane]:
        return [self.image_lane] + ([self.video_lane] if self.video_lane is not None else [])

    def _image_lane(self, model_dir: Path) -> Lane:
        """The image lane: with `mm_processes` > 1 its images go to the process pool, whose
        processes hold the shared-memory slots (the worker hands their views on); else the
        lane's thread processes them, into slots of the worker's own."""
        config = self.config
        cache = self._sender_cache("")
        transport = shm_transport(config)
        tag = self._reaped_tag(cache.sender)
        capacity = int(config.shm_transport_mb * 2**20) if transport else POOL_SLOTS_BYTES
        to_engine: shm.ShmSender | None = None  # what the engine codec sends slots through
        pool = None
        if config.mm_processes > 1:
            views = shm.ShmViews(SHM_MIN_BYTES if transport else None)
            self.metrics.add_counters(views.counters)
            to_engine = views if transport else None
            pool = ProcessPool(model_dir, self.preprocessor.image_backend,
                               self.media, config.mm_processes,
                               PoolSlots(tag, capacity // config.mm_processes, SHM_MAX_AGE_S,
                                         views), video_processes=config.video_processes)
            self._closing.callback(pool.close)
        elif transport:
            to_engine = self._shm_writer(tag, capacity)
        # What the hash stands for: the tensors, so every setting that changes them is in it.
        hasher = ImageHasher(config.mm_hash, self.preprocessor.model_id,
                             {**self.preprocessor.image_processor.to_dict(),
                              "mmlane_jpeg_draft": config.jpeg_draft})
        renderer = JobRenderer(self.preprocessor, self.media, cache, hasher, self.metrics, pool)
        self.metrics.add_counters(cache.counters)
        return self._lane("image", renderer, to_engine,
                          ahead=2 * config.mm_processes if pool else 1)

    def _video_lane(self, model_dir: Path) -> Lane | None:
        """The video lane, where the model takes video (None: not; a job with a video is then
        refused, naming the family): its own sender cache and socket. With a pool, it shares
        the image lane's (its processes' slots go on to the engine as the image lane's do),
        else its threads decode and it writes into slots of its own."""
        video = videos_of(model_dir, self.preprocessor)
        if video is None:
            return None
        config = self.config
        cache = self._sender_cache(VIDEO_SENDER)
        pool = self.image_lane.renderer.pool
        to_engine: shm.ShmSender | None = None
        if pool is not None:
            to_engine = pool.views if shm_transport(config) else None
        elif shm_transport(config):
            to_engine = self._shm_writer(self._reaped_tag(cache.sender),
                                         int(config.shm_transport_mb * 2**20))
        hasher = ImageHasher(config.mm_hash, self.preprocessor.model_id,
                             {type(video).__name__: video.hashed_settings()})
        threads = None
        if pool is None:  # videos on threads of the lane's own, niced as the worker is
            threads = concurrent.futures.ThreadPoolExecutor(config.video_processes,
                                                            thread_name_prefix="video")
            self._closing.callback(threads.shutdown, cancel_futures=True)
        renderer = JobRenderer(self.preprocessor, self.media, cache,
                               self.image_lane.renderer.hasher, self.metrics, pool,
                               video=VideoRendering(video, hasher, threads))
        self.metrics.add_counters(cache.counters, prefix="video_")
        return self._lane("video", renderer, to_engine, ahead=2 * config.video_processes)

    def _lane(self, name: str, renderer: JobRenderer, to_engine: shm.ShmSender | None, *,
              ahead: int) -> Lane:
        engine = make_socket(self._ctx, zmq.PUSH, self.config.engine_endpoint, bind=False,
                             hwm=ENGINE_SEND_HWM, security=self._security, peer="engine")
        lane = Lane(name, renderer, engine, Codec(EngineInput, shm_writer=to_engine),
                    ahead=ahead, queue_limit=self.config.fetch_ahead_jobs, metrics=self.metrics,
                    security=self._security, ctx=self._ctx,
                    engine_endpoint=self.config.engine_endpoint)
        self._closing.callback(lane.close)
        return lane

    def _sender_cache(self, suffix: str) -> SenderCache:
        """A lane's P0. The engine keeps one receiver cache per sender: named by host and bound
        address (resolved, so two workers bound to 'tcp://host:*' get different names)."""
        bound = self._jobs.getsockopt_string(zmq.LAST_ENDPOINT)
        return SenderCache(f"{socket.gethostname()}/{bound}{suffix}",
                           capacity_bytes(self.config.mm_cache_gb))

    def _reaped_tag(self, sender: str) -> str:
        """The shared-memory tag of a sender, its predecessor's slots unlinked."""
        tag = shm.sender_tag(sender)
        reaped = shm.reap(tag)
        if reaped:
            log.info("unlinked %d shared-memory slot(s) a previous MM worker left", reaped)
        return tag

    def _shm_writer(self, tag: str, capacity: int) -> shm.ShmWriter:
        writer = shm.ShmWriter(tag, threshold=SHM_MIN_BYTES, capacity=capacity,
                               max_age_s=SHM_MAX_AGE_S)
        self._closing.callback(writer.close)
        self.metrics.add_counters(writer.counters)
        return writer

    def serve(self, stop: Stop) -> None:
        """Run the lanes until `stop` is set, then drain."""
        threading.current_thread().name = "mm-worker-fifo"
        self._stop = stop
        self._input = threading.Thread(target=self._input_loop, name="mm-worker-input",
                                       daemon=True)
        self._input.start()
        video = None
        if self.video_lane is not None:
            video = threading.Thread(target=self._serve_video_lane, args=(self.video_lane, stop),
                                     name="mm-worker-video", daemon=True)
            video.start()
        self._serve_lane(self.image_lane, stop)
        if video is not None:
            video.join()
        self._stop_input()  # the last arrivals get their refusal too
        for lane in self._lanes:
            lane.fail_held(unfinished_at_drain_timeout("MM worker", stop))

    def _serve_video_lane(self, lane: Lane, stop: Stop) -> None:
        """The mm-worker-video thread. A failure that escapes the lane (a socket's) stops the
        whole worker, which drains and exits, as one in the image lane's thread does: never a
        lane gone quiet while its jobs wait."""
        try:
            self._serve_lane(lane, stop)
        except BaseException:
            log.exception("the video lane failed; the MM worker stops")
            stop.set()
            raise

    @staticmethod
    def _serve_lane(lane: Lane, stop: Stop) -> None:
        """Turn `lane` until `stop` is set, then drain it (jobs arriving from then on are
        refused at once: `_take_message`)."""
        while not stop.is_set():
            lane.turn(stop)
        drain(stop, log, held=lane.jobs_held, turn=lambda: lane.turn(stop))

    def close(self) -> None:
        """Close every socket (flushing within their linger), the pool and the context."""
        self._stop_input()
        log_totals(self.metrics)
        self.fetcher.close()
        self._closing.close()

    # ------------------------------------------------------------ the input thread

    def _input_loop(self) -> None:
        """The mm-worker-input thread: reads the job socket, which it alone uses, while the
        image lane's queue has room (always, once draining: new jobs are refused, not queued);
        ends at `_stop_input`, after reading what has arrived by then."""
        replies = FrontendReplies(self._ctx, self._security)
        try:
            while not self._input_done.is_set():
                if self.image_lane.wait_for_room(self._stop.is_set()) and \
                        self._jobs.poll(POLL_MS):
                    self._take_message(replies)
            while self._jobs.poll(0):
                self._take_message(replies)
        finally:
            replies.close()

    def _stop_input(self) -> None:
        self._input_done.set()
        if self._input is not None:
            self._input.join()

    def _take_message(self, replies: FrontendReplies) -> None:
        """Read one message off the job socket: queue it, apply it (a cancel), answer it (a
        hello), refuse it (a job while draining, or a video job while its lane is full) or drop
        it (invalid)."""
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
            for lane in self._lanes:
                lane.enqueue(message)
            return
        if isinstance(message, Hello):
            replies.send(message.reply_to, HelloReply(peer=message.peer, started=self._started_ns))
            return
        counters["requests"] += 1
        lane = self._lane_of(message)
        if self._stop.is_set():
            counters["refused_draining"] += 1
            lane.fail(message, refused_while_draining("MM worker"), replies)
            return
        if lane.full():  # only the video lane's queue can be: the image lane's is waited for
            counters["refused_overloaded"] += 1
            lane.fail(message, RetryableError(
                f"MM worker overloaded: {lane.queued()} jobs queued in its {lane.name} lane "
                f"(fetch_ahead_jobs={self.config.fetch_ahead_jobs})", code="overloaded"),
                replies)
            return
        lane.enqueue(self._start_fetches(message, received_at, lane))

    def _lane_of(self, job: MMJob) -> Lane:
        """A job with a video goes to the video lane, images and all (without one, to the image
        lane, which refuses it by the family's name)."""
        return self.video_lane if job.videos and self.video_lane is not None else self.image_lane

    def _start_fetches(self, job: MMJob, received_at: float, lane: Lane) -> PendingJob:
        fetches: dict[int, concurrent.futures.Future[bytes]] = {}
        limits = [self.media.image.max_bytes] * len(job.images) + \
            [self.media.video.max_bytes] * len(job.videos)
        for index, (source, limit) in enumerate(zip([*job.images, *job.videos], limits,
                                                    strict=True)):
            scheme = source.url.partition(":")[0].lower()
            if is_fetched(source.url) and scheme in self.media.allowed_schemes:
                fetches[index] = fetch = self.fetcher.submit(source.url, limit)
                fetch.add_done_callback(self._fetch_done(lane))
                self.metrics.counters["fetches"] += 1
        return PendingJob(job, fetches, received_at)

    def _fetch_done(self, lane: Lane) -> Callable[[concurrent.futures.Future[bytes]], None]:
        """A done-callback (on the fetcher's thread) that records how long a fetch took and
        wakes the lane, whose head may now be ready."""
        started = time.monotonic()

        def done(_: concurrent.futures.Future[bytes]) -> None:
            self.metrics.observe("fetch", time.monotonic() - started)
            lane.wake()

        return done

    def _cancel(self, request_ids: list[str]) -> None:
        """Take the named jobs out of the queues, unprocessed and unanswered (see the module
        docstring); ids not queued are ignored."""
        cancelled = set(request_ids)
        for lane in self._lanes:
            for item in lane.cancel(cancelled):
                for fetch in item.fetches.values():
                    fetch.cancel()
                self.metrics.counters["cancelled"] += 1
                log.info("request %s cancelled by its frontend: skipped", item.job.request_id)


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
