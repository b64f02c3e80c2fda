"""What both vLLM backends' runners share: requests run as asyncio tasks on a thread of their own,
and what a request is to vLLM (its images' hashes, the finish reasons, vLLM's refusals).

The engine's main thread calls `add`, `step` and `abort` (the ModelRunner interface), which hand
work to the loop thread and take outputs from a queue: `add` starts the request's task
(`_run`, the backend's), which puts its outputs; `abort` cancels it, and no output of an
aborted request is returned after that.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from mmlane.engine.runner import StepOutput
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import EngineRequest

T = TypeVar("T")
FINISH_REASONS = frozenset({"stop", "length"})
"""The finish reasons StepOutput takes; any other of vLLM's (abort, error) ends a request with
an error."""


def refusal(message: str) -> RequestError:
    """vLLM's refusal of a request (its message) as the request's error."""
    code = "prompt_too_long" if "maximum model length" in message else "invalid_request"
    return RequestError(f"vLLM refused the request: {message}", code=code)


class LoopRunner:
    """The loop thread, named `thread_name`, and the queue of outputs (see the module
    docstring); a backend's runner implements `_run`."""

    def __init__(self, thread_name: str) -> None:
        self._outputs: queue.SimpleQueue[StepOutput | None] = queue.SimpleQueue()
        self._live: set[int] = set()  # main thread: handles whose outputs still count
        self._tasks: dict[int, asyncio.Task[None]] = {}  # loop thread only
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name,
                                        daemon=True)
        self._thread.start()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def add(self, handle: int, request: EngineRequest, *, arrived: float | None = None) -> None:
        self._live.add(handle)
        self._loop.call_soon_threadsafe(self._spawn, handle, request)

    def step(self, timeout: float) -> list[StepOutput]:
        return self._ready(timeout)

    def _ready(self, timeout: float) -> list[StepOutput]:
        """The outputs put so far of requests not aborted, waiting up to `timeout` for one; no
        more than were queued once the first came. The loop thread may put them as fast as
        they are taken (a replica streaming hundreds of tokens a second): taking until none is
        left kept the engine's turn from its deadlines and arrivals until the stream ended."""
        try:
            items = [self._outputs.get(timeout=timeout)]
        except queue.Empty:
            return []
        items += [self._outputs.get_nowait() for _ in range(self._outputs.qsize())]  # one taker
        outputs: list[StepOutput] = []
        for item in items:
            if item is not None and item.handle in self._live:
                outputs.append(item)
                if item.finished:
                    self._live.discard(item.handle)
        return outputs

    def wake(self) -> None:
        self._outputs.put(None)

    def abort(self, handle: int) -> None:
        self._live.discard(handle)
        self._loop.call_soon_threadsafe(self._cancel, handle)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------ on the loop thread

    def _spawn(self, handle: int, request: EngineRequest) -> None:
        self._tasks[handle] = self._loop.create_task(self._task(handle, request))

    async def _task(self, handle: int, request: EngineRequest) -> None:
        try:
            await self._run(handle, request)
        finally:
            self._tasks.pop(handle, None)

    def _cancel(self, handle: int) -> None:
        task = self._tasks.pop(handle, None)
        if task is not None:
            task.cancel()

    async def _run(self, handle: int, request: EngineRequest) -> None:
        """Run the request, putting its outputs: the last has `finished` set."""
        raise NotImplementedError
