"""Stand-in peers: the test plays a role's neighbours on real ZMQ sockets, with the real codec.

    Inbox            where a role sends to the test: a bound PULL socket (an engine's input, a
                     frontend's reply socket, an MM worker's job socket) or a native client's
                     DEALER; it decodes each message and keeps them all, in arrival order, but
                     answers a frontend's Hello at once, as a role does
    StandInEngine    an Inbox of EngineInput that answers a request when the test says so
    StandInFrontend  pushes requests or jobs to a role and takes its replies on `reply_to`
    push, send       a PUSH socket to a role, and sending messages on any socket
    wait_for_stats   waits for a role's published Stats to show something (requests held);
    counters, counter
                     a role's counters now, or once one reaches a value
    stand_in_pool_process
                     an MM worker's pool process that puts pixels into its slots as the real
                     one does, but may name them wrongly
    wait_until       polls for what no socket tells us (a log line, a process's state)
    mixed_load, image_request, all_ok, one_reply_each
                     a native client's load on a whole pipeline, and its replies checked

Sockets have linger 0 (but a StandInEngine's answers, which flush on close) and are closed by
their owner's `close()` or `with` block. An Inbox bound to `tcp://127.0.0.1:0` gets a free port
and reports it in `endpoint`; a frontend started with `--port 0` reports its port in its Ready
(`Child.endpoint`). Every wait is bounded (PATIENCE_S unless told): a hang fails with a message
saying what never came, it never passes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
import zmq

from bench.images import jpeg_uri
from mmlane.client import ChatResult, Client, user_message
from mmlane.common.sockets import ReplySockets, bound_endpoint, make_socket
from mmlane.launcher import Child
from mmlane.mm_worker.worker import SHM_MIN_BYTES
from mmlane.ops.discovery import Targets
from mmlane.ops.feed import StatsFeed
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import RetryableError
from mmlane.protocol.messages import (
    ChatError,
    ClientReply,
    EngineInput,
    EngineOutput,
    FrontendInput,
    Hello,
    HelloReply,
    RequestFailed,
    Stats,
)

PATIENCE_S = 60.0
"""The longest any wait for a peer may take."""
SERVE_READY = "mmlane ready:"
"""What `mmlane serve` prints on stdout once every role is ready (each role logs its own 'ready
on' line before that, on stderr)."""

T = TypeVar("T")
InboxT = TypeVar("InboxT", bound="Inbox")


def is_terminal(reply: Any) -> bool:
    """Whether `reply` is the last one its request gets (a failure, or the finished output)."""
    return isinstance(reply, RequestFailed | ChatError) or reply.finished


def by_request(messages: Iterable[Any]) -> dict[str, list[Any]]:
    """`messages` grouped by request id, each group in arrival order."""
    grouped: dict[str, list[Any]] = {}
    for message in messages:
        grouped.setdefault(message.request_id, []).append(message)
    return grouped


def push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A PUSH socket connected to a role's input (linger 0)."""
    return make_socket(ctx, zmq.PUSH, endpoint, bind=False, linger_ms=0)


def send(sock: zmq.Socket, *messages: msgspec.Struct) -> None:
    """Send each message as the real codec frames it (msgpack body, then any arrays)."""
    codec: Codec[Any] = Codec(Any)
    for message in messages:
        sock.send_multipart(codec.encode(message), copy=False)


def frames_for(tensors: Iterable[np.ndarray], shm: bool = True) -> int:
    """How many frames a role sends a message with these tensors in: the msgpack body, then one
    per array; over ipc (`shm`) none for those large enough to go through shared memory
    (services/mm_worker/worker.py)."""
    return 1 + sum(1 for tensor in tensors if not shm or tensor.nbytes < SHM_MIN_BYTES)


class Inbox:
    """Where a role sends to the test, and every message it sent there, in arrival order."""

    def __init__(self, sock: zmq.Socket, endpoint: str, union: Any) -> None:
        self.sock = sock
        self.endpoint = endpoint
        # As a role reading an ipc socket does: it takes tensors sent through shared memory.
        self.codec: Codec[Any] = Codec(union, accept_shm=endpoint.startswith("ipc://"))
        self.received: list[Any] = []
        self.started = time.time_ns()
        """What it answers a `Hello` with: the start of the process it stands in for."""
        self._hello_replies: ReplySockets | None = None

    @classmethod
    def bound(cls: type[InboxT], ctx: zmq.Context, endpoint: str, union: Any) -> InboxT:
        """A PULL socket standing in for a peer's input, decoding messages of `union`."""
        sock = make_socket(ctx, zmq.PULL, endpoint, bind=True, linger_ms=0)
        return cls(sock, bound_endpoint(sock), union)

    @classmethod
    def client(cls, ctx: zmq.Context, endpoint: str) -> Inbox:
        """A native client of the frontend at `endpoint` (it sends with `send(inbox.sock)`)."""
        sock = make_socket(ctx, zmq.DEALER, endpoint, bind=False, linger_ms=0)
        return cls(sock, endpoint, ClientReply)

    def __enter__(self: InboxT) -> InboxT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._hello_replies is not None:
            self._hello_replies.close()
        self.sock.close(linger=0)

    def take_frames(self, timeout_s: float = PATIENCE_S) -> tuple[Any, int]:
        """The next message (kept in `received`) and how many frames it came in."""
        taken = self._next(timeout_s)
        assert taken is not None, (
            f"nothing arrived at {self.endpoint} within {timeout_s:g} s; before that "
            f"{len(self.received)} messages, the last {repr(self.received[-1:])[:300]}")
        self.received.append(taken[0])
        return taken

    def _next(self, timeout_s: float) -> tuple[Any, int] | None:
        """The next message but a Hello (answered here), or None if none came in time."""
        while self.sock.poll(int(timeout_s * 1000)):
            frames = self.sock.recv_multipart(copy=False)
            message = self.codec.decode(frames)
            if not isinstance(message, Hello):
                return message, len(frames)
            self._answer(message)
        return None

    def greet(self, timeout_s: float = PATIENCE_S) -> None:
        """Answer the Hello a frontend sends first on connecting, as the peer does (its /health
        waits for the engine's answer)."""
        assert self.sock.poll(int(timeout_s * 1000)), \
            f"no Hello at {self.endpoint} within {timeout_s:g} s"
        message = self.codec.decode(self.sock.recv_multipart(copy=False))
        assert isinstance(message, Hello), message
        self._answer(message)

    def _answer(self, hello: Hello) -> None:
        if self._hello_replies is None:
            self._hello_replies = ReplySockets(self.sock.context)
        reply = HelloReply(peer=hello.peer, started=self.started)
        self._hello_replies.send(hello.reply_to, Codec(FrontendInput).encode(reply))

    def take(self, timeout_s: float = PATIENCE_S) -> Any:
        """The next message (kept in `received`)."""
        return self.take_frames(timeout_s)[0]

    def take_until_answered(self, request_ids: Iterable[str], since: int = 0) -> dict[str, list]:
        """Read on (as a peer does) until each request has had a terminal reply among
        `received[since:]`; those messages, by request."""
        waiting = set(request_ids) - {
            m.request_id for m in self.received[since:] if is_terminal(m)
        }
        while waiting:
            message = self.take()
            if is_terminal(message):
                waiting.discard(message.request_id)
        return by_request(self.received[since:])

    def take_all(self, wait_s: float = 0.5) -> None:
        """Everything still arriving within `wait_s` (after the sender exited: all it sent)."""
        while (taken := self._next(wait_s)) is not None:
            self.received.append(taken[0])

    def assert_quiet(self, wait_ms: int = 200) -> None:
        unexpected = self._next(wait_ms / 1000)
        assert unexpected is None, f"unexpected message at {self.endpoint}: {unexpected}"

    def by_request(self) -> dict[str, list[Any]]:
        return by_request(self.received)


class StandInEngine(Inbox):
    """An engine's input socket: keeps the EngineRequests and aborts that reach it, and answers
    a request (on its frontend's `reply_to`) only when the test says so."""

    def __init__(self, sock: zmq.Socket, endpoint: str, union: Any = EngineInput) -> None:
        super().__init__(sock, endpoint, union)
        self._replies = ReplySockets(sock.context)
        self._reply_codec: Codec[Any] = Codec(FrontendInput)

    @classmethod
    def at(cls, ctx: zmq.Context, endpoint: str) -> StandInEngine:
        """One bound to `endpoint` (the address the roles under test send requests to)."""
        return cls.bound(ctx, endpoint, EngineInput)

    def answer(self, reply_to: str, request_id: str, **fields: Any) -> None:
        """Finish `request_id` with one last token (EngineOutput FIELDS override the rest)."""
        self.reply(reply_to, EngineOutput(**{
            "request_id": request_id, "token_ids": [42], "finished": True,
            "finish_reason": "length", **fields,
        }))

    def reply(self, reply_to: str, message: Any) -> None:
        """Send `message` (a FrontendInput: an output, a RequestFailed) to `reply_to`."""
        assert self._replies.send(reply_to, self._reply_codec.encode(message)), reply_to

    def close(self) -> None:
        self._replies.close()
        super().close()


class StandInFrontend:
    """Stands in for a frontend: pushes requests or jobs to a role, takes replies on `reply_to`."""

    def __init__(self, ctx: zmq.Context, role_endpoint: str, reply_to: str) -> None:
        self.push = push(ctx, role_endpoint)
        self.replies = Inbox.bound(ctx, reply_to, FrontendInput)
        self.reply_to = self.replies.endpoint
        self.codec: Codec[Any] = self.replies.codec
        self.finished_order: list[str] = []
        """Request ids in the order their terminal replies came (through `collect`)."""

    @classmethod
    @contextlib.contextmanager
    def connected(cls, role: Child, run_dir: Path) -> Iterator[StandInFrontend]:
        """One sending to the process `role`, its replies on ipc://RUN_DIR/reply.sock; on
        leaving, checks that the process still runs."""
        assert role.endpoint is not None
        with zmq.Context() as ctx, cls(ctx, role.endpoint, f"ipc://{run_dir}/reply.sock") as fe:
            yield fe
        assert role.process.poll() is None, f"the {role.role} process died"

    def __enter__(self) -> StandInFrontend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, *messages: msgspec.Struct) -> None:
        send(self.push, *messages)

    def send_frames(self, frames: list[Any]) -> None:
        self.push.send_multipart(frames)

    def take(self) -> Any:
        """The next reply."""
        return self.replies.take()

    def collect(self, request_ids: list[str]) -> dict[str, list[Any]]:
        """Every reply from now on until each of `request_ids` has had a terminal one."""
        since = len(self.replies.received)
        replies = self.replies.take_until_answered(request_ids, since)
        self.finished_order += [m.request_id for m in self.replies.received[since:]
                                if is_terminal(m)]
        return replies

    def run(self, *requests: Any) -> dict[str, list[Any]]:
        self.send(*requests)
        return self.collect([r.request_id for r in requests])

    def close(self) -> None:
        self.push.close(linger=0)
        self.replies.close()


def wait_until(
    done: Callable[[], T], what: str, timeout_s: float = PATIENCE_S, every_s: float = 0.02
) -> T:
    """Check `done()` until it is true (returning it), for events no socket tells us of (a line
    in a log, a process's state); fails saying `what` never happened."""
    deadline = time.monotonic() + timeout_s
    while not (result := done()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(every_s)
    return result


def wait_for_stats(
    run_dir: Path, done: Callable[[Stats], bool], what: str, timeout_s: float = PATIENCE_S
) -> Stats:
    """The first Stats snapshot, from any role whose stats socket is under `run_dir`, for which
    `done` holds (a role publishes every --stats-interval, also while it computes)."""
    deadline = time.monotonic() + timeout_s
    with StatsFeed(Targets("stats", (), run_dir)) as feed:
        while (remaining := deadline - time.monotonic()) > 0:
            for stats in feed.receive_for(min(remaining, 0.5)):
                if done(stats):
                    return stats
    raise AssertionError(f"{what}: no stats under {run_dir} said so within {timeout_s:g} s")


def counters(run_dir: Path, role: str) -> dict[str, int]:
    """A role's counters as its stats show them now."""
    return dict(wait_for_stats(run_dir, lambda s: s.role == role, f"the {role}'s stats").counters)


def counter(run_dir: Path, role: str, name: str, at_least: int) -> Stats:
    """The role's stats once counter `name` reaches `at_least`."""
    return wait_for_stats(run_dir, lambda s: s.role == role and s.counters.get(name, 0)
                          >= at_least, f"{role} counting {at_least} {name}")


def one_reply_each(
    client: Client, request_ids: list[str], timeout_s: float, *, frontend_may_die: bool = False
) -> dict[str, ChatResult | RetryableError]:
    """Each request's one terminal reply, within `timeout_s`; then no further reply may come.
    With `frontend_may_die`, the client's own timeout stands in for the replies that a killed
    frontend took with it; else it fails the test."""
    results: dict[str, ChatResult | RetryableError] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(request_ids):
            result = client.next_finished(deadline)
            assert result.request_id not in results, f"a second reply: {result}"
            results[result.request_id] = result
    except RetryableError as exc:  # only a frontend's kill leaves requests unanswered
        if not frontend_may_die:
            raise
        results.update({rid: exc for rid in request_ids if rid not in results})
    with pytest.raises(RetryableError, match="no reply"):
        extra = client.next_finished(time.monotonic() + 0.5)
        pytest.fail(f"a reply after every request had one: {extra}")
    return results


def image_request(client: Client, seed: int) -> str:
    return client.submit([user_message("what is it?", [jpeg_uri(800, 600, seed)])],
                         max_tokens=4)


def mixed_load(client: Client, seed: int) -> list[str]:
    """Four text and four image requests, in flight at once."""
    text = [client.submit([user_message(f"hello {i}")], max_tokens=8) for i in range(4)]
    return text + [image_request(client, seed + i) for i in range(4)]


def all_ok(client: Client, *request_ids: str) -> None:
    for rid, result in client.collect(list(request_ids)).items():
        assert result.error is None and result.finish_reason, f"{rid}: {result}"


def serves_again_with_its_cache(client: Client, run_dir: Path) -> None:
    """After a role's restart: a mixed load is answered, and a repeated image hits the MM
    worker's sender cache (and so the engine's mirror of it) again."""
    all_ok(client, *mixed_load(client, seed=200))
    all_ok(client, image_request(client, 7))
    since = time.time()
    before = wait_for_stats(run_dir, lambda s: s.role == "mm-worker" and s.time > since,
                            "a fresh MM worker snapshot").counters.get("cache_hits", 0)
    all_ok(client, image_request(client, 7))  # the same image: a hit on both sides again
    wait_for_stats(run_dir, lambda s: s.role == "mm-worker"
                   and s.counters.get("cache_hits", 0) > before, "the repeated image hit the cache")


LIE = b"lie"
"""Task bytes that make `stand_in_pool_process` send a reference its slot does not bear out."""
PIXELS = np.arange(1 << 17, dtype=np.uint32).astype(np.uint8)
"""What `stand_in_pool_process` puts into a slot for each task (128 KiB: a slot's worth)."""


def stand_in_pool_process(tasks: Any, results: Any, model_dir: str, image_backend: str,
                          media: Any, tag: str, capacity: int, max_age_s: float) -> None:
    """Stands in for a pool process (services/mm_worker/pool.py `_serve`, same pipes and
    arguments): says it is ready with its slots' stem, then answers each task with PIXELS in
    a slot of its own writer, named by the slot's reference, dtype and shape; for task bytes
    LIE, with a shape of other bytes than the slot holds."""
    from mmlane.protocol import shm

    slots = shm.ShmWriter(tag, threshold=1024, capacity=capacity, max_age_s=max_age_s,
                          relayed=True)
    results.send(("ready", slots.stem))
    try:
        while True:
            try:
                task = tasks.recv()  # an ImageTask or a VideoTask
            except (EOFError, OSError):
                return
            ref = slots.put(PIXELS)
            shape = (2, 2) if task.data == LIE else PIXELS.shape
            results.send(("ok", [("pixel_values", (ref, PIXELS.dtype.str, shape))], 1, None,
                          0.0, 0.0))
    finally:
        slots.close()
