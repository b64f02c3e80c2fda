"""The engine's half of the mirrored feature cache: one receiver cache (P1) per MM worker.

`ReceiverCaches.receive` runs on the input thread for every EngineRequest, in arrival order,
before anything can refuse the request: it applies the request to its sender's P1 with the very
`commit` the sender applied to P0, then gives every hash-only item its tensors back.

A request's P1 is used only while the sender is in sync with this engine:
  - its header names this engine's epoch (else the sender has not heard of our restart or
    reset yet; it clears P0 when it does);
  - its sender epoch is the sender's newest (an older one is a message from before the sender
    restarted; a newer one starts a new P1, and must start at seq 0);
  - its seq follows the last one (no message of this sender epoch was lost);
  - its capacity fits under ours and does not change within an epoch.
A request from a sender out of sync changes no cache and is served with the tensors it carries;
if it refers to any cached item it gets a CacheMissError naming all its hashes, and the frontend
resends it once with those hashes invalidated, so every image then travels with its tensors.
If P1 lacks an item although the sender is in sync, the caches drifted (a lost message, a bug):
the engine starts a new epoch, which every sender follows, so the mirror heals itself.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
from msgspec.structs import replace

from mmlane.common.feature_cache import (
    FeatureCache,
    commit,
    is_epoch,
    new_epoch,
    tensors_nbytes,
)
from mmlane.protocol.errors import CacheMissError
from mmlane.protocol.messages import EngineRequest, MMCacheHeader, MMItem

log = logging.getLogger(__name__)

MAX_SENDERS = 64
"""Receiver caches kept at once; past it the least recently active sender's is dropped."""

Tensors = dict[str, np.ndarray]


@dataclass
class _Mirror:
    """One sender's P1, and where that sender's stream of commits stands."""

    sender_epoch: int
    next_seq: int
    cache: FeatureCache[Tensors]


class ReceiverCaches:
    """Every P1 of the engine and the engine's cache epoch; used by the input thread only
    (`epoch` is also read by the output thread, to stamp it on every reply)."""

    def __init__(self, max_capacity: int) -> None:
        self.max_capacity = max_capacity
        """The largest sender capacity mirrored (--mm-cache-gb of the engine)."""
        self.epoch = new_epoch()
        self.counters: Counter[str] = Counter()
        self._mirrors: OrderedDict[str, _Mirror] = OrderedDict()
        self._refused: set[tuple[str, int]] = set()  # (sender, capacity) already logged
        self._stale_logged: set[tuple[str, int]] = set()  # (sender, epoch) already logged

    def reset(self) -> int:
        """Drop every P1 and start a new engine epoch (senders clear P0 when they learn it)."""
        self._mirrors.clear()
        self.epoch = new_epoch(self.epoch)
        return self.epoch

    def entries(self, sender: str) -> list[tuple[str, int]]:
        """(hash, nbytes) of a sender's P1, least recently used first (empty when none)."""
        mirror = self._mirrors.get(sender)
        return [] if mirror is None else mirror.cache.entries()

    def sender_epoch(self, sender: str) -> int:
        """The sender epoch a sender's P1 mirrors (0 when there is none)."""
        mirror = self._mirrors.get(sender)
        return 0 if mirror is None else mirror.sender_epoch

    def receive(self, request: EngineRequest) -> EngineRequest:
        """Apply the request's cache updates, then return it with every item's tensors.

        Raises CacheMissError when an item refers to tensors the engine does not hold.
        """
        header = request.mm_cache
        mirror = self._mirror_for(header, request.mm_items) if header is not None else None
        held: dict[str, Tensors] = {}
        if mirror is not None:
            evicted = mirror.cache.evictions
            held = commit(mirror.cache, request, lambda item: item.tensors)
            self.counters["cache_evictions"] += mirror.cache.evictions - evicted
            mirror.next_seq += 1
        items, missing = _resolve(request.mm_items, held)
        self.counters["cache_hits"] += sum(
            1 for item in request.mm_items if item.mm_hash in held and not item.tensors
        )
        if missing:
            if mirror is not None:
                assert header is not None
                self._drifted(header, f"P1 lacks {len(missing)} referenced item(s)")
            self.counters["cache_misses"] += 1
            raise _miss(request, missing)
        if all(new is old for new, old in zip(items, request.mm_items, strict=True)):
            return request
        return replace(request, mm_items=items)

    # ------------------------------------------------------------ sync

    def _mirror_for(self, header: MMCacheHeader, items: list[MMItem]) -> _Mirror | None:
        """The P1 this request commits to, or None when its sender is out of sync."""
        if header.engine_epoch != self.epoch:
            # Newer: our clock went back across a restart (never past what a clock makes).
            if self.epoch < header.engine_epoch and is_epoch(header.engine_epoch):
                self._drifted(header, "it knows a newer engine epoch than ours")
            self.counters["cache_unsynced"] += 1
            return None
        if not self._capacity_fits(header):
            self.counters["cache_unsynced"] += 1
            return None
        mirror = self._mirrors.get(header.sender)
        if mirror is not None and header.sender_epoch < mirror.sender_epoch:
            self.counters["cache_stale_sender"] += 1
            if (header.sender, header.sender_epoch) not in self._stale_logged:
                self._stale_logged.add((header.sender, header.sender_epoch))
                log.warning(
                    "sender %s: a message of its older epoch %d, served without the cache: the "
                    "last ones of a restarted MM worker, or two MM workers under one name "
                    "(host and --mm-worker-endpoint) if it goes on",
                    header.sender, header.sender_epoch,
                )
            return None
        if mirror is None or header.sender_epoch > mirror.sender_epoch:
            if header.seq != 0:
                self._drifted(header, "the first requests of its sender epoch never arrived")
                return None
            if mirror is not None:
                self.counters["cache_sender_restarts"] += 1
                log.info("sender %s started over (epoch %d): its receiver cache is dropped",
                         header.sender, header.sender_epoch)
            mirror = self._new_mirror(header)
        if header.seq != mirror.next_seq or header.capacity != mirror.cache.capacity:
            self._drifted(header, f"seq {header.seq} where {mirror.next_seq} was next")
            return None
        if not _sizes_match(items):
            self._drifted(header, "an item's nbytes differs from its tensors")
            return None
        self._mirrors.move_to_end(header.sender)
        return mirror

    def _new_mirror(self, header: MMCacheHeader) -> _Mirror:
        mirror = _Mirror(header.sender_epoch, 0, FeatureCache(header.capacity))
        self._mirrors[header.sender] = mirror
        self._mirrors.move_to_end(header.sender)
        if len(self._mirrors) > MAX_SENDERS:
            sender, _ = self._mirrors.popitem(last=False)
            log.warning("more than %d senders: dropped the receiver cache of %s",
                        MAX_SENDERS, sender)
        return mirror

    def _capacity_fits(self, header: MMCacheHeader) -> bool:
        if header.capacity <= self.max_capacity:
            return True
        if (header.sender, header.capacity) not in self._refused:
            self._refused.add((header.sender, header.capacity))
            log.error(
                "MM worker %s caches %d bytes but this engine mirrors at most %d "
                "(--mm-cache-gb): its requests are served without the cache; give the MM "
                "worker and the engine the same --mm-cache-gb",
                header.sender, header.capacity, self.max_capacity,
            )
        return False

    def _drifted(self, header: MMCacheHeader, why: str) -> None:
        """P0 and P1 may differ: start a new engine epoch, so every sender starts over."""
        self.counters["cache_desyncs"] += 1
        old = self.epoch
        self._mirrors.clear()
        self.epoch = new_epoch(max(self.epoch, header.engine_epoch))
        log.warning("sender %s (epoch %d, seq %d) is out of sync: %s; engine cache epoch "
                    "%d -> %d", header.sender, header.sender_epoch, header.seq, why, old,
                    self.epoch)


def _resolve(items: list[MMItem], held: dict[str, Tensors]) -> tuple[list[MMItem], list[str]]:
    """Each hash-only item with the tensors of an earlier item of the request or of P1; and the
    hashes found in neither."""
    carried: dict[str, Tensors] = {}
    resolved, missing = [], []
    for item in items:
        if item.tensors or not item.mm_hash:
            if item.mm_hash:
                carried.setdefault(item.mm_hash, item.tensors)
            resolved.append(item)
            continue
        tensors = carried.get(item.mm_hash)
        if tensors is None:
            tensors = held.get(item.mm_hash)
        if tensors is None or tensors_nbytes(tensors) != item.nbytes:
            missing.append(item.mm_hash)
            resolved.append(item)
        else:
            resolved.append(replace(item, tensors=tensors))
    return resolved, missing


def _sizes_match(items: list[MMItem]) -> bool:
    """Every item that carries tensors declares their size: what P0 counted them as."""
    return all(tensors_nbytes(item.tensors) == item.nbytes for item in items if item.tensors)


def _miss(request: EngineRequest, missing: list[str]) -> CacheMissError:
    # Name every hash of the request, not only the missing ones: the resend then carries every
    # image with its tensors, even from a sender that is out of sync for some other reason.
    hashes = list(dict.fromkeys(item.mm_hash for item in request.mm_items if item.mm_hash))
    shown = ", ".join(h[:16] for h in missing[:4])
    return CacheMissError(
        f"the engine does not hold {len(missing)} cached image(s) of request "
        f"{request.request_id} ({shown}); resend them with their tensors",
        mm_hashes=hashes,
    )
