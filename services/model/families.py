"""Per-family description of image placeholders, so adding a model family is a local change.

A family says which token marks an image in the rendered prompt, which image-processor outputs
belong to one image, how to split a batched processor output into per-image items, how many
image tokens one image has, the text the Hugging Face processor puts in place of its
placeholder where that is more than its image tokens (its span), and which tensor shapes the
model takes (the engine checks every request against them, whatever its backend).
"""

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image
from transformers.image_processing_utils import get_size_dict, select_best_resolution
from transformers.image_transforms import get_resize_output_image_size
from transformers.image_utils import ChannelDimension
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    get_resize_output_image_size as idefics3_resized_size,
)
from transformers.models.pixtral import image_processing_pil_pixtral as pixtral
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import MMItem

if TYPE_CHECKING:
    import torch

Tensors = Mapping[str, np.ndarray]
TokenCounter = Callable[[Tensors], int]
ItemChecker = Callable[[list[MMItem]], None]
"""Raises RequestError when a request's images have tensors the model cannot take."""
Uint8Processor = Callable[[Any, Image.Image], dict[str, np.ndarray]]
ResizeRule = Callable[[Any, int, int], tuple[int, int]]
"""`(image_processor, width, height) -> (width, height)`: the size the processor resizes an
upright image of that size to."""
PlaceholderText = Callable[[Tensors], str]
"""The text the HF processor puts in place of an image's placeholder token."""


class UnsupportedModelError(ValueError):
    """The model directory's `model_type` has no family here."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    image_token: str
    # Image-processor outputs that are per-image tensors, in the order the model takes them.
    item_fields: tuple[str, ...]
    # `(image_processor, batch) -> items`: a batched processor output, one image an item.
    split_items: Callable[[Any, Tensors], list[dict[str, np.ndarray]]]
    # Reads the model's settings once and returns `num_image_tokens(item) -> int`: the image
    # tokens of the image's span, one per feature the model makes for it (the span's length
    # too, unless the family has a `placeholder_text`).
    token_counter: Callable[[Path, Any, Any], TokenCounter]
    # Reads the model's config (transformers' PretrainedConfig) once and returns the check.
    item_checker: Callable[[Any], ItemChecker]
    # `(image_processor, rgb_image) -> tensors`: one image's tensors with the pixels as uint8
    # in the model's layout, before the processor's rescale and normalise (services/model/
    # pixels.py: the engine runs those two).
    uint8_pixels: Uint8Processor
    # The processor's own resize rule: what decoding may reduce a JPEG to and no further
    # (services/mm_worker/media.py, `--jpeg-draft`).
    resized_size: ResizeRule
    # Reads the model's settings once and returns the text that replaces an image's
    # placeholder (its span), for a family whose images expand into more than image tokens:
    # tokens around the image or each tile, row breaks, row/column tokens. The preprocessor
    # tokenizes it (special tokens stay whole; Idefics3's newlines take the ids they take in
    # the HF processor's prompt); the image token's positions in it take the features, the
    # other tokens keep their own embeddings. None: the image token `token_counter` times.
    placeholder_text: Callable[[Path, Any, Any], PlaceholderText] | None = None
    # Settings the model's processor gives its image processor on top of the image processor's
    # own file (`(model_dir, config) -> kwargs`, given at load time), so that the image
    # processor alone makes what the processor makes (Pixtral's patch size, InternVL's
    # crop_to_patches, Idefics3's return_row_col_info: each image's rows and columns of
    # tiles, which the HF processor drops from its own output).
    image_processor_settings: Callable[[Path, Any], dict[str, Any]] = lambda model_dir, config: {}
    # The image processor's setting that counts an image's identical frames in the model's
    # layout (Qwen2-VL's temporal_patch_size: a video's patch spans that many frames). The
    # pixels sent hold one frame (the processor called with the setting at 1); the engine
    # repeats it (services/model/pixels.py, `model_layout`). None: one frame, sent as it is.
    frames_setting: str | None = None
    # The format of tool calls in the model's output, as vLLM's --tool-call-parser names it
    # ('hermes': `<tool_call>{"name", "arguments"}</tool_call>`; 'mistral': `[TOOL_CALLS]
    # [{"name", "arguments"}]`; services/frontend/tools.py); None: none known (tool_choice
    # 'auto' is refused unless --tool-call-parser names one).
    tool_call_format: str | None = None

    def frames(self, image_processor: Any) -> int:
        """The identical frames of an image in the model's layout (one of them is sent)."""
        return 1 if self.frames_setting is None else int(getattr(image_processor,
                                                                 self.frames_setting))

    def one_frame(self) -> dict[str, int]:
        """The image processor's call settings that lay out one frame of an image."""
        return {} if self.frames_setting is None else {self.frames_setting: 1}

    def join_items(self, items: list[Tensors]) -> dict[str, np.ndarray]:
        """The inverse of `split_items`: the batched tensors the model takes for these images,
        each padded at the end with zeros to the largest of them (Pixtral's images of several
        sizes: the model reads each one's own from image_sizes)."""
        return {field: _join_padded([item[field] for item in items]) for field in self.item_fields}


def _join_padded(arrays: list[np.ndarray]) -> np.ndarray:
    shape = tuple(int(side) for side in np.max([array.shape[1:] for array in arrays], axis=0))
    return np.concatenate([
        array if array.shape[1:] == shape else np.pad(
            array, [(0, 0), *((0, m - n) for m, n in zip(shape, array.shape[1:], strict=True))]
        )
        for array in arrays
    ])


def _split_qwen2_vl(image_processor: Any, batch: Tensors) -> list[dict[str, np.ndarray]]:
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


def _qwen2_vl_item_checker(config: Any) -> ItemChecker:
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.patch_size**2  # one frame (`Family.frames`)

    def check_tensors(where: str, tensors: Tensors) -> None:
        grid = _tensor(tensors, where, "image_grid_thw", ndim=2, kind="iu")
        # uint8 (the codec's only unsigned dtype): before the processor's rescale and normalise
        pixels = _tensor(tensors, where, "pixel_values", ndim=2, kind="u")
        if grid.shape != (1, 3) or (grid < 1).any():
            raise RequestError(
                f"{where}.image_grid_thw must be one positive (t, h, w) row, got {grid.tolist()}"
            )
        t, h, w = (int(v) for v in grid[0])
        if h % merge or w % merge:
            raise RequestError(
                f"{where}.image_grid_thw h and w must be multiples of {merge}, got {h}x{w}"
            )
        if pixels.shape != (t * h * w, patch_dim):
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, grid {(t, h, w)} needs "
                f"({t * h * w}, {patch_dim})"
            )

    def check_items(items: list[MMItem]) -> None:
        _check_each(items, check_tensors)
        # M-RoPE finds images as runs of image tokens: two touching images would merge.
        for index in range(1, len(items)):
            if items[index].offset == items[index - 1].offset + items[index - 1].length:
                raise RequestError(
                    f"mm_items[{index}] starts right where mm_items[{index - 1}] ends; "
                    "Qwen2-VL needs a token (e.g. <|vision_end|>) between two images"
                )

    return check_items

def processor_uint8(image_processor: Any, image: "Image.Image | torch.Tensor",
                    **settings: Any) -> dict[str, np.ndarray]:
    """Any family: the processor itself with its rescale and normalise turned off (and any
    `settings` of the call), on an image as the processor takes it (a torchvision backend's:
    also as its tensor). Its resize works in uint8, so the values it returns (float32 for some
    families) are whole 0-255."""
    batch = image_processor(
        images=[image], do_rescale=False, do_normalize=False, return_tensors="np", **settings
    )
    tensors = dict(batch)
    tensors["pixel_values"] = np.asarray(tensors["pixel_values"]).astype(np.uint8, copy=False)
    return tensors


def _qwen2_vl_resized_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """smart_resize, as the processor calls it: sides multiples of patch x merge, the pixel
    count within the processor's min and max pixels (its size's shortest and longest edge)."""
    p = image_processor
    height, width = smart_resize(
        height, width, factor=p.patch_size * p.merge_size,
        min_pixels=p.size["shortest_edge"], max_pixels=p.size["longest_edge"],
    )
    return width, height


def _qwen2_vl_uint8(image_processor: Any, image: Image.Image) -> dict[str, np.ndarray]:
    """Qwen2VLImageProcessorPil's resize and patch layout, done in uint8 on the PIL image,
    one frame of the image (`Family.frames`).

    The processor turns the image into a channel-first array, back into a PIL image to resize
    it, and lays the patches out in float32: two copies of the full-size image and a float
    pass this skips. Same resize (its smart_resize rule, PIL, its resample filter), same
    layout, so the pixels are the processor's bit for bit (tests/test_pixels.py)."""
    p = image_processor
    width, height = _qwen2_vl_resized_size(p, image.width, image.height)
    resized = np.asarray(image.resize((width, height), resample=p.resample, reducing_gap=None))
    grid_h, grid_w = height // p.patch_size, width // p.patch_size
    merge, patch = p.merge_size, p.patch_size
    # (H, W, C) -> (h/m, w/m, m, m, C, patch, patch), as the processor's patchify orders it
    patches = resized.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch, -1)
    patches = patches.transpose(0, 3, 1, 4, 6, 2, 5)
    return {
        "pixel_values": patches.reshape(grid_h * grid_w, -1),  # a contiguous copy
        "image_grid_thw": np.array([[1, grid_h, grid_w]], dtype=np.int64),
    }


def _llava_resized_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """CLIP's resize (before its centre crop): the shortest edge to `size["shortest_edge"]`, the
    other in proportion, as transformers computes it; or a fixed height and width. Any other
    size rule: the image's own size, so that decoding never reduces it."""
    size = image_processor.size
    if size.get("shortest_edge") and not size.get("longest_edge"):
        shape = np.broadcast_to(np.uint8(0), (height, width, 3))  # only its shape is read
        height, width = get_resize_output_image_size(
            shape, size["shortest_edge"], default_to_square=False,
            input_data_format=ChannelDimension.LAST,
        )
    elif size.get("height") and size.get("width"):
        height, width = size["height"], size["width"]
    return width, height


def _split_llava(image_processor: Any, batch: Tensors) -> list[dict[str, np.ndarray]]:
    pixel_values = batch["pixel_values"]
    return [{"pixel_values": pixel_values[index : index + 1]} for index in range(len(pixel_values))]


def _llava_feature_settings(model_dir: Path, config: Any) -> tuple[int, int]:
    """`(patch_size, extra)`: the vision tower's patch side, and the tokens an image's features
    have beyond one per patch (the CLS feature, unless the "default" strategy drops it)."""
    # LLaVA's processors read these from processor_config.json; the model config is the
    # fallback for directories saved before the processor carried them.
    settings = _read_processor_config(model_dir)
    patch_size = settings.get("patch_size") or config.vision_config.patch_size
    strategy = (
        settings.get("vision_feature_select_strategy") or config.vision_feature_select_strategy
    )
    additional = settings.get("num_additional_image_tokens", 0)
    return patch_size, additional - (1 if strategy == "default" else 0)


def _llava_token_counter(model_dir: Path, config: Any, image_processor: Any) -> TokenCounter:
    patch_size, extra = _llava_feature_settings(model_dir, config)

    def num_image_tokens(item: Tensors) -> int:
        height, width = item["pixel_values"].shape[-2:]
        return (height // patch_size) * (width // patch_size) + extra

    return num_image_tokens


def _llava_item_checker(config: Any) -> ItemChecker:
    vision = config.vision_config
    pixel_shape = (1, vision.num_channels, vision.image_size, vision.image_size)

    def check_tensors(where: str, tensors: Tensors) -> None:
        pixels = _tensor(tensors, where, "pixel_values", ndim=4, kind="u")  # uint8
        if pixels.shape != pixel_shape:
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, expected {pixel_shape}"
            )

    return lambda items: _check_each(items, check_tensors)


def _llava_next_uint8(image_processor: Any, image: Image.Image) -> dict[str, np.ndarray]:
    """LLaVA-NeXT's (and OneVision's) processor with its rescale and normalise off: its
    one-image batch is one item. Its steps in order are resize (to the best grid resolution,
    and the whole image to one tile), pad with 0, cut into tiles, rescale, normalise; the
    padding comes before the normalise, so uint8 zeros normalise to what the processor's float
    path holds there."""
    tensors = processor_uint8(image_processor, image)
    return {"pixel_values": tensors["pixel_values"][0], "image_sizes": tensors["image_sizes"]}


def _tile_side(image_processor: Any) -> int:
    """The side of one anyres tile, as the LLaVA-NeXT processors pick it."""
    crop = image_processor.crop_size
    return int(crop["height"] if crop else image_processor.size["height"])


def _split_llava_next(image_processor: Any, batch: Tensors) -> list[dict[str, np.ndarray]]:
    # The batch pads every image to the most tiles with float zeros (after normalising: no
    # uint8 value gives them); each image keeps its own tiles, the whole image first.
    tile = _tile_side(image_processor)
    items = []
    for pixels, size in zip(batch["pixel_values"], batch["image_sizes"], strict=True):
        tiles = _llava_next_tiles(size, image_processor.image_grid_pinpoints, tile)
        items.append({"pixel_values": pixels[:tiles], "image_sizes": size[None]})
    return items


def _llava_next_tiles(size: Any, pinpoints: list, tile: int) -> int:
    """The tiles LLaVA-NeXT makes of an image of `size` (height, width), the whole image first,
    as its model counts them."""
    # From its modeling module, which imports torch: the frontend loads this module without.
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    return int(image_size_to_num_patches(size, pinpoints, tile))


def _unpadded_grid(item: Tensors, pinpoints: list, features_per_side: int) -> tuple[int, int]:
    """`(rows, columns)` of an image's grid-tile features once the padding that the processor
    added around the resized image is cut off again (the model's `unpad_image`)."""
    height, width = (int(v) for v in item["image_sizes"][0])
    tile = item["pixel_values"].shape[-1]
    best_height, best_width = select_best_resolution((height, width), pinpoints)
    rows = features_per_side * (best_height // tile)
    columns = features_per_side * (best_width // tile)
    if width / height > columns / rows:  # wider than the grid: padded above and below
        rows -= 2 * ((rows - int(round(height * (columns / width), 7))) // 2)
    else:
        columns -= 2 * ((columns - int(round(width * (rows / height), 7))) // 2)
    return rows, columns


def _llava_next_token_counter(model_dir: Path, config: Any, image_processor: Any) -> TokenCounter:
    """LlavaNextProcessor's count: the whole image's tile, then the grid tiles' features,
    unpadded, with one image_newline a row."""
    patch_size, extra = _llava_feature_settings(model_dir, config)
    pinpoints = image_processor.image_grid_pinpoints

    def num_image_tokens(item: Tensors) -> int:
        side = item["pixel_values"].shape[-1] // patch_size
        rows, columns = _unpadded_grid(item, pinpoints, side)
        return side * side + extra + rows * columns + rows

    return num_image_tokens


def llava_onevision_tile_features(model_dir: Path, config: Any) -> int:
    """A LLaVA-OneVision tile's features before any pooling: LlavaOnevisionProcessor's
    `num_image_tokens` (processor_config.json), else the vision tower's patches."""
    settings = _read_processor_config(model_dir)
    vision = config.vision_config
    tile_features: int = (settings.get("num_image_tokens")
                          or (vision.image_size // vision.patch_size) ** 2)
    return tile_features


def _llava_onevision_token_counter(
    model_dir: Path, config: Any, image_processor: Any
) -> TokenCounter:
    """LlavaOnevisionProcessor's count: LLaVA-NeXT's, except that grid features beyond about
    `anyres_max_N` tiles' worth are pooled down (bilinear, in the model) to that many."""
    settings = _read_processor_config(model_dir)
    base = llava_onevision_tile_features(model_dir, config)
    strategy = (
        settings.get("vision_feature_select_strategy") or config.vision_feature_select_strategy
    )
    aspect = settings.get("vision_aspect_ratio") or config.vision_aspect_ratio
    max_tiles = int(aspect.removeprefix("anyres_max_"))
    side = int(math.sqrt(base))
    pinpoints = image_processor.image_grid_pinpoints
    dropped = 1 if strategy == "default" else 0

    def num_image_tokens(item: Tensors) -> int:
        rows, columns = _unpadded_grid(item, pinpoints, side)
        ratio = math.sqrt(rows * columns / (max_tiles * side**2))
        if ratio > 1.1:
            rows, columns = int(rows // ratio), int(columns // ratio)
        return base + rows * columns + rows - dropped

    return num_image_tokens


def _llava_next_item_checker(config: Any) -> ItemChecker:
    tile_shape = _tile_shape(config)

    def check_tensors(where: str, tensors: Tensors) -> None:
        pixels = _tensor(tensors, where, "pixel_values", ndim=4, kind="u")  # uint8
        sizes = _tensor(tensors, where, "image_sizes", ndim=2, kind="iu")
        if sizes.shape != (1, 2) or (sizes < 1).any():
            raise RequestError(
                f"{where}.image_sizes must be one positive (height, width) row, "
                f"got {sizes.tolist()}"
            )
        # The model reads the number of tiles from the image's size, and takes that many.
        tiles = _llava_next_tiles(sizes[0], config.image_grid_pinpoints, tile_shape[-1])
        if pixels.shape != (tiles, *tile_shape):
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, an image of size "
                f"{tuple(sizes[0].tolist())} needs {(tiles, *tile_shape)}"
            )

    return lambda items: _check_each(items, check_tensors)


def _pixtral_cell(model_dir: Path, config: Any) -> int:
    """The side in pixels of one [IMG] token's cell: the vision patch times the spatial merge,
    which PixtralProcessor gives its image processor as the patch size to resize to."""
    settings = _read_processor_config(model_dir)
    patch = settings.get("patch_size") or config.vision_config.patch_size
    return patch * (settings.get("spatial_merge_size") or config.spatial_merge_size)


def _mistral3_image_processor_settings(model_dir: Path, config: Any) -> dict[str, Any]:
    cell = _pixtral_cell(model_dir, config)
    return {"patch_size": {"height": cell, "width": cell}}


def _pixtral_resized_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """Pixtral's resize: the longest edge down to at most `size["longest_edge"]`, then each
    side up to whole cells (the image processor's patch size)."""
    longest = image_processor.size["longest_edge"]
    patch = get_size_dict(image_processor.patch_size, default_to_square=True)
    shape = np.broadcast_to(np.uint8(0), (height, width, 3))  # only its shape is read
    height, width = pixtral.get_resize_output_image_size(
        shape, size=(longest, longest), patch_size=(patch["height"], patch["width"]),
        input_data_format=ChannelDimension.LAST,
    )
    return width, height


def _split_pixtral(image_processor: Any, batch: Tensors) -> list[dict[str, np.ndarray]]:
    # The batch pads every image to the tallest height and widest width with float zeros
    # (after normalising: no uint8 value gives them); each image keeps its own size.
    return [
        {"pixel_values": pixels[None, :, :height, :width], "image_sizes": size[None]}
        for pixels, size in zip(batch["pixel_values"], batch["image_sizes"], strict=True)
        for height, width in [(int(size[0]), int(size[1]))]
    ]


def _mistral3_token_counter(model_dir: Path, config: Any, image_processor: Any) -> TokenCounter:
    """PixtralProcessor's image tokens: one [IMG] per cell."""
    cell = _pixtral_cell(model_dir, config)

    def num_image_tokens(item: Tensors) -> int:
        height, width = (int(v) for v in item["image_sizes"][0])
        return (height // cell) * (width // cell)

    return num_image_tokens


def _mistral3_placeholder_text(
    model_dir: Path, config: Any, image_processor: Any
) -> PlaceholderText:
    """PixtralProcessor's text for one image: [IMG] per cell, row by row, [IMG_BREAK] after
    each row but the last, [IMG_END] after the last."""
    settings = _read_processor_config(model_dir)
    image = settings.get("image_token", "[IMG]")
    row_break = settings.get("image_break_token", "[IMG_BREAK]")
    end = settings.get("image_end_token", "[IMG_END]")
    cell = _pixtral_cell(model_dir, config)

    def text(item: Tensors) -> str:
        height, width = (int(v) for v in item["image_sizes"][0])
        rows = [image * (width // cell)] * (height // cell)
        return row_break.join(rows) + end

    return text


def _mistral3_item_checker(config: Any) -> ItemChecker:
    vision = config.vision_config
    cell = vision.patch_size * config.spatial_merge_size
    # Pixtral's 2-D RoPE has positions for this many patches a side.
    most = vision.image_size // vision.patch_size * vision.patch_size

    def check_tensors(where: str, tensors: Tensors) -> None:
        pixels = _tensor(tensors, where, "pixel_values", ndim=4, kind="u")  # uint8
        sizes = _tensor(tensors, where, "image_sizes", ndim=2, kind="iu")
        if pixels.shape[:2] != (1, vision.num_channels):
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, expected one image of "
                f"{vision.num_channels} channels"
            )
        height, width = pixels.shape[2:]
        if sizes.tolist() != [[height, width]]:
            raise RequestError(
                f"{where}.image_sizes must be the pixels' (height, width), "
                f"{(height, width)}, got {sizes.tolist()}"
            )
        if height % cell or width % cell or not (0 < height <= most and 0 < width <= most):
            raise RequestError(
                f"{where}.pixel_values is {height}x{width} pixels; the model takes sides that "
                f"are multiples of {cell}, at most {most}"
            )

    return lambda items: _check_each(items, check_tensors)


def _split_internvl(image_processor: Any, batch: Tensors) -> list[dict[str, np.ndarray]]:
    # Tiles of all images are stacked on axis 0; each image owns num_patches of them.
    ends = np.cumsum(batch["num_patches"])
    return [{"pixel_values": batch["pixel_values"][end - tiles : end]}
            for tiles, end in zip(batch["num_patches"], ends, strict=True)]


def internvl_tile_tokens(model_dir: Path, config: Any) -> int:
    """The features of one InternVL tile (after the pixel shuffle), each a token: the
    processor's `image_seq_length` (processor_config.json), else the model config's."""
    tokens: int = (_read_processor_config(model_dir).get("image_seq_length")
                   or config.image_seq_length)
    return tokens


def internvl_image_text(token: str, features: int) -> str:
    """InternVLProcessor's text for an image's (or a video frame's) `features`: <img>, the
    feature `token` that many times, </img> (the tokenizer's start_image_token and
    end_image_token, as published)."""
    return f"<img>{token * features}</img>"


def _internvl_token_counter(model_dir: Path, config: Any, image_processor: Any) -> TokenCounter:
    """InternVLProcessor's image tokens: each tile's <IMG_CONTEXT> tokens."""
    return _tiles_of(internvl_tile_tokens(model_dir, config))


def _internvl_placeholder_text(
    model_dir: Path, config: Any, image_processor: Any
) -> PlaceholderText:
    """InternVLProcessor's text for one image: <IMG_CONTEXT> for each feature of each tile."""
    per_tile = internvl_tile_tokens(model_dir, config)
    return lambda item: internvl_image_text(INTERNVL.image_token,
                                            per_tile * len(item["pixel_values"]))


def _internvl_item_checker(config: Any) -> ItemChecker:
    vision = config.vision_config
    tile_shape = (vision.num_channels, *vision.image_size)

    def check_tensors(where: str, tensors: Tensors) -> None:
        pixels = _tensor(tensors, where, "pixel_values", ndim=4, kind="u")  # uint8
        if pixels.shape[1:] != tile_shape or not len(pixels):
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, expected (tiles, "
                f"{', '.join(map(str, tile_shape))}) with at least one tile"
            )

    return lambda items: _check_each(items, check_tensors)
IDEFICS3_MAX_GRID = 6
"""Rows and columns of tiles at most: the processors' <row_R_col_C> tokens go up to 6."""


def _idefics3_uint8(image_processor: Any, image: Image.Image) -> dict[str, np.ndarray]:
    """Idefics3's (and SmolVLM's) processor with its rescale and normalise off. Its steps in
    order: resize (the longest edge to `size`), resize up to whole tiles, cut the tiles and
    resize the whole image to one more, rescale, normalise, pad. Every tile is
    `max_image_size` square, so one image's tiles need no padding (their pixel_attention_mask
    is all ones, the mask the model makes when given none) and every resize works in uint8."""
    batch = image_processor(
        images=[image], do_rescale=False, do_normalize=False, return_tensors="np"
    )
    [item] = _split_idefics3(image_processor, batch)
    return {**item, "pixel_values": item["pixel_values"].astype(np.uint8)}


def _split_idefics3(image_processor: Any, batch: Tensors) -> list[dict[str, np.ndarray]]:
    # A sample's images are one run of tiles (pixel_values: samples x tiles x C x H x W, padded
    # with all-0 tiles to the most tiles of any sample); each image owns rows x cols tiles and
    # then its whole image (rows = cols = 0: the whole image alone). The image processor
    # returns rows and cols when asked (image_processor_settings); the pixel_attention_mask of an
    # image's own tiles is all ones and is left out.
    items = []
    for pixels, rows, cols in zip(batch["pixel_values"], batch["rows"], batch["cols"], strict=True):
        start = 0
        for row_count, col_count in zip(rows, cols, strict=True):
            tiles = int(row_count) * int(col_count) + 1
            items.append({
                "pixel_values": pixels[start : start + tiles],
                "rows": np.array([row_count], dtype=np.int64),
                "cols": np.array([col_count], dtype=np.int64),
            })
            start += tiles
    return items


def idefics3_image_seq_len(model_dir: Path, config: Any) -> int:
    """Image tokens a tile makes: processor_config.json's image_seq_len, else the model's
    (the tile's patches, pixel-shuffled by scale_factor)."""
    settings = _read_processor_config(model_dir)
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return settings.get("image_seq_len") or int(patches / config.scale_factor**2)


def _idefics3_token_counter(model_dir: Path, config: Any, image_processor: Any) -> TokenCounter:
    return _tiles_of(idefics3_image_seq_len(model_dir, config))


def _idefics3_placeholder_text(
    model_dir: Path, config: Any, image_processor: Any
) -> PlaceholderText:
    """Idefics3Processor's text for one image (SmolVLMProcessor's is the same): each tile's
    image tokens after <fake_token_around_image> and its <row_R_col_C>, a newline after each
    row of tiles, then a newline and the whole image's tokens after <global-img>, closed by
    <fake_token_around_image>."""
    image = "<image>" * idefics3_image_seq_len(model_dir, config)
    around = "<fake_token_around_image>"

    def text(item: Tensors) -> str:
        rows, cols = int(item["rows"][0]), int(item["cols"][0])
        grid = "".join(
            "".join(f"{around}<row_{row + 1}_col_{col + 1}>{image}" for col in range(cols)) + "\n"
            for row in range(rows)
        )
        newline = "\n" if rows else ""
        return f"{grid}{newline}{around}<global-img>{image}{around}"

    return text


def _idefics3_item_checker(config: Any) -> ItemChecker:
    tile_shape = _tile_shape(config)

    def check_tensors(where: str, tensors: Tensors) -> None:
        pixels = _tensor(tensors, where, "pixel_values", ndim=4, kind="u")  # uint8
        grid = []
        for name in ("rows", "cols"):
            count = _tensor(tensors, where, name, ndim=1, kind="iu")
            if count.shape != (1,) or not 0 <= int(count[0]) <= IDEFICS3_MAX_GRID:
                raise RequestError(
                    f"{where}.{name} must be one count of 0 to {IDEFICS3_MAX_GRID}, "
                    f"got {count.tolist()}"
                )
            grid.append(int(count[0]))
        rows, cols = grid
        if (rows == 0) != (cols == 0):
            raise RequestError(f"{where}: rows and cols must both be 0 or neither, got {grid}")
        # The model takes the tiles as given; the prompt's row/column tokens follow rows, cols.
        if pixels.shape != (rows * cols + 1, *tile_shape):
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, a {rows}x{cols} grid needs "
                f"{(rows * cols + 1, *tile_shape)}"
            )

    return lambda items: _check_each(items, check_tensors)


def _idefics3_resized_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """The processor's first resize (the longest edge to `size["longest_edge"]`, up or down,
    the other side in proportion and even); the tiles follow from that size alone."""
    size = image_processor.size
    if not size.get("longest_edge"):
        return width, height
    shape = np.broadcast_to(np.uint8(0), (3, height, width))  # only its shape is read
    height, width = idefics3_resized_size(shape, resolution_max_side=size["longest_edge"])
    return width, height


def _tile_shape(config: Any) -> tuple[int, int, int]:
    """One tile as the vision tower takes it: (channels, side, side)."""
    vision = config.vision_config
    return (vision.num_channels, vision.image_size, vision.image_size)


def _tiles_of(per_tile: int) -> TokenCounter:
    """The image tokens of an image cut into tiles (pixel_values' first axis), `per_tile` each."""
    return lambda item: per_tile * len(item["pixel_values"])


def _image_own_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """No reduced decode: the family's token count reads the image's own size."""
    return width, height


def _check_each(items: list[MMItem], check_tensors: Callable[[str, Tensors], None]) -> None:
    for index, item in enumerate(items):
        check_tensors(f"mm_items[{index}]", item.tensors)


def _tensor(tensors: Tensors, where: str, name: str, *, ndim: int, kind: str) -> np.ndarray:
    array = tensors.get(name)
    if array is None:
        raise RequestError(f"{where} lacks tensor {name!r} (has {sorted(tensors)})")
    if array.ndim != ndim or array.dtype.kind not in kind:
        raise RequestError(
            f"{where}.{name} must be a {ndim}-D array of kind {kind!r}, "
            f"got {array.ndim}-D {array.dtype}"
        )
    return array


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
    item_checker=_qwen2_vl_item_checker,
    uint8_pixels=_qwen2_vl_uint8,
    resized_size=_qwen2_vl_resized_size,
    frames_setting="temporal_patch_size",
    tool_call_format="hermes",
)

LLAVA = Family(
    name="llava",
    model_types=("llava",),
    image_token="<image>",
    item_fields=("pixel_values",),
    split_items=_split_llava,
    token_counter=_llava_token_counter,
    item_checker=_llava_item_checker,
    uint8_pixels=processor_uint8,
    resized_size=_llava_resized_size,
)

# The whole image's size picks the tile grid and the token count (image_sizes), so a JPEG is
# never decoded reduced (--jpeg-draft leaves it whole).
LLAVA_NEXT = Family(
    name="llava_next",
    model_types=("llava_next",),
    image_token="<image>",
    item_fields=("pixel_values", "image_sizes"),
    split_items=_split_llava_next,
    token_counter=_llava_next_token_counter,
    item_checker=_llava_next_item_checker,
    uint8_pixels=_llava_next_uint8,
    resized_size=_image_own_size,
)

# LLaVA-NeXT's tiles with SigLIP, pooled past anyres_max_9. Each image of a request is tiled
# on its own, as the processor does for a flat list of images (a prompt's images given as one
# nested list would each be padded to one square tile instead: not what it is called with).
LLAVA_ONEVISION = replace(
    LLAVA_NEXT,
    name="llava_onevision",
    model_types=("llava_onevision",),
    token_counter=_llava_onevision_token_counter,
)

# Pixtral's resize rounds each side up to whole cells; the padding of a batch comes after the
# normalise and is cut off again (image_sizes): one image's uint8 pixels are the processor's.
MISTRAL3 = Family(
    name="mistral3",
    model_types=("mistral3",),
    image_token="[IMG]",
    item_fields=("pixel_values", "image_sizes"),
    split_items=_split_pixtral,
    token_counter=_mistral3_token_counter,
    item_checker=_mistral3_item_checker,
    uint8_pixels=processor_uint8,
    resized_size=_pixtral_resized_size,
    placeholder_text=_mistral3_placeholder_text,
    image_processor_settings=_mistral3_image_processor_settings,
    tool_call_format="mistral",
)

# GotOcr2's tiles: resize to the grid (in uint8), cut, a thumbnail beside them; then rescale and
# normalise, so one image's uint8 tiles are the processor's. The grid follows the image's own
# aspect ratio and area, so a JPEG is never decoded reduced (as LLaVA-NeXT).
INTERNVL = Family(
    name="internvl",
    model_types=("internvl",),
    image_token="<IMG_CONTEXT>",
    item_fields=("pixel_values",),
    split_items=_split_internvl,
    token_counter=_internvl_token_counter,
    item_checker=_internvl_item_checker,
    uint8_pixels=processor_uint8,
    resized_size=_image_own_size,
    placeholder_text=_internvl_placeholder_text,
    # InternVLProcessor's own images_kwargs: the stock image processor file leaves it off.
    image_processor_settings=lambda model_dir, config: {"crop_to_patches": True},
)
# Idefics3's tiles, each a run of image tokens among row/column tokens (placeholder_text).
# SmolVLM is Idefics3 with another tower and language model: the same processor steps, prompt
# text and model inputs.
IDEFICS3 = Family(
    name="idefics3",
    model_types=("idefics3", "smolvlm"),
    image_token="<image>",
    item_fields=("pixel_values", "rows", "cols"),
    split_items=_split_idefics3,
    token_counter=_idefics3_token_counter,
    item_checker=_idefics3_item_checker,
    uint8_pixels=_idefics3_uint8,
    resized_size=_idefics3_resized_size,
    placeholder_text=_idefics3_placeholder_text,
    image_processor_settings=lambda model_dir, config: {"return_row_col_info": True},
)

FAMILIES = (QWEN2_VL, LLAVA, LLAVA_NEXT, LLAVA_ONEVISION, MISTRAL3, INTERNVL, IDEFICS3)


def family_for(model_type: str) -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(t for family in FAMILIES for t in family.model_types)
    raise UnsupportedModelError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported)}"
    )
