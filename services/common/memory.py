"""How a role's process keeps the memory it frees: an image's buffers are reused for the next
image instead of being mapped afresh (page faults) every time; and what it holds.

    keep_freed_memory()     glibc's thresholds fixed (roles that handle images)
    usage()                 the process's memory by kind, for its stats
    bound_freed_memory(usage)   give freed memory back past KEPT_FREE_BYTES (each snapshot)
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
KEPT_BLOCK_BYTES = 32 << 20
"""Allocations up to this size come from the heap, whose freed memory is reused (glibc's most;
Pillow holds an image in blocks of 16 MiB)."""
KEPT_FREE_BYTES = 256 << 20
"""Freed heap memory kept for reuse before any is given back to the system (at the top of the
heap by glibc's trim threshold; anywhere in its heaps by `bound_freed_memory`)."""
counters: Counter[str] = Counter(heap_trims=0)
"""`heap_trims`: how often `bound_freed_memory` gave memory back (published in the stats)."""


def keep_freed_memory() -> None:
    """Have glibc's malloc keep the memory freed after an image for the next one.

    Left to itself, glibc moves its thresholds with what the process frees, and in the MM
    worker they settled where a 12 MP JPEG's pixel blocks were mapped afresh for every image
    and given back after it: some 15 000 more pages faulted in and zeroed per image than in a
    thread of the bench, 30-100 ms of system time each (BENCHMARKS.md, "MM lane throughput").
    The engine role copies each image's tensors as it receives them, the same way. Fixed
    thresholds keep them; other C libraries are left as they are."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)
        mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)


class _Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 on): totals over all of malloc's arenas."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(None)
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def usage() -> dict[str, int]:
    """This process's memory, in bytes: `resident` (RSS) and its `anonymous` part (RSS less
    file-backed and shared pages: the heap, tensors, buffers), from /proc; with glibc, its
    heaps' `heap_in_use` (allocated), `heap_free` (freed and kept for reuse: in its arenas,
    not given back) and `heap_mapped` (allocations mapped apart, above the mmap threshold).
    Reads all of malloc's arenas: once per stats interval, not per request."""
    with open("/proc/self/statm") as statm:
        resident, shared = (int(field) * _PAGE for field in statm.read().split()[1:3])
    usage = {"resident": resident, "anonymous": resident - shared}
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        usage.update(heap_in_use=info.uordblks, heap_free=info.fordblks,
                     heap_mapped=info.hblkhd)
    return usage


def bound_freed_memory(usage: dict[str, int]) -> None:
    """Give glibc's free memory back to the system once its heaps keep more than
    KEPT_FREE_BYTES of it (`usage`: this process's, just read).

    The trim threshold bounds only the free memory at the top of the main heap. Below it, the
    holes that a long run of buffers of many sizes leaves (the engine's received tensors, freed
    in the cache's eviction order) kept growing under sustained load, with the memory in use
    flat (BENCHMARKS.md, "Memory under sustained load"). `malloc_trim` returns every free page
    of every arena; what is in use stays, and up to KEPT_FREE_BYTES stays kept for reuse
    between two snapshots."""
    if _MALLOC_TRIM is not None and usage.get("heap_free", 0) > KEPT_FREE_BYTES:
        _MALLOC_TRIM(0)
        counters["heap_trims"] += 1
