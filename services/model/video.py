"""A decoded video's tensors and token count for Qwen2-VL and Qwen2.5-VL, as vLLM 0.32 gets them
from transformers' `Qwen2VLVideoProcessor`.

    load_video_preprocessor(model_dir, preprocessor)   -> VideoPreprocessor (qwen2_vl family)
    videos_of(model_dir, preprocessor)                 the same, or None for another family
    VideoPreprocessor.count_tokens(frames, w, h)       a video's tokens, before any pixel work
    VideoPreprocessor.process_video(frames, metadata)  -> VideoItem: its tensors, its tokens
    VideoPreprocessor.expand_placeholders(ids, items)  each <|video_pad|> to its video's tokens
    VideoPreprocessor.check_item(where, tensors)       the engine's check of a video's tensors
    VideoPreprocessor.count_item_tokens(tensors)       the tokens a checked video's tensors make

What vLLM calls. vLLM samples and decodes the frames itself (mmlane.mm_worker.video gives the
same frames and metadata), then calls the model's HF processor once per prompt with `videos=
[frames, ...]`, `return_tensors="pt"` and `do_rescale=False, do_normalize=False` (its
`mm_device_do_normalize`, on by default for these models: the model normalises on its device)
and nothing else unless the server is given `--mm-processor-kwargs`. So the video processor
keeps its default `do_sample_frames=False` and processes every frame it is given. For Qwen2-VL
vLLM passes no metadata, and the processor returns `pixel_values_videos` and `video_grid_thw`.
For Qwen2.5-VL it passes `video_metadata`: the decoder's metadata as a `VideoMetadata`, less
`do_sample_frames`; the processor adds `second_per_grid_ts`, `temporal_patch_size /
sampled_fps` where `sampled_fps` is the kept frames over the source's frames times the source's
`fps` (the seconds one temporal patch spans; the model's M-RoPE reads it), which vLLM then casts
to the model's dtype, as it casts every floating output. vLLM reads no `fps` of its own there:
its `fps` setting (`--media-io-kwargs`) only picks the frames.

What the processor does, and what this does instead. `Qwen2VLVideoProcessor` (transformers'
torchvision backend) resizes all frames of a video at once with torch's antialiased bicubic
interpolation on uint8, to `smart_resize`'s size (sides multiples of patch x merge, pixels
within min and max pixels: `size`'s shortest and longest edge, and with `cap_pixels_per_frame`
within an even share of `max_video_tokens`' pixels), rescales and normalises in float32, pads the
frames to whole temporal patches by repeating the last, and lays the patches out. This runs
the same interpolation call (torch's own; torchvision, which the processor imports, is not
needed) and the same layout, in uint8: the rescale and normalise are the engine's, as for
images (services/model/pixels.py; `pixel_norm`, the torchvision backend's order), and element-
wise, so doing them after the layout changes no bit. The values are the processor's bit for bit
(tests/test_video_render.py, tests/test_vllm_video_render.py). Unlike an image's, a video's
temporal patch holds distinct frames: all of them are sent (`pixel_norm.frames` is 1).

The settings are read as transformers' AutoVideoProcessor reads them: `processor_config.json`'s
`video_processor`, else `video_preprocessor_config.json`, else `preprocessor_config.json` (the
image processor's file, the only one most Qwen2-VL directories have), over the processor class's
defaults. A directory whose settings this does not reproduce (another resample filter, no resize)
is refused at load with a ModelDirError.

The work is bounded before any pixel is touched: the token count follows from the frame count
and size alone, and `process_video` refuses a video whose tokens exceed the caller's limit (the
context left) with `video_too_large`, naming the video (`video 2: ...`) as the decoder does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mmlane.model.families import QWEN2_VL, UnsupportedModelError
from mmlane.model.loading import (
    ModelDirError,
    Preprocessor,
    expand_placeholder,
    read_json,
    resolve_model_dir,
)
from mmlane.model.pixels import RGB, PixelNorm
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import VIDEO_PIXELS

VIDEO_TOKEN = "<|video_pad|>"
"""The placeholder of a video in the prompt (Qwen2VLProcessor's `video_token`)."""

TIMED_MODEL_TYPES = ("qwen2_5_vl",)
"""The model types whose model takes `second_per_grid_ts` beside a video (Qwen2.5-VL's M-RoPE
spaces a video's temporal patches by their seconds; Qwen2-VL's by one)."""

PROCESSOR_DEFAULTS: Mapping[str, Any] = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "resample": PILImageResampling.BICUBIC,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "cap_pixels_per_frame": None,
    "max_video_tokens": 128000,
}
"""transformers' `Qwen2VLVideoProcessor` class defaults (its module needs torchvision to import;
tests/test_video_render.py compares these with it where torchvision is installed)."""

VIDEO_FIELDS = (VIDEO_PIXELS, "video_grid_thw")
"""The tensors every video has; Qwen2.5-VL's have `second_per_grid_ts` too."""


_SETTINGS_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")
"""Where AutoVideoProcessor reads a video processor's settings, in order, after
processor_config.json's `video_processor`."""


@dataclass(frozen=True, kw_only=True)
class VideoSettings:
    """The video processor's settings that shape a video's tensors."""

    min_pixels: int
    """A resized frame's pixels at least (`size["shortest_edge"]`, or `min_pixels`)."""
    max_pixels: int
    """A resized frame's pixels at most (`size["longest_edge"]`, or `max_pixels`)."""
    patch_size: int
    temporal_patch_size: int
    """Frames in one temporal patch; a video is padded to whole ones with its last frame."""
    merge_size: int
    """Patches a side merged into one token."""
    cap_pixels_per_frame: bool
    """Also bound each frame to an even share of `max_video_tokens`' pixels (qwen-vl-utils'
    total budget; transformers' default is off)."""
    max_video_tokens: int
    norm: PixelNorm
    """The rescale and normalise the engine runs (the torchvision backend's order)."""

    @classmethod
    def read(cls, model_dir: Path) -> VideoSettings:
        """The settings as AutoVideoProcessor loads them from `model_dir` (the module docstring);
        ModelDirError where they are not ones this reproduces."""
        where, stored = _stored_settings(model_dir)
        raw = {**PROCESSOR_DEFAULTS, **stored}
        size = dict(raw["size"])  # Qwen2VLVideoProcessor.__init__: min/max_pixels win over size
        if raw.get("min_pixels") is not None:
            size["shortest_edge"] = raw["min_pixels"]
        if raw.get("max_pixels") is not None:
            size["longest_edge"] = raw["max_pixels"]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ModelDirError(f"{where}: the video processor's size needs a shortest_edge and "
                                f"a longest_edge (or min_pixels and max_pixels), got {size}")
        if not raw["do_resize"] or raw["resample"] != PILImageResampling.BICUBIC:
            raise ModelDirError(f"{where}: mmlane renders videos as Qwen2VLVideoProcessor does "
                                f"with its bicubic resize (do_resize true, resample 3), got "
                                f"do_resize {raw['do_resize']}, resample {raw['resample']}")
        return cls(
            min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
            patch_size=int(raw["patch_size"]), temporal_patch_size=int(raw["temporal_patch_size"]),
            merge_size=int(raw["merge_size"]),
            cap_pixels_per_frame=bool(raw["cap_pixels_per_frame"]),
            max_video_tokens=int(raw["max_video_tokens"]),
            # The video processor is transformers' torchvision backend, whatever its settings say.
            norm=PixelNorm.of(SimpleNamespace(**{**raw, "backend": "torchvision"})),
        )


def _stored_settings(model_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The settings file AutoVideoProcessor would read, and what it holds."""
    processor = model_dir / "processor_config.json"
    nested = read_json(processor).get("video_processor") if processor.is_file() else None
    if nested is not None:
        return processor, nested
    for name in _SETTINGS_FILES:
        if (model_dir / name).is_file():
            return model_dir / name, read_json(model_dir / name)
    raise ModelDirError(f"{model_dir} has no video processor settings "
                        f"({', '.join(_SETTINGS_FILES)})")


@dataclass(frozen=True, eq=False)
class VideoItem:
    """One processed video: the model's tensors for it and the tokens its placeholder becomes."""

    tensors: dict[str, np.ndarray]
    """`pixel_values_videos` (uint8 patch rows), `video_grid_thw` (1, 3), and for Qwen2.5-VL
    `second_per_grid_ts` (1,), float32 as the HF processor returns it (vLLM casts it to the
    model's dtype)."""
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


@dataclass(frozen=True)
class VideoGrid:
    """A video's patches once resized: temporal patches, patch rows and columns per frame."""

    t: int
    h: int
    w: int

    def tokens(self, merge_size: int) -> int:
        return self.t * self.h * self.w // merge_size**2


@dataclass(frozen=True, eq=False)
class VideoPreprocessor:
    """A Qwen2-VL or Qwen2.5-VL model's video processing; holds no model weights."""

    settings: VideoSettings
    video_token_id: int
    timed: bool
    """The model takes `second_per_grid_ts` (TIMED_MODEL_TYPES)."""

    @property
    def pixel_norm(self) -> PixelNorm:
        """What the engine applies to a video's uint8 pixel_values_videos."""
        return self.settings.norm

    @property
    def item_fields(self) -> tuple[str, ...]:
        """The tensor names of one video (`process_video`'s)."""
        return VIDEO_FIELDS + (("second_per_grid_ts",) if self.timed else ())

    def check_item(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        """RequestError naming `where` unless a video's tensors (their names checked) have
        the shapes and dtypes `process_video` makes: what the model can take."""
        s = self.settings
        grid = tensors["video_grid_thw"]
        pixels = tensors["pixel_values_videos"]
        if grid.shape != (1, 3) or grid.dtype.kind not in "iu" or (grid < 1).any():
            raise RequestError(f"{where}.video_grid_thw must be one positive (t, h, w) row of "
                               f"integers, got {grid.dtype} {grid.tolist()}")
        t, h, w = (int(v) for v in grid[0])
        if h % s.merge_size or w % s.merge_size:
            raise RequestError(f"{where}.video_grid_thw h and w must be multiples of "
                               f"{s.merge_size}, got {h}x{w}")
        row = RGB * s.temporal_patch_size * s.patch_size**2
        if pixels.dtype != np.uint8 or pixels.shape != (t * h * w, row):
            raise RequestError(f"{where}.pixel_values_videos is {pixels.dtype} {pixels.shape}, "
                               f"grid {(t, h, w)} needs uint8 ({t * h * w}, {row})")
        if self.timed:
            seconds = tensors["second_per_grid_ts"]
            if seconds.shape != (1,) or seconds.dtype.kind != "f" or \
                    not (np.isfinite(seconds) & (seconds > 0)).all():
                raise RequestError(f"{where}.second_per_grid_ts must be one positive float, "
                                   f"got {seconds.dtype} {seconds.tolist()}")

    def count_item_tokens(self, tensors: Mapping[str, np.ndarray]) -> int:
        """The video tokens a checked video's tensors make."""
        return int(tensors["video_grid_thw"].prod()) // self.settings.merge_size**2

    def resized_size(self, frames: int, width: int, height: int) -> tuple[int, int]:
        """The (width, height) the processor resizes each of a video's frames to; ValueError
        for a frame it refuses (an aspect ratio over 200)."""
        s = self.settings
        max_pixels = s.max_pixels
        if s.cap_pixels_per_frame:  # Qwen2VLVideoProcessor.resize, on the frames before padding
            factor = s.patch_size * s.merge_size
            total = int(s.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * s.temporal_patch_size // frames),
                             int(s.min_pixels * 1.05))
        height, width = smart_resize(height, width, factor=s.patch_size * s.merge_size,
                                     min_pixels=s.min_pixels, max_pixels=max_pixels)
        return width, height

    def grid(self, frames: int, width: int, height: int) -> VideoGrid:
        """`video_grid_thw` of a video of `frames` frames of this size."""
        if frames < 1:
            raise ValueError("a video needs at least one frame")
        s = self.settings
        width, height = self.resized_size(frames, width, height)
        return VideoGrid(-(-frames // s.temporal_patch_size), height // s.patch_size,
                         width // s.patch_size)

    def count_tokens(self, frames: int, width: int, height: int) -> int:
        """The video tokens of a video of `frames` frames of this size."""
        return self.grid(frames, width, height).tokens(self.settings.merge_size)

    def process_video(self, frames: np.ndarray, metadata: Mapping[str, Any], *, index: int,
                      max_tokens: int) -> VideoItem:
        """A video's tensors, pixels as uint8 (`pixel_norm` turns them into the processor's
        float output), from its kept frames ((n, h, w, 3) uint8 RGB) and the metadata vLLM
        pairs with them (`DecodedVideo.frames` and `.hf_metadata()`; Qwen2.5-VL reads its
        `fps`, `total_num_frames` and `frames_indices`). Raises RequestError naming the video
        (`video {index}: ...`): `video_too_large` where it makes more than `max_tokens` tokens,
        `invalid_video` where the processor would refuse it."""
        count, height, width = frames.shape[:3]
        try:
            grid = self.grid(count, width, height)
        except ValueError as exc:  # no frame; smart_resize's aspect ratio bound
            raise RequestError(f"video {index}: its {count} frames of {width}x{height} cannot "
                               f"be processed: {exc}", code="invalid_video") from exc
        tokens = grid.tokens(self.settings.merge_size)
        if tokens > max_tokens:
            raise RequestError(
                f"video {index}: its {count} frames of {width}x{height} make {tokens} tokens "
                f"(a {grid.t}x{grid.h}x{grid.w} patch grid), more than the {max_tokens} it may "
                "take", code="video_too_large")
        tensors = {
            "pixel_values_videos": self._patch_rows(frames, grid),
            "video_grid_thw": np.array([[grid.t, grid.h, grid.w]], dtype=np.int64),
        }
        if self.timed:
            tensors["second_per_grid_ts"] = np.array(
                [self._seconds_per_grid(metadata, index)], dtype=np.float32)
        return VideoItem(tensors, tokens)

    def expand_placeholders(self, token_ids: list[int], items: Sequence[VideoItem]) -> list[int]:
        """Replace the i-th video placeholder with items[i]'s tokens; image placeholders stay
        (Preprocessor.expand_placeholders expands those)."""
        spans = [(self.video_token_id,) * item.num_tokens for item in items]
        return expand_placeholder(token_ids, self.video_token_id, spans, "video")

    def _patch_rows(self, frames: np.ndarray, grid: VideoGrid) -> np.ndarray:
        """The processor's resize and patch layout in uint8: (t*h*w, 3 * temporal patch *
        patch * patch) rows, each channel's values one block."""
        import torch  # the MM worker's: the frontend loads this module without torch

        s = self.settings
        # (n, h, w, 3) viewed as (n, 3, h, w): channels-last in memory, which torch's uint8
        # kernel resizes without the processor's contiguous copy, to the same values.
        video = torch.from_numpy(frames).permute(0, 3, 1, 2)
        size = (grid.h * s.patch_size, grid.w * s.patch_size)
        if size != tuple(video.shape[2:]):  # torchvision's resize returns a same-size image
            video = torch.nn.functional.interpolate(
                video, size=size, mode="bicubic", align_corners=False, antialias=True)
        if pad := -len(video) % s.temporal_patch_size:  # the last frame, repeated
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
        merge, patch = s.merge_size, s.patch_size
        patches = video.reshape(grid.t, s.temporal_patch_size, RGB, grid.h // merge, merge,
                                patch, grid.w // merge, merge, patch)
        # -> (t, h/m, w/m, m, m, channel, temporal patch, patch, patch), the processor's order
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(grid.t * grid.h * grid.w, -1).numpy()

    def _seconds_per_grid(self, metadata: Mapping[str, Any], index: int) -> float:
        """Qwen2_5_VLProcessor's `second_per_grid_ts`: temporal patch / the kept frames' rate."""
        fps = float(metadata["fps"])
        if not math.isfinite(fps) or fps <= 0:
            raise RequestError(f"video {index}: its frame rate is unknown; Qwen2.5-VL needs it "
                               "to time the video's frames", code="invalid_video")
        sampled_fps = len(metadata["frames_indices"]) / metadata["total_num_frames"] * fps
        return self.settings.temporal_patch_size / sampled_fps


def video_token_id(preprocessor: Preprocessor) -> int | None:
    """The id of the video placeholder of the model `preprocessor` loaded; None where mmlane
    renders no video for its family, or its tokenizer has no video token."""
    if preprocessor.family is not QWEN2_VL:
        return None
    token_id: int | None = preprocessor.tokenizer.backend_tokenizer.token_to_id(VIDEO_TOKEN)
    return token_id


def load_video_preprocessor(model_dir: str | Path, preprocessor: Preprocessor) -> VideoPreprocessor:
    """The video processing of the model in `model_dir`, whose `preprocessor` (loaded from the
    same directory) gives the tokenizer; UnsupportedModelError for a family other than
    Qwen2-VL's, ModelDirError for settings this does not reproduce."""
    model_dir = resolve_model_dir(model_dir)
    if preprocessor.family is not QWEN2_VL:
        raise UnsupportedModelError(f"{model_dir}: mmlane renders videos for Qwen2-VL and "
                                    f"Qwen2.5-VL only, not the {preprocessor.family.name} family")
    token_id = video_token_id(preprocessor)
    if token_id is None:
        raise ModelDirError(f"the tokenizer in {model_dir} lacks the video token {VIDEO_TOKEN!r}")
    model_type = read_json(model_dir / "config.json").get("model_type")
    return VideoPreprocessor(settings=VideoSettings.read(model_dir),
                             video_token_id=token_id,
                             timed=model_type in TIMED_MODEL_TYPES)



def videos_of(model_dir: str | Path, preprocessor: Preprocessor) -> VideoPreprocessor | None:
    """`load_video_preprocessor`'s, or None for a family mmlane renders no video for (an engine
    whose spec then refuses video items)."""
    try:
        return load_video_preprocessor(model_dir, preprocessor)
    except UnsupportedModelError:
        return None
