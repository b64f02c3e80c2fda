"""The MM worker's half of the mirrored feature cache: `mm_hash` and the sender cache (P0).

    ImageHasher    mm_hash of an image or a video: over the model, its processor settings, (a
                   video) its sampling, and the encoded bytes, or over a client-supplied uuid;
                   computed before any decoding
    SenderCache    P0 (metadata only) with its epochs. A job's images are looked up before the
                   work; the request is committed to P0 after it was sent, in send order

Epochs: P0 starts empty under a new sender epoch at start and whenever the worker learns of a
newer engine epoch (the engine restarted or reset its caches). Until it knows an engine epoch
the worker sends every tensor and commits nothing: there is no receiver cache to mirror yet.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import blake3

from mmlane.common.feature_cache import FeatureCache, commit, is_epoch, new_epoch
from mmlane.protocol.messages import EngineRequest, MMCacheHeader, MMItem

HASH_FORMAT = "mmlane-mm-hash-1"
"""Part of every hash: change it when decoding or hashing changes what a hash stands for."""


class ImageHasher:
    """mm_hash for one model: the same image under another model or processor hashes apart."""

    def __init__(self, algorithm: str, model_id: str, processor_settings: dict[str, Any]) -> None:
        scope = json.dumps(
            {"format": HASH_FORMAT, "model": model_id, "processor": processor_settings},
            sort_keys=True, default=str,
        )
        self._scope = _new_hash(algorithm)
        self._scope.update(scope.encode() + b"\0")

    def of_bytes(self, data: bytes, settings: str = "") -> str:
        """The hash of an item given by its encoded bytes; `settings`: what else decides its
        tensors, for this item alone (a video's sampling)."""
        return self._digest(b"bytes\0", settings, data)

    def of_uuid(self, uuid: str, settings: str = "") -> str:
        """The hash of an item the client named with a uuid (its bytes are not even read)."""
        return self._digest(b"uuid\0", settings, uuid.encode())

    def _digest(self, kind: bytes, settings: str, data: bytes) -> str:
        hasher = self._scope.copy()
        hasher.update(kind)
        if settings:  # an image's hash stays what it was before videos came
            hasher.update(settings.encode() + b"\0")
        hasher.update(data)
        return str(hasher.hexdigest())


def _new_hash(algorithm: str) -> Any:
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown mm_hash algorithm {algorithm!r} (blake3 or sha256)")


@dataclass(frozen=True)
class ItemInfo:
    """What P0 keeps of an item: enough to send its hash in place of its tensors."""

    nbytes: int
    num_tokens: int
    """The length of its span (MMItem.length)."""
    token_ids: tuple[int, ...] = ()
    """The item's span where it is not the image token `num_tokens` times
    (ImageItem.token_ids); empty: that token repeated."""


class SenderCache:
    """P0 and its epochs, used by the FIFO thread alone (so commits happen in send order)."""

    def __init__(self, sender: str, capacity: int) -> None:
        self.sender = sender
        """This worker's identity at the engine, which keeps one receiver cache per sender."""
        self.cache: FeatureCache[ItemInfo] = FeatureCache(capacity)
        self.epoch = new_epoch()
        self.engine_epoch = 0
        """The engine epoch P0 was started for; 0 until a job tells us one."""
        self.seq = 0
        """How many requests were committed in this epoch: the next request's `seq`."""
        self.counters: Counter[str] = Counter()

    @property
    def in_use(self) -> bool:
        """Whether requests use P0: the cache is on and an engine epoch is known."""
        return self.cache.capacity > 0 and self.engine_epoch != 0

    def see_engine_epoch(self, engine_epoch: int) -> bool:
        """Start over (empty P0, new sender epoch) when `engine_epoch` is newer than ours.

        0 (the frontend knows none yet), older epochs (a frontend that has not heard of the
        newest one) and epochs no engine makes (`is_epoch`) change nothing. Returns whether P0
        was cleared.
        """
        if not self._newer(engine_epoch):
            return False
        self.engine_epoch = engine_epoch
        self.cache.clear()
        self.epoch = new_epoch(self.epoch)
        self.seq = 0
        self.counters["cache_epochs"] += 1
        return True

    def lookup(self, hashes: list[str], invalidate: list[str]) -> list[ItemInfo | None]:
        """For each hash, its P0 entry when the engine holds its tensors too, else None.

        A hash the job asks to invalidate counts as absent: it is sent with its tensors.
        """
        if not self.in_use:
            return [None] * len(hashes)
        dropped = set(invalidate)
        found = [None if h in dropped else self.cache.get(h) for h in hashes]
        hits = sum(info is not None for info in found)
        self.counters["cache_hits"] += hits
        self.counters["cache_misses"] += len(hashes) - hits
        return found

    def _newer(self, engine_epoch: int) -> bool:
        return engine_epoch > self.engine_epoch and is_epoch(engine_epoch)

    def guess(self, hashes: list[str], invalidate: list[str], engine_epoch: int) -> list[bool]:
        """For each hash, whether `lookup` would find it if nothing were committed before: a
        guess for a job started ahead of others (counts nothing, changes nothing)."""
        if self._newer(engine_epoch):  # P0 will start over before this job's lookup
            return [False] * len(hashes)
        dropped = set(invalidate)
        return [self.in_use and h not in dropped and h in self.cache for h in hashes]

    def header(self, invalidate: list[str]) -> MMCacheHeader | None:
        """What the engine needs to mirror the commit of the next request (None: not in use)."""
        if not self.in_use:
            return None
        return MMCacheHeader(
            sender=self.sender, sender_epoch=self.epoch, engine_epoch=self.engine_epoch,
            seq=self.seq, capacity=self.cache.capacity, invalidate=list(invalidate),
        )

    def commit(self, request: EngineRequest) -> None:
        """Apply a request that was just sent to P0, exactly as the engine applies it to P1."""
        header = request.mm_cache
        if header is None or header.sender_epoch != self.epoch or header.seq != self.seq:
            return  # rendered before P0 started over: the engine will not mirror it either
        evicted = self.cache.evictions
        commit(self.cache, request, lambda item: _item_info(request, item))
        self.counters["cache_evictions"] += self.cache.evictions - evicted
        self.seq += 1


def _item_info(request: EngineRequest, item: MMItem) -> ItemInfo:
    """The item's sizes, and its span where it is not all one token (the image token): a hit
    places it again without the tensors it was made from."""
    span = tuple(request.prompt_token_ids[item.offset : item.offset + item.length])
    if span.count(span[0]) == len(span):
        return ItemInfo(item.nbytes, item.length)
    return ItemInfo(item.nbytes, item.length, _shared(span))


@functools.lru_cache(maxsize=256)
def _shared(span: tuple[int, ...]) -> tuple[int, ...]:
    # A family has few distinct spans (one per tile grid or image size): the entries holding
    # one share one tuple, and this table stays bounded.
    return span
