"""vLLM's scale-out wire format for an image, written here so that the remote backend needs no
vLLM: one `MultiModalKwargsItem` as vLLM 0.32 puts it in `/inference/v1/generate`'s
`features.kwargs_data` (vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py): base64 of
msgpack, as vLLM's `MsgpackEncoder` writes it with every tensor inline.

An item maps each tensor name to {"data": [dtype, shape, raw bytes as msgpack extension 3],
"field": [factory, keywords]}: its field says how vLLM's model batches it with other items
('flat': rows along dim 0, the item's slice of them; 'batched': one entry per item, without the
batch dimension). The fields per family are those vLLM's processor gives the model
(`_get_mm_fields_config`); tests/test_vllm_remote.py decodes these items with vLLM's own
decoder and compares them with the items vLLM builds.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np

from mmlane.model import PixelNorm, model_layout

RAW_VIEW = 3
"""vLLM's msgpack extension code for a tensor's bytes (`CUSTOM_TYPE_RAW_VIEW`)."""

Field = list[Any]


def flat(rows: int) -> Field:
    """A tensor whose rows (dim 0) are the item's, concatenated with other items' rows."""
    return ["flat", {"keep_on_cpu": False, "slices": [[[0, rows, None]]], "dim": 0}]


def batched(*, keep_on_cpu: bool = False) -> Field:
    """One entry per item, stacked on a new first dimension."""
    return ["batched", {"keep_on_cpu": keep_on_cpu}]


def encode_item(tensors: Mapping[str, tuple[np.ndarray, Field]]) -> str:
    """The item (each tensor with its field) as vLLM's `decode_mm_kwargs_item` takes it."""
    item = {name: {"data": _tensor(array), "field": field}
            for name, (array, field) in tensors.items()}
    return base64.b64encode(msgspec.msgpack.encode(item)).decode("ascii")


def _tensor(array: np.ndarray) -> list[Any]:
    array = np.ascontiguousarray(array)
    return [array.dtype.name, list(array.shape), msgspec.msgpack.Ext(RAW_VIEW, array.tobytes())]


def _qwen2_vl(tensors: Mapping[str, np.ndarray],
              norm: PixelNorm) -> dict[str, tuple[np.ndarray, Field]]:
    # uint8 pixels in the model's layout: vLLM 0.32 normalises Qwen2-VL's on the device.
    pixels = model_layout(tensors["pixel_values"], norm)
    return {"pixel_values": (pixels, flat(len(pixels))),
            "image_grid_thw": (tensors["image_grid_thw"][0], batched(keep_on_cpu=True))}


ITEMS: dict[str, Callable[[Mapping[str, np.ndarray], PixelNorm],
                          dict[str, tuple[np.ndarray, Field]]]] = {
    "qwen2_vl": _qwen2_vl,
}
"""An image's tensors (as the MM worker sends them) as the tensors and fields of vLLM's item,
by family."""
