"""The vision lane: images' vision-encoder passes on a thread of their own, beside the runner's.

An image's vision pass is the largest part of its engine work (a 1024x1024 image on the tiny
Qwen2-VL: about 165 ms on one CPU thread, against 45-60 ms for its prompt's prefill). On the
runner's thread it had to be cut into slices, so that a text request waited for one slice at
most, and it ran on that thread's core while the machine's other core was idle a third of the
time. Here one thread runs each image's whole pass, in the order they are submitted, while the
runner's thread goes on with text units and decode steps, and the bulk lane's with image
prompts' prefill: no text request waits for a pass. Like the bulk lane's, the thread is a
LaneThread (lane_thread.py): `nice` steps below the runner's, beside it on another core.

The lane's thread has its own torch thread count (torch keeps the count per thread): `threads`,
or `idle_threads` for a pass that starts while `spare()` says that the runner has nothing to
run meanwhile. A pass is the model's own `get_image_features`; the runner gives the lane two
counts only where a probe image's features are the same bits on both, so a pass gives the same
bits whatever else runs.

On CUDA the lane queues its kernels on a stream of its own, so that a pass and the runner's
units run on the GPU at once, as they do on two cores (the bulk lane's units share the
runner's stream); the lane waits for its stream before a
result leaves, and marks the features as used on the runner's stream, so that their memory is
not reused while the runner's kernels still read it.

The lane holds no request state. The runner's thread submits jobs by number, cancels the ones no
request waits for any more, and takes the results (`finished`); the lane calls `wake` after each
result so that a runner waiting for work looks at once. Every submitted job gets exactly one
result: its features, the exception its pass raised, or None if it was cancelled before it ran.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from services.engine.hf.budget import synchronize
from services.engine.hf.lane_thread import LaneThread

log = logging.getLogger(__name__)


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
    lane thread `nice` steps below its creator's, with `threads` torch threads (`idle_threads`
    for a pass that starts while `spare()` is true); `wake` is called after each result."""

    def __init__(self, encode: Callable[[Mapping[str, np.ndarray]], torch.Tensor], *,
                 threads: int, idle_threads: int, spare: Callable[[], bool],
                 device: torch.device, wake: Callable[[], None], nice: int = 0) -> None:
        self._encode = encode
        self.threads = threads
        self.idle_threads = idle_threads
        self._spare = spare
        self._device = device
        self._runner_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        """The creating thread's (the runner's) stream, which reads the features (CUDA only)."""
        self._cancelled: set[int] = set()
        """Jobs to skip if not yet started (set by the runner's thread, read by the lane's)."""
        self._thread: LaneThread[tuple[int, Mapping[str, np.ndarray]], VisionResult] = (
            LaneThread("vision-lane", self._pass, nice=nice, wake=wake, context=self._stream))

    def submit(self, job: int, tensors: Mapping[str, np.ndarray]) -> None:
        self._thread.submit((job, tensors))

    def cancel(self, job: int) -> None:
        """Skip `job` if its pass has not started (its result is then None)."""
        self._cancelled.add(job)

    def finished(self) -> list[VisionResult]:
        """The results that have come since the last call."""
        return self._thread.finished()

    def close(self) -> None:
        """End the thread after the pass under way (jobs still queued are dropped)."""
        self._thread.close()

    def _stream(self) -> contextlib.AbstractContextManager[Any]:
        """A stream of the lane's own on CUDA (None: no stream, on the CPU)."""
        stream = None if self._runner_stream is None else torch.cuda.Stream(self._device)
        return torch.cuda.stream(stream)

    def _pass(self, job_tensors: tuple[int, Mapping[str, np.ndarray]]) -> VisionResult:
        job, tensors = job_tensors
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
