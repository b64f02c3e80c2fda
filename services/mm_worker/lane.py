"""A lane of the MM worker: one FIFO of jobs, sent to the engine as a sender of its own.

    Lane.turn()   1. take the head of the queue once its own fetches are done; load, hash,
                     start decoding and processing the items the engine lacks (`JobRenderer`)
                  2. the oldest started job, once its items are done: look up the lane's
                     sender cache, send one EngineRequest to the engine (the lane's own PUSH)
                  3. commit it to the sender cache; a failed job's RequestFailed goes to its
                     `reply_to` instead

One thread turns a lane and starts and finishes every job of it, finishing them in the order it
started them, so its jobs leave in the order they arrived: the order its sender cache relies
on, since each request is committed to it right after its send, and looked up (step 2) only
after every request before it was committed. Each lane has its own sender cache (P0: its own
sender name, epoch and seq) and its own socket to the engine, an ordered channel of its own,
so the engine's receiver cache for that sender (P1) mirrors it exactly; nothing orders one lane
against another. The worker has two (services/mm_worker/worker.py): images, and videos.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from mmlane.common.lifecycle import Stop, unfinished_at_drain_timeout
from mmlane.common.sockets import ReplySockets, Security
from mmlane.common.stats import Metrics
from mmlane.mm_worker.jobs import JobRenderer, StartedJob
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import MMLaneError, RetryableError
from mmlane.protocol.messages import (
    EngineEpoch,
    EngineRequest,
    FrontendInput,
    HelloReply,
    MMJob,
    RequestFailed,
)

log = logging.getLogger(__name__)

POLL_MS = 100
"""How long a wait lasts before the loop looks at the stop flag again."""
SLOW_ENGINE_WARNING_S = 5.0


@dataclass
class PendingJob:
    """A received job and the fetches of its http(s) images and videos, by item index."""

    job: MMJob
    fetches: dict[int, concurrent.futures.Future[bytes]]
    received_at: float
    """When the job was taken off the socket (`time.monotonic()`)."""

    def ready(self) -> bool:
        return all(fetch.done() for fetch in self.fetches.values())


class Lane:
    """A FIFO of jobs and engine-epoch notices, rendered by `renderer` (which holds the lane's
    sender cache) and sent on `engine`; up to `ahead` jobs started before the oldest is
    finished. `queue_limit` bounds the jobs received ahead."""

    def __init__(self, name: str, renderer: JobRenderer, engine: zmq.Socket, codec: Codec[Any],
                 *, ahead: int, queue_limit: int, metrics: Metrics, security: Security,
                 ctx: zmq.Context, engine_endpoint: str) -> None:
        self.name = name
        self.renderer = renderer
        self.cache = renderer.cache
        self.metrics = metrics
        self._engine = engine
        self._engine_codec = codec
        self._engine_endpoint = engine_endpoint
        self._failures = FrontendReplies(ctx, security)  # the lane thread's
        self._ahead = ahead
        self._queue_limit = queue_limit
        self._queue: collections.deque[PendingJob | EngineEpoch] = collections.deque()
        self._changed = threading.Condition()
        """Guards `_queue`; notified when an item comes or goes and when a fetch finishes."""
        self._started: collections.deque[StartedJob | EngineEpoch] = collections.deque()
        """Jobs started and not yet finished, and the notices between them, in arrival order
        (the lane thread's alone; guarded by `_changed` for the counts other threads read)."""
        self._turning = 0  # 1 while the lane starts or finishes a job off both queues
        self._stop = Stop(0.0)

    # ------------------------------------------------------------ other threads' side

    def enqueue(self, item: PendingJob | EngineEpoch) -> None:
        with self._changed:
            self._queue.append(item)
            self._changed.notify_all()

    def full(self) -> bool:
        """Whether the queue holds `queue_limit` items."""
        return len(self._queue) >= self._queue_limit

    def wait_for_room(self, stopping: bool) -> bool:
        """Whether the queue has room for one more (always, once `stopping`: new jobs are then
        refused, not queued); waits up to POLL_MS for it."""
        with self._changed:
            return self._changed.wait_for(lambda: stopping or not self.full(), POLL_MS / 1e3)

    def cancel(self, request_ids: set[str]) -> list[PendingJob]:
        """Take the named jobs out of the queue; those found."""
        with self._changed:
            found = [item for item in self._queue
                     if isinstance(item, PendingJob) and item.job.request_id in request_ids]
            for item in found:
                self._queue.remove(item)
            self._changed.notify_all()  # the head may have changed
        return found

    def wake(self, _: object = None) -> None:
        """A done-callback: an item or a fetch finished, so a job may be ready."""
        with self._changed:
            self._changed.notify_all()

    def queued(self) -> int:
        """Jobs and notices queued, not yet started."""
        return len(self._queue)

    def in_flight(self) -> int:
        return len(self._queue) + len(self._started) + self._turning

    def jobs_held(self) -> int:
        with self._changed:
            return sum(isinstance(item, PendingJob | StartedJob)
                       for item in (*self._queue, *self._started))

    # ------------------------------------------------------------ the lane thread's side

    def turn(self, stop: Stop) -> None:
        """Finish the oldest started job if it is ready, start the next one if there is room;
        wait up to POLL_MS when neither can be done."""
        self._stop = stop
        with self._changed:
            if not self._changed.wait_for(self._can_turn, POLL_MS / 1e3):
                return
            oldest = self._started.popleft() if self._oldest_ready() else None
            head = self._pop_head() if oldest is None and self._room() else None
            self._changed.notify_all()  # room for the input thread
        self._turning = 1
        try:
            if oldest is not None:
                self._finish(oldest)
            elif head is not None:
                self._start(head)
        finally:
            self._turning = 0

    def fail_held(self, error: MMLaneError) -> None:
        """At the end: every job still started or queued gets `error`."""
        with self._changed:
            left = [*self._started, *self._queue]
            self._started, self._queue = collections.deque(), collections.deque()
        for item in left:
            if isinstance(item, StartedJob):
                item.drop()
                self.fail(item.job, error)
            elif isinstance(item, PendingJob):
                for fetch in item.fetches.values():
                    fetch.cancel()
                self.fail(item.job, error)

    def close(self) -> None:
        self._failures.close()
        self._engine.close()

    def fail(self, job: MMJob, exc: Exception, replies: FrontendReplies | None = None) -> None:
        """Send the job's terminal error to its frontend (through `replies`, the calling
        thread's; the lane's by default); the lane serves on."""
        if isinstance(exc, MMLaneError):
            error = exc
            log.info("request %s failed (%s): %s", job.request_id, error.code, error.message)
        else:
            log.exception("request %s: internal error", job.request_id, exc_info=exc)
            error = MMLaneError(f"internal error in the MM worker: {type(exc).__name__}: {exc}")
        self.metrics.errors[error.code] += 1
        reply = RequestFailed(request_id=job.request_id, error=error.to_info())
        (replies or self._failures).send(job.reply_to, reply)

    def _start(self, item: PendingJob | EngineEpoch) -> None:
        """Step 1 for one job: its failure is its alone."""
        if isinstance(item, EngineEpoch):
            self._add_started(item)
            return
        job = item.job
        self.metrics.observe("queue_wait", time.monotonic() - item.received_at)
        if job.deadline and job.deadline <= time.time():  # nobody waits for it any more
            self.metrics.counters["expired"] += 1
            self.fail(job, RetryableError(
                f"request {job.request_id} passed its deadline before the MM worker reached it",
                code="timeout",
            ))
            return
        try:
            started = self.renderer.start(job, item.fetches)
        except Exception as exc:
            self.fail(job, exc)
            return
        started.received_at = item.received_at
        for work in started.work.values():
            work.add_done_callback(self.wake)
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
            self.fail(job, exc)
            return
        if self._send(job, request):  # 2. send one EngineRequest to the engine
            self.cache.commit(request)  # 3. commit it to the sender cache, in send order
            self.metrics.observe("mm_job", time.monotonic() - item.received_at)

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
        with self._changed:
            self._started.append(item)
            self._turning = 0  # counted in `_started` from now on

    def _send(self, job: MMJob, request: EngineRequest) -> bool:
        """Hand the request to the engine, waiting while the engine is behind (until the drain
        timeout, once stopping); False when it was not sent (the job got an error instead)."""
        frames = self._engine_codec.encode(request)
        waiting_since = time.monotonic()
        warned = False
        while not self._engine.poll(POLL_MS, zmq.POLLOUT):
            if self._stop.drain_expired():
                self.fail(job, unfinished_at_drain_timeout("MM worker", self._stop))
                return False
            if not warned and time.monotonic() - waiting_since > SLOW_ENGINE_WARNING_S:
                log.warning("engine %s is not reading; the %s lane waits", self._engine_endpoint,
                            self.name)
                warned = True
        self._engine.send_multipart(frames, copy=False)
        self.metrics.counters["sent"] += 1
        self.metrics.counters["bytes_out"] += sum(len(frame) for frame in frames)
        return True


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
