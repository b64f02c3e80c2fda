"""vLLM's scale-out wire format, written here so that neither the remote backend nor the render
API needs vLLM: a request as the body of `/inference/v1/generate` (vLLM 0.32's
`GenerateRequest`, which its `/v1/chat/completions/render` answers too), and each image in it
as one `MultiModalKwargsItem` in `features.kwargs_data`
(vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py): base64 of msgpack, as vLLM's
`MsgpackEncoder` writes it with every tensor inline.

    generate_body(request, family, norm[, kwargs_data])
                                            the request's GenerateRequest, as a dict
    mm_hashes(request)                      its images' hashes, as vLLM takes them
    item_tensors(request, family, norm[, embeds])
                                            its images' tensors and fields
    encode_item(tensors)                    one image's item
    nbytes(tensors)                         an item's size in vLLM's processor caches

An item maps each tensor name to {"data": [dtype, shape, raw bytes as msgpack extension 3],
"field": [factory, keywords]}: its field says how vLLM's model batches it with other items
('flat': rows along dim 0, the item's slice of them; 'batched': one entry per item, without the
batch dimension). The fields per family are those vLLM's processor gives the model
(`_get_mm_fields_config`); tests/test_vllm.py decodes these items with vLLM's own
decoder and compares them with the items vLLM builds.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np
import torch

from mmlane.model import PixelNorm, model_layout, normalize
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import EngineRequest

RAW_VIEW = 3
"""vLLM's msgpack extension code for a tensor's bytes (`CUSTOM_TYPE_RAW_VIEW`)."""

Field = list[Any]


def flat(rows: int) -> Field:
    """A tensor whose rows (dim 0) are the item's, concatenated with other items' rows."""
    return ["flat", {"keep_on_cpu": False, "slices": [[[0, rows, None]]], "dim": 0}]


def batched(*, keep_on_cpu: bool = False) -> Field:
    """One entry per item, stacked on a new first dimension."""
    return ["batched", {"keep_on_cpu": keep_on_cpu}]


Array = np.ndarray | torch.Tensor


def encode_item(tensors: Mapping[str, tuple[Array, Field]]) -> str:
    """The item (each tensor with its field) as vLLM's `decode_mm_kwargs_item` takes it."""
    item = {name: {"data": _tensor(array), "field": field}
            for name, (array, field) in tensors.items()}
    return base64.b64encode(msgspec.msgpack.encode(item)).decode("ascii")


def nbytes(tensors: Mapping[str, tuple[Array, Field]]) -> int:
    """The bytes an item stands for in vLLM's processor caches (its tensors' bytes, as
    `MultiModalCache.get_item_size` counts them)."""
    return sum(array.nbytes for array, _ in tensors.values())


def _tensor(array: Array) -> list[Any]:
    if isinstance(array, torch.Tensor):  # its dtype may be one numpy lacks (bfloat16)
        raw = array.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return [str(array.dtype).removeprefix("torch."), list(array.shape),
                msgspec.msgpack.Ext(RAW_VIEW, raw)]
    array = np.ascontiguousarray(array)
    return [array.dtype.name, list(array.shape), msgspec.msgpack.Ext(RAW_VIEW, array.tobytes())]


def _qwen2_vl(tensors: Mapping[str, np.ndarray],
              norm: PixelNorm) -> dict[str, tuple[Array, Field]]:
    # uint8 pixels in the model's layout: vLLM 0.32 normalises Qwen2-VL's on the device.
    pixels = model_layout(tensors["pixel_values"], norm)
    return {"pixel_values": (pixels, flat(len(pixels))),
            "image_grid_thw": (tensors["image_grid_thw"][0], batched(keep_on_cpu=True))}


def _qwen2_vl_embeds(tensors: Mapping[str, np.ndarray],
                    embeds: torch.Tensor) -> dict[str, tuple[Array, Field]]:
    return {"image_embeds": (embeds, flat(len(embeds))),
            "image_grid_thw": (tensors["image_grid_thw"][0], batched(keep_on_cpu=True))}


def _llava(tensors: Mapping[str, np.ndarray], norm: PixelNorm) -> dict[str, tuple[Array, Field]]:
    # float32 pixels, normalised as vLLM's processor gives them (vLLM 0.32 does not normalise
    # LLaVA's on the device); the worker sends one image as a batch of one
    pixels = normalize(torch.from_numpy(np.array(tensors["pixel_values"])), norm)
    return {"pixel_values": (pixels[0], batched())}


def _llava_embeds(tensors: Mapping[str, np.ndarray],
                  embeds: torch.Tensor) -> dict[str, tuple[Array, Field]]:
    return {"image_embeds": (embeds, batched())}


ITEMS: dict[str, Callable[[Mapping[str, np.ndarray], PixelNorm],
                          dict[str, tuple[Array, Field]]]] = {
    "qwen2_vl": _qwen2_vl,
    "llava": _llava,
}
"""An image's tensors (as the MM worker sends them) as the tensors and fields of vLLM's item,
by family."""

EMBEDS: dict[str, Callable[[Mapping[str, np.ndarray], torch.Tensor],
                           dict[str, tuple[Array, Field]]]] = {
    "qwen2_vl": _qwen2_vl_embeds,
    "llava": _llava_embeds,
}
"""An image's tensors and its embeddings (--encoder-lane) as the tensors and fields of vLLM's
item of embedding inputs (`image_embeds`), by family."""


EMBEDS_HASH = "+embeds"
"""Added to an image's hash where vLLM gets its embeddings (--encoder-lane): vLLM's caches
(items, encoder outputs, prefix blocks) then never give one in place of the other."""


def mm_hashes(request: EngineRequest, *, embeds: bool = False) -> list[str]:
    """The request's images' hashes for vLLM: mmlane's, or ("": not cached) the request's own;
    with `embeds`, marked as its embeddings' (EMBEDS_HASH)."""
    mark = EMBEDS_HASH if embeds else ""
    return [(item.mm_hash or f"{request.request_id}:{index}") + mark
            for index, item in enumerate(request.mm_items)]


def item_tensors(request: EngineRequest, family: str, norm: PixelNorm,
                 embeds: list[torch.Tensor] | None = None) -> list[dict[str, tuple[Array, Field]]]:
    """The request's images as the tensors and fields of vLLM's items in the layout of the
    model's `family`: their pixels, or with `embeds` (one per image) their embeddings
    (RequestError for a family whose layout is not written here yet)."""
    layouts: Mapping[str, object] = ITEMS if embeds is None else EMBEDS
    if request.mm_items and family not in layouts:
        raise RequestError(f"images of {family} models cannot be written in vLLM's "
                           f"scale-out format yet (only {', '.join(layouts)})")
    if embeds is None:
        return [ITEMS[family](one.tensors, norm) for one in request.mm_items]
    return [EMBEDS[family](one.tensors, rows)
            for one, rows in zip(request.mm_items, embeds, strict=True)]


def generate_body(request: EngineRequest, family: str, norm: PixelNorm,
                  kwargs_data: list[str | None] | None = None, *,
                  embeds: bool = False) -> dict[str, Any]:
    """`request` as vLLM's GenerateRequest: its prompt ids, its sampling fields (vLLM's names),
    and its images' hashes (`embeds`: of their embeddings), placeholder ranges and items:
    `kwargs_data` (an encoded item, or None for one the server's engine core holds by its
    hash), by default each image's pixels in full (`item_tensors`)."""
    sampling = msgspec.structs.asdict(request.sampling)
    if request.sampling.structured_outputs is not None:
        sampling["structured_outputs"] = request.sampling.structured_outputs.vllm_fields()
    if request.sampling.logit_bias is not None:
        sampling["logit_bias"] = {str(k): v for k, v in request.sampling.logit_bias.items()}
    body: dict[str, Any] = {"request_id": request.request_id,
                            "token_ids": list(request.prompt_token_ids),
                            "sampling_params": sampling}
    if request.mm_items:
        if kwargs_data is None:
            kwargs_data = [encode_item(tensors)
                           for tensors in item_tensors(request, family, norm)]
        body["features"] = {
            "mm_hashes": {"image": mm_hashes(request, embeds=embeds)},
            "mm_placeholders": {"image": [{"offset": one.offset, "length": one.length}
                                          for one in request.mm_items]},
            "kwargs_data": {"image": kwargs_data},
        }
    return body
