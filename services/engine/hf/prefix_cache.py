"""The prefix cache: the KV of prompt prefixes seen before, reused bit for bit.

A request prefills its prompt in chunks of `chunk_tokens` tokens from position 0 (runner.py).
After each full chunk the runner stores that chunk's keys and values here; a later request whose
prompt starts the same way copies the longest run of held chunks into its own KV cache and
prefills only the rest, in its own chunks. The reuse is exact because a chunk's KV is a function
of what its forward pass got, and the key names all of it:

- the chunk size: a chunk's KV depends on its shape (a matmul over 64 rows may sum in another
  order than one over 100), so only chunks of the same size, at the same boundaries (multiples
  of the chunk size from 0), are ever shared; the size is in every key, as
  `HFRunner.prefill_chunk_tokens` may change (configured per engine, or derived at startup);
- every token up to the chunk's end, and every image whose placeholder tokens overlap that
  span, by its offset, length and `mm_hash`: placeholder token ids are the same for every
  image, the hash tells the images apart, and it also fixes the image's features (the same
  bits from the encoder cache or a vision pass, which always runs whole on the same thread
  count: vision_lane.py) and its grid. Qwen2-VL's M-RoPE position of
  a token follows from the tokens and the grids of the images before it, so that is named too;
  LLaVA's positions are the token's index;
- the KV of the chunks before: each key is a hash chained over the previous chunk's key.
The model, its dtype, device and attention are the runner's own, the same for every request.

A request looks its prefix up when its first unit runs (`HFRunner._reuse_prefix`), so it
also shares what a request that arrived just before it has stored since.

An image without a hash (its MM worker's cache off, no client uuid) cannot be named, so the
chunks from the first one it overlaps on are never stored. A prompt's last chunk (full or
short) gives its first token's logits: it is stored with them, under a key that names the
whole prompt (`prompt_key`), so that the same prompt again (a retry, a regenerated answer, the
same image asked the same question) runs no prefill at all; any other prompt reuses at most the
chunks before its last token. Bounded by bytes (`FeatureCache`, LRU): a chain is stored and
refreshed with its first chunk most recent and its prompt's end least, so eviction takes a
prefix's tail before its head and a held chain stays reachable from position 0.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from transformers import DynamicCache

from protocol.messages import EngineRequest
from services.common.feature_cache import FeatureCache
from services.common.stats import Metrics


@dataclass(frozen=True)
class KVChunk:
    """One chunk's keys and values, a (1, kv_heads, chunk_tokens, head_dim) tensor per layer."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True)
class PromptEnd:
    """A whole prompt's last chunk (its keys and values) and the logits it ended with."""

    kv: KVChunk
    logits: torch.Tensor
    """(vocab,): the next-token logits after the prompt."""

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.logits.numel() * self.logits.element_size()


def prompt_key(request: EngineRequest, chunk_tokens: int) -> str | None:
    """The key of the request's whole prompt (its end's, in the cache): the chunk size, every
    token and every image; None when an image has no hash."""
    if any(not item.mm_hash for item in request.mm_items):
        return None
    whole = hashlib.blake2b(f"prompt, chunk_tokens {chunk_tokens}".encode())
    whole.update(repr(request.prompt_token_ids).encode())
    for item in request.mm_items:
        whole.update(f"|{item.offset},{item.length},{item.mm_hash}".encode())
    return whole.hexdigest()


def chunk_keys(request: EngineRequest, chunk_tokens: int) -> list[str]:
    """The key of each full chunk of the request's prompt, in order: chunk j's names the chunk
    size, the tokens of [0, (j+1) * chunk_tokens) and the images overlapping it. Stops before
    the first chunk that overlaps an image without a hash."""
    tokens = request.prompt_token_ids
    digest = hashlib.blake2b(f"chunk_tokens {chunk_tokens}".encode()).digest()
    keys: list[str] = []
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        end = start + chunk_tokens
        part = hashlib.blake2b(digest)
        part.update(repr(tokens[start:end]).encode())
        for item in request.mm_items:
            if item.offset < end and start < item.offset + item.length:
                if not item.mm_hash:
                    return keys
                part.update(f"|{item.offset},{item.length},{item.mm_hash}".encode())
        digest = part.digest()
        keys.append(digest.hex())
    return keys


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[PrefixCache, _P], _R]
            ) -> Callable[Concatenate[PrefixCache, _P], _R]:
    """`method`, run holding the cache's lock."""
    @functools.wraps(method)
    def locked(self: PrefixCache, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class PrefixCache:
    """KV chunks by `chunk_keys` and prompt ends by `prompt_key`, LRU by bytes; counts into
    `metrics` as prefix_cache_hits, _misses (requests with a chunk or a whole prompt to look up
    that found none), _hit_tokens, _hit_prompts (whole prompts held), _hit_images (images
    inside reused prefixes, counted by the runner), _evictions and _bytes. The runner's thread
    and the bulk lane's use it at once: each method holds its lock."""

    def __init__(self, capacity: int, metrics: Metrics) -> None:
        self._chunks: FeatureCache[KVChunk | PromptEnd] = FeatureCache(capacity)
        self._counters = metrics.counters
        self._lock = threading.Lock()

    @_locked
    def reuse(
        self, keys: list[str], chunk_tokens: int, prompt_len: int, cache: DynamicCache,
        whole: str | None = None,
    ) -> tuple[int, torch.Tensor | None]:
        """Fill the empty `cache` with the longest held run of `keys` from the start that ends
        before the prompt's last token, and with the prompt's end too when `whole` (its
        `prompt_key`) is held after all of them: how many prompt tokens it now holds, and the
        logits after the prompt when it holds the whole prompt (else None)."""
        usable = keys[: (prompt_len - 1) // chunk_tokens]
        held = self._held_run(usable)
        end = None
        if whole is not None and len(held) == len(usable):
            found = self._chunks.touch(whole)  # before its chain: eviction takes the end first
            end = found if isinstance(found, PromptEnd) else None
        if not held and end is None:
            if usable or whole is not None:
                self._counters["prefix_cache_misses"] += 1
            return 0, None
        self._refresh(usable[: len(held)])
        parts = [*held, end.kv] if end is not None else held
        for layer, layer_keys in enumerate(zip(*(part.keys for part in parts), strict=True)):
            values = [part.values[layer] for part in parts]
            cache.update(torch.cat(layer_keys, dim=-2), torch.cat(values, dim=-2), layer)
        reused = prompt_len if end is not None else len(held) * chunk_tokens
        self._counters["prefix_cache_hits"] += 1
        self._counters["prefix_cache_hit_tokens"] += reused
        if end is None:
            return reused, None
        self._counters["prefix_cache_hit_prompts"] += 1
        return reused, end.logits

    @_locked
    def held_tokens(self, keys: list[str], chunk_tokens: int, prompt_len: int,
                    whole: str | None = None) -> int:
        """How many prompt tokens `reuse` would fill in now; nothing is used or counted."""
        usable = keys[: (prompt_len - 1) // chunk_tokens]
        held = len(self._held_run(usable))
        if whole is not None and held == len(usable) and isinstance(self._chunks.get(whole),
                                                                    PromptEnd):
            return prompt_len
        return held * chunk_tokens

    def _held_run(self, keys: list[str]) -> list[KVChunk]:
        """The chunks of the longest run of `keys` from the start that are held."""
        held: list[KVChunk] = []
        for key in keys:
            chunk = self._chunks.get(key)
            if not isinstance(chunk, KVChunk):
                break
            held.append(chunk)
        return held

    @_locked
    def store_end(self, keys: list[str], whole: str, chunk_tokens: int, cache: DynamicCache,
                  logits: torch.Tensor) -> None:
        """Hold the end of the prompt `whole` names, now wholly in `cache`: its last chunk,
        after the full chunks `keys` name, and `logits` (vocab,) after it."""
        if whole in self._chunks:
            return
        prompt_len = cache.get_seq_length()
        start = (prompt_len - 1) // chunk_tokens * chunk_tokens
        end = PromptEnd(_sliced(cache, start, prompt_len - start), logits.clone())
        chain = keys[: start // chunk_tokens]
        self._refresh(chain)  # as `store`: the put evicts other chains, not this one
        self._chunks.put(whole, end.nbytes, end)
        self._refresh(chain)  # and the end goes before its chain
        self._count()

    @_locked
    def store(self, keys: list[str], chunk_tokens: int, cache: DynamicCache) -> None:
        """Hold the chunks `keys` name, the first len(keys) of `cache` (each one taken from it
        unless held already), unless together they are larger than the whole cache."""
        chunks = [_held_chunk(self._chunks.get(key))
                  or _sliced(cache, index * chunk_tokens, chunk_tokens)
                  for index, key in enumerate(keys)]
        if sum(chunk.nbytes for chunk in chunks) > self._chunks.capacity:
            return
        self._refresh(keys)  # the held ones are most recent: a put evicts only other chains
        for key, chunk in zip(keys, chunks, strict=True):
            if key not in self._chunks:
                self._chunks.put(key, chunk.nbytes, chunk)
        self._refresh(keys)
        self._count()

    def _count(self) -> None:
        self._counters["prefix_cache_evictions"] = self._chunks.evictions
        self._counters["prefix_cache_bytes"] = self._chunks.nbytes

    def _refresh(self, keys: list[str]) -> None:
        """Make a chain's chunks the most recently used, its first chunk most of all."""
        for key in reversed(keys):
            self._chunks.touch(key)


def _held_chunk(held: KVChunk | PromptEnd | None) -> KVChunk | None:
    return held if isinstance(held, KVChunk) else None


def _sliced(cache: DynamicCache, start: int, count: int) -> KVChunk:
    """Tokens [start, start + count) of every layer of `cache`, copied: a view would keep the
    whole layer's tensor alive, and the cache's next update replaces that tensor anyway."""
    span = slice(start, start + count)
    layers: list[Any] = list(cache.layers)  # DynamicLayers: the runner refuses sliding windows
    return KVChunk(
        keys=tuple(layer.keys[:, :, span].clone() for layer in layers),
        values=tuple(layer.values[:, :, span].clone() for layer in layers),
    )
