"""Large tensors through shared memory between two processes of one host, not through ZMQ.

    sender ── put(array) ──▶ /dev/shm/mmlane-TAG-STARTED-SEQ (0600) ── its name, in the
                                                                      message's TensorHeader
    receiver ◀── take(name) ── opens, unlinks, maps it read-only: the array is the mapping

Over an ipc socket a ZMQ frame is copied into the kernel and out again in small pieces; here
the sender writes the bytes once into a file of the host's shared-memory filesystem and the
receiver maps that file, so the receiving side copies nothing. The receiver unlinks the file as
it takes it (the memory lives on until the last array over the mapping is gone), so a block
that exists is one no receiver has taken yet: that is all the sender needs to bound what it
has outstanding.

Bounded, and cleaned up when a peer dies:
- `ShmWriter` keeps at most `capacity` bytes in blocks not yet taken; beyond it (and whenever
  the filesystem has no room: `posix_fallocate` reserves every page first, so a full /dev/shm
  is an error here, not a SIGBUS later) a tensor goes as a ZMQ frame, as over tcp.
- A block not taken within `max_age_s` is unlinked by its sender: its receiver is gone (a live
  one takes a block as the message arrives, within milliseconds).
- A sender's blocks are named by its identity (`tag`) and start time, so a restarted sender
  unlinks what its killed predecessor left (`reap_predecessors`).
A receiver that finds a block gone (its sender was restarted meanwhile, or the block was
reaped) makes the codec raise `TensorsLost` (protocol/errors.py) with the rest of the message
decoded, so that the request it belongs to still gets its one reply (a retryable error; the
receiver cache, which missed the request's commit, falls out of sync and starts over).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
_PREFIX = "mmlane-"
_NAME = re.compile(r"mmlane-[0-9a-f]{12}-[0-9]{1,20}-[0-9]{1,20}")


def available() -> bool:
    """Whether this host has the shared-memory filesystem the transport uses (Linux)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def sender_tag(identity: str) -> str:
    """A short name for a sender's identity, the same across its restarts."""
    return hashlib.blake2b(identity.encode(), digest_size=6).hexdigest()


@dataclass
class _Block:
    path: Path
    nbytes: int
    created: float


class ShmWriter:
    """The sending side: puts arrays of at least `threshold` bytes into blocks of its own."""

    def __init__(self, tag: str, *, threshold: int, capacity: int, max_age_s: float) -> None:
        self.tag = tag
        self.threshold = threshold
        self.capacity = capacity
        self.max_age_s = max_age_s
        self._stem = f"{_PREFIX}{tag}-{time.time_ns()}-"
        self._seq = 0
        self._outstanding: deque[_Block] = deque()
        self._bytes = 0
        self.counters: Counter[str] = Counter()
        """shm_tensors, shm_bytes (put into blocks), shm_fallbacks (sent as frames instead),
        shm_reaped (unlinked untaken)."""

    def reap_predecessors(self) -> int:
        """Unlink the blocks an earlier process under the same tag left; how many there were."""
        reaped = 0
        for path in SHM_DIR.glob(f"{_PREFIX}{self.tag}-*"):
            if not path.name.startswith(self._stem):
                path.unlink(missing_ok=True)
                reaped += 1
        self.counters["shm_reaped"] += reaped
        return reaped

    def put(self, array: np.ndarray) -> str | None:
        """The name of a new block holding `array`'s bytes, or None: send it as a frame."""
        nbytes = array.nbytes
        if nbytes < self.threshold:
            return None
        self._prune()
        if self._bytes + nbytes > self.capacity:
            self.counters["shm_fallbacks"] += 1
            return None
        path = SHM_DIR / f"{self._stem}{self._seq}"
        self._seq += 1
        try:
            _write(path, array)
        except OSError:  # no room in /dev/shm (or none at all): frames still work
            path.unlink(missing_ok=True)
            self.counters["shm_fallbacks"] += 1
            return None
        self._outstanding.append(_Block(path, nbytes, time.monotonic()))
        self._bytes += nbytes
        self.counters["shm_tensors"] += 1
        self.counters["shm_bytes"] += nbytes
        return path.name

    def _prune(self) -> None:
        """Forget the blocks their receiver took; unlink the ones too old to be taken."""
        now = time.monotonic()
        kept: deque[_Block] = deque()
        for block in self._outstanding:
            if not block.path.exists():
                self._bytes -= block.nbytes
            elif now - block.created > self.max_age_s:
                block.path.unlink(missing_ok=True)
                self._bytes -= block.nbytes
                self.counters["shm_reaped"] += 1
            else:
                kept.append(block)
        self._outstanding = kept


def _write(path: Path, array: np.ndarray) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, array.nbytes)  # ENOSPC now rather than SIGBUS while writing
        with mmap.mmap(fd, array.nbytes) as mapping:
            target = np.frombuffer(mapping, dtype=array.dtype).reshape(array.shape)
            np.copyto(target, array)
            del target
    finally:
        os.close(fd)


def take(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
    """The array a sender put into block `name` (a read-only mapping; the block is unlinked),
    or None when the block is gone. Raises ValueError for a name that is not a block's, or a
    block of another size than `dtype` and `shape` need."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a shared-memory tensor name")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        path.unlink(missing_ok=True)  # taken: its sender stops counting it
        size = os.fstat(fd).st_size
        expected = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if any(d < 0 for d in shape) or size != expected or size == 0:
            raise ValueError(
                f"shared-memory tensor {name} holds {size} bytes, shape {shape} of {dtype} "
                f"needs {expected}"
            )
        mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=dtype).reshape(shape)
