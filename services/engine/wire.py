"""vLLM's scale-out wire format, written here so that neither the remote backend nor the render
API needs vLLM: a request as the body of `/inference/v1/generate` (vLLM 0.32's
`GenerateRequest`, which its `/v1/chat/completions/render` answers too), and each image or
video in it as one `MultiModalKwargsItem` in `features.kwargs_data`
(vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py): base64 of msgpack, as vLLM's
`MsgpackEncoder` writes it with every tensor inline. `features` holds each modality's items
apart ("image", "video"), each modality's in prompt order.

    generate_body(request, spec[, kwargs_data])
                                            the request's GenerateRequest, as a dict
    mm_hashes(request)                      its items' hashes, as vLLM takes them
    modality(item), by_modality(request, values)
                                            "image" or "video"; one value per item, grouped
    item_tensors(request, spec[, embeds])
                                            its items' tensors and fields
    encode_item(tensors)                    one item's encoding
    nbytes(tensors)                         an item's size in vLLM's processor caches

An item maps each tensor name to {"data": [dtype, shape, raw bytes as msgpack extension 3],
"field": [factory, keywords]}: its field says how vLLM's model batches it with other items
('flat': rows along dim 0, the item's slice of them; 'batched': one entry per item, without the
batch dimension). The fields per family are those vLLM's processor gives the model
(`_get_mm_fields_config`); tests/test_vllm.py and tests/test_vllm_video_serving.py decode
these items with vLLM's own decoder and compare them with the items vLLM builds.

A Qwen2-VL or Qwen2.5-VL video goes as vLLM's processor lays it out (`_qwen2_vl_video`): uint8
`pixel_values_videos` rows (vLLM 0.32 normalises them on the device), `video_grid_thw` and, for
Qwen2.5-VL, `second_per_grid_ts` in float32, as the HF processor returns it. vLLM's own
processor casts that to the model's dtype: a replica that runs the model in 16 bits reads the
float32 value, which can time a video's patches a rounding apart from vLLM alone's (a replica
run with `--dtype float32` reads the same value).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from mmlane.model import PixelNorm, model_layout, normalize
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import VIDEO_PIXELS, EngineRequest, MMItem

if TYPE_CHECKING:
    from mmlane.engine.runner import ModelSpec

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
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would give a scalar a dimension)
        array = np.ascontiguousarray(array)
    return [array.dtype.name, list(array.shape), msgspec.msgpack.Ext(RAW_VIEW, array.tobytes())]


def _normalised(pixels: np.ndarray, norm: PixelNorm) -> torch.Tensor:
    """uint8 pixels (a read-only view, as they come in a ZMQ frame) normalised as the processor
    normalises them, float32, for a model vLLM 0.32 does not normalise on the device."""
    return normalize(torch.from_numpy(np.array(pixels)), norm)


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
    pixels = _normalised(tensors["pixel_values"], norm)
    return {"pixel_values": (pixels[0], batched())}


def _llava_embeds(tensors: Mapping[str, np.ndarray],
                  embeds: torch.Tensor) -> dict[str, tuple[Array, Field]]:
    return {"image_embeds": (embeds, batched())}


def _llava_next(tensors: Mapping[str, np.ndarray],
                norm: PixelNorm) -> dict[str, tuple[Array, Field]]:
    # LLaVA-NeXT's and OneVision's: the image's own tiles, float32 and normalised (vLLM 0.32
    # normalises neither on the device), with its size. vLLM's processor pads a prompt's images
    # to the most tiles of any; the model drops a padded tile's features, so each item goes
    # as its image alone makes it, whatever the request holds beside it.
    pixels = _normalised(tensors["pixel_values"], norm)
    return {"pixel_values": (pixels, batched()),
            "image_sizes": (tensors["image_sizes"][0], batched(keep_on_cpu=True))}


ITEMS: dict[str, Callable[[Mapping[str, np.ndarray], PixelNorm],
                          dict[str, tuple[Array, Field]]]] = {
    "qwen2_vl": _qwen2_vl,
    "llava": _llava,
    "llava_next": _llava_next,
    "llava_onevision": _llava_next,
}
"""An image's tensors (as the MM worker sends them) as the tensors and fields of vLLM's item,
by family. The families not here (Mistral 3, InternVL, Idefics3) cannot be served through
vLLM 0.32's scale-out API: their image spans hold other tokens besides the image's (row breaks,
<img>, row and column tokens), and its `PlaceholderRangeInfo` has no `is_embed` mask to mark
which positions take the image's features (NO_MASK)."""

NO_MASK = ("their image spans hold other tokens besides the image's, and vLLM 0.32's scale-out "
           "API (/inference/v1/generate) takes a placeholder range without the mask that marks "
           "them (is_embed)")
"""Why the families ITEMS lacks cannot be sent to vLLM's scale-out API."""

EMBEDS: dict[str, Callable[[Mapping[str, np.ndarray], torch.Tensor],
                           dict[str, tuple[Array, Field]]]] = {
    "qwen2_vl": _qwen2_vl_embeds,
    "llava": _llava_embeds,
}
"""An image's tensors and its embeddings (--encoder-lane) as the tensors and fields of vLLM's
item of embedding inputs (`image_embeds`), by family."""


def _qwen2_vl_video(tensors: Mapping[str, np.ndarray],
                    norm: PixelNorm) -> dict[str, tuple[Array, Field]]:
    # uint8 pixels: vLLM 0.32 normalises Qwen2-VL's videos on the device too.
    pixels = tensors[VIDEO_PIXELS]
    item = {VIDEO_PIXELS: (pixels, flat(len(pixels))),
            "video_grid_thw": (tensors["video_grid_thw"][0], batched(keep_on_cpu=True))}
    if "second_per_grid_ts" in tensors:  # Qwen2.5-VL's: one float per video
        item["second_per_grid_ts"] = (tensors["second_per_grid_ts"].reshape(()),
                                      batched(keep_on_cpu=True))
    return item


def _llava_onevision_video(tensors: Mapping[str, np.ndarray],
                          norm: PixelNorm) -> dict[str, tuple[Array, Field]]:
    # Its frames, float32 and normalised (vLLM 0.32 does not normalise them on the device): one
    # batched entry a video, as vLLM's processor lists a prompt's videos.
    return {VIDEO_PIXELS: (_normalised(tensors[VIDEO_PIXELS], norm), batched())}


VIDEOS: dict[str, Callable[[Mapping[str, np.ndarray], PixelNorm],
                           dict[str, tuple[Array, Field]]]] = {
    "qwen2_vl": _qwen2_vl_video,
    "llava_onevision": _llava_onevision_video,
}
"""A video's tensors (as the MM worker sends them) and the video processor's pixel norm as the
tensors and fields of vLLM's item, by family. With --encoder-lane too: videos go as pixels, and
vLLM runs their vision pass."""


EMBEDS_HASH = "+embeds"
"""Added to an image's hash where vLLM gets its embeddings (--encoder-lane): vLLM's caches
(items, encoder outputs, prefix blocks) then never give one in place of the other."""


def mm_hashes(request: EngineRequest, *, embeds: bool = False) -> list[str]:
    """The request's items' hashes for vLLM: mmlane's, or ("": not cached) the request's own;
    with `embeds`, its images' marked as their embeddings' (EMBEDS_HASH)."""
    return [(item.mm_hash or f"{request.request_id}:{index}")
            + (EMBEDS_HASH if embeds and not item.is_video else "")
            for index, item in enumerate(request.mm_items)]


def modality(item: MMItem) -> str:
    """The item's modality, as vLLM names it."""
    return "video" if item.is_video else "image"


def image_indices(request: EngineRequest) -> list[int]:
    """Where the request's images are among its items (its videos left out)."""
    return [index for index, item in enumerate(request.mm_items) if not item.is_video]


def item_tensors(request: EngineRequest, spec: ModelSpec,
                 embeds: list[torch.Tensor] | None = None) -> list[dict[str, tuple[Array, Field]]]:
    """The request's items as the tensors and fields of vLLM's items in the layout of the
    model's family (`spec`): their pixels, or with `embeds` (one per image, in order) its
    images' embeddings and its videos' pixels (RequestError for a family whose layout is not
    written here)."""
    family = spec.family
    images: Mapping[str, object] = ITEMS if embeds is None else EMBEDS
    for kinds, layouts in (("images", images), ("videos", VIDEOS)):
        if family not in layouts and any(
                item.is_video == (kinds == "videos") for item in request.mm_items):
            reason = NO_MASK if family not in ITEMS else f"only those of {', '.join(layouts)}"
            raise RequestError(f"{kinds} of {family} models cannot be written in vLLM's "
                               f"scale-out format: {reason}")
    video_norm = spec.video.pixel_norm if spec.video is not None else spec.pixel_norm
    rows = iter(embeds or ())
    return [VIDEOS[family](one.tensors, video_norm) if one.is_video
            else ITEMS[family](one.tensors, spec.pixel_norm) if embeds is None
            else EMBEDS[family](one.tensors, next(rows)) for one in request.mm_items]


def by_modality(request: EngineRequest, values: list[Any]) -> dict[str, list[Any]]:
    """`values` (one per item of the request) by the items' modality, each in prompt order."""
    grouped: dict[str, list[Any]] = {}
    for item, value in zip(request.mm_items, values, strict=True):
        grouped.setdefault(modality(item), []).append(value)
    return grouped


def generate_body(request: EngineRequest, spec: ModelSpec,
                  kwargs_data: list[str | None] | None = None, *,
                  embeds: bool = False) -> dict[str, Any]:
    """`request` as vLLM's GenerateRequest: its prompt ids, its sampling fields (vLLM's names),
    and its items' hashes (`embeds`: of the images' embeddings), placeholder ranges and items,
    by modality: `kwargs_data` (one per item: an encoded item, or None for one the server's
    engine core holds by its hash), by default each item's pixels in full (`item_tensors`)."""
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
                           for tensors in item_tensors(request, spec)]
        body["features"] = {
            "mm_hashes": by_modality(request, mm_hashes(request, embeds=embeds)),
            "mm_placeholders": by_modality(request, [
                {"offset": one.offset, "length": one.length} for one in request.mm_items]),
            "kwargs_data": by_modality(request, kwargs_data),
        }
    return body
