"""A thread that runs one kind of the runner's work beside the runner's own thread, in order.

The runner hands two kinds of work off its thread, so that text requests never wait for them:
images' vision passes (the vision lane, vision_lane.py) and image prompts' prefill units (the
bulk lane, runner.py). Each lane's thread runs `nice` steps below the runner's (`--image-nice`):
where cores are shared, a text request's unit takes one first. torch releases the GIL inside its
operations, so the lanes and the runner run at once on as many cores.

The creator submits jobs and takes the results (`finished`) on its own thread; the lane calls
`wake` after each result, so that a runner waiting for work looks at once. Every job submitted
before `close` gets exactly one result, in submission order, unless `close` drops it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from services.common.lifecycle import lower_priority

CLOSE_TIMEOUT_S = 10.0
"""How long `close` waits for the job under way to end."""

Job = TypeVar("Job")
Result = TypeVar("Result")


class LaneThread(Generic[Job, Result]):
    """Runs `work(job)` for each submitted job, in order, on a thread `nice` steps below its
    creator's, in torch's inference mode and in `context()` (made on that thread: e.g. a CUDA
    stream of its own); `wake` is called after each result."""

    def __init__(self, name: str, work: Callable[[Job], Result], *, nice: int,
                 wake: Callable[[], None],
                 context: Callable[[], contextlib.AbstractContextManager[Any]] = (
                     contextlib.nullcontext)) -> None:
        self._work = work
        self._nice = nice
        self._wake = wake
        self._context = context
        self._jobs: queue.SimpleQueue[tuple[Job] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put((job,))

    def finished(self) -> list[Result]:
        """The results that have come since the last call."""
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def close(self) -> None:
        """End the thread after the job under way (jobs still queued are dropped)."""
        while True:  # what is queued will not be waited for
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        lower_priority(self._nice)
        with torch.inference_mode(), self._context():
            while (job := self._jobs.get()) is not None:
                self._results.put(self._work(job[0]))
                self._wake()
