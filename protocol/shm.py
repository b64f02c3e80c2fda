"""Large tensors through shared memory between two processes of one host, not through ZMQ.

    sender ── put(array) ──▶ a free slot: /dev/shm/mmlane-TAG-STARTED-SLOT (0600), its bytes
                             written, marked full ── "SLOT-NAME.GENERATION" in the TensorHeader
    receiver ◀── ShmReader.take(ref) ── copies the bytes out, marks the slot free again

Over an ipc socket a ZMQ frame is copied into the kernel and out again in small pieces, with a
switch between the two processes for each; here the sender copies the bytes once into a slot,
a file of the host's shared-memory filesystem, and the receiver copies them once out of it into
memory of its own. The slots are kept and reused, so their pages are allocated once: a new
file per tensor would cost the kernel more (allocating and zeroing every page) than the copies.

A slot starts with a 64-byte header: byte 0 says whether it is full (the sender sets it after
writing the bytes; the receiver clears it after copying them out), byte 1 that its sender has
closed (the receiver then unlinks the slot once it has emptied it), byte 2 that the bytes were
handed to the receiver that empties the slot (at once, or by a relay: `ShmViews`), bytes 8-16
count the slot's uses (its generation, named in the message, so that a message can never read a
later use of its slot), bytes 16-24 hold the size of the bytes put (which must be what the
message's dtype and shape need).

Bounded, and cleaned up when a peer dies:
- `ShmWriter` keeps at most `capacity` bytes of slots; a tensor that finds no free slot and no
  room for a new one goes as a ZMQ frame, as over tcp. `posix_fallocate` reserves a slot's pages
  when it is made, so a full /dev/shm means frames, not a SIGBUS later.
- A slot full for `max_age_s` since it was handed to its receiver is taken back by its sender:
  that receiver is gone (a live one empties a slot as the message arrives, within milliseconds).
  A slot that a relay holds (the MM worker, for a pool process) is not aged until the relay
  hands it on, however long it waits for its turn.
- A sender unlinks its empty slots when it closes and marks the others closed: their receiver,
  which may still be on its way to them (an engine reading behind a worker that drained and
  stopped), unlinks each once it has emptied it. A restarted sender unlinks what its killed
  predecessor under the same tag left (`reap`).
A pool process of the MM worker (services/mm_worker/pool.py) has a `ShmWriter` of its own
(`relayed`) and puts its results into its slots; the worker takes them as views
(`ShmViews.adopt`, no copy) and its codec sends a view's slot on to the engine as it is
(`ShmViews.put`, which marks the slot handed on): the pixels are copied once into a slot where
they are made, and once out of it in the engine. A view the worker holds while its job waits
behind a slower one in its lane is never taken back: the writer ages a slot from when it first
sees it handed on. A view the worker drops unsent (its job failed or was cancelled) frees its
slot; for an engine that takes no shared memory (tcp), or a tensor too small to be worth a slot,
the worker copies the view out at once and frees the slot. The slots of a pool process that died
are released as its close would (`abandon`).

A receiver that finds a slot gone or reused (its sender restarted meanwhile, or took the slot
back) makes the codec raise `TensorsLost` (protocol/errors.py) with the rest of the message
decoded, so that the request it belongs to still gets its one reply (a retryable error; the
receiver cache, which missed the request's commit, falls out of sync and starts over). A
reference that names no slot, or a slot that is no regular file of this user's (a symlink, a
FIFO), is smaller than a header, or whose header disagrees with the message's dtype and shape,
is refused (`SlotRefused`; the codec raises `TensorsRefused`, as well with the message), and so
is a slot cut short since it was mapped (its pages past the file's end would raise SIGBUS).
Only names of the slot pattern are ever opened or unlinked, never through a symlink.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import mmap
import os
import re
import stat
import struct
import threading
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

SHM_DIR = Path("/dev/shm")
HEADER = 64
"""Bytes before a slot's data: the full flag, the generation; the data stays 64-byte aligned."""
_GROW = 1 << 20  # slots are sized in whole MiB, so that a slightly larger tensor still fits
_PREFIX = "mmlane-"
_NAME = r"mmlane-[0-9a-f]{12}-[0-9]{1,20}-[0-9]{1,9}"
_SLOT = re.compile(_NAME)
_REF = re.compile(rf"({_NAME})\.([0-9]{{1,20}})")
_STEM = re.compile(r"mmlane-[0-9a-f]{12}-[0-9]{1,20}-")
_USE = struct.Struct("<QQ")  # generation, nbytes: at offset 8


class SlotRefused(ValueError):
    """A reference that names no slot, or a slot whose file or header disagrees with it."""


def available() -> bool:
    """Whether this host has the shared-memory filesystem the transport uses (Linux)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class ShmSender(Protocol):
    """What a codec that sends through shared memory needs: a slot's reference for an array,
    or None to send it as a frame."""

    def put(self, array: np.ndarray) -> str | None: ...


def reap(tag: str, keep: str = "") -> int:
    """Unlink every slot under `tag` but those whose name starts with `keep`: what a killed
    predecessor under the same tag left. How many there were."""
    reaped = 0
    for path in _slot_paths(f"{_PREFIX}{tag}-"):
        if not keep or not path.name.startswith(keep):
            _unlink(path)
            reaped += 1
    return reaped


def _slot_paths(stem: str) -> list[Path]:
    """The files under `stem` whose names are slots' (a glob alone matches any tail)."""
    return [path for path in SHM_DIR.glob(f"{stem}*") if _SLOT.fullmatch(path.name)]


def abandon(stem: str) -> None:
    """Release the slots of a writer that is gone without closing them (a killed pool process),
    as its `close` would have. A stem that is not a writer's (a process that died before it
    said its own) names nothing."""
    if not _STEM.fullmatch(stem):
        return
    for path in _slot_paths(stem):
        with contextlib.suppress(SlotRefused):  # not a slot of its: left alone
            mapping = _open(path.name)
            if mapping is not None:
                _close_slot(path, mapping)


def _close_slot(path: Path, mapping: mmap.mmap) -> None:
    """A writer lets go of a slot: unlinked if empty (or cut short: no receiver can take it),
    else marked closed for its receiver."""
    if _cut(mapping):
        _unlink(path)
    else:
        mapping[1] = 1  # closed: before looking whether it is empty (see `ShmReader.take`)
        if mapping[0] == 0:
            _unlink(path)
    mapping.close()


def _unlink(path: Path) -> None:
    """Unlink a slot's name; what stands there now and is not ours to unlink (a folder, another
    user's file in the sticky /dev/shm) is left."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
        path.unlink()


def _cut(mapping: mmap.mmap) -> bool:
    """Whether a mapped slot's file was truncated since it was mapped (by no writer of ours):
    touching its pages past the file's end would die of SIGBUS. (`size` is the file's.)"""
    return mapping.size() < len(mapping)


def sender_tag(identity: str) -> str:
    """A short name for a sender's identity, the same across its restarts."""
    return hashlib.blake2b(identity.encode(), digest_size=6).hexdigest()


@dataclass
class _Slot:
    path: Path
    mapping: mmap.mmap
    size: int
    generation: int = 0
    handed_at: float | None = None
    """When its writer put its use (or, relayed, first saw it handed on); None: not yet."""

    def is_free(self) -> bool:
        return self.mapping[0] == 0


class ShmWriter:
    """The sending side: puts arrays of at least `threshold` bytes into slots of its own. With
    `relayed`, its receiver hands each slot on to the one that empties it, and marks it then (a
    pool process's, the MM worker's `ShmViews`): only from then is a full slot aged."""

    def __init__(self, tag: str, *, threshold: int, capacity: int, max_age_s: float,
                 relayed: bool = False) -> None:
        self.tag = tag
        self.threshold = threshold
        self.capacity = capacity
        self.max_age_s = max_age_s
        self.relayed = relayed
        self.stem = f"{_PREFIX}{tag}-{time.time_ns()}-"
        """The start of every slot name of this writer's."""
        self._slots: list[_Slot] = []
        self._numbers = itertools.count()
        self.counters: Counter[str] = Counter()
        """shm_tensors and shm_bytes (put into slots), shm_fallbacks (sent as frames instead,
        no slot free and no room), shm_reaped (full slots taken back untaken). Its one thread's:
        a writer is one lane's, or one pool process's."""

    def put(self, array: np.ndarray) -> str | None:
        """The reference of a slot now holding `array`'s bytes, or None: send it as a frame."""
        nbytes = array.nbytes
        if nbytes < self.threshold:
            return None
        slot = self._free_slot(nbytes)
        if slot is None:
            self.counters["shm_fallbacks"] += 1
            return None
        target = np.frombuffer(slot.mapping, dtype=array.dtype, count=array.size, offset=HEADER)
        np.copyto(target.reshape(array.shape), array)
        del target
        slot.generation += 1
        _USE.pack_into(slot.mapping, 8, slot.generation, nbytes)
        slot.mapping[2] = int(not self.relayed)  # handed on with the message, unless relayed
        slot.mapping[0] = 1  # full: after the bytes, before the message is sent
        slot.handed_at = None if self.relayed else time.monotonic()
        self.counters["shm_tensors"] += 1
        self.counters["shm_bytes"] += nbytes
        return f"{slot.path.name}.{slot.generation}"

    def close(self) -> None:
        """Unlink the empty slots; mark the full ones closed, for their receiver to unlink once
        it has taken them (a message sent just before a stop may still be on its way)."""
        for slot in self._slots:
            _close_slot(slot.path, slot.mapping)
        self._slots = []

    def _free_slot(self, nbytes: int) -> _Slot | None:
        """The smallest free slot that fits (a slot full too long is taken back first), else a
        new one while the capacity allows; None when neither."""
        for slot in [s for s in self._slots if _cut(s.mapping)]:  # never touched again
            self._slots.remove(slot)
            _close_slot(slot.path, slot.mapping)
        now = time.monotonic()
        for slot in self._slots:
            if slot.is_free():
                continue
            if slot.handed_at is None and slot.mapping[2]:  # a relay handed it on by now
                slot.handed_at = now
            if slot.handed_at is not None and now - slot.handed_at >= self.max_age_s:
                slot.mapping[0] = 0
                self.counters["shm_reaped"] += 1
        fitting = [s for s in self._slots if s.is_free() and s.size - HEADER >= nbytes]
        if fitting:
            return min(fitting, key=lambda s: s.size)
        size = HEADER + -(-nbytes // _GROW) * _GROW
        if sum(s.size for s in self._slots) + size > self.capacity:
            return None
        path = SHM_DIR / f"{self.stem}{next(self._numbers)}"  # never a dropped slot's again
        try:
            mapping = _create(path, size)
        except OSError:  # no room in /dev/shm (or none at all): frames still work
            _unlink(path)
            return None
        slot = _Slot(path, mapping, size)
        self._slots.append(slot)
        return slot


def _create(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS while writing
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class ShmReader:
    """The receiving side: copies tensors out of their senders' slots. It keeps each slot it
    has read mapped (at most `MAPPINGS`, the least recently used dropped first, and any whose
    file is gone), since mapping a slot afresh for every tensor costs a page fault per page.
    Before each copy it checks that the slot's file still covers its mapping: a slot cut short
    since it was mapped is refused, where touching its pages would die of SIGBUS. (A cut that
    races the copy itself takes a process of the receiver's own user, which could as well kill
    it: the slots are 0600.)"""

    MAPPINGS = 64

    def __init__(self) -> None:
        self._mappings: OrderedDict[str, mmap.mmap] = OrderedDict()

    def take(self, ref: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
        """A copy of the array a sender put into the slot `ref` names (the slot is free again
        after it), or None when the slot is gone or holds another use by now. Raises
        `SlotRefused` for a reference that names no slot, a file that is no slot, or bytes of
        another size than `dtype` and `shape` need."""
        name, generation, nbytes = _parse(ref, dtype, shape)
        slot = self._mapping(name)
        if slot is None:
            return None
        if _cut(slot):
            self._mappings.pop(name).close()
            raise SlotRefused(f"shared-memory slot {name} was truncated")
        view = _held_view(slot, ref, generation, nbytes, dtype, shape)
        if view is None:
            return None
        array = view.copy()
        del view  # no view may outlive the copy: the mapping may be closed later
        _free(slot, name)
        return array

    def _mapping(self, name: str) -> mmap.mmap | None:
        slot = self._mappings.get(name)
        if slot is not None:
            self._mappings.move_to_end(name)
            return slot
        for known in [n for n in self._mappings if not (SHM_DIR / n).exists()]:
            self._mappings.pop(known).close()
        slot = _open(name)
        if slot is None:
            return None
        self._mappings[name] = slot
        if len(self._mappings) > self.MAPPINGS:
            self._mappings.popitem(last=False)[1].close()
        return slot


def _open_fd(name: str) -> int | None:
    """A descriptor of slot `name`, checked to be a slot's (a regular file of this user's, at
    least a header long, never reached through a symlink), or None when it is gone; raises
    SlotRefused for any other file."""
    try:  # O_NONBLOCK: a FIFO in its place must not stall the receiver
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink; EACCES: another user's; EISDIR ...
        raise SlotRefused(f"shared-memory slot {name} cannot be opened: {exc.strerror}") from exc
    info = os.fstat(fd)
    problem = ("is no regular file" if not stat.S_ISREG(info.st_mode)
               else "belongs to another user" if info.st_uid != os.geteuid()
               else f"is {info.st_size} bytes, no slot's size" if info.st_size < HEADER
               else "")
    if problem:
        os.close(fd)
        raise SlotRefused(f"shared-memory slot {name} {problem}")
    return fd


def _open(name: str) -> mmap.mmap | None:
    """Slot `name` mapped, or None when it is gone; raises SlotRefused as `_open_fd`."""
    fd = _open_fd(name)
    if fd is None:
        return None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _parse(ref: str, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[str, int, int]:
    """A reference's slot name and generation, and the bytes `dtype` and `shape` need; raises
    SlotRefused for a reference that names no slot, or a negative shape."""
    match = _REF.fullmatch(ref)
    if match is None:
        raise SlotRefused(f"{ref[:80]!r} is not a shared-memory tensor reference")
    if any(d < 0 for d in shape):
        raise SlotRefused(f"shared-memory tensor {ref} has a negative shape {shape}")
    return match[1], int(match[2]), dtype.itemsize * math.prod(shape)  # Python ints


def _held_view(slot: mmap.mmap, ref: str, generation: int, nbytes: int, dtype: np.dtype,
               shape: tuple[int, ...]) -> np.ndarray | None:
    """The use `ref` names, as a view of `slot` in the message's dtype and shape; None when
    the slot holds it no more (taken back, or reused). Raises SlotRefused when that use's
    bytes are not the `nbytes` that `dtype` and `shape` need, or numpy takes no such shape
    (more dimensions than it has, or a dimension past its index, next to a zero one)."""
    used, put = _USE.unpack_from(slot, 8)
    if slot[0] != 1 or used != generation:
        return None
    if put != nbytes or HEADER + nbytes > len(slot):
        raise SlotRefused(f"shared-memory tensor {ref} holds {put} bytes in a slot of "
                          f"{len(slot)}, shape {shape} of {dtype} needs {nbytes}")
    flat = np.frombuffer(slot, dtype=dtype, count=nbytes // dtype.itemsize, offset=HEADER)
    try:
        return flat.reshape(shape)
    except ValueError as exc:
        raise SlotRefused(f"shared-memory tensor {ref}: shape {shape} is no array's") from exc


class ShmViews:
    """The MM worker's side of its pool processes' slots: each tensor a pool process put is
    taken as a view of its slot (`adopt`), and handed on to the engine as that slot (`put`, the
    codec's), or released when it is dropped unsent. With `keep_from` None (no engine takes
    shared memory) or a tensor under `keep_from` bytes, it is copied out and its slot freed at
    once. Slots stay mapped while views of them live; a mapping whose file is gone is closed
    once no view is left. The pool's thread adopts, the lanes' threads hand on (their codecs):
    the counts are kept under a lock."""

    def __init__(self, keep_from: int | None) -> None:
        self.keep_from = keep_from
        self._mappings: dict[str, mmap.mmap] = {}
        self._views: dict[int, tuple[weakref.ref[np.ndarray], str, weakref.finalize]] = {}
        self.counters: Counter[str] = Counter()
        """shm_tensors, shm_bytes: handed on to the engine in their slots (no copy);
        shm_fallbacks: a pool process found no slot and sent its tensor in its message.
        Counted with `count`."""
        self._counting = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name`, from any thread (`+=` on a Counter is a read, then a
        write: two threads at once could lose one)."""
        with self._counting:
            self.counters[name] += n

    def adopt(self, ref: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
        """The array a pool process put into slot `ref`: a view of the slot, or a copy (slot
        freed); None when the slot is gone or reused. Raises SlotRefused as `ShmReader.take`."""
        name, generation, nbytes = _parse(ref, dtype, shape)
        slot = self._mapping(name)
        if slot is None:
            return None
        if _cut(slot):
            raise SlotRefused(f"shared-memory slot {name} was truncated")
        view = _held_view(slot, ref, generation, nbytes, dtype, shape)
        if view is None:
            return None
        if self.keep_from is None or nbytes < self.keep_from:
            array = view.copy()
            del view
            _free(slot, name)
            return array
        key = id(view)
        release = weakref.finalize(view, self._release, key, name, generation)
        self._views[key] = (weakref.ref(view), ref, release)
        return view

    def put(self, array: np.ndarray) -> str | None:
        """The codec's side: the slot reference of an adopted view, which is the engine's to
        free from now on (the slot marked handed on, so its writer ages it from now); None for
        any other array."""
        entry = self._views.get(id(array))
        if entry is None or entry[0]() is not array:
            return None
        del self._views[id(array)]
        _, ref, release = entry
        release.detach()
        slot = self._mappings.get(ref.rpartition(".")[0])  # mapped while the view lives
        if slot is not None and not _cut(slot):  # (a cut one the engine refuses)
            slot[2] = 1
        self.count("shm_tensors")
        self.count("shm_bytes", array.nbytes)
        return ref

    def _release(self, key: int, name: str, generation: int) -> None:
        """A view dropped unsent: free its slot, unless it holds another use by now."""
        self._views.pop(key, None)
        slot = self._mappings.get(name)
        if (slot is not None and not _cut(slot) and slot[0] == 1
                and _USE.unpack_from(slot, 8)[0] == generation):
            _free(slot, name)

    def _mapping(self, name: str) -> mmap.mmap | None:
        slot = self._mappings.get(name)
        if slot is not None:
            return slot
        for known in [n for n in self._mappings if not (SHM_DIR / n).exists()]:
            with contextlib.suppress(BufferError):  # views of it live on: kept until later
                self._mappings[known].close()
                del self._mappings[known]
        slot = _open(name)
        if slot is not None:
            self._mappings[name] = slot
        return slot


def _free(slot: mmap.mmap, name: str) -> None:
    """A receiver is done with a slot's bytes: free for its writer, or unlinked when that writer
    has closed (it set the flag before looking whether its slots were free)."""
    slot[0] = 0
    if slot[1]:
        _unlink(SHM_DIR / name)
