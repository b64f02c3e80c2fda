"""The mirrored feature cache: one LRU-by-bytes cache, and the one way a request changes it.

The MM worker's sender cache (P0) and the engine's receiver caches (P1, one per MM worker) are
both a `FeatureCache`: P0 keeps each item's metadata, P1 its tensors. A request changes a cache
only through `commit(cache, request, value_of)`, which both sides call with the same message,
so both caches go through the same operations in the same order:

    1. drop the hashes the request invalidates (a resend after a cache miss)
    2. touch every hash of the request that the cache holds, in item order
    3. insert every item that carries tensors, in item order; an item larger than the whole
       cache is never cached; least recently used items are evicted until the rest fits

The sender commits when it sends, the engine at receipt, before anything can refuse the
request; one ordered channel lies between them. So for each sender epoch (`MMCacheHeader`),
P1 goes through exactly the commits P0 went through, from the same empty start.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

import numpy as np

from mmlane.protocol.messages import EngineRequest, MMItem

V = TypeVar("V")

GIB = 1 << 30


def capacity_bytes(cache_gb: float, name: str = "mm_cache_gb") -> int:
    """A cache size setting `name` (GiB, 0 disables) as a capacity in bytes; refuses negative
    or NaN."""
    if not (math.isfinite(cache_gb) and cache_gb >= 0):
        raise ValueError(f"{name} must be a number >= 0, got {cache_gb}")
    return int(cache_gb * GIB)


MAX_EPOCH = 2**63 - 1
"""The largest epoch any process makes: epochs are int64 nanoseconds (until the year 2262)."""


def is_epoch(epoch: int) -> bool:
    """Whether a peer's `epoch` may be followed: one a process could have made, below
    MAX_EPOCH so that the epoch made newer than it (`new_epoch`) is one too. A larger one (2**64
    - 1 from a faulty peer) is not: followed, the next epoch would not fit in msgpack, and the
    stats and replies that carry it could no longer be sent."""
    return 0 < epoch < MAX_EPOCH


def new_epoch(previous: int = 0) -> int:
    """A new epoch: the wall clock in ns, and always larger than `previous`.

    Larger means newer: a restarted process starts from its start time, so its epoch is larger
    than the one before it, and a late message from before a restart is recognised as older.
    """
    return max(time.time_ns(), previous + 1)


def tensors_nbytes(tensors: Mapping[str, np.ndarray]) -> int:
    return sum(array.nbytes for array in tensors.values())


class FeatureCache(Generic[V]):
    """An LRU cache bounded by the bytes its entries stand for (not by their count)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[str, tuple[int, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> V | None:
        """The value of `key`, without making it recently used."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def entries(self) -> list[tuple[str, int]]:
        """(key, nbytes) of every entry, least recently used first."""
        return [(key, nbytes) for key, (nbytes, _) in self._entries.items()]

    def touch(self, key: str) -> V | None:
        """Make `key` the most recently used entry; its value, or None when it is not held."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: str, nbytes: int, value: V) -> bool:
        """Insert (or replace) `key` as most recently used, evicting the least recently used
        entries until the total fits; False, and nothing changes, when it alone is too large."""
        if nbytes > self.capacity:
            return False
        self.drop(key)
        self._entries[key] = (nbytes, value)
        self.nbytes += nbytes
        while self.nbytes > self.capacity:
            _, (evicted, _) = self._entries.popitem(last=False)
            self.nbytes -= evicted
            self.evictions += 1
        return True

    def drop(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.nbytes -= entry[0]
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def commit(
    cache: FeatureCache[V], request: EngineRequest, value_of: Callable[[MMItem], V]
) -> dict[str, V]:
    """Apply one request to a cache (the three steps in the module docstring).

    Returns the values the cache held for the request's hashes at step 2, before step 3 could
    evict them: what the request's hash-only items refer to.
    """
    if request.mm_cache is not None:
        for mm_hash in request.mm_cache.invalidate:
            cache.drop(mm_hash)
    held: dict[str, V] = {}
    for item in request.mm_items:
        if item.mm_hash:
            value = cache.touch(item.mm_hash)
            if value is not None:
                held[item.mm_hash] = value
    for item in request.mm_items:
        if item.mm_hash and item.tensors:
            cache.put(item.mm_hash, item.nbytes, value_of(item))
    return held
