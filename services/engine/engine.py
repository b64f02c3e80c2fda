"""The engine role: takes rendered requests, runs them on the model, streams tokens back.

Socket I/O stays at the edges, on threads that own their sockets:

    engine-input    PULL (binds `input_endpoint`) → decode → admission → arrivals queue
    serve (main)    1. admit: validate arrivals, hand the valid ones to the runner
                    2. step: the runner advances each request in progress by one unit
                    3. reply: turn the runner's outputs into EngineOutput / RequestFailed
    engine-output   replies queue → encode → PUSH to each request's `reply_to`

Every admitted request leaves with exactly one terminal reply: its last EngineOutput
(`finished`), or a RequestFailed (bad input, model error, engine stopping).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from protocol.codec import Codec
from protocol.errors import MMLaneError, RequestError, RetryableError
from protocol.messages import (
    EngineInput,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    RequestFailed,
)
from services.common.config import EngineConfig
from services.common.sockets import ReplySockets, make_socket
from services.engine.hf_runner import HFRunner
from services.engine.runner import ModelRunner, StepOutput
from services.engine.validation import validate_request

log = logging.getLogger(__name__)

POLL_S = 0.1  # how soon the loops notice a stop
_REPLY_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class _Held:
    """An admitted request the runner holds, and whether its first output (with the prompt) went."""

    request: EngineRequest
    replied: bool = False


class Engine:
    """The engine role (see the module docstring); `serve` runs it until `stop` is set."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.endpoint = config.input_endpoint
        self.counters: Counter[str] = Counter()
        self._ctx = zmq.Context()
        # Bind before loading the model: a taken address fails in a second, not after the load.
        self._input = make_socket(self._ctx, zmq.PULL, self.endpoint, bind=True)
        try:
            self.runner = runner or HFRunner.load(config.model, config.device)
        except BaseException:
            self._close_sockets()
            raise
        self._arrivals: queue.SimpleQueue[EngineRequest] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[tuple[str, FrontendInput] | None] = queue.SimpleQueue()
        self._capacity = threading.BoundedSemaphore(config.max_queued_requests)
        self._held: dict[int, _Held] = {}
        self._handles = itertools.count()
        self._stopping = threading.Event()
        self._receiver: threading.Thread | None = None
        self._sender: threading.Thread | None = None

    # ------------------------------------------------------------ the Role interface

    def serve(self, stop: threading.Event) -> None:
        self._receiver = _start_thread("engine-input", self._receive_loop)
        self._sender = _start_thread("engine-output", self._send_loop)
        try:
            while not stop.is_set():
                self._admit(wait=not self.runner.has_work())  # 1
                for output in self.runner.step():  # 2
                    self._reply(output)  # 3
        finally:
            self._drain()

    def close(self) -> None:
        self._stopping.set()
        self._replies.put(None)  # the sender sends what is queued before it, then ends
        for thread in (self._receiver, self._sender):
            if thread is not None:
                thread.join()
        self._close_sockets()

    # ------------------------------------------------------------ main loop steps

    def _admit(self, *, wait: bool) -> None:
        """Validate what arrived and hand it to the runner; when idle, wait briefly for work."""
        try:
            request = self._arrivals.get(timeout=POLL_S) if wait else self._arrivals.get_nowait()
            while True:
                self._admit_one(request)
                request = self._arrivals.get_nowait()
        except queue.Empty:
            pass

    def _admit_one(self, request: EngineRequest) -> None:
        handle = next(self._handles)
        try:
            validate_request(request, self.runner.spec)
            self.runner.add(handle, request)
        except Exception as exc:  # a bad request fails alone
            self.counters["invalid_requests"] += 1
            log.info("refused request %s: %s", request.request_id, exc)
            self._fail(request, _as_request_error(exc))
            self._capacity.release()
            return
        self._held[handle] = _Held(request)

    def _reply(self, output: StepOutput) -> None:
        held = self._held[output.handle]
        request = held.request
        message: FrontendInput
        if output.error is not None:
            self.counters["failed_requests"] += 1
            message = RequestFailed(request_id=request.request_id, error=output.error.to_info())
        else:
            message = EngineOutput(
                request_id=request.request_id,
                token_ids=output.token_ids,
                finished=output.finished,
                finish_reason=output.finish_reason,
                prompt_token_ids=None if held.replied else request.prompt_token_ids,
            )
        held.replied = True
        self._replies.put((request.reply_to, message))
        if output.finished:
            del self._held[output.handle]
            self._capacity.release()

    def _drain(self) -> None:
        """At stop: every request not yet answered gets a retryable error, then the replies go."""
        self._stopping.set()
        if self._receiver is not None:  # once it has ended, nothing new arrives
            self._receiver.join()
        waiting = []
        while not self._arrivals.empty():
            waiting.append(self._arrivals.get_nowait())
        held = [h.request for h in self._held.values()]
        if waiting or held:
            log.info("draining %d requests", len(waiting) + len(held))
        error = RetryableError("the engine is stopping", code="peer_restarted")
        for request in waiting + held:
            self._fail(request, error)
        for handle in list(self._held):
            self.runner.abort(handle)
        self._held.clear()

    def _fail(self, request: EngineRequest, error: MMLaneError) -> None:
        failed = RequestFailed(request_id=request.request_id, error=error.to_info())
        self._replies.put((request.reply_to, failed))

    # ------------------------------------------------------------ socket threads

    def _receive_loop(self) -> None:
        codec: Codec[EngineRequest] = Codec(EngineInput)
        while not self._stopping.is_set():
            if self._input.poll(int(POLL_S * 1000)):
                self._receive(codec, self._input.recv_multipart(copy=False))

    def _receive(self, codec: Codec[EngineRequest], frames: list[Any]) -> None:
        try:
            request = codec.decode(frames)
        except Exception as exc:  # garbage has no reply address: count, log, drop
            self.counters["invalid_messages"] += 1
            count = self.counters["invalid_messages"]
            log.warning("dropped an undecodable message (%d so far): %s", count, exc)
            return
        if not request.reply_to.startswith(_REPLY_SCHEMES):
            self.counters["invalid_messages"] += 1
            log.warning("dropped request %s: reply_to %r is no ZMQ address",
                        request.request_id, request.reply_to)
            return
        if not self._capacity.acquire(blocking=False):
            self.counters["overloaded"] += 1
            limit = self.config.max_queued_requests
            self._fail(request, RetryableError(
                f"engine overloaded: it holds {limit} requests (max_queued_requests)",
                code="overloaded",
            ))
            return
        self._arrivals.put(request)

    def _send_loop(self) -> None:
        codec: Codec[Any] = Codec(FrontendInput)
        replies = ReplySockets(self._ctx)
        try:
            while (item := self._replies.get()) is not None:
                reply_to, message = item
                try:
                    replies.send(reply_to, codec.encode(message))
                except zmq.ZMQError as exc:  # e.g. a reply_to that is no ZMQ address
                    log.warning("cannot reply to %r: %s", reply_to, exc)
        finally:
            replies.close()

    def _close_sockets(self) -> None:
        self._input.close(linger=0)
        self._ctx.term()


def _start_thread(name: str, target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _as_request_error(exc: Exception) -> MMLaneError:
    if isinstance(exc, MMLaneError):
        return exc
    return RequestError(f"invalid request: {type(exc).__name__}: {exc}")
