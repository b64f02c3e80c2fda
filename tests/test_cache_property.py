"""The mirrored feature cache under random histories (hypothesis, stateful).

Hypothesis drives the real sender side (`JobRenderer.render`, then `SenderCache.commit` after
the "send") and the real receiver side (`ReceiverCaches.receive`), with every message passing
through the real codec, over modelled channels whose deliveries it interleaves at will:

    frontend ──jobs──▶ worker w (FIFO) ──frames──▶ engine (FIFO per worker incarnation)
        ▲                                             │
        └──────────── replies (epoch stamped) ◀───────┘

The frontend here is a model of `services/frontend`'s rules: follow the newest engine epoch
(on every job, and a notice to every worker when it changes), resend a job once to the same
worker after a cache miss, time requests out. The one fake is the image processor: an image's
"tensors" are `nbytes` bytes all equal to the image's number, so a wrong item is seen at once.

Histories mix repeated and new images of random sizes, capacities that force eviction, items
larger than the whole cache, bad images (failed before the send), requests refused or aborted
after receipt, timeouts, cache resets and restarts of the engine or of either worker (which
lose what was in flight there). After every step: for each worker in sync with the engine, the
receiver cache, once the worker's messages still in flight have arrived, holds the same keys in
the same LRU order with the same sizes as the sender cache; and no drift is ever detected. At
the end every request has exactly one answer (only ones lost in a restart wait for their
timeout), items are always the right ones, and a repeated image hits again.
"""

from __future__ import annotations

import base64
import copy
import itertools
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from msgspec.structs import replace

from mmlane.engine.cache import ReceiverCaches
from mmlane.mm_worker.cache import ImageHasher, SenderCache
from mmlane.mm_worker.jobs import JobRenderer
from mmlane.mm_worker.media import MediaPolicy
from mmlane.model import ImageItem, Preprocessor
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import CacheMissError, ErrorInfo, RequestError
from mmlane.protocol.messages import (
    EngineCacheReset,
    EngineEpoch,
    EngineInput,
    EngineOutput,
    EngineRequest,
    ImageUrl,
    MMJob,
    RequestFailed,
    SamplingParams,
)

WORKERS = ("w0", "w1")
IMAGES = 6
ACTIONS = ["submit", "run_worker", "run_engine", "deliver_reply"] * 8 + ["time_out", "disrupt"]


@cache
def preprocessor() -> Preprocessor:
    from mmlane.model import load_preprocessor, resolve_model_dir

    return load_preprocessor(resolve_model_dir(None))


@dataclass(frozen=True)
class Image:
    number: int
    nbytes: int
    num_tokens: int
    bad: bool

    @property
    def url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.data).decode()

    @property
    def data(self) -> bytes:
        return f"image-{self.number}".encode()


class FakeProcessing(JobRenderer):
    """The real renderer with the image processor replaced: bytes -> known tensors."""

    images: dict[bytes, Image]
    processed = 0

    def process_image(self, index: int, data: bytes) -> ImageItem:
        image = self.images[data]
        if image.bad:
            raise RequestError(f"image {index}: cannot decode", code="invalid_image")
        self.processed += 1
        pixels = np.full(image.nbytes, image.number, dtype=np.uint8)
        return ImageItem(tensors={"pixel_values": pixels}, num_tokens=image.num_tokens)


@dataclass
class Worker:
    """One MM worker incarnation: its sender cache, renderer, job queue and channel."""

    cache: SenderCache
    renderer: FakeProcessing
    jobs: deque = field(default_factory=deque)
    channel: deque = field(default_factory=deque)  # frames on their way to the engine


@dataclass
class Pending:
    images: list[int]
    job: MMJob
    worker: int
    resent: bool = False
    disruptions_at_resend: int = -1


class CacheHistories(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.codec: Codec[Any] = Codec(EngineInput)
        self.ids = itertools.count()
        self.engine_epoch = 0  # the frontend's: the newest seen
        self.pending: dict[str, Pending] = {}
        self.answers: dict[str, list[str]] = {}
        self.lost: set[str] = set()  # requests whose message died in a restart
        self.replies: deque = deque()
        self.channels: list[deque] = []  # every incarnation's, old ones draining
        self.disruptions = 0  # restarts and resets so far
        self.next_worker = itertools.cycle(range(len(WORKERS)))

    # ------------------------------------------------------------ setup

    @initialize(
        capacity=st.integers(100, 600),
        # Mostly items a few of which fit at once; now and then one larger than the cache.
        sizes=st.lists(st.sampled_from([0, 0, 0, 1]).flatmap(
            lambda large: st.integers(150, 800) if large else st.integers(1, 100)),
            min_size=IMAGES, max_size=IMAGES),
        tokens=st.lists(st.integers(1, 3), min_size=IMAGES, max_size=IMAGES),
        bad=st.sets(st.integers(0, IMAGES - 1), max_size=1),
        warm=st.booleans(),
    )
    def setup(
        self, capacity: int, sizes: list[int], tokens: list[int], bad: set[int], warm: bool
    ) -> None:
        self.capacity = capacity
        self.images = [
            Image(n, size, count, n in bad)
            for n, (size, count) in enumerate(zip(sizes, tokens, strict=True))
        ]
        self.engine = ReceiverCaches(capacity)
        self.workers = [self._new_worker(w) for w in range(len(WORKERS))]
        if warm:  # the frontend already had a reply from this engine (e.g. a text request)
            self._see_engine_epoch(self.engine.epoch)

    def _new_worker(self, w: int) -> Worker:
        pre = preprocessor()
        policy = MediaPolicy(allowed_media_dir=None, max_image_bytes=1 << 20,
                             max_image_pixels=1 << 20)
        cache = SenderCache(WORKERS[w], self.capacity)
        renderer = FakeProcessing(pre, policy, cache, ImageHasher("blake3", pre.model_id, {}))
        renderer.images = {image.data: image for image in self.images}
        worker = Worker(cache, renderer)
        self.channels.append(worker.channel)
        return worker

    # ------------------------------------------------------------ one step of history

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data: st.DataObject) -> None:
        """One event, drawn with the weights of ACTIONS (disruptions are the rare ones)."""
        if action == "submit":
            self.submit(data.draw(st.lists(st.integers(0, IMAGES - 1), max_size=3)))
        elif action == "run_worker":
            self.run_worker(data.draw(st.integers(0, len(WORKERS) - 1)))
        elif action == "run_engine" and any(self.channels):
            busy = [channel for channel in reversed(self.channels) if channel]  # newest first
            outcome = data.draw(st.sampled_from(["output", "refused", "aborted"]))
            self._receive(data.draw(st.sampled_from(busy)), outcome)
        elif action == "deliver_reply" and self.replies:
            self.deliver_reply()
        elif action == "time_out" and self.pending:
            self._answer(data.draw(st.sampled_from(sorted(self.pending))), "timeout")
        elif action == "disrupt":
            disruption = data.draw(
                st.sampled_from(["worker", "restart_engine", "reset_cache", "worker"])
            )
            if disruption == "worker":  # the one with most in flight: the harder case
                self.restart_worker(max(range(len(WORKERS)),
                                        key=lambda w: len(self.workers[w].channel)))
            else:
                getattr(self, disruption)()

    # ------------------------------------------------------------ the frontend

    def submit(self, images: list[int]) -> None:
        request_id = f"r{next(self.ids)}"
        pre = preprocessor()
        prompt = [1] + [pre.image_token_id, 2] * len(images)
        job = MMJob(
            request_id=request_id, reply_to="ipc://frontend", prompt_token_ids=prompt,
            images=[ImageUrl(url=self.images[n].url) for n in images],
            sampling=SamplingParams(max_tokens=1), engine_epoch=self.engine_epoch,
        )
        worker = next(self.next_worker)
        self.pending[request_id] = Pending(images, job, worker)
        self.answers[request_id] = []
        self.workers[worker].jobs.append(job)

    def deliver_reply(self) -> None:
        reply = self.replies.popleft()
        self._see_engine_epoch(reply.engine_epoch)
        pending = self.pending.get(reply.request_id)
        if pending is None:  # answered already (timed out)
            return
        if isinstance(reply, RequestFailed) and reply.error.code == "cache_miss":
            if not pending.resent:  # the frontend's rule: resend once, to the same worker
                pending.resent, pending.disruptions_at_resend = True, self.disruptions
                pending.job = replace(pending.job, engine_epoch=self.engine_epoch,
                                      mm_cache_invalidate=reply.error.mm_hashes)
                self.workers[pending.worker].jobs.append(pending.job)
                return
            # A second miss needs a new disruption after the resend.
            assert self.disruptions > pending.disruptions_at_resend, reply
        self._answer(reply.request_id, "ok" if isinstance(reply, EngineOutput)
                     else reply.error.code)

    def _see_engine_epoch(self, epoch: int) -> None:
        if epoch > self.engine_epoch:
            self.engine_epoch = epoch
            for worker in self.workers:
                worker.jobs.append(EngineEpoch(engine_epoch=epoch))

    def _answer(self, request_id: str, outcome: str) -> None:
        del self.pending[request_id]
        self.answers[request_id].append(outcome)

    # ------------------------------------------------------------ the MM workers

    def run_worker(self, w: int) -> None:
        worker = self.workers[w]
        if not worker.jobs:
            return
        message = worker.jobs.popleft()
        if isinstance(message, EngineEpoch):
            worker.cache.see_engine_epoch(message.engine_epoch)
            return
        before = worker.cache.cache.entries()
        try:
            request = worker.renderer.render(message)
        except RequestError as exc:  # fails before the send: the sender cache is unchanged
            assert worker.cache.cache.entries() == before
            self.replies.append(RequestFailed(request_id=message.request_id,
                                              error=exc.to_info()))
            return
        worker.channel.append(self.codec.encode(request))  # sent ...
        worker.cache.commit(request)  # ... then committed, in send order

    def restart_worker(self, w: int) -> None:
        old = self.workers[w]
        self.lost.update(job.request_id for job in old.jobs if isinstance(job, MMJob))
        self.workers[w] = self._new_worker(w)  # its sent frames still drain from `old.channel`
        self.disruptions += 1

    # ------------------------------------------------------------ the engine

    def _receive(self, channel: deque, outcome: str) -> None:
        request: EngineRequest = self.codec.decode(channel.popleft())
        try:
            resolved = self.engine.receive(request)
        except CacheMissError as exc:
            self._engine_reply(RequestFailed(request_id=request.request_id,
                                             error=exc.to_info()))
            return
        self._check_items(resolved)
        # What happens after receipt (validation, overload, an abort) cannot touch the caches.
        if outcome == "output":
            self._engine_reply(EngineOutput(request_id=request.request_id, token_ids=[1],
                                            finished=True))
        else:
            code = "invalid_request" if outcome == "refused" else "aborted"
            info = ErrorInfo(kind="request", code=code, message=outcome)
            self._engine_reply(RequestFailed(request_id=request.request_id, error=info))

    def _engine_reply(self, reply: EngineOutput | RequestFailed) -> None:
        self.replies.append(replace(reply, engine_epoch=self.engine.epoch))  # the send loop

    def _check_items(self, request: EngineRequest) -> None:
        pending = self.pending.get(request.request_id)
        if pending is None:
            return
        for item, number in zip(request.mm_items, pending.images, strict=True):
            image = self.images[number]
            pixels = item.tensors["pixel_values"]
            assert pixels.nbytes == image.nbytes and (pixels == number).all(), (item, image)

    def restart_engine(self) -> None:
        for channel in self.channels:
            self.lost.update(self.codec.decode(frames).request_id for frames in channel)
            channel.clear()
        self.engine = ReceiverCaches(self.capacity)
        self.disruptions += 1

    def reset_cache(self) -> None:
        epoch = self.engine.reset()  # the engine's input thread, between two arrivals
        self.replies.append(EngineCacheReset(request_id="reset", engine_epoch=epoch))
        self.disruptions += 1

    # ------------------------------------------------------------ invariants

    @invariant()
    def caches_mirror(self) -> None:
        if not hasattr(self, "engine"):
            return
        assert self.engine.counters["cache_desyncs"] == 0
        for worker in self.workers:
            sender = worker.cache
            if sender.engine_epoch == 0:
                assert len(sender.cache) == 0
            if sender.engine_epoch != self.engine.epoch or sender.seq == 0:
                continue  # not in sync with this engine (yet), or nothing committed since
            receiver = copy.deepcopy(self.engine)
            for frames in worker.channel:  # what is still on its way arrives first
                try:
                    receiver.receive(self.codec.decode(frames))
                except CacheMissError:
                    pass
            assert receiver.sender_epoch(sender.sender) == sender.epoch
            assert receiver.entries(sender.sender) == sender.cache.entries()
            assert sender.cache.nbytes <= self.capacity

    def teardown(self) -> None:
        if not hasattr(self, "workers"):
            return
        self._drain()
        for request_id in list(self.pending):  # only ones lost in a restart may still wait
            assert request_id in self.lost, f"{request_id} was never answered"
            self._answer(request_id, "timeout")
        for request_id, outcomes in self.answers.items():
            assert len(outcomes) == 1, (request_id, outcomes)
        self._repeat_hits()

    def _drain(self) -> None:
        for _ in range(10_000):
            if self.replies:
                self.deliver_reply()
            elif any(worker.jobs for worker in self.workers):
                for w in range(len(WORKERS)):
                    self.run_worker(w)
            elif any(self.channels):
                self._receive(next(channel for channel in self.channels if channel), "output")
            else:
                return
        raise AssertionError("the system did not settle")

    def _repeat_hits(self) -> None:
        """Once everything settled, an image each worker has sent is a hit the next time."""
        fitting = [im.number for im in self.images if not im.bad and im.nbytes <= self.capacity]
        if not fitting:
            return
        for _ in range(2):  # a worker that had not heard of the engine's epoch has now
            for _ in WORKERS:
                self.submit([fitting[0]])
            self._drain()
        hits = self.engine.counters["cache_hits"]
        processed = [worker.renderer.processed for worker in self.workers]
        for _ in WORKERS:
            self.submit([fitting[0]])
        self._drain()
        assert self.engine.counters["cache_hits"] == hits + len(WORKERS)
        assert [worker.renderer.processed for worker in self.workers] == processed


CacheHistories.TestCase.settings = settings(
    max_examples=300, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_histories = pytest.mark.timeout(120)(CacheHistories.TestCase)
