"""The attentions the runner switches a model's text layers to: a batched decode step's, where
each row attends to its own request's KV cache (PER_SEQUENCE), a prefill forward's of several
chunks, where each chunk attends as in a forward of its own (PER_CHUNK), and a prefill forward's
of several requests' chunks, where each request's chunks do so over its own KV cache
(PER_REQUEST).

Importing this registers them with transformers; only the "hf" backend's runner imports it, so
an engine on another backend registers nothing.

The runner's thread and the bulk lane's (runner.py) run forwards at once, each with its own
implementation, through the same layers, which look the name up on the text config at each
call: `attention` sets it for the calling thread alone (`per_thread` makes the config's name
follow the thread).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

PER_SEQUENCE = "mmlane_per_sequence"
"""The attention implementation a batched decode step switches the model's text layers to."""
PER_CHUNK = "mmlane_per_chunk"
"""The one a prefill forward switches them to where it runs several chunks at once."""
PER_REQUEST = "mmlane_per_request"
"""The one a prefill forward switches them to where it runs chunks of several requests."""


def per_sequence_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, *, decode_caches: list[DynamicCache], **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A decode step's attention, row by row: row i's new key and value go into
    `decode_caches[i]` (request i's cache), and its query attends to that cache alone, through
    SDPA as in a step of one request (no mask: one query attends to every cached token). Rows
    past the requests attend to nothing and give zeros. `attention_mask` is None: the step is
    run with an implementation name that has no mask function."""
    rows = []
    for row, cache in enumerate(decode_caches):
        keys, values = cache.update(key[row : row + 1], value[row : row + 1], module.layer_idx)
        out, _ = sdpa_attention_forward(module, query[row : row + 1], keys, values, None, **kwargs)
        rows.append(out)
    unused = query.shape[0] - len(rows)
    rows.append(rows[0].new_zeros((unused, *rows[0].shape[1:])))
    return torch.cat(rows), None


def per_chunk_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, *, prefill_chunk: int, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One request's prefill attention, chunk by chunk: the queries of each `prefill_chunk`
    tokens (the forward starts a chunk) attend to the keys up to their chunk's end, with a
    causal mask, through SDPA exactly as in a forward of that chunk alone. The key length a
    kernel sees sets how it blocks its sums, so a forward of several chunks then gives each
    the same bits as a forward of its own (the runner checks the layers around it at startup).
    `key` and `value` hold the cache and the forward's tokens; `attention_mask` is None (no
    mask function has this implementation's name)."""
    length = query.shape[2]
    past = key.shape[2] - length
    chunks = []
    for start in range(0, length, prefill_chunk):
        end = min(length, start + prefill_chunk)
        mask = torch.ones(end - start, past + end, dtype=torch.bool, device=query.device)
        out, _ = sdpa_attention_forward(
            module, query[:, :, start:end], key[:, :, : past + end], value[:, :, : past + end],
            mask.tril(past + start)[None, None], **kwargs)
        chunks.append(out)
    return torch.cat(chunks, dim=1), None


def per_request_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, *, prefill_parts: list[tuple[DynamicCache, int]],
    prefill_chunk: int, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Several requests' prefill attention: the forward's tokens are `prefill_parts`' in turn,
    (request's KV cache, its whole chunks' token count). Each part's keys and values go into
    its request's cache, and its queries attend over that cache as `per_chunk_attention` has
    them attend in a forward of that request alone (its chunks start at a chunk boundary).
    `attention_mask` is None: the forward runs without a cache of the model's own."""
    parts, start = [], 0
    for cache, length in prefill_parts:
        end = start + length
        keys, values = cache.update(key[:, :, start:end], value[:, :, start:end],
                                    module.layer_idx)
        out, _ = per_chunk_attention(module, query[:, :, start:end], keys, values, None,
                                     prefill_chunk=prefill_chunk, **kwargs)
        parts.append(out)
        start = end
    return torch.cat(parts, dim=1), None


AttentionInterface.register(PER_SEQUENCE, per_sequence_attention)
AttentionInterface.register(PER_CHUNK, per_chunk_attention)
AttentionInterface.register(PER_REQUEST, per_request_attention)


_THREAD = threading.local()
"""The attention implementation the calling thread's forwards use (`attention`), if set."""


def per_thread(config: Any) -> None:
    """Make `config` (a text config) give each thread the implementation `attention` set for
    it, and its own one elsewhere. Its class becomes a subclass of its own whose
    `_attn_implementation` looks at the thread first; done once per config."""
    base = type(config)
    if getattr(base, "_per_thread", False):
        return

    def implementation(self: Any) -> Any:
        return getattr(_THREAD, "name", None) or self._attn_implementation_internal

    prop = property(implementation, base._attn_implementation.fset)
    config.__class__ = type(base.__name__, (base,), {"_attn_implementation": prop,
                                                      "_per_thread": True})


@contextmanager
def attention(implementation: str) -> Iterator[None]:
    """Run this thread's forwards through the text layers of a `per_thread` config with
    another attention implementation for a while (the vision tower's config is another)."""
    saved = getattr(_THREAD, "name", None)
    _THREAD.name = implementation
    try:
        yield
    finally:
        _THREAD.name = saved
