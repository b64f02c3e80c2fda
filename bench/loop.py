"""What the bench's I/O threads share (its client's and its in-process server's): a mailbox
that other threads fill and a `zmq.Poller` watches, and reading a socket dry.

One thread owns every socket; other threads never touch them: they put into a `Mailbox`, whose
pipe wakes the owner's poll.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from typing import Generic, TypeVar

import zmq

T = TypeVar("T")


class Mailbox(Generic[T]):
    """A queue with a pipe: register `fd` with the poller; `put` from any thread wakes it."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)

    def put(self, item: T) -> None:
        self._items.put(item)
        os.write(self._write_fd, b"\0")

    def take_all(self) -> Iterator[T]:
        """Everything put so far (on the owner's thread, once `fd` polled readable)."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        while not self._items.empty():
            yield self._items.get_nowait()

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._write_fd)


def received(sock: zmq.Socket) -> Iterator[list[zmq.Frame]]:
    """Each message waiting on `sock`, until none is left (never blocks)."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
