"""The bench's side of mmlane's native API: many requests in flight, each one's times recorded.

`mmlane.client.Client` waits for whole replies; the bench needs every request's submit, first
output and last reply times, with requests submitted from several threads at chosen moments. So
one I/O thread owns one DEALER socket: `submit()` puts pre-encoded frames in its `Mailbox`, it
stamps `submitted` right before the send, and stamps `first_output` and `finished` as
the replies arrive. Times are `time.monotonic()`, the clock the in-process server's handoff times
use too (CLOCK_MONOTONIC on Linux: one clock for every process).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from bench.loop import Mailbox, received
from mmlane.common.sockets import make_socket
from mmlane.protocol.codec import Codec
from mmlane.protocol.messages import ChatError, ChatMessage, ChatRequest, ClientReply

log = logging.getLogger(__name__)

POLL_MS = 100


@dataclass(eq=False)
class Record:
    """One request the bench sent and what became of it."""

    kind: str
    """text, image or probe."""
    phase: str
    request_class: str = "text"
    """What `engine_service_ms` is keyed by: 'text', or the image sizes joined by '+'."""
    images: int = 0
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    submitted: float | None = None
    first_output: float | None = None
    finished: float | None = None
    error: str | None = None
    """The error code of a failed request."""
    done: threading.Event = field(default_factory=threading.Event)


def request_frames(record: Record, messages: list[ChatMessage], max_tokens: int) -> list[Any]:
    """The frames of `record`'s chat request; callable from any thread (encode big ones ahead).

    A chat request carries no arrays, so it is one msgpack frame: what `Codec.encode` makes.
    """
    request = ChatRequest(request_id=record.request_id, messages=messages, max_tokens=max_tokens)
    return [msgspec.msgpack.encode(request)]


class BenchClient:
    """Sends chat requests on one DEALER socket and records when their replies come back."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, endpoint, bind=False, linger_ms=0)
        self._codec: Codec[Any] = Codec(ClientReply)
        self._outbox: Mailbox[tuple[list[Any], Record]] = Mailbox()
        self._pending: dict[str, Record] = {}
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-client-io", daemon=True)
        self._thread.start()

    def submit(self, record: Record, frames: list[Any]) -> Record:
        """Send now (from any thread); `record.done` is set when its terminal reply arrives."""
        self._outbox.put((frames, record))
        return record

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        self._ctx.destroy(linger=0)
        self._outbox.close()

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the I/O thread

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._outbox.fd, zmq.POLLIN)
        while not self._closing.is_set():
            ready = dict(poller.poll(POLL_MS))
            if self._outbox.fd in ready:
                self._send_queued()
            if self._sock in ready:
                self._receive()

    def _send_queued(self) -> None:
        for frames, record in self._outbox.take_all():
            self._pending[record.request_id] = record
            record.submitted = time.monotonic()
            self._sock.send_multipart(frames, copy=False)

    def _receive(self) -> None:
        for frames in received(self._sock):
            now = time.monotonic()
            reply = self._codec.decode(frames)
            record = self._pending.get(reply.request_id)
            if record is None:
                log.warning("a reply for unknown request %r", reply.request_id)
                continue
            if record.first_output is None:
                record.first_output = now
            if isinstance(reply, ChatError):
                record.error = reply.error.code
            elif not reply.finished:
                continue
            record.finished = now
            del self._pending[reply.request_id]
            record.done.set()
