"""The vision lane: images' vision-encoder passes on a thread of their own, beside the runner's.

An image's vision pass is the largest part of its engine work (a 1024x1024 image on the tiny
Qwen2-VL: about 165 ms on one CPU thread, against 45-60 ms for its prompt's prefill). On the
runner's thread it had to be cut into slices, so that a text request waited for one slice at
most, and it ran on that thread's core while the machine's other core was idle a third of the
time. Here one thread runs each image's whole pass, in the order they are submitted, while the
runner's thread goes on with prefill chunks and decode steps: torch releases the GIL inside its
operations, so both run at once on two cores, and no text request waits for a pass (where the
engine has one core, the OS shares it between the two).

The lane's thread runs `nice` steps below the runner's (`--image-nice`): where the cores are
shared, a text request's unit takes one first, and passes get what it leaves idle.

The lane's thread has its own torch thread count (torch keeps the count per thread): `threads`,
or `idle_threads` for a pass that starts while `spare()` says that the runner has nothing to
run meanwhile. A pass is the model's own `get_image_features`; the runner gives the lane two
counts only where a probe image's features are the same bits on both, so a pass gives the same
bits whatever else runs.

On CUDA the lane queues its kernels on a stream of its own, so that a pass and the runner's
units run on the GPU at once, as they do on two cores; the lane waits for its stream before a
result leaves, and marks the features as used on the runner's stream, so that their memory is
not reused while the runner's kernels still read it.

The lane holds no request state. The runner's thread submits jobs by number, cancels the ones no
request waits for any more, and takes the results (`finished`); the lane calls `wake` after each
result so that a runner waiting for work looks at once. Every submitted job gets exactly one
result: its features, the exception its pass raised, or None if it was cancelled before it ran.
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
from services.engine.hf.budget import synchronize

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
"""How long `close` waits for the pass under way to end."""


class VisionResult(NamedTuple):
    job: int
    features: torch.Tensor | Exception | None
    """The image's features; the exception its pass raised; None: cancelled before it ran."""
    seconds: float
    """How long its pass took (0 when it did not run)."""
    threads: int
    """The torch threads it ran with."""


class VisionLane:
    """Runs `encode` (an image's tensors to its features) for each submitted job, in order, on a
    thread `nice` steps below its creator's, with `threads` torch threads (`idle_threads` for a
    pass that starts while `spare()` is true); `wake` is called after each result."""

    def __init__(self, encode: Callable[[Mapping[str, np.ndarray]], torch.Tensor], *,
                 threads: int, idle_threads: int, spare: Callable[[], bool],
                 device: torch.device, wake: Callable[[], None], nice: int = 0) -> None:
        self._encode = encode
        self._nice = nice
        self.threads = threads
        self.idle_threads = idle_threads
        self._spare = spare
        self._device = device
        self._wake = wake
        self._runner_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        """The creating thread's (the runner's) stream, which reads the features (CUDA only)."""
        self._jobs: queue.SimpleQueue[tuple[int, Mapping[str, np.ndarray]] | None] = (
            queue.SimpleQueue())
        self._results: queue.SimpleQueue[VisionResult] = queue.SimpleQueue()
        self._cancelled: set[int] = set()
        """Jobs to skip if not yet started (set by the runner's thread, read by the lane's)."""
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
        while True:  # what is queued will not be waited for
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        lower_priority(self._nice)
        stream = None if self._runner_stream is None else torch.cuda.Stream(self._device)
        with torch.inference_mode(), torch.cuda.stream(stream):  # None: no stream (the CPU)
            while (job := self._jobs.get()) is not None:
                self._results.put(self._pass(*job))
                self._wake()

    def _pass(self, job: int, tensors: Mapping[str, np.ndarray]) -> VisionResult:
        if job in self._cancelled:
            self._cancelled.discard(job)
            return VisionResult(job, None, 0.0, 0)
        threads = self.idle_threads if self._spare() else self.threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
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
        return VisionResult(job, features, time.monotonic() - started, threads)
