"""Per-family description of image placeholders, so adding a model family is a local change.

A family says which token marks an image in the rendered prompt, which image-processor outputs
belong to one image, how to split a batched processor output into per-image items, and how many
placeholder tokens the Hugging Face processor expands one image into.
"""

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

Tensors = Mapping[str, np.ndarray]
TokenCounter = Callable[[Tensors], int]
Uint8Processor = Callable[[Any, Image.Image], dict[str, np.ndarray]]


class UnsupportedModelError(ValueError):
    """The model directory's `model_type` has no family here."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    image_token: str
    # Image-processor outputs that are per-image tensors, in the order the model takes them.
    item_fields: tuple[str, ...]
    split_items: Callable[[Tensors], list[dict[str, np.ndarray]]]
    # Reads the model's settings once and returns `num_image_tokens(item) -> int`.
    token_counter: Callable[[Path, Any, Any], TokenCounter]
    # `(image_processor, rgb_image) -> tensors`: one image's tensors with the pixels as uint8
    # in the model's layout, before the processor's rescale and normalise (services/model/
    # pixels.py: the engine runs those two).
    uint8_pixels: Uint8Processor

    def join_items(self, items: list[Tensors]) -> dict[str, np.ndarray]:
        """The inverse of `split_items`: the batched tensors the model takes for these images."""
        return {
            field: np.concatenate([item[field] for item in items]) for field in self.item_fields
        }


def _split_qwen2_vl(batch: Tensors) -> list[dict[str, np.ndarray]]:
    # Patches of all images are stacked on axis 0; each image owns t*h*w rows of them.
    grids = batch["image_grid_thw"]
    ends = np.cumsum(grids.prod(axis=1))
    starts = ends - grids.prod(axis=1)
    return [
        {
            "pixel_values": batch["pixel_values"][start:end],
            "image_grid_thw": grids[index : index + 1],
        }
        for index, (start, end) in enumerate(zip(starts, ends, strict=True))
    ]


def _qwen2_vl_token_counter(model_dir: Path, config: Any, image_processor: Any) -> TokenCounter:
    # Each group of merge_size x merge_size patches becomes one placeholder token.
    merge_length = image_processor.merge_size**2
    return lambda item: int(item["image_grid_thw"].prod()) // merge_length


def _processor_uint8(image_processor: Any, image: Image.Image) -> dict[str, np.ndarray]:
    """Any family: the processor itself with its rescale and normalise turned off. Its resize
    works in uint8, so the values it returns (float32 for some families) are whole 0-255."""
    batch = image_processor(
        images=[image], do_rescale=False, do_normalize=False, return_tensors="np"
    )
    tensors = dict(batch)
    tensors["pixel_values"] = np.asarray(tensors["pixel_values"]).astype(np.uint8)
    return tensors


def _qwen2_vl_uint8(image_processor: Any, image: Image.Image) -> dict[str, np.ndarray]:
    """Qwen2VLImageProcessorPil's resize and patch layout, done in uint8 on the PIL image.

    The processor turns the image into a channel-first array, back into a PIL image to resize
    it, and lays the patches out in float32: two copies of the full-size image and a float
    pass this skips. Same resize (its smart_resize rule, PIL, its resample filter), same
    layout, so the pixels are the processor's bit for bit (tests/test_pixels.py)."""
    p = image_processor
    factor = p.patch_size * p.merge_size
    height, width = smart_resize(
        image.height, image.width, factor=factor,
        min_pixels=p.size["shortest_edge"], max_pixels=p.size["longest_edge"],
    )
    resized = np.asarray(image.resize((width, height), resample=p.resample, reducing_gap=None))
    grid_h, grid_w = height // p.patch_size, width // p.patch_size
    merge, patch = p.merge_size, p.patch_size
    # (H, W, C) -> (h/m, w/m, m, m, C, patch, patch), as the processor's patchify orders it
    patches = resized.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch, -1)
    patches = patches.transpose(0, 3, 1, 4, 6, 2, 5)
    channels = patches.shape[4]
    # One image is `temporal_patch_size` identical frames.
    frames = np.broadcast_to(
        patches[:, :, :, :, :, None], (*patches.shape[:5], p.temporal_patch_size, patch, patch)
    )
    pixel_values = frames.reshape(grid_h * grid_w, channels * p.temporal_patch_size * patch**2)
    return {
        "pixel_values": np.ascontiguousarray(pixel_values),
        "image_grid_thw": np.array([[1, grid_h, grid_w]], dtype=np.int64),
    }


def _split_llava(batch: Tensors) -> list[dict[str, np.ndarray]]:
    pixel_values = batch["pixel_values"]
    return [{"pixel_values": pixel_values[index : index + 1]} for index in range(len(pixel_values))]


def _llava_token_counter(model_dir: Path, config: Any, image_processor: Any) -> TokenCounter:
    # LlavaProcessor reads these from processor_config.json; the model config is the fallback
    # for directories saved before the processor carried them.
    settings = _read_processor_config(model_dir)
    patch_size = settings.get("patch_size") or config.vision_config.patch_size
    strategy = (
        settings.get("vision_feature_select_strategy") or config.vision_feature_select_strategy
    )
    additional = settings.get("num_additional_image_tokens", 0)
    # The "default" strategy drops the CLS feature, so one additional token goes away again.
    dropped = 1 if strategy == "default" else 0

    def num_image_tokens(item: Tensors) -> int:
        height, width = item["pixel_values"].shape[-2:]
        return (height // patch_size) * (width // patch_size) + additional - dropped

    return num_image_tokens


def _read_processor_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "processor_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


QWEN2_VL = Family(
    name="qwen2_vl",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    image_token="<|image_pad|>",
    item_fields=("pixel_values", "image_grid_thw"),
    split_items=_split_qwen2_vl,
    token_counter=_qwen2_vl_token_counter,
    uint8_pixels=_qwen2_vl_uint8,
)

LLAVA = Family(
    name="llava",
    model_types=("llava",),
    image_token="<image>",
    item_fields=("pixel_values",),
    split_items=_split_llava,
    token_counter=_llava_token_counter,
    uint8_pixels=_processor_uint8,
)

FAMILIES = (QWEN2_VL, LLAVA)


def family_for(model_type: str) -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(t for family in FAMILIES for t in family.model_types)
    raise UnsupportedModelError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported)}"
    )
