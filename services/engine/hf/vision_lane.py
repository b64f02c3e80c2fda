"""The vision lane: images' vision-encoder passes on a thread of their own, beside the runner's.

An image's vision pass is the largest part of its engine work (a 1024x1024 image on the tiny
Qwen2-VL: about 165 ms on one CPU thread, against 45-60 ms for its prompt's prefill). Here one
thread runs each image's whole pass, in the order they are submitted, while the runner's model
thread goes on with prefill chunks and decode steps: no text request waits for a pass. The
lane's thread runs `nice` steps below its creator's (`--image-nice`): where cores are shared, a
text request's unit takes one first. torch releases the GIL inside its operations, so the lane
and the runner run at once on as many cores. A pass is the model's own `get_image_features`,
with the lane's own torch thread count (torch keeps the count per thread).

On CUDA the lane queues its kernels on a stream of its own, so that a pass and the runner's
units run on the GPU at once; the lane waits for its stream before a result leaves, and marks
the features as used on the runner's stream, so that their memory is not reused while the
runner's kernels still read it.

The lane holds no request state. The runner's thread submits jobs by number, cancels the ones no
request waits for any more, and takes the results (`finished`); the lane calls `wake` after each
result so that a runner waiting for work looks at once. Every job submitted before `close` gets
exactly one result: its features, the exception its pass raised, or None if it was cancelled
before it ran.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch

from services.common.lifecycle import lower_priority

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
"""How long `close` waits for the pass under way to end."""


def synchronize(device: torch.device) -> None:
    """Wait for the work this thread queued on the device (CUDA runs kernels asynchronously, on
    the thread's current stream), so that a time taken after it is the work's, not its
    launch's."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class VisionResult(NamedTuple):
    job: int
    features: torch.Tensor | Exception | None
    """The image's features; the exception its pass raised; None: cancelled before it ran."""
    seconds: float
    """How long its pass took (0 when it did not run)."""


class VisionLane:
    """Runs `encode` (an image's tensors to its features) for each submitted job, in order, on a
    thread `nice` steps below its creator's, with `threads` torch threads; `wake` is called
    after each result."""

    def __init__(self, encode: Callable[[Mapping[str, np.ndarray]], torch.Tensor], *,
                 threads: int, device: torch.device, wake: Callable[[], None],
                 nice: int) -> None:
        self._encode = encode
        self.threads = threads
        self._device = device
        self._wake = wake
        self._nice = nice
        self._runner_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        """The creating thread's (the runner's) stream, which reads the features (CUDA only)."""
        self._cancelled: set[int] = set()
        """Jobs to skip if not yet started (set by the runner's thread, read by the lane's)."""
        self._jobs: queue.SimpleQueue[tuple[int, Mapping[str, np.ndarray]] | None] = (
            queue.SimpleQueue())
        self._results: queue.SimpleQueue[VisionResult] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="vision-lane", daemon=True)
        self._thread.start()

    def submit(self, job: int, tensors: Mapping[str, np.ndarray]) -> None:
        self._jobs.put((job, tensors))

    def cancel(self, job: int) -> None:
        """Skip `job` if its pass has not started (its result is then None)."""
        self._cancelled.add(job)

    def finished(self) -> list[VisionResult]:
        """The results that have come since the last call."""
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def close(self) -> None:
        """End the thread after the pass under way (jobs still queued are dropped)."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        lower_priority(self._nice)
        torch.set_num_threads(self.threads)
        stream = None if self._runner_stream is None else torch.cuda.Stream(self._device)
        with torch.inference_mode(), torch.cuda.stream(stream):
            while (job := self._jobs.get()) is not None:
                self._results.put(self._pass(*job))
                self._wake()

    def _pass(self, job: int, tensors: Mapping[str, np.ndarray]) -> VisionResult:
        if job in self._cancelled:
            self._cancelled.discard(job)
            return VisionResult(job, None, 0.0)
        started = time.monotonic()
        try:
            encoded = self._encode(tensors)
            synchronize(self._device)  # the time is the pass's, not its launch's
            if self._runner_stream is not None:
                encoded.record_stream(self._runner_stream)
            features: torch.Tensor | Exception = encoded
        except Exception as exc:  # the runner fails the requests that wait for it
            log.warning("a vision pass failed", exc_info=True)
            features = exc
        self._cancelled.discard(job)
        return VisionResult(job, features, time.monotonic() - started)
