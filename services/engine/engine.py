"""The engine role: takes rendered requests, runs them on the model, streams tokens back.

Socket I/O stays at the edges, on threads that own their sockets:

    engine-input    PULL (binds `engine_endpoint`) → decode → receiver cache (applied at
                    receipt, in arrival order; see cache.py) → admission → arrivals queue,
                    and wakes the runner; a frontend's `Hello` is answered at once
    serve (main)    1. admit: validate arrivals, hand the valid ones to the runner; apply aborts
                    2. expire: drop the requests whose deadline has passed
                    3. step: the runner's next outputs; it waits (until woken by an arrival,
                       the next deadline or a short poll for a stop) only while it has none
                    4. reply: turn the runner's outputs into EngineOutput / RequestFailed
    engine-output   replies queue → encode → PUSH to each request's `reply_to`; what a slow
                    frontend's socket does not take yet waits, merged per request (outbox.py)

The runner is whatever the `backend` setting names (runner.py): the engine sees only the
ModelRunner interface.

Every admitted request leaves with exactly one terminal reply: its last EngineOutput
(`finished`), or a RequestFailed (bad input, model error, deadline passed, aborted by its
frontend, engine stopping). A dropped request's KV cache is freed between two units.

At SIGTERM the engine drains: the input thread keeps reading, but answers each new request at
once with a retryable error (after applying its cache updates, which its MM worker has already
committed); the main loop runs the requests it holds until they finish or the drain timeout
passes, then fails the rest. `serve` returns once every one has had its terminal reply.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from msgspec.structs import replace

from mmlane.common.feature_cache import capacity_bytes
from mmlane.common.lifecycle import (
    Stop,
    drain,
    refused_while_draining,
    unfinished_at_drain_timeout,
)
from mmlane.common.memory import keep_freed_memory
from mmlane.common.sockets import Security, make_socket
from mmlane.common.stats import Metrics, log_totals
from mmlane.engine.cache import ReceiverCaches
from mmlane.engine.config import EngineConfig
from mmlane.engine.outbox import RETRY_S, Outbox
from mmlane.engine.runner import RunnerFactory, StepOutput, backend_factory
from mmlane.engine.validation import validate_request
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import (
    CacheMissError,
    FatalError,
    MMLaneError,
    PartlyDecoded,
    RetryableError,
    translate,
)
from mmlane.protocol.messages import (
    AbortRequests,
    EngineCacheReset,
    EngineInput,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    Hello,
    HelloReply,
    RequestFailed,
    ResetEngineCache,
)

log = logging.getLogger(__name__)

POLL_S = 0.1  # how soon the loops notice a stop
CLOSE_FLUSH_S = 2.0
"""At exit, how long replies that wait for a slow frontend may still take to go."""
ABORTS_REMEMBERED = 4096
"""Aborted request ids the engine keeps in mind while it waits to see whether they arrive."""
_REPLY_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class _Held:
    """An admitted request the runner holds, when it was received (`time.monotonic()`), and
    whether its first output (with the prompt) went."""

    request: EngineRequest
    received_at: float
    replied: bool = False


@dataclass(frozen=True)
class _Arrival:
    """A decoded message, and when it was received (`time.monotonic()`)."""

    message: EngineRequest | AbortRequests
    received_at: float


class Engine:
    """The engine role (see the module docstring); `serve` runs it until `stop` is set."""

    def __init__(self, config: EngineConfig, make_runner: RunnerFactory | None = None) -> None:
        """`make_runner` builds the runner (None: the factory of `config.backend`)."""
        self.config = config
        self.endpoint = config.engine_endpoint
        self.metrics = Metrics("engine", config.ops.name)
        self._started_ns = time.time_ns()  # tells a frontend's `Hello` which process answers
        keep_freed_memory()  # each image's tensors are copied at receipt, into reused memory
        self._ctx = zmq.Context()
        self._security = Security.of("engine", config, self.metrics.counters)
        # Bind before loading the model: a taken address fails in a second, not after the load.
        try:
            self._input = make_socket(self._ctx, zmq.PULL, self.endpoint, bind=True,
                                      security=self._security)
        except BaseException:
            self._security.close()
            self._ctx.term()
            raise
        try:
            make_runner = make_runner or backend_factory(config.backend)
            self.runner = make_runner(config, self.metrics)
        except BaseException:
            self._close_sockets()
            raise
        self.caches = ReceiverCaches(capacity_bytes(config.mm_cache_gb))
        log.info("feature cache: %s, engine cache epoch %d",
                 f"up to {config.mm_cache_gb} GiB per MM worker" if config.mm_cache_gb else "off",
                 self.caches.epoch)
        self._arrivals: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[tuple[str, FrontendInput] | None] = queue.SimpleQueue()
        self._capacity = threading.BoundedSemaphore(config.max_queued_requests)
        self._held: dict[int, _Held] = {}
        self._handles = itertools.count()
        self._by_id: dict[str, int] = {}  # request ids are unique: frontends prefix their pid
        # Aborts of requests not here yet (an image request still in its MM worker): refused on
        # arrival instead of run for nobody. Bounded: the oldest are forgotten first.
        self._aborted_early: OrderedDict[str, None] = OrderedDict()
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, handle)
        # serve's: from its signal on, new requests are refused
        self._stop = Stop(config.ops.drain_timeout_s)
        self._stopping = threading.Event()
        self._receiver: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._publish_metrics()

    def _publish_metrics(self) -> None:
        m = self.metrics
        m.model = self.runner.spec.model_id
        m.add_counters(self.caches.counters)
        m.epoch = lambda: self.caches.epoch
        m.in_flight = self._holds
        m.gauge("arrivals", self._arrivals.qsize)
        m.gauge("running", lambda: len(self._held))
        m.gauge("replies", self._replies.qsize)

    # ------------------------------------------------------------ the Role interface

    def serve(self, stop: Stop) -> None:
        self._stop = stop
        self._receiver = _start_thread("engine-input", self._receive_loop)
        self._sender = _start_thread("engine-output", self._send_loop)
        try:
            while not stop.is_set():
                self._turn()
            drain(stop, log, held=self._holds, turn=self._turn)
        finally:
            self._fail_all_held(unfinished_at_drain_timeout("engine", stop))

    def _turn(self) -> None:
        self._admit()  # 1
        now = time.time()
        self._expire(now)  # 2
        try:
            outputs = self.runner.step(self._wait_s(now))  # 3
        except Exception as exc:  # a backend's bug fails what it holds, not the engine
            log.exception("the backend's step failed; failing its %d requests", len(self._held))
            # A FatalError: the backend cannot go on (vLLM's engine core died); the role exits,
            # and its supervisor starts it again.
            fatal = isinstance(exc, FatalError)
            error = (RetryableError(f"the engine's backend stopped: {exc}", code="backend_died")
                     if fatal else translate(exc, "the engine's backend failed"))
            for handle in list(self._held):
                self._drop(handle, error)
            if fatal:
                raise
            return
        for output in outputs:
            self._reply(output)  # 4

    def _wait_s(self, now: float) -> float:
        """How long the runner may wait for outputs: until the next deadline, POLL_S at most
        (so a stop is noticed); an arrival wakes it sooner."""
        if not self._deadlines:
            return POLL_S
        return min(POLL_S, max(0.0, self._deadlines[0][0] - now))

    def close(self) -> None:
        self._stopping.set()
        self._replies.put(None)  # the sender sends what is queued before it, then ends
        for thread in (self._receiver, self._sender):
            if thread is not None:
                thread.join()
        self.runner.close()
        self._close_sockets()
        log_totals(self.metrics)

    # ------------------------------------------------------------ main loop steps

    def _admit(self) -> None:
        """Validate what arrived and hand it to the runner; apply aborts, in arrival order."""
        try:
            while True:
                arrival = self._arrivals.get_nowait()
                if isinstance(arrival.message, AbortRequests):
                    self._abort(arrival.message.request_ids)
                else:
                    self._admit_one(arrival.message, arrival.received_at)
        except queue.Empty:
            pass

    def _admit_one(self, request: EngineRequest, received_at: float) -> None:
        if request.request_id in self._aborted_early:
            del self._aborted_early[request.request_id]
            self.metrics.counters["aborted_before_arrival"] += 1
            self._fail(request, _aborted(request.request_id))
            self._capacity.release()
            return
        if request.deadline and request.deadline <= time.time():
            self.metrics.counters["expired_requests"] += 1
            self._fail(request, _timeout(request))
            self._capacity.release()
            return
        handle = next(self._handles)
        try:
            validate_request(request, self.runner.spec)
            if request.render:
                self._render(request)
                return
            self.runner.add(handle, request, arrived=received_at)
        except Exception as exc:  # a bad request fails alone
            self.metrics.counters["invalid_requests"] += 1
            log.info("refused request %s: %s", request.request_id, exc)
            self._fail(request, translate(exc, f"cannot admit the request: {type(exc).__name__}"))
            self._capacity.release()
            return
        self._held[handle] = _Held(request, received_at)
        self._by_id[request.request_id] = handle
        if request.deadline:
            heapq.heappush(self._deadlines, (request.deadline, handle))

    def _render(self, request: EngineRequest) -> None:
        """Answer a render request with its GenerateRequest (wire.py): it takes no runner."""
        from mmlane.engine.wire import generate_body  # the model's pixels: torch, not at import

        body = msgspec.json.encode(generate_body(request, self.runner.spec))
        self.metrics.counters["rendered_requests"] += 1
        self._replies.put((request.reply_to, EngineOutput(
            request_id=request.request_id, token_ids=[], finished=True, finish_reason="stop",
            prompt_token_ids=request.prompt_token_ids, rendered=body)))
        self._capacity.release()

    def _expire(self, now: float) -> None:
        """Drop every held request whose deadline has passed, with a 'timeout' error."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, handle = heapq.heappop(self._deadlines)
            held = self._held.get(handle)
            if held is not None:  # else it finished before its deadline
                self.metrics.counters["expired_requests"] += 1
                self._drop(handle, _timeout(held.request))

    def _abort(self, request_ids: list[str]) -> None:
        """Drop the held requests named; the others are remembered, to be refused if they
        arrive later (from an MM worker that had not sent them yet)."""
        for request_id in request_ids:
            handle = self._by_id.get(request_id)
            if handle is None:
                self._aborted_early[request_id] = None
                if len(self._aborted_early) > ABORTS_REMEMBERED:
                    self._aborted_early.popitem(last=False)
                continue
            self.metrics.counters["aborted_requests"] += 1
            self._drop(handle, _aborted(request_id))

    def _drop(self, handle: int, error: MMLaneError) -> None:
        """End a held request with `error` and free what the runner holds for it."""
        self.runner.abort(handle)
        self._fail(self._held[handle].request, error)
        self._release(handle)

    def _release(self, handle: int) -> None:
        request = self._held.pop(handle).request
        if self._by_id.get(request.request_id) == handle:
            del self._by_id[request.request_id]
        self._capacity.release()

    def _reply(self, output: StepOutput) -> None:
        held = self._held[output.handle]
        request = held.request
        message: FrontendInput
        self.metrics.counters["tokens_out"] += len(output.token_ids)
        if output.error is not None:
            self.metrics.errors[output.error.code] += 1
            message = RequestFailed(request_id=request.request_id, error=output.error.to_info())
        else:
            message = EngineOutput(
                request_id=request.request_id,
                token_ids=output.token_ids,
                finished=output.finished,
                finish_reason=output.finish_reason,
                prompt_token_ids=None if held.replied else request.prompt_token_ids,
                logprobs=output.logprobs,
            )
        if not held.replied and output.token_ids:  # whichever backend runs the model
            kind = "image" if request.mm_items else "text"
            self.metrics.observe(f"first_token:{kind}", time.monotonic() - held.received_at)
        held.replied = True
        self._replies.put((request.reply_to, message))
        if output.finished:
            self._release(output.handle)

    def _holds(self) -> int:
        """Requests admitted or waiting to be (and aborts not yet applied)."""
        return len(self._held) + self._arrivals.qsize()

    def _fail_all_held(self, error: MMLaneError) -> None:
        """At the end: every request not yet answered gets `error`, then the replies go."""
        self._stopping.set()
        if self._receiver is not None:  # once it has ended, nothing new arrives
            self._receiver.join()
        waiting = []
        while not self._arrivals.empty():
            message = self._arrivals.get_nowait().message
            if isinstance(message, EngineRequest):
                waiting.append(message)
        for request in waiting + [h.request for h in self._held.values()]:
            self._fail(request, error)
        for handle in list(self._held):
            self.runner.abort(handle)
        self._held.clear()

    def _fail(self, request: EngineRequest, error: MMLaneError) -> None:
        self.metrics.errors[error.code] += 1
        failed = RequestFailed(request_id=request.request_id, error=error.to_info())
        self._replies.put((request.reply_to, failed))

    # ------------------------------------------------------------ socket threads

    def _receive_loop(self) -> None:
        codec: Codec[EngineRequest | AbortRequests | ResetEngineCache | Hello] = Codec(
            EngineInput, accept_shm=self.config.engine_endpoint.startswith("ipc://"))
        while not self._stopping.is_set():
            if self._input.poll(int(POLL_S * 1000)):
                self._receive(codec, self._input.recv_multipart(copy=False))

    def _receive(
        self, codec: Codec[EngineRequest | AbortRequests | ResetEngineCache | Hello],
        frames: list[Any],
    ) -> None:
        received_at = time.monotonic()
        self.metrics.counters["bytes_in"] += sum(len(frame) for frame in frames)
        try:
            request = codec.decode(frames)
        except PartlyDecoded as exc:  # shared-memory tensors gone (its MM worker restarted, or
            self.metrics.counters[exc.counter] += 1  # they waited a minute unread) or refused
            log.warning("%s", exc)
            lost = exc.decoded
            if isinstance(lost, EngineRequest) and lost.reply_to.startswith(_REPLY_SCHEMES):
                self._fail(lost, exc)
            return
        except Exception as exc:  # garbage has no reply address: count, log, drop
            self.metrics.counters["invalid_messages"] += 1
            count = self.metrics.counters["invalid_messages"]
            log.warning("dropped an undecodable message (%d so far): %s", count, exc)
            return
        if isinstance(request, AbortRequests):  # takes no capacity; ordered after its requests
            self._arrive(_Arrival(request, received_at))
            return
        if isinstance(request, ResetEngineCache):
            self._reset_cache(request)
            return
        if isinstance(request, Hello):
            reply = HelloReply(peer=request.peer, started=self._started_ns)
            self._replies.put((request.reply_to, reply))
            return
        self.metrics.counters["requests"] += 1
        try:  # cache updates apply at receipt, in arrival order, before anything can refuse it
            request = self.caches.receive(request)
        except CacheMissError as exc:
            log.info("request %s: %s", request.request_id, exc)
            self._fail(request, exc)
            return
        except Exception as exc:  # a bug must not stop this thread; start the caches over
            log.exception("request %s: receiver cache failed", request.request_id)
            self.caches.reset()
            self._fail(request, translate(exc, "internal error in the receiver cache"))
            return
        if not request.reply_to.startswith(_REPLY_SCHEMES):
            self.metrics.counters["invalid_messages"] += 1
            log.warning("dropped request %s: reply_to %r is no ZMQ address",
                        request.request_id, request.reply_to)
            return
        if self._stop.is_set():
            self.metrics.counters["refused_draining"] += 1
            self._fail(request, refused_while_draining("engine"))
            return
        if not self._capacity.acquire(blocking=False):
            self.metrics.counters["overloaded"] += 1
            limit = self.config.max_queued_requests
            self._fail(request, RetryableError(
                f"engine overloaded: it holds {limit} requests (max_queued_requests)",
                code="overloaded",
            ))
            return
        self._arrive(_Arrival(request, received_at))

    def _arrive(self, arrival: _Arrival) -> None:
        """Queue it for the main loop, and end the runner's wait so the loop admits it now."""
        self._arrivals.put(arrival)
        self.runner.wake()

    def _reset_cache(self, message: ResetEngineCache) -> None:
        """Drop every receiver cache now, between two arrivals; MM workers follow the epoch."""
        epoch = self.caches.reset()
        self.metrics.counters["cache_resets"] += 1
        log.info("receiver caches dropped on request: engine cache epoch %d", epoch)
        reset = EngineCacheReset(request_id=message.request_id, engine_epoch=epoch)
        self._replies.put((message.reply_to, reset))

    def _send_loop(self) -> None:
        outbox = Outbox(self._ctx, self._security, self.metrics, self._stamped)
        try:
            while True:
                try:
                    item = self._replies.get(timeout=RETRY_S if outbox.busy else None)
                except queue.Empty:
                    outbox.flush()
                    continue
                if item is None:  # the end: what is queued before it has gone, or waits
                    break
                outbox.flush()
                outbox.send(*item)
        finally:
            outbox.close(within_s=CLOSE_FLUSH_S)

    def _stamped(self, message: FrontendInput) -> FrontendInput:
        """A reply as it leaves: with the engine's cache epoch then, so frontends see the
        epochs in the order they began."""
        if isinstance(message, (EngineOutput, RequestFailed, HelloReply)):
            return replace(message, engine_epoch=self.caches.epoch)
        return message

    def _close_sockets(self) -> None:
        self._input.close(linger=0)
        self._security.close()
        self._ctx.term()


def _start_thread(name: str, target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _aborted(request_id: str) -> RetryableError:
    return RetryableError(f"request {request_id} aborted by its frontend", code="aborted")


def _timeout(request: EngineRequest) -> RetryableError:
    late = time.time() - request.deadline
    return RetryableError(
        f"request {request.request_id} passed its deadline {late:.3f} s ago", code="timeout"
    )

