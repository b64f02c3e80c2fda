"""Decoding and processing images and videos on more cores: a pool of processes inside the MM
worker.

    lane thread ──submit(index, bytes)────▶ ProcessPool ──task pipe──▶ mm-process-K (loads the
                ──submit_video(VideoTask)─▶                            preprocessors once)
                ◀── Future[Processed] ────  mm-worker-pool ◀─ result pipe ─
                                            thread          + shared memory

Only work that needs no order runs here: decode an image's bytes and run the model's image
processor on it (`process_image`), or decode the frames a video's sampling keeps and process
them (`process_video`): the functions a lane's thread runs itself when the worker has no pool.
Everything that keeps order (hashing, the sender cache, sending, committing) stays on the
lanes' threads, each of which submits the items of the jobs it has started and finishes its jobs
in arrival order (services/mm_worker/lane.py).

Both lanes share the pool; videos must not take it from images. A free process takes the oldest
image waiting, else the oldest video waiting while fewer than `video_processes` processes hold
one: a stream of videos takes at most that many processes from images, and no image waits
behind a video that has not started.

Each process takes one task at a time, so the pool knows which task each one holds. A task
goes down its process's pipe: an image's bytes from the pool's thread, a video's (up to
`max_video_bytes`) from a thread of their own (`mm-process-K-handover`), so that the pool's
thread dispatches and collects images while a process reads a video, however slowly. A result's
tensors come back through the slots of the process's own `ShmWriter` (protocol/shm.py; reused
slots, no pickling of pixels), which the worker takes as views (`ShmViews`) and sends to an
engine on the same host as they are: the pixels are copied once where they are made, and once
in the engine. Tensors under `IN_MESSAGE_BYTES`, and any that find no slot free (every slot
waiting for the engine), come in the result message itself. Errors come back as `ErrorInfo`.
A process that dies (a decoder fault on a hostile image or video, an out-of-memory kill) fails the
one task it held with a retryable error naming its item and is replaced, its slots released
(`shm.abandon`); the other tasks are not touched. A process that holds a video past
`VIDEO_TASK_LIMIT` times `max_video_decode_s` is stuck in a decoder call (the decoder checks its
own bound between frames): it is killed, and the video refused (`video_too_large`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmlane.mm_worker.media import MediaPolicy, configure_pillow, decode_image
from mmlane.mm_worker.video import FrameSampling, decode_video
from mmlane.model import ImageItem, Preprocessor, load_preprocessor
from mmlane.model.video import VideoItem, VideoPreprocessor, videos_of
from mmlane.protocol import shm
from mmlane.protocol.errors import (
    ErrorInfo,
    FatalError,
    RequestError,
    RetryableError,
    from_info,
    translate,
)

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""How long the pool's processes may take to load the preprocessor at startup."""
RESTART_BACKOFF_S = 1.0
"""The wait before replacing a process that died before it was ready (no tight crash loop)."""
VIDEO_TASK_LIMIT = 2.0
"""A video task still held after this many times `max_video_decode_s` (the bound its decoding
checks between frames; processing the frames takes less) hangs inside one decoder call."""
IN_MESSAGE_BYTES = 1 << 16
"""Tensors smaller than this come back in the result message (a grid, a tiny image's pixels):
a slot is not worth it for them."""


@dataclass(frozen=True)
class PoolSlots:
    """Where the pool's processes put their results: slots under `tag` (the worker's), at most
    `capacity` bytes per process, taken back once full for `max_age_s` after the worker handed
    them on (`views`, the worker's, mark them then)."""

    tag: str
    capacity: int
    max_age_s: float
    views: shm.ShmViews


@dataclass(frozen=True)
class Processed:
    """An image or a video decoded and processed, and how long each step took (seconds)."""

    item: ImageItem | VideoItem
    decode_s: float
    process_s: float


@dataclass(frozen=True)
class ImageTask:
    """Decode and process image `index` of a job."""

    index: int
    data: bytes

    @property
    def name(self) -> str:
        return f"image {self.index}"


@dataclass(frozen=True)
class VideoTask:
    """Decode the frames `sampling` keeps of video `index` of a job and process them, into at
    most `max_tokens` tokens (the context its job leaves)."""

    index: int
    data: bytes
    sampling: FrameSampling
    max_tokens: int

    @property
    def name(self) -> str:
        return f"video {self.index}"


Task = ImageTask | VideoTask


def process_image(preprocessor: Preprocessor, index: int, data: bytes,
                  media: MediaPolicy) -> Processed:
    """Decode image `index`'s bytes (big JPEGs reduced to what the processor needs, with
    `media.jpeg_draft`) and run the model's image processor on it; raises RequestError naming
    the image when either refuses it."""
    started = time.perf_counter()
    resized_size = preprocessor.resized_size if media.jpeg_draft else None
    image = decode_image(data, index, media.max_image_pixels, resized_size)
    decoded = time.perf_counter()
    try:
        item = preprocessor.process_image(image)
    except ValueError as exc:  # HF processors refuse bad sizes (e.g. extreme aspect ratios)
        raise RequestError(
            f"image {index}: the image processor refused it: {exc}", code="invalid_image"
        ) from exc
    return Processed(item, decoded - started, time.perf_counter() - decoded)


def process_video(video: VideoPreprocessor, task: VideoTask, media: MediaPolicy) -> Processed:
    """Decode the frames a video's sampling keeps (within `media.video_limits`) and run the
    model's video processing on them; raises RequestError naming the video."""
    started = time.perf_counter()
    decoded = decode_video(task.data, task.index, task.sampling, media.video_limits)
    done_decoding = time.perf_counter()
    item = video.process_video(decoded.frames, decoded.hf_metadata(), index=task.index,
                               max_tokens=task.max_tokens)
    return Processed(item, done_decoding - started, time.perf_counter() - done_decoding)


# ---------------------------------------------------------------- the pool, in the worker


@dataclass
class _Task:
    work: Task
    future: concurrent.futures.Future[Processed] = field(
        default_factory=concurrent.futures.Future)


class _Member:
    """One pool process, its two pipes and the task it holds, and the thread that hands it a
    video's bytes."""

    def __init__(self, ctx: Any, number: int, args: tuple[Any, ...]) -> None:
        task_reader, self.task_writer = ctx.Pipe(duplex=False)
        self.result_reader, result_writer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve, args=(task_reader, result_writer, *args),
                                   name=f"mm-process-{number}", daemon=True)
        self.process.start()
        task_reader.close()  # the child's ends: closed here, so a dead child reads as EOF
        result_writer.close()
        self.ready = False
        self.stem = ""
        """Its slots' names start with this (it says so when ready)."""
        self.task: _Task | None = None
        self.deadline: float | None = None
        """When the video it holds is taken to hang (`VIDEO_TASK_LIMIT`); None: none held."""
        self.overdue = False
        """It was killed for holding its video past its deadline."""
        self._handover: threading.Thread | None = None

    def send(self, task: Task) -> None:
        """Hand the process its task: an image's bytes at once, a video's (up to
        `max_video_bytes`) on a thread of the member's, so that the pool's thread serves the
        other processes while this one reads them (or is killed, frozen, before it has)."""
        if self._handover is not None:
            self._handover.join()  # ended: the process read it before it sent its result
        if isinstance(task, ImageTask):
            self._write(task)
            return
        self._handover = threading.Thread(target=self._write, args=(task,), daemon=True,
                                          name=f"{self.process.name}-handover")
        self._handover.start()

    def handing_over(self) -> bool:
        """Whether its process has not read all of the video handed to it yet."""
        return self._handover is not None and self._handover.is_alive()

    def _write(self, task: Task) -> None:
        try:
            self.task_writer.send(task)
        except OSError:
            pass  # it died: `_serve_member` fails the task and replaces it

    def close(self) -> None:
        """Close its pipes, once a handover has ended (the process read it all, or is dead:
        its pipe then refuses the rest). A pipe closed under the writing thread could be a new
        one's by the time it writes again."""
        if self._handover is not None:
            self._handover.join()
        self.task_writer.close()
        self.result_reader.close()


class ProcessPool:
    """`processes` pool processes for `model_dir`'s image (and video) processing, fed by
    `submit` and `submit_video`; at most `video_processes` of them hold a video at once."""

    def __init__(self, model_dir: Path, image_backend: str, media: MediaPolicy,
                 processes: int, slots: PoolSlots, *, video_processes: int) -> None:
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self.views = slots.views
        """Where the worker takes its processes' results: what it hands on to the engine."""
        self._args = (str(model_dir), image_backend, media, slots.tag, slots.capacity,
                      slots.max_age_s)
        self._video_processes = video_processes
        self._max_video_decode_s = media.video_limits.max_video_decode_s
        self._waiting: deque[_Task] = deque()
        """Images waiting for a process."""
        self._waiting_videos: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._wake_reader, self._wake_writer = self._ctx.Pipe(duplex=False)
        self._closing = False
        self._numbers = itertools.count()
        self._restart_at: list[float] = []
        self._members = [self._start() for _ in range(processes)]
        self._wait_ready()
        self._thread = threading.Thread(target=self._run, name="mm-worker-pool", daemon=True)
        self._thread.start()
        log.info("%d image and video processes, videos in %d at once (pids %s)", processes,
                 video_processes, ",".join(str(m.process.pid) for m in self._members))

    def submit(self, index: int, data: bytes) -> concurrent.futures.Future[Processed]:
        """Process image `index` in a pool process; the future fails with the image's error,
        or a retryable one when its process died."""
        return self._submit(_Task(ImageTask(index, data)), self._waiting)

    def submit_video(self, task: VideoTask) -> concurrent.futures.Future[Processed]:
        """Decode and process a video in a pool process, once one of the `video_processes` is
        free; the future fails as `submit`'s."""
        return self._submit(_Task(task), self._waiting_videos)

    def _submit(self, task: _Task, queue: deque[_Task]) -> concurrent.futures.Future[Processed]:
        with self._lock:
            queue.append(task)
        self._wake_writer.send_bytes(b"")
        return task.future

    def close(self) -> None:
        """Stop every process; tasks not done fail as retryable."""
        self._closing = True
        self._wake_writer.send_bytes(b"")
        self._thread.join(10)
        for member in self._members:
            if member.handing_over():  # its video failed as the pool's thread ended
                member.process.kill()
            member.close()
            member.process.join(2)
            if member.process.is_alive():
                member.process.kill()
                member.process.join()
            shm.abandon(member.stem)  # had it no time to close its slots itself
        self._wake_reader.close()
        self._wake_writer.close()

    # ------------------------------------------------------------ the mm-worker-pool thread

    def _start(self) -> _Member:
        return _Member(self._ctx, next(self._numbers), self._args)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for member in self._members:
            left = deadline - time.monotonic()
            if not member.result_reader.poll(max(left, 0)):
                raise FatalError(f"pool process {member.process.name} did not start within "
                                 f"{START_TIMEOUT_S:.0f} s", code="cannot_serve")
            try:
                self._take_result(member, member.result_reader.recv())
            except EOFError:
                raise FatalError(f"pool process {member.process.name} exited at startup "
                                 f"(status {member.process.exitcode})",
                                 code="cannot_serve") from None

    def _run(self) -> None:
        while not self._closing:
            self._dispatch()
            readers: list[Any] = [self._wake_reader]
            for member in self._members:
                readers += [member.result_reader, member.process.sentinel]
            for ready in multiprocessing.connection.wait(readers, self._next_due()):
                if ready is self._wake_reader:
                    self._wake_reader.recv_bytes()
            for member in list(self._members):
                self._serve_member(member)
            self._replace_due()
            self._stop_overdue()
        self._fail_all(RetryableError("the MM worker stopped before processing this item",
                                      code="peer_restarted"))

    def _serve_member(self, member: _Member) -> None:
        try:
            while member.result_reader.poll():
                self._take_result(member, member.result_reader.recv())
        except (EOFError, OSError):
            pass  # it died: its sentinel says so below
        if member.process.is_alive():
            return
        member.process.join()
        self._members.remove(member)
        member.close()
        shm.abandon(member.stem)
        held = member.task.work.name if member.task else None
        log.error("pool process %s (pid %s) died with status %s%s; replacing it",
                  member.process.name, member.process.pid, member.process.exitcode,
                  f" while processing {held}" if held else "")
        if member.task is not None:
            member.task.future.set_exception(self._lost(member))
        if member.ready:
            self._members.append(self._start())
        else:  # it never got ready: wait a little before trying again
            self._restart_at.append(time.monotonic() + RESTART_BACKOFF_S)

    def _lost(self, member: _Member) -> RequestError | RetryableError:
        """The error of the task a process held when it died."""
        assert member.task is not None
        held, decode_s = member.task.work.name, self._max_video_decode_s
        if member.overdue:
            return RequestError(
                f"{held}: still being decoded after {VIDEO_TASK_LIMIT * decode_s:g} s, "
                f"{VIDEO_TASK_LIMIT:g} times max_video_decode_s {decode_s:g}; its process was "
                "stopped", code="video_too_large")
        return RetryableError(f"{held}: the process decoding it died (status "
                              f"{member.process.exitcode}); it was replaced",
                              code="peer_restarted")

    def _next_due(self) -> float | None:
        """Seconds until a replacement is due or a video overdue; None: neither."""
        due = [*self._restart_at, *(m.deadline for m in self._members if m.deadline is not None)]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _stop_overdue(self) -> None:
        """Kill each process that holds its video past its deadline (its death, seen next,
        refuses the video and replaces it)."""
        now = time.monotonic()
        for member in self._members:
            if member.deadline is not None and member.deadline <= now and member.task:
                log.warning("pool process %s (pid %s) has held %s for %g s: stopping it",
                            member.process.name, member.process.pid, member.task.work.name,
                            VIDEO_TASK_LIMIT * self._max_video_decode_s)
                member.deadline, member.overdue = None, True
                member.process.kill()

    def _replace_due(self) -> None:
        now = time.monotonic()
        due = [at for at in self._restart_at if at <= now]
        for at in due:
            self._restart_at.remove(at)
            self._members.append(self._start())

    def _take_result(self, member: _Member, message: tuple[Any, ...]) -> None:
        kind, *body = message
        if kind == "ready":
            member.ready, member.stem = True, body[0]
            return
        task, member.task, member.deadline = member.task, None, None
        assert task is not None, "a result from a process that holds no task"
        if kind == "ok":
            tensors, num_tokens, token_ids, decode_s, process_s = body
            item: ImageItem | VideoItem
            try:
                adopted = self._adopt(tensors)
            except (RetryableError, shm.SlotRefused) as exc:  # a slot of ours refused: a bug
                task.future.set_exception(translate(exc, f"{task.work.name}'s pixels"))
                return
            if isinstance(task.work, VideoTask):
                item = VideoItem(adopted, num_tokens, token_ids)
            else:
                item = ImageItem(tensors=adopted, num_tokens=num_tokens, token_ids=token_ids)
            task.future.set_result(Processed(item, decode_s, process_s))
        else:
            task.future.set_exception(from_info(body[0]))

    def _adopt(self, tensors: list[tuple[str, Any]]) -> dict[str, np.ndarray]:
        """A result's tensors: those in slots as the worker's views of them, the others as they
        came in the message."""
        adopted = {}
        for key, tensor in tensors:
            if isinstance(tensor, np.ndarray):
                adopted[key] = tensor
                if tensor.nbytes >= IN_MESSAGE_BYTES:
                    self.views.count("shm_fallbacks")
                continue
            ref, dtype, shape = tensor
            view = self.views.adopt(ref, np.dtype(dtype), tuple(shape))
            if view is None:  # gone or reused: no longer the use its process named
                raise RetryableError(f"the pixels of {ref} were gone before the worker read "
                                     "them", code="tensors_lost")
            adopted[key] = view
        return adopted

    def _dispatch(self) -> None:
        for member in self._members:
            if not member.ready or member.task is not None:
                continue
            task = self._next_task()
            while task is not None and not task.future.set_running_or_notify_cancel():
                task = self._next_task()  # cancelled while it waited
            if task is None:
                return
            member.task = task
            if isinstance(task.work, VideoTask):
                member.deadline = time.monotonic() + VIDEO_TASK_LIMIT * self._max_video_decode_s
            member.send(task.work)

    def _next_task(self) -> _Task | None:
        """The oldest image waiting, else the oldest video while fewer than `video_processes`
        processes hold one."""
        videos = sum(isinstance(m.task.work, VideoTask) for m in self._members if m.task)
        with self._lock:
            if self._waiting:
                return self._waiting.popleft()
            if self._waiting_videos and videos < self._video_processes:
                return self._waiting_videos.popleft()
        return None

    def _fail_all(self, error: RetryableError) -> None:
        with self._lock:
            left = [*self._waiting, *self._waiting_videos]
            self._waiting.clear()
            self._waiting_videos.clear()
        left += [m.task for m in self._members if m.task is not None]
        for task in left:
            if not task.future.done():
                task.future.set_exception(error)


# ---------------------------------------------------------------- a pool process


def _serve(tasks: Any, results: Any, model_dir: str, image_backend: str, media: MediaPolicy,
           tag: str, capacity: int, max_age_s: float) -> None:
    """A pool process: load the preprocessors, then process tasks until the pipe closes."""
    import torch

    torch.set_num_threads(1)  # one core per process: the pool is the parallelism
    configure_pillow(media.max_image_pixels)
    preprocessor = load_preprocessor(model_dir, image_backend)  # type: ignore[arg-type]
    video = videos_of(model_dir, preprocessor)  # None: the worker has no video lane
    slots = shm.ShmWriter(tag, threshold=IN_MESSAGE_BYTES, capacity=capacity,
                          max_age_s=max_age_s, relayed=True)
    results.send(("ready", slots.stem))
    try:
        while True:
            try:
                task: Task = tasks.recv()
            except (EOFError, OSError):
                return
            try:
                done = _process(preprocessor, video, task, media)
            except Exception as exc:
                info: ErrorInfo = translate(exc, task.name).to_info()
                results.send(("err", info))
                continue
            results.send(("ok", _put(slots, done.item.tensors), done.item.num_tokens,
                          done.item.token_ids, done.decode_s, done.process_s))
    finally:
        slots.close()


def _process(preprocessor: Preprocessor, video: VideoPreprocessor | None, task: Task,
         media: MediaPolicy) -> Processed:
    if isinstance(task, ImageTask):
        return process_image(preprocessor, task.index, task.data, media)
    assert video is not None, "a video for a model that takes none"
    return process_video(video, task, media)


def _put(slots: shm.ShmWriter, tensors: dict[str, np.ndarray]) -> list[tuple[str, Any]]:
    """Each tensor as it goes back: (key, (slot reference, dtype, shape)) once put into a slot,
    else (key, the array itself)."""
    sent: list[tuple[str, Any]] = []
    for key, array in tensors.items():
        array = np.ascontiguousarray(array)
        ref = slots.put(array)
        sent.append((key, array if ref is None else (ref, array.dtype.str, array.shape)))
    return sent
