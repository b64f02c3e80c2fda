"""Decoding and image processing on more cores: a pool of processes inside the MM worker.

    FIFO thread ──submit(index, bytes)──▶ ProcessPool ──task pipe──▶ mm-process-K (loads the
                ◀── Future[Processed] ──  mm-worker-pool ◀─ result pipe ─  preprocessor once)
                                          thread          + shared memory

Only work that needs no order runs here: decode an image's bytes and run the model's image
processor on it (`process_image`, the function the worker runs itself when it has no pool).
Everything that keeps order (hashing, the sender cache, sending, committing) stays on the
worker's FIFO thread, which submits the images of the jobs it has started and finishes the jobs
in arrival order (services/mm_worker/worker.py).

Each process takes one task at a time, so the pool knows which task each one holds. A result's
tensors come back through the slots of the process's own `ShmWriter` (protocol/shm.py; reused
slots, no pickling of pixels), which the worker takes as views (`ShmViews`) and sends to an
engine on the same host as they are: the pixels are copied once where they are made, and once
in the engine. Tensors under `IN_MESSAGE_BYTES`, and any that find no slot free (every slot
waiting for the engine), come in the result message itself. Errors come back as `ErrorInfo`.
A process that dies (a decoder fault on a hostile image, an out-of-memory kill) fails the one
task it held with a retryable error and is replaced, its slots released (`shm.abandon`); the
other tasks are not touched.
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
from mmlane.model import ImageItem, Preprocessor, load_preprocessor
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
IN_MESSAGE_BYTES = 1 << 16
"""Tensors smaller than this come back in the result message (a grid, a tiny image's pixels):
a slot is not worth it for them."""


@dataclass(frozen=True)
class PoolSlots:
    """Where the pool's processes put their results: slots under `tag` (the worker's), at most
    `capacity` bytes per process, taken back after `max_age_s` full; the worker's `views`."""

    tag: str
    capacity: int
    max_age_s: float
    views: shm.ShmViews


@dataclass(frozen=True)
class Processed:
    """An image decoded and processed, and how long each step took (seconds)."""

    item: ImageItem
    decode_s: float
    process_s: float


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


# ---------------------------------------------------------------- the pool, in the worker


@dataclass
class _Task:
    index: int
    data: bytes
    future: concurrent.futures.Future[Processed] = field(
        default_factory=concurrent.futures.Future)


class _Member:
    """One pool process, its two pipes and the task it holds."""

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

    def close(self) -> None:
        self.task_writer.close()
        self.result_reader.close()


class ProcessPool:
    """`processes` pool processes for `model_dir`'s image processor, fed by `submit`."""

    def __init__(self, model_dir: Path, image_backend: str, media: MediaPolicy,
                 processes: int, slots: PoolSlots) -> None:
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._views = slots.views
        self._args = (str(model_dir), image_backend, media, slots.tag, slots.capacity,
                      slots.max_age_s)
        self._waiting: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._wake_reader, self._wake_writer = self._ctx.Pipe(duplex=False)
        self._closing = False
        self._numbers = itertools.count()
        self._restart_at: list[float] = []
        self._members = [self._start() for _ in range(processes)]
        self._wait_ready()
        self._thread = threading.Thread(target=self._run, name="mm-worker-pool", daemon=True)
        self._thread.start()
        log.info("%d image processes (pids %s)", processes,
                 ",".join(str(m.process.pid) for m in self._members))

    def submit(self, index: int, data: bytes) -> concurrent.futures.Future[Processed]:
        """Process image `index` in a pool process; the future fails with the image's error,
        or a retryable one when its process died."""
        task = _Task(index, data)
        with self._lock:
            self._waiting.append(task)
        self._wake_writer.send_bytes(b"")
        return task.future

    def close(self) -> None:
        """Stop every process; tasks not done fail as retryable."""
        self._closing = True
        self._wake_writer.send_bytes(b"")
        self._thread.join(10)
        for member in self._members:
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
                raise FatalError(f"image process {member.process.name} did not start within "
                                 f"{START_TIMEOUT_S:.0f} s", code="cannot_serve")
            try:
                self._take_result(member, member.result_reader.recv())
            except EOFError:
                raise FatalError(f"image process {member.process.name} exited at startup "
                                 f"(status {member.process.exitcode})",
                                 code="cannot_serve") from None

    def _run(self) -> None:
        while not self._closing:
            self._dispatch()
            readers: list[Any] = [self._wake_reader]
            for member in self._members:
                readers += [member.result_reader, member.process.sentinel]
            timeout = (max(0.0, min(self._restart_at) - time.monotonic())
                       if self._restart_at else None)
            for ready in multiprocessing.connection.wait(readers, timeout):
                if ready is self._wake_reader:
                    self._wake_reader.recv_bytes()
            for member in list(self._members):
                self._serve_member(member)
            self._replace_due()
        self._fail_all(RetryableError("the MM worker stopped before processing this image",
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
        log.error("image process %s (pid %s) died with status %s%s; replacing it",
                  member.process.name, member.process.pid, member.process.exitcode,
                  f" while processing image {member.task.index}" if member.task else "")
        if member.task is not None:
            member.task.future.set_exception(RetryableError(
                f"image {member.task.index}: the process decoding it died (status "
                f"{member.process.exitcode}); it was replaced", code="peer_restarted"))
        if member.ready:
            self._members.append(self._start())
        else:  # it never got ready: wait a little before trying again
            self._restart_at.append(time.monotonic() + RESTART_BACKOFF_S)

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
        task, member.task = member.task, None
        assert task is not None, "a result from a process that holds no task"
        if kind == "ok":
            tensors, num_tokens, token_ids, decode_s, process_s = body
            try:
                item = ImageItem(tensors=self._adopt(tensors), num_tokens=num_tokens,
                                 token_ids=token_ids)
            except (RetryableError, shm.SlotRefused) as exc:  # a slot of ours refused: a bug
                task.future.set_exception(translate(exc, f"image {task.index}'s pixels"))
                return
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
                    self._views.counters["shm_fallbacks"] += 1
                continue
            ref, dtype, shape = tensor
            view = self._views.adopt(ref, np.dtype(dtype), tuple(shape))
            if view is None:  # taken back already: the result waited past SHM_MAX_AGE_S
                raise RetryableError(f"the pixels of {ref} were taken back before the worker "
                                     "read them", code="tensors_lost")
            adopted[key] = view
        return adopted

    def _dispatch(self) -> None:
        for member in self._members:
            if not member.ready or member.task is not None:
                continue
            with self._lock:
                if not self._waiting:
                    return
                task = self._waiting.popleft()
            if not task.future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            member.task = task
            try:
                member.task_writer.send((task.index, task.data))
            except OSError:
                pass  # it died: `_serve_member` fails the task and replaces it

    def _fail_all(self, error: RetryableError) -> None:
        with self._lock:
            left = list(self._waiting)
            self._waiting.clear()
        left += [m.task for m in self._members if m.task is not None]
        for task in left:
            if not task.future.done():
                task.future.set_exception(error)


# ---------------------------------------------------------------- a pool process


def _serve(tasks: Any, results: Any, model_dir: str, image_backend: str, media: MediaPolicy,
           tag: str, capacity: int, max_age_s: float) -> None:
    """A pool process: load the preprocessor, then process tasks until the pipe closes."""
    import torch

    torch.set_num_threads(1)  # one core per process: the pool is the parallelism
    configure_pillow(media.max_image_pixels)
    preprocessor = load_preprocessor(model_dir, image_backend)  # type: ignore[arg-type]
    slots = shm.ShmWriter(tag, threshold=IN_MESSAGE_BYTES, capacity=capacity,
                          max_age_s=max_age_s)
    results.send(("ready", slots.stem))
    try:
        while True:
            try:
                index, data = tasks.recv()
            except (EOFError, OSError):
                return
            try:
                done = process_image(preprocessor, index, data, media)
            except Exception as exc:
                info: ErrorInfo = translate(exc, f"image {index}").to_info()
                results.send(("err", info))
                continue
            results.send(("ok", _put(slots, done.item.tensors), done.item.num_tokens,
                          done.item.token_ids, done.decode_s, done.process_s))
    finally:
        slots.close()


def _put(slots: shm.ShmWriter, tensors: dict[str, np.ndarray]) -> list[tuple[str, Any]]:
    """Each tensor as it goes back: (key, (slot reference, dtype, shape)) once put into a slot,
    else (key, the array itself)."""
    sent: list[tuple[str, Any]] = []
    for key, array in tensors.items():
        array = np.ascontiguousarray(array)
        ref = slots.put(array)
        sent.append((key, array if ref is None else (ref, array.dtype.str, array.shape)))
    return sent
