"""The attention a batched decode step switches a model's text layers to: each row attends to
its own request's KV cache (PER_SEQUENCE).

Importing this registers it with transformers; only the "hf" backend's runner imports it, so an
engine on another backend registers nothing. Only the runner's model thread runs the text
layers (the vision lane runs the vision tower, whose config is its own), so `attention` may set
the implementation on the shared text config for the length of a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

PER_SEQUENCE = "mmlane_per_sequence"
"""The attention implementation a batched decode step switches the model's text layers to."""


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


AttentionInterface.register(PER_SEQUENCE, per_sequence_attention)


@contextmanager
def attention(text_config: Any, implementation: str) -> Iterator[None]:
    """Run the text layers with another attention implementation for a while."""
    saved = text_config._attn_implementation
    text_config._attn_implementation = implementation
    try:
        yield
    finally:
        text_config._attn_implementation = saved
