"""The engine's replies to its frontends, sent from the engine-output thread; none lost to a
frontend that reads slower than the engine makes tokens.

A reply goes out at once when its frontend's socket takes it. A burst of one-token outputs
(a short prompt decoding thousands of tokens, a busy machine) can fill a frontend's queue: the
high-water marks of both sockets and the kernel's buffer between them. Then that frontend's
replies wait here, in order, and go as soon as its socket takes them again (`flush`, called
every RETRY_S while any wait). While a request's output waits, the request's next outputs are
merged into it (their tokens and logprobs joined; the last one's finish), so a slow frontend
costs a message or two per request it holds, not one per token. Each request's messages keep
their order; the epoch a message carries is the engine's as it leaves (`stamp`).

A frontend that takes nothing for `give_up_s` is taken to be gone: what waits for it is dropped,
counted (`replies_dropped`) and logged; a frontend restarted since fails what it had sent anyway.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from itertools import count
from typing import Any

import zmq
from msgspec.structs import replace

from mmlane.common.sockets import ReplySockets, Security
from mmlane.common.stats import Metrics
from mmlane.protocol.codec import Codec
from mmlane.protocol.messages import EngineOutput, FrontendInput

log = logging.getLogger(__name__)

RETRY_S = 0.005
"""How often replies that wait are offered to their frontend's socket again."""
GIVE_UP_S = 60.0
"""How long a frontend may take none of its replies before they are dropped."""


class _Waiting:
    """A frontend's replies that its socket has not taken yet, in order; a request's outputs
    merged into its last one still waiting."""

    def __init__(self, now: float) -> None:
        self.messages: OrderedDict[int, FrontendInput] = OrderedDict()
        self.last_output: dict[str, int] = {}
        """Request id -> the key of its output still waiting, while nothing follows it."""
        self.progress = now
        """When the frontend last took a reply (or began to wait)."""

    def add(self, key: int, message: FrontendInput) -> None:
        request_id = getattr(message, "request_id", None)
        at = self.last_output.pop(request_id, None) if request_id is not None else None
        if at is not None and isinstance(message, EngineOutput):
            self.messages[at] = _joined(self.messages[at], message)  # type: ignore[arg-type]
            if not message.finished:
                self.last_output[message.request_id] = at
            return
        self.messages[key] = message
        if isinstance(message, EngineOutput) and not message.finished:
            self.last_output[message.request_id] = key

    def first(self) -> FrontendInput:
        return next(iter(self.messages.values()))

    def sent_first(self, now: float) -> None:
        key, message = self.messages.popitem(last=False)
        request_id = getattr(message, "request_id", None)
        if request_id is not None and self.last_output.get(request_id) == key:
            del self.last_output[request_id]
        self.progress = now


def _joined(first: EngineOutput, then: EngineOutput) -> EngineOutput:
    """Two outputs of one request, in order, as one."""
    logprobs = None if first.logprobs is None else first.logprobs + (then.logprobs or [])
    return replace(first, token_ids=first.token_ids + then.token_ids, finished=then.finished,
                   finish_reason=then.finish_reason, logprobs=logprobs)


class Outbox:
    """Sends each reply to its `reply_to` (see the module docstring). One thread's: its
    sockets are."""

    def __init__(self, ctx: zmq.Context, security: Security, metrics: Metrics,
                 stamp: Callable[[FrontendInput], FrontendInput],
                 give_up_s: float = GIVE_UP_S) -> None:
        self._sockets = ReplySockets(ctx, security=security)
        self._codec: Codec[Any] = Codec(FrontendInput)
        self._metrics = metrics
        self._stamp = stamp
        self._give_up_s = give_up_s
        self._waiting: dict[str, _Waiting] = {}
        self._keys = count()
        metrics.gauge("replies_waiting", self.waiting)

    @property
    def busy(self) -> bool:
        """Whether any reply waits (then `flush` is due every RETRY_S)."""
        return bool(self._waiting)

    def waiting(self) -> int:
        """Replies waiting for their frontend's socket."""
        return sum(len(w.messages) for w in list(self._waiting.values()))

    def send(self, reply_to: str, message: FrontendInput) -> None:
        """Send now, or keep it behind what already waits for the same frontend."""
        waiting = self._waiting.get(reply_to)
        if waiting is None:
            if self._offer(reply_to, message):
                return
            waiting = self._waiting[reply_to] = _Waiting(time.monotonic())
        self._metrics.counters["replies_waited"] += 1
        waiting.add(next(self._keys), message)

    def flush(self) -> None:
        """Offer each frontend's waiting replies, in order, as far as its socket takes them;
        drop those of a frontend that has taken nothing for `give_up_s`."""
        now = time.monotonic()
        for reply_to, waiting in list(self._waiting.items()):
            while waiting.messages and self._offer(reply_to, waiting.first()):
                waiting.sent_first(now)
            if not waiting.messages:
                del self._waiting[reply_to]
            elif now - waiting.progress > self._give_up_s:
                del self._waiting[reply_to]
                self._metrics.counters["replies_dropped"] += len(waiting.messages)
                log.warning("dropped %d replies to %s: it took none for %.0f s",
                            len(waiting.messages), reply_to, now - waiting.progress)

    def close(self, within_s: float) -> None:
        """Send what waits, for `within_s` at most, then drop the rest (logged)."""
        deadline = time.monotonic() + within_s
        while self._waiting and time.monotonic() < deadline:
            self.flush()
            time.sleep(RETRY_S)
        left = self.waiting()
        if left:
            self._metrics.counters["replies_dropped"] += left
            log.warning("dropped %d replies at exit: their frontends took none", left)
        self._waiting.clear()
        self._sockets.close()

    def _offer(self, reply_to: str, message: FrontendInput) -> bool:
        """Whether the frontend's socket took the message (a bad address: dropped, logged)."""
        frames = self._codec.encode(self._stamp(message))
        try:
            sent = self._sockets.send(reply_to, frames)
        except zmq.ZMQError as exc:  # e.g. a reply_to that is no ZMQ address
            log.warning("cannot reply to %r: %s", reply_to, exc)
            return True
        if sent:
            self._metrics.counters["bytes_out"] += sum(len(frame) for frame in frames)
        return sent
