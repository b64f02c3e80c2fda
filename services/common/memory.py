"""How a role's process keeps the memory it frees: an image's buffers are reused for the next
image instead of being mapped afresh (page faults) every time."""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
KEPT_BLOCK_BYTES = 32 << 20
"""Allocations up to this size come from the heap, whose freed memory is reused (glibc's most;
Pillow holds an image in blocks of 16 MiB)."""
KEPT_FREE_BYTES = 256 << 20
"""Freed heap memory kept for reuse before any is given back to the system."""


def keep_freed_memory() -> None:
    """Have glibc's malloc keep the memory freed after an image for the next one.

    Left to itself, glibc moves its thresholds with what the process frees, and in the MM
    worker they settled where a 12 MP JPEG's pixel blocks were mapped afresh for every image
    and given back after it: some 15 000 more pages faulted in and zeroed per image than in a
    thread of the bench, 30-100 ms of system time each (BENCHMARKS.md, "MM lane throughput").
    The engine role copies each image's tensors as it receives them, the same way. Fixed
    thresholds keep them; other C libraries are left as they are."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)
        mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
