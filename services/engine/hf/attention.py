"""The attention a batched decode step runs: each row attends to its own request's KV cache.

Importing this registers it with transformers (as PER_SEQUENCE); only the "hf" backend's runner
imports it, so an engine on another backend registers nothing.
"""

from __future__ import annotations

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
