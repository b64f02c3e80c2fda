"""The MM worker with a pool of image processes: order and the mirrored cache kept exactly.

    PipelineHistories  hypothesis drives the real worker's start/finish pipeline (`MMWorker`
                       with real sockets, its pool's processes played by the test: each image's
                       work completes, fails or dies when and in what order the test says),
                       with cancels, bad images, engine-epoch notices and evictions. After every
                       step: the requests reached the engine in arrival order, each hash-only
                       item is held by the engine's mirror (P1), and P0 equals P1
    TestRealPool       `mmlane mm-worker --mm-processes 2`: requests equal the in-process
                       processor's and leave in arrival order; a pool process killed while it
                       holds an image fails that job alone (retryable) and is replaced
    pool_in_process    a ProcessPool in the test's process (its processes real, or stand-ins):
                       a slot the worker refuses, a video's handover that holds no image back,
                       a result's slot kept while it waits for its job's turn
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_mm_worker import shm_slots

from bench.images import data_uri, encode, noise_image
from conftest import pool_pids, role_log, start_role, stop_role
from mmlane.common.feature_cache import FeatureCache, commit
from mmlane.common.lifecycle import Stop
from mmlane.mm_worker import pool
from mmlane.mm_worker import worker as worker_module
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.mm_worker.lane import PendingJob
from mmlane.mm_worker.media import MediaPolicy, decode_image
from mmlane.mm_worker.pool import Processed
from mmlane.mm_worker.video import Qwen2VLSampling
from mmlane.mm_worker.worker import MMWorker
from mmlane.model import ImageItem, Preprocessor, load_preprocessor
from mmlane.protocol import shm
from mmlane.protocol.errors import MMLaneError, RequestError, RetryableError
from mmlane.protocol.messages import (
    EngineEpoch,
    EngineRequest,
    FrontendInput,
    ImageUrl,
    MMJob,
    RequestFailed,
    SamplingParams,
)
from peers import LIE, PIXELS, Inbox, StandInEngine, push, send, stand_in_pool_process, wait_until

IMAGES = 3
ACTIONS = ["arrive"] * 4 + ["turn"] * 6 + ["work_ends"] * 5 + ["cancel", "engine_restarts"]


@cache
def preprocessor(model_dir: str) -> Preprocessor:
    return load_preprocessor(model_dir)


def image_url(number: int) -> str:
    return "data:image/png;base64," + base64.b64encode(f"image-{number}".encode()).decode()


def image_number(data: bytes) -> int:
    return int(data.decode().removeprefix("image-"))


Task = tuple[int, bytes, concurrent.futures.Future[Processed]]


class HeldPool:
    """The pool's side of the contract (`submit` -> a future), its work done when the test
    says: each task waits in `tasks` until completed, failed or 'killed'; but while `now` is
    set (the worker waits for an image it must process to finish a job), it is done at once."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self.now: Callable[[Task], None] | None = None

    def submit(self, index: int, data: bytes) -> concurrent.futures.Future[Processed]:
        future: concurrent.futures.Future[Processed] = concurrent.futures.Future()
        self.tasks.append((index, data, future))
        if self.now is not None:
            self.now(self.tasks[-1])
        return future

    def close(self) -> None:
        pass


STOP = Stop(60.0)
"""Never set: the lanes' turns here never drain."""


class PipelineHistories(RuleBasedStateMachine):
    """See the module docstring. `sizes[n]` bytes of value n stand for image n's tensors."""

    model_dir = ""
    run_dir = Path()

    @initialize(capacity=st.integers(100, 500), sizes=st.lists(st.integers(60, 250),
                min_size=IMAGES, max_size=IMAGES), bad=st.sets(st.integers(0, IMAGES - 1),
                max_size=1), ahead=st.integers(1, 4))
    def setup(self, capacity: int, sizes: list[int], bad: set[int], ahead: int) -> None:
        self.sizes, self.bad = sizes, bad
        self.ctx = zmq.Context.instance()
        tag = next(_examples)
        self.engine = Inbox.bound(self.ctx, f"ipc://{self.run_dir}/e{tag}.sock",
                                  worker_module.EngineInput)
        self.replies = Inbox.bound(self.ctx, f"ipc://{self.run_dir}/f{tag}.sock", FrontendInput)
        config = MMWorkerConfig(
            model=self.model_dir, mm_worker_endpoint=f"ipc://{self.run_dir}/w{tag}.sock",
            engine_endpoint=self.engine.endpoint, mm_cache_gb=capacity / (1 << 30),
            mm_processes=1, image_nice=0,  # built here: it would lower the test's own thread
        )
        self.worker = MMWorker(config)
        self.pool = HeldPool()
        self.worker.renderer.pool = self.pool  # type: ignore[assignment]
        finish = self.worker.renderer.finish

        def finish_now(started: Any) -> Any:  # an image guessed held, then evicted: done now
            self.pool.now = lambda task: self.work_ends(task, "done")
            try:
                return finish(started)
            finally:
                self.pool.now = None

        self.worker.renderer.finish = finish_now  # type: ignore[method-assign]
        self.lane = self.worker.image_lane
        self.lane._ahead = ahead
        self.p1: FeatureCache[int] = FeatureCache(self.worker.cache.cache.capacity)
        self.p1_epoch = 0
        self.ids = itertools.count()
        self.engine_epoch = time.time_ns()  # known: the worker's cache is in use from the start
        self.arrived: list[str] = []
        self.cancelled: set[str] = set()
        self.sent: list[str] = []
        self.failed: dict[str, str] = {}

    # ------------------------------------------------------------ events

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data: st.DataObject) -> None:
        """One event, drawn with the weights of ACTIONS (restarts are the rare ones)."""
        open_tasks = [task for task in self.pool.tasks if not task[2].done()]
        if action == "arrive":
            self.arrive(data.draw(st.lists(st.integers(0, IMAGES - 1), max_size=3)),
                        data.draw(st.integers(1, 3)))
        elif action == "turn" and self.lane._can_turn():
            self.lane.turn(STOP)
            self._take()
        elif action == "work_ends" and open_tasks:
            self.work_ends(data.draw(st.sampled_from(open_tasks)),
                           data.draw(st.sampled_from(["done"] * 5 + ["died"])))
        elif action == "cancel" and self.arrived:
            self.cancel(data.draw(st.sampled_from(self.arrived)))
        elif action == "engine_restarts":
            self.engine_epoch = time.time_ns()
            self.lane.enqueue(EngineEpoch(engine_epoch=self.engine_epoch))

    def arrive(self, images: list[int], prompt: int) -> None:
        pre = self.worker.preprocessor
        request_id = f"r{next(self.ids)}"
        job = MMJob(
            request_id=request_id, reply_to=self.replies.endpoint,
            prompt_token_ids=[5] * prompt + [pre.image_token_id] * len(images),
            images=[ImageUrl(url=image_url(n)) for n in images],
            sampling=SamplingParams(max_tokens=1), engine_epoch=self.engine_epoch,
        )
        self.arrived.append(request_id)
        self.lane.enqueue(self.worker._start_fetches(job, time.monotonic(), self.lane))

    def work_ends(self, task: tuple[int, bytes, Any], outcome: str) -> None:
        """One image's work ends, in any order: done (or the image's own error), or its
        process died."""
        index, payload, future = task
        number = image_number(payload)
        if outcome == "died":
            future.set_exception(RetryableError("its process died", code="peer_restarted"))
        elif number in self.bad:
            future.set_exception(RequestError(f"image {index}: cannot decode",
                                              code="invalid_image"))
        else:
            future.set_result(self.processed(number))

    def processed(self, number: int) -> Processed:
        pixels = np.full(self.sizes[number], number, dtype=np.uint8)
        item = ImageItem(tensors={"pixel_values": pixels}, num_tokens=1 + number % 3)
        return Processed(item, 0.0, 0.0)

    def cancel(self, request_id: str) -> None:
        queued = {item.job.request_id for item in self.lane._queue
                  if isinstance(item, PendingJob)}
        if request_id in queued:
            self.cancelled.add(request_id)
        self.worker._cancel([request_id])

    # ------------------------------------------------------------ what the engine sees

    def _take(self) -> None:
        """Read what the worker sent so far (its counts say how much is on its way)."""
        metrics = self.worker.metrics
        deadline = time.monotonic() + 10
        while (len(self.sent) < metrics.counters["sent"]
               or len(self.failed) < sum(metrics.errors.values())):
            assert time.monotonic() < deadline, "sent messages never arrived"
            self._read(timeout_ms=10)

    def _read(self, timeout_ms: int) -> None:
        while self.engine.sock.poll(timeout_ms):
            request, _ = self.engine.take_frames(1)
            assert isinstance(request, EngineRequest)
            self.sent.append(request.request_id)
            header = request.mm_cache
            held: dict[str, int] = {}
            if header is not None:
                if header.sender_epoch != self.p1_epoch:
                    self.p1.clear()
                    self.p1_epoch = header.sender_epoch
                held = commit(self.p1, request, lambda item: item.nbytes)
            with_tensors = set()
            for item in request.mm_items:
                if item.tensors:
                    number = int(item.tensors["pixel_values"][0])
                    assert item.nbytes == self.sizes[number]
                    with_tensors.add(item.mm_hash)
                else:  # the engine has it: in its cache, or earlier in this request
                    assert item.mm_hash in held or item.mm_hash in with_tensors, (
                        f"{request.request_id}: {item.mm_hash[:8]} sent by hash, not held")
        while self.replies.sock.poll(timeout_ms):
            reply = self.replies.take(1)
            assert isinstance(reply, RequestFailed)
            self.failed[reply.request_id] = reply.error.code

    @invariant()
    def in_arrival_order_and_mirrored(self) -> None:
        if not hasattr(self, "worker"):
            return
        self._take()
        order = [self.arrived.index(request_id) for request_id in self.sent]
        assert order == sorted(order), f"left out of order: {self.sent}"
        cache = self.worker.cache
        if cache.in_use and cache.epoch == self.p1_epoch:
            assert cache.cache.entries() == self.p1.entries()

    def teardown(self) -> None:
        if not hasattr(self, "worker"):
            return
        try:
            for _ in range(200):
                for task in self.pool.tasks:
                    if not task[2].done():
                        self.work_ends(task, "done")
                if not (self.lane._queue or self.lane._started):
                    break
                if self.lane._can_turn():
                    self.lane.turn(STOP)
            self._take()
            answered = self.sent + list(self.failed)
            assert len(answered) == len(set(answered)), "a job answered twice"
            assert set(answered) | self.cancelled == set(self.arrived), "a job never answered"
            assert not set(answered) & self.cancelled, "a cancelled job was answered"
        finally:
            self.worker.close()
            self.engine.close()
            self.replies.close()


_examples = itertools.count()


@pytest.fixture(scope="module")
def patched_loading(qwen_dir: Path) -> Iterator[None]:
    """Every MMWorker of the histories shares one loaded preprocessor (loading is slow)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_module, "load_preprocessor",
                      lambda model_dir, backend: preprocessor(str(model_dir)))
        yield


def test_pipeline_histories(patched_loading: None, qwen_dir: Path, tmp_path: Path) -> None:
    PipelineHistories.model_dir = str(qwen_dir)
    PipelineHistories.run_dir = tmp_path
    machine = settings(max_examples=100, stateful_step_count=40, deadline=None,
                       suppress_health_check=list(HealthCheck))(PipelineHistories)
    machine.TestCase().runTest()


def test_an_image_guessed_held_but_evicted_since_is_sent_with_its_tensors(
    patched_loading: None, qwen_dir: Path, tmp_path: Path
) -> None:
    """Job B starts while A still works and guesses that the engine holds its image; A's
    commit evicts it: B must send the image's tensors, not its hash (the one case where the
    guess is wrong in the harmful direction)."""
    PipelineHistories.model_dir = str(qwen_dir)
    PipelineHistories.run_dir = tmp_path
    history = PipelineHistories()
    history.setup(capacity=300, sizes=[200, 150, 50], bad=set(), ahead=2)

    def turn() -> None:
        assert history.lane._can_turn()
        history.lane.turn(STOP)
        history._take()

    def work_ends() -> None:
        for task in history.pool.tasks:
            if not task[2].done():
                history.work_ends(task, "done")

    try:
        history.arrive([1], 1)  # image 1 (150 bytes) reaches both caches
        turn(), work_ends(), turn()
        history.arrive([0], 1)  # A: image 0 (200 bytes) will evict image 1
        history.arrive([1], 1)  # B: image 1, held for now
        turn(), turn()
        assert [len(job.work) for job in history.lane._started] == [1, 0]
        work_ends(), turn()  # A leaves: image 1 evicted
        tasks = len(history.pool.tasks)
        turn()  # B: its image processed after all (the FIFO waits for it), then sent
        assert len(history.pool.tasks) == tasks + 1
        history.in_arrival_order_and_mirrored()
        assert history.sent == ["r0", "r1", "r2"]
    finally:
        history.teardown()


# ---------------------------------------------------------------- the real pool


class TestRealPool:
    @pytest.fixture(scope="class")
    def setup(self, qwen_dir: Path, module_run_dir: Path) -> Iterator[Any]:
        ctx = zmq.Context.instance()
        engine = StandInEngine.at(ctx, f"ipc://{module_run_dir}/pool-engine.sock")
        replies = Inbox.bound(ctx, f"ipc://{module_run_dir}/pool-frontend.sock", FrontendInput)
        worker = start_role("mm-worker", [
            "--mm-worker-endpoint", f"ipc://{module_run_dir}/pool-worker.sock",
            "--engine-endpoint", engine.endpoint, "--model", str(qwen_dir),
            "--mm-processes", "2",
        ], module_run_dir, log_dir=module_run_dir / "pool-worker")
        assert worker.endpoint is not None
        jobs = push(ctx, worker.endpoint)
        try:
            yield worker, engine, replies, jobs
        finally:
            jobs.close()
            assert stop_role(worker) == 0
            engine.close()
            replies.close()
        # Its processes closed their slots (the engine emptied every one): none is left.
        assert shm_slots(worker.endpoint) == {}, role_log(worker)

    def job(self, request_id: str, reply_to: str, *urls: str) -> MMJob:
        pre = preprocessor_of_default()
        prompt = pre.tokenize_batch([pre.render_prompt([{"role": "user", "content": [
            *({"type": "image"} for _ in urls), {"type": "text", "text": "what is it?"}]}])])[0]
        return MMJob(request_id=request_id, reply_to=reply_to, prompt_token_ids=prompt,
                     images=[ImageUrl(url=url) for url in urls],
                     sampling=SamplingParams(max_tokens=1))

    def test_requests_equal_the_processors_in_arrival_order(self, setup: Any) -> None:
        worker, engine, replies, jobs = setup
        pre = preprocessor_of_default()
        sizes = [(1600, 1200), (40, 30), (333, 517), (56, 56), (1024, 768), (64, 64)]
        images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
        ids = [f"order-{i}" for i in range(len(images))]
        for request_id, image in zip(ids, images, strict=True):  # big first, small behind it
            send(jobs, self.job(request_id, replies.endpoint, data_uri(encode(image, "JPEG"))))
        got = [engine.take() for _ in ids]
        assert [request.request_id for request in got] == ids
        for request, image in zip(got, images, strict=True):
            expected = pre.process_image(decode_image(encode(image, "JPEG"), 0, 10**9))
            (item,) = request.mm_items
            for name, tensor in expected.tensors.items():
                assert np.array_equal(item.tensors[name], tensor), name
            assert item.length == expected.num_tokens
        # The big images' pixels came in the pool processes' own slots, taken by the engine.
        assert shm_slots(worker.endpoint) and not any(shm_slots(worker.endpoint).values())

    def test_the_worker_runs_openmp_passive_and_its_processes_inherit_it(
            self, setup: Any) -> None:
        """Set by `mmlane mm-worker` before torch loads (cli.MM_WORKER_ENVIRONMENT), unless
        the user set it: the pool processes it started have it in their environment."""
        worker, *_ = setup
        expected = os.environ.get("OMP_WAIT_POLICY", "PASSIVE").encode()
        for pid in pool_pids(worker.process.pid):
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"OMP_WAIT_POLICY=" + expected in environment

    def test_a_failed_jobs_pixels_free_their_slot(self, setup: Any) -> None:
        worker, engine, replies, jobs = setup
        big = data_uri(encode(noise_image(1600, 1200, seed=30), "JPEG"))
        send(jobs, self.job("half-bad", replies.endpoint, big, "data:image/png;base64,AAAA"))
        failure = replies.take()
        assert isinstance(failure, RequestFailed) and failure.error.code == "invalid_image"
        # The first image was processed into a slot, then dropped unsent with its job.
        wait_until(lambda: not any(shm_slots(worker.endpoint).values()),
                   "the dropped pixels' slot freed")
        engine.assert_quiet()
    def test_a_dead_process_fails_its_job_alone_and_is_replaced(self, setup: Any) -> None:
        worker, engine, replies, jobs = setup
        before = pool_pids(worker.process.pid)
        assert len(before) == 2
        stems_before = _stems(shm_slots(worker.endpoint))
        assert stems_before  # each process that processed a big image made a slot
        for pid in before:  # frozen, so the job's image waits inside one of them
            os.kill(pid, signal.SIGSTOP)
        image = data_uri(encode(noise_image(48, 32, seed=7), "PNG"))  # fits in a pipe
        send(jobs, self.job("held", replies.endpoint, image))
        time.sleep(0.5)  # the one sleep: nothing tells when the image is in a frozen process
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        failure = replies.take()
        assert isinstance(failure, RequestFailed) and failure.request_id == "held"
        assert failure.error.kind == "retryable" and failure.error.code == "peer_restarted"
        assert "died" in failure.error.message
        wait_until(lambda: len(pool_pids(worker.process.pid)) == 2,
                   "the pool processes were replaced")
        assert not set(pool_pids(worker.process.pid)) & set(before)
        send(jobs, self.job("after", replies.endpoint, image))
        request = engine.take()
        assert request.request_id == "after" and request.mm_items[0].tensors
        engine.assert_quiet()
        # The killed processes' slots (all empty) were unlinked for them.
        assert not _stems(shm_slots(worker.endpoint)) & stems_before


@contextlib.contextmanager
def pool_in_process(model_dir: Path, processes: int, *,
                    max_age_s: float = 60.0) -> Iterator[pool.ProcessPool]:
    """A ProcessPool run by this process (its slots' views `.views`, keeping 1 KiB and more),
    closed after; then its slots are unlinked, as a worker's successor reaps what its
    predecessor left under its tag (full ones no engine took)."""
    views = shm.ShmViews(keep_from=1024)
    slots = pool.PoolSlots(shm.sender_tag(f"test-{time.time_ns()}"), 64 << 20, max_age_s, views)
    media = MediaPolicy(allowed_media_dir=None, max_image_bytes=1 << 20, max_image_pixels=1 << 20)
    processes = pool.ProcessPool(model_dir, "pil", media, processes, slots, video_processes=1)
    try:
        yield processes
    finally:
        processes.close()
        shm.reap(slots.tag)


def test_a_pool_slot_the_worker_refuses_fails_that_image_alone(
    monkeypatch: pytest.MonkeyPatch, qwen_dir: Path
) -> None:
    """A pool process (a stand-in, peers.py) names its slot wrongly: that image's future fails
    with an internal error naming its pixels and the slot; the process's next image, named
    rightly, comes through as a view of its slot."""
    monkeypatch.setattr(pool, "_serve", stand_in_pool_process)  # what each member runs
    with pool_in_process(qwen_dir, 1) as processes:
        refused = processes.submit(0, LIE).exception(timeout=60)
        assert isinstance(refused, MMLaneError) and refused.code == "internal", refused
        assert "image 0's pixels" in str(refused) and "needs 4" in str(refused)
        taken = processes.submit(1, b"any").result(timeout=60)
        assert np.array_equal(taken.item.tensors["pixel_values"], PIXELS)
        assert processes.views.put(taken.item.tensors["pixel_values"]) is not None  # its slot


@pytest.mark.parametrize("end", ["read", "died", "closed"])
def test_a_videos_handover_to_its_process_holds_no_image_back(
    monkeypatch: pytest.MonkeyPatch, qwen_dir: Path, end: str
) -> None:
    """A video's bytes go down its process's pipe from a thread of their own: with that process
    frozen before it has read them (8 MiB, far more than a pipe holds), an image submitted
    after the video goes to the other process and is done meanwhile. The handover ends with the
    process: it reads the rest (the video is done), it dies (the video fails, retryable), or the
    pool closes (it is killed, the video failed); no handover thread is left."""
    monkeypatch.setattr(pool, "_serve", stand_in_pool_process)
    with pool_in_process(qwen_dir, 2) as processes:
        pids = [member.process.pid for member in processes._members]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        video = processes.submit_video(pool.VideoTask(0, bytes(8 << 20), Qwen2VLSampling(),
                                                      max_tokens=1000))
        holder = wait_until(lambda: next((m.process.pid for m in processes._members if m.task),
                                         None), "the video handed to a process")
        os.kill(next(pid for pid in pids if pid != holder), signal.SIGCONT)
        image = processes.submit(0, b"any").result(timeout=60)
        assert np.array_equal(image.item.tensors["pixel_values"], PIXELS)
        assert not video.done()  # its process has not read its bytes yet
        if end == "read":
            os.kill(holder, signal.SIGCONT)
            assert np.array_equal(video.result(timeout=60).item.tensors["pixel_values"], PIXELS)
        elif end == "died":
            os.kill(holder, signal.SIGKILL)
            died = video.exception(timeout=60)
            assert isinstance(died, RetryableError) and died.code == "peer_restarted", died
    if end == "closed":
        stopped = video.exception(timeout=0)
        assert isinstance(stopped, RetryableError), stopped
        assert stopped.message == "the MM worker stopped before processing this item"
    assert not [t.name for t in threading.enumerate() if t.name.endswith("-handover")]


def test_a_result_waiting_for_its_jobs_turn_keeps_its_slot(qwen_dir: Path) -> None:
    """A finished video waits in its lane behind a slower one at the head (each video before it
    may take 2 x max_video_decode_s, 2 minutes by default); its slot, full past the writer's max
    age (a minute), was taken back when its process put its next result, and the video reached
    the engine as `tensors_lost`. A pool process's slot is aged only from when the worker hands
    it on. With a max age of 0: a result the worker holds keeps its slot through its process's
    next result; one handed on and never taken (an engine gone) is taken back."""
    image = encode(noise_image(256, 256, seed=1), "PNG")  # its pixels: 381 KB, a slot's worth
    with pool_in_process(qwen_dir, 1, max_age_s=0.0) as processes:
        held = processes.submit(0, image).result(timeout=60).item.tensors["pixel_values"]
        pixels = np.array(held)
        later = processes.submit(1, image).result(timeout=60).item.tensors["pixel_values"]
        engine = shm.ShmReader()
        sent = processes.views.put(held)  # its job's turn: sent, and taken by the engine
        assert sent is not None
        assert np.array_equal(engine.take(sent, held.dtype, held.shape), pixels)
        unread = processes.views.put(later)  # sent to an engine that is gone
        assert unread is not None
        processes.submit(2, image).result(timeout=60)
        assert engine.take(unread, later.dtype, later.shape) is None  # taken back


def _stems(slots: dict[str, bool]) -> set[str]:
    """The writers (one per pool process) the slot names say: mmlane-TAG-STARTED-SLOT."""
    return {name.rsplit("-", 1)[0] for name in slots}


def test_a_pool_process_sends_the_images_span(model_dirs: dict[str, Path], run_dir: Path) -> None:
    """Mistral 3's span (rows of [IMG], [IMG_BREAK], [IMG_END]) crosses from a pool process
    with its image: the request is the in-process one."""
    ctx = zmq.Context.instance()
    engine = StandInEngine.at(ctx, f"ipc://{run_dir}/engine.sock")
    worker = start_role("mm-worker", [
        "--mm-worker-endpoint", f"ipc://{run_dir}/worker.sock", "--engine-endpoint",
        engine.endpoint, "--model", str(model_dirs["mistral3"]), "--mm-processes", "1",
    ], run_dir)
    assert worker.endpoint is not None
    jobs = push(ctx, worker.endpoint)
    try:
        pre = preprocessor(str(model_dirs["mistral3"]))
        image = noise_image(100, 60, seed=1)
        prompt = pre.tokenize_batch([pre.render_prompt(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
        )])[0]
        send(jobs, MMJob(request_id="span", reply_to="ipc://nowhere", prompt_token_ids=prompt,
                         images=[ImageUrl(url=data_uri(encode(image, "PNG")))],
                         sampling=SamplingParams(max_tokens=1)))
        expected = pre.expand_placeholders(prompt, [pre.process_image(image)])
        assert engine.take().prompt_token_ids == expected
    finally:
        jobs.close()
        stop_role(worker)
        engine.close()


@cache
def preprocessor_of_default() -> Preprocessor:
    from mmlane.model import resolve_model_dir

    return load_preprocessor(resolve_model_dir(None))
