"""A decoded video's tensors and token count, family by family, as vLLM 0.32 gets them from
transformers' video processors: `Qwen2VLVideoProcessor` for Qwen2-VL and Qwen2.5-VL,
`LlavaOnevisionVideoProcessor` for LLaVA-OneVision, `InternVLVideoProcessor` for InternVL; and
for SmolVLM, which vLLM 0.32 takes no video of, as transformers' own `SmolVLMProcessor` makes
them (`SmolVLMVideo`'s docstring).

    load_video_preprocessor(model_dir, preprocessor)   -> its family's VideoPreprocessor
    videos_of(model_dir, preprocessor)                 the same, or None for another family
    video_token_id(preprocessor)                       the video placeholder's id, or None
    VideoPreprocessor.count_tokens(frames, w, h)       a video's tokens, before any pixel work
    VideoPreprocessor.process_video(frames, metadata)  -> VideoItem: its tensors, its tokens
    VideoPreprocessor.expand_placeholders(ids, items)  each placeholder to its video's tokens
    VideoPreprocessor.check_item(where, tensors)       the engine's check of a video's tensors
    VideoPreprocessor.expand_item(tensors)             the span a checked video's tensors make

A family's video processing is a subclass of `VideoPreprocessor` (`VIDEO_FAMILIES`: `Qwen2VLVideo`,
`LlavaOnevisionVideo`, `InternVLVideo`, `SmolVLMVideo`); the base class holds what they share:
the bound before any pixel work, the placeholder's expansion, the settings files, the resize.
`SquareFrameVideo` holds what LLaVA-OneVision's and InternVL's share: frames resized to the
tower's square tile.

What vLLM calls. vLLM samples and decodes the frames itself with the loader its model's video
processor maps to (`VideoPreprocessor.loader`; mmlane.mm_worker.video gives the same frames and
metadata), then calls the model's HF processor with `videos=[frames, ...]` (LLaVA-OneVision's and
InternVL's one video a call), `return_tensors="pt"` and nothing else unless the server is given
`--mm-processor-kwargs`, but `do_rescale=False, do_normalize=False` where the model normalises on
its device (its `mm_device_do_normalize`, on by default where the model can: Qwen2-VL and
Qwen2.5-VL, not LLaVA-OneVision nor InternVL). So the video processor keeps its default
`do_sample_frames=False` and processes every frame it is given; vLLM casts the floating outputs
to the model's dtype.

The shared steps. The settings are read as transformers' AutoVideoProcessor reads them:
`processor_config.json`'s `video_processor`, else `video_preprocessor_config.json`, else
`preprocessor_config.json` (the image processor's file, the only one many model directories
have), over the processor class's defaults (InternVL's `size` is the image processor's: vLLM
sets it so); settings this does not reproduce (another resample
filter, no resize) are refused at load with a ModelDirError. Both processors are transformers'
torchvision backend, which resizes all frames of a video at once with torch's antialiased bicubic
interpolation, on uint8 (torchvision's native uint8 kernel on the CPU, where vLLM runs the
processor), and returns a frame of the wanted size as it is. `_resized` runs the same
interpolation call, torch's own: torchvision, which the processors import, is not needed (and
not installed here: its wheels are CUDA builds). The rescale and normalise are the engine's, as
for images (services/model/pixels.py; `pixel_norm`, the torchvision backend's order), and
element-wise, so doing them after the layout changes no bit: the pixels travel as uint8, and are
the processor's bit for bit once normalised (tests/test_video_render.py,
tests/test_vllm_video_render.py). The work is bounded before any pixel is touched: the token
count (the length of the video's span) follows from the frame count and size alone, and
`process_video` refuses a video whose tokens exceed the caller's limit (the context left) with
`video_too_large`, naming the video (`video 2: ...`) as the decoder does.

Qwen2-VL and Qwen2.5-VL (`Qwen2VLVideo`, vLLM's `qwen2_vl` loader: frames by rate). Each frame
is resized to `smart_resize`'s size (sides multiples of patch x merge, pixels within min and max
pixels: `size`'s shortest and longest edge, and with `cap_pixels_per_frame` within an even share
of `max_video_tokens`' pixels); the frames are padded to whole temporal patches by repeating the
last, and the patches laid out as the processor lays them out: `pixel_values_videos` rows and
`video_grid_thw`, a token per merge x merge patches. Unlike an image's, a video's temporal patch
holds distinct frames: all of them are sent (`pixel_norm.frames` is 1). For Qwen2.5-VL vLLM
passes `video_metadata` (the decoder's metadata as a `VideoMetadata`, less `do_sample_frames`)
and the processor adds `second_per_grid_ts`, `temporal_patch_size / sampled_fps` where
`sampled_fps` is the kept frames over the source's frames times the source's `fps` (the seconds
one temporal patch spans; the model's M-RoPE reads it). vLLM reads no `fps` of its own there:
its `fps` setting only picks the frames.

LLaVA-OneVision (`LlavaOnevisionVideo`, vLLM's default `opencv` loader: 32 frames evenly
spaced). Each frame is resized to the processor's `size`, the vision tower's square tile (384
pixels), whatever its aspect ratio, and neither padded nor cut: `pixel_values_videos` is
(frames, 3, side, side), the processor's one video without its batch axis (as vLLM batches a
video item, and channel-major after the first axis, as the engine normalises). The model runs
each frame through its tower, pools each frame's features 2x2 (bilinear, to half the side
rounded up) and appends one image_newline to the video: its tokens are frames x pooled features
+ 1, as LlavaOnevisionProcessor counts them (the side of its `num_image_tokens`, halved up).

InternVL (`InternVLVideo`, the default `opencv` loader too: vLLM 0.32 serves
InternVLForConditionalGeneration with its InternS1 model, whose video processor has no loader of
its own). Each frame is resized as LLaVA-OneVision's, to the image processor's tile (448 pixels;
vLLM gives the video processor that `size`): `pixel_values_videos` (frames, 3, side, side). The
model has no video path: each frame is an image of one tile through `get_image_features`, its
`image_seq_length` features (256) each a token. A video's span is InternVLProcessor's text, one
"FrameN: <img>...</img>" a frame joined by newlines, tokenized alone, with vLLM's video token
(`<video>`) for the features where transformers writes <IMG_CONTEXT> (vLLM's InternS1 processor
rewrites them, so that images and videos stay apart): `VideoItem.token_ids`, as the span of an
InternVL image.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from num2words import num2words
from transformers import AutoConfig
from transformers.image_utils import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PILImageResampling,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.smolvlm import processing_smolvlm as smolvlm_text

from mmlane.model.families import (
    IDEFICS3,
    INTERNVL,
    LLAVA_ONEVISION,
    QWEN2_VL,
    UnsupportedModelError,
    idefics3_image_seq_len,
    internvl_image_text,
    internvl_tile_tokens,
    llava_onevision_tile_features,
)
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

if TYPE_CHECKING:
    import torch

_SETTINGS_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")
"""Where AutoVideoProcessor reads a video processor's settings, in order, after
processor_config.json's `video_processor`."""


@dataclass(frozen=True, eq=False)
class VideoItem:
    """One processed video: the model's tensors for it and the tokens its placeholder becomes."""

    tensors: dict[str, np.ndarray]
    """`pixel_values_videos` as uint8, and the family's other tensors (`item_fields`)."""
    num_tokens: int
    """The length of its span: all the tokens its placeholder becomes, video tokens or not."""
    token_ids: tuple[int, ...] = ()
    """The span itself where it is not the video token `num_tokens` times (InternVL's frames,
    each "FrameN: <img>...</img>")."""

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


@dataclass(frozen=True, eq=False, kw_only=True)
class VideoPreprocessor(ABC):
    """A model's video processing, its family's subclass; holds no model weights."""

    video_token_id: int

    token: ClassVar[str]
    """The placeholder of a video in the prompt (the processor's `video_token`)."""
    loader: ClassVar[str]
    """vLLM's video loader for the family, whose rule picks a video's frames (mmlane.mm_worker.
    video's sampling of that loader)."""
    vision_inputs: ClassVar[tuple[str, ...]] = ()
    """The tensors the model's `get_video_features` takes beside the pixels."""
    model_features: ClassVar[tuple[str, str]] = ("get_video_features", VIDEO_PIXELS)
    """The model's method that makes a video's features from its pixels, and the argument it
    takes them as (InternVL has no video method: its frames go through the image one)."""
    text_joins_prompt: ClassVar[bool] = False
    """The text its span begins or ends with is tokenized with the prompt's text around its
    placeholder (`Preprocessor.merge_text_edges`), as transformers' processor tokenizes the
    whole prompt (SmolVLM's); else its span is tokenized alone, as vLLM's processors do."""
    runs_apart: ClassVar[bool] = False
    """Two videos' tokens must not touch: the model finds a video as a run of video tokens
    (Qwen2-VL's M-RoPE)."""

    model_types: ClassVar[tuple[str, ...]] = ()
    """The family's model types that take videos; () for every one."""

    @classmethod
    @abstractmethod
    def load(cls, model_dir: Path, preprocessor: Preprocessor,
             video_token_id: int) -> VideoPreprocessor:
        """The family's video processing of the model in `model_dir` (whose images and text
        `preprocessor` processes); ModelDirError for settings this does not reproduce."""

    @property
    @abstractmethod
    def pixel_norm(self) -> PixelNorm:
        """What the engine applies to a video's uint8 pixel_values_videos."""

    @property
    @abstractmethod
    def item_fields(self) -> tuple[str, ...]:
        """The tensor names of one video (`process_video`'s)."""

    @property
    def frame_group(self) -> int:
        """Frames the model takes together: the sampling keeps a multiple of them."""
        return 1

    @abstractmethod
    def count_tokens(self, frames: int, width: int, height: int) -> int:
        """The video tokens of a video of `frames` frames of this size; ValueError for a video
        the processor refuses."""

    @abstractmethod
    def check_item(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        """RequestError naming `where` unless a video's tensors (their names checked) have the
        shapes and dtypes `process_video` makes: what the model can take."""

    @abstractmethod
    def count_item_tokens(self, tensors: Mapping[str, np.ndarray]) -> int:
        """The length of the span a checked video's tensors make."""

    @property
    def feature_token_id(self) -> int:
        """The token its features replace in its span: the video token, unless the family
        writes a video's frames as images (SmolVLM)."""
        return self.video_token_id

    def expand_item(self, tensors: Mapping[str, np.ndarray]) -> Sequence[int]:
        """The span a checked video's tensors make: what its placeholder becomes."""
        return (self.video_token_id,) * self.count_item_tokens(tensors)

    def hashed_settings(self) -> dict[str, Any]:
        """What decides its videos' tensors and spans, for the MM worker's hash: its fields
        that compare (not InternVL's tokenizing, the model's, which the hash covers)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}

    def model_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """A video's pixels (normalised) as the model's method (`model_features`) takes them."""
        return pixels

    def process_video(self, frames: np.ndarray, metadata: Mapping[str, Any], *, index: int,
                      max_tokens: int) -> VideoItem:
        """A video's tensors, pixels as uint8 (`pixel_norm` turns them into the processor's
        float output), from its kept frames ((n, h, w, 3) uint8 RGB) and the metadata vLLM
        pairs with them (`DecodedVideo.frames` and `.hf_metadata()`). Raises RequestError
        naming the video (`video {index}: ...`): `video_too_large` where it makes more than
        `max_tokens` tokens, `invalid_video` where the processor would refuse it."""
        count, height, width = frames.shape[:3]
        try:
            tokens = self.count_tokens(count, width, height)
        except ValueError as exc:  # no frame; smart_resize's aspect ratio bound
            raise RequestError(f"video {index}: its {count} frames of {width}x{height} cannot "
                               f"be processed: {exc}", code="invalid_video") from exc
        span = self._span(count, metadata)
        tokens = len(span) or tokens
        if tokens > max_tokens:
            raise RequestError(
                f"video {index}: its {count} frames of {width}x{height} make {tokens} tokens "
                f"({self._token_layout(count, width, height)}), more than the {max_tokens} it "
                "may take", code="video_too_large")
        return VideoItem(self._tensors(frames, metadata, index), tokens, span)

    def expand_placeholders(self, token_ids: list[int], items: Sequence[VideoItem]) -> list[int]:
        """Replace the i-th video placeholder with items[i]'s span; image placeholders stay
        (Preprocessor.expand_placeholders expands those)."""
        spans = [item.token_ids or (self.video_token_id,) * item.num_tokens for item in items]
        return expand_placeholder(token_ids, self.video_token_id, spans, "video")

    def _span(self, frames: int, metadata: Mapping[str, Any]) -> tuple[int, ...]:
        """`VideoItem.token_ids` of a video of `frames` frames with this metadata: none, its
        video token repeated, unless the family puts other tokens among them."""
        return ()

    @abstractmethod
    def _token_layout(self, frames: int, width: int, height: int) -> str:
        """How a video's tokens come about, for a refusal's message."""

    @abstractmethod
    def _tensors(self, frames: np.ndarray, metadata: Mapping[str, Any],
                 index: int) -> dict[str, np.ndarray]:
        """The video's tensors, once its tokens are known to fit."""


# ---------------------------------------------------------------- Qwen2-VL and Qwen2.5-VL


TIMED_MODEL_TYPES = ("qwen2_5_vl",)
"""The model types whose model takes `second_per_grid_ts` beside a video (Qwen2.5-VL's M-RoPE
spaces a video's temporal patches by their seconds; Qwen2-VL's by one)."""

QWEN2_VL_PROCESSOR_DEFAULTS: Mapping[str, Any] = {
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

QWEN2_VL_VIDEO_FIELDS = (VIDEO_PIXELS, "video_grid_thw")
"""The tensors every Qwen2-VL video has; Qwen2.5-VL's have `second_per_grid_ts` too."""


@dataclass(frozen=True, kw_only=True)
class Qwen2VLVideoSettings:
    """The video processor's settings that shape a Qwen2-VL video's tensors."""

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
    def read(cls, model_dir: Path) -> Qwen2VLVideoSettings:
        """The settings as AutoVideoProcessor loads them from `model_dir` (the module docstring);
        ModelDirError where they are not ones this reproduces."""
        where, raw = _processor_settings(model_dir, QWEN2_VL_PROCESSOR_DEFAULTS)
        size = dict(raw["size"])  # Qwen2VLVideoProcessor.__init__: min/max_pixels win over size
        if raw.get("min_pixels") is not None:
            size["shortest_edge"] = raw["min_pixels"]
        if raw.get("max_pixels") is not None:
            size["longest_edge"] = raw["max_pixels"]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ModelDirError(f"{where}: the video processor's size needs a shortest_edge and "
                                f"a longest_edge (or min_pixels and max_pixels), got {size}")
        _check_bicubic(where, raw, "Qwen2VLVideoProcessor")
        return cls(
            min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
            patch_size=int(raw["patch_size"]), temporal_patch_size=int(raw["temporal_patch_size"]),
            merge_size=int(raw["merge_size"]),
            cap_pixels_per_frame=bool(raw["cap_pixels_per_frame"]),
            max_video_tokens=int(raw["max_video_tokens"]), norm=_torchvision_norm(raw),
        )


@dataclass(frozen=True)
class VideoGrid:
    """A video's patches once resized: temporal patches, patch rows and columns per frame."""

    t: int
    h: int
    w: int

    def tokens(self, merge_size: int) -> int:
        return self.t * self.h * self.w // merge_size**2


@dataclass(frozen=True, eq=False, kw_only=True)
class Qwen2VLVideo(VideoPreprocessor):
    """A Qwen2-VL or Qwen2.5-VL model's video processing."""

    settings: Qwen2VLVideoSettings
    timed: bool
    """The model takes `second_per_grid_ts` (TIMED_MODEL_TYPES)."""

    token = "<|video_pad|>"
    loader = "qwen2_vl"
    vision_inputs = ("video_grid_thw",)
    runs_apart = True

    @classmethod
    def load(cls, model_dir: Path, preprocessor: Preprocessor,
             video_token_id: int) -> Qwen2VLVideo:
        model_type = read_json(model_dir / "config.json").get("model_type")
        return cls(video_token_id=video_token_id, settings=Qwen2VLVideoSettings.read(model_dir),
                   timed=model_type in TIMED_MODEL_TYPES)

    @property
    def pixel_norm(self) -> PixelNorm:
        return self.settings.norm

    @property
    def item_fields(self) -> tuple[str, ...]:
        return QWEN2_VL_VIDEO_FIELDS + (("second_per_grid_ts",) if self.timed else ())

    @property
    def frame_group(self) -> int:
        return self.settings.temporal_patch_size

    def check_item(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        s = self.settings
        grid = tensors["video_grid_thw"]
        pixels = tensors[VIDEO_PIXELS]
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
        return self.grid(frames, width, height).tokens(self.settings.merge_size)

    def _token_layout(self, frames: int, width: int, height: int) -> str:
        grid = self.grid(frames, width, height)
        return f"a {grid.t}x{grid.h}x{grid.w} patch grid"

    def _tensors(self, frames: np.ndarray, metadata: Mapping[str, Any],
                 index: int) -> dict[str, np.ndarray]:
        """Qwen2.5-VL reads the metadata's `fps`, `total_num_frames` and `frames_indices`."""
        count, height, width = frames.shape[:3]
        grid = self.grid(count, width, height)
        tensors = {
            VIDEO_PIXELS: self._patch_rows(frames, grid),
            "video_grid_thw": np.array([[grid.t, grid.h, grid.w]], dtype=np.int64),
        }
        if self.timed:  # float32, as the HF processor returns it (vLLM casts it)
            tensors["second_per_grid_ts"] = np.array(
                [self._seconds_per_grid(metadata, index)], dtype=np.float32)
        return tensors

    def _patch_rows(self, frames: np.ndarray, grid: VideoGrid) -> np.ndarray:
        """The processor's resize and patch layout in uint8: (t*h*w, 3 * temporal patch *
        patch * patch) rows, each channel's values one block."""
        import torch  # the MM worker's: the frontend loads this module without torch

        s = self.settings
        video = _resized(frames, grid.h * s.patch_size, grid.w * s.patch_size)
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


# ---------------------------------------------------------------- frames as the tower's tiles


SQUARE_FRAME_PROCESSOR_DEFAULTS: Mapping[str, Any] = {
    "size": {"height": 384, "width": 384},
    "resample": PILImageResampling.BICUBIC,
    "do_resize": True,
    "do_center_crop": None,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
}
"""The class defaults that shape the output of transformers' `LlavaOnevisionVideoProcessor` and
`InternVLVideoProcessor` alike (compared with both where torchvision is installed, as
Qwen2-VL's)."""


@dataclass(frozen=True, kw_only=True)
class SquareFrameSettings:
    """The settings that shape a video whose frames are each resized to the vision tower's
    square tile (LLaVA-OneVision's, InternVL's)."""

    side: int
    """Each frame is resized to side x side pixels (the vision tower's tile)."""
    frame_tokens: int
    """A frame's features, each a video token (LLaVA-OneVision's once pooled, InternVL's
    `image_seq_length`)."""
    norm: PixelNorm
    """The rescale and normalise the engine runs (the torchvision backend's order)."""

    @classmethod
    def read(cls, model_dir: Path, *, family: str, processor: str, tile: int,
             frame_tokens: int, size: Mapping[str, Any] | None = None) -> SquareFrameSettings:
        """The settings as AutoVideoProcessor loads them from `model_dir` (the module
        docstring), `size` where vLLM sets it over the file's, for a tower of `tile` pixels a
        side; ModelDirError where the model could not take the frames they make."""
        where, raw = _processor_settings(model_dir, SQUARE_FRAME_PROCESSOR_DEFAULTS)
        _check_bicubic(where, raw, processor)
        size = raw["size"] if size is None else size
        if raw["do_center_crop"] or size.get("height") != tile or size.get("width") != tile:
            raise ModelDirError(
                f"{where}: {family}'s vision tower takes frames of {tile}x{tile} pixels; the "
                f"video processor makes size {dict(size)}, do_center_crop "
                f"{raw['do_center_crop']}")
        return cls(side=tile, frame_tokens=frame_tokens, norm=_torchvision_norm(raw))


@dataclass(frozen=True, eq=False, kw_only=True)
class SquareFrameVideo(VideoPreprocessor):
    """A video as its frames, each resized to the vision tower's square tile, whatever its
    aspect ratio, and neither padded nor cut: `pixel_values_videos` (frames, 3, side, side),
    sampled by vLLM's default loader. The subclasses say how the model reads them."""

    settings: SquareFrameSettings

    loader = "opencv"

    @property
    def pixel_norm(self) -> PixelNorm:
        return self.settings.norm

    @property
    def item_fields(self) -> tuple[str, ...]:
        return (VIDEO_PIXELS,)

    def check_item(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        _check_square_frames(where, tensors[VIDEO_PIXELS], self.settings.side)

    def count_item_tokens(self, tensors: Mapping[str, np.ndarray]) -> int:
        return self.count_tokens(len(tensors[VIDEO_PIXELS]), self.settings.side,
                                 self.settings.side)

    def _tensors(self, frames: np.ndarray, metadata: Mapping[str, Any],
                 index: int) -> dict[str, np.ndarray]:
        side = self.settings.side
        return {VIDEO_PIXELS: _resized(frames, side, side).contiguous().numpy()}


# ---------------------------------------------------------------- LLaVA-OneVision


POOL_STRIDE = 2
"""LLaVA-OneVision pools a frame's features this many to one a side (the model's
`apply_pooling`; vLLM's `spatial_pool_stride`)."""

VIDEO_NEWLINES = 1
"""The image_newline features the model appends to a video, after its last frame's."""


@dataclass(frozen=True, eq=False, kw_only=True)
class LlavaOnevisionVideo(SquareFrameVideo):
    """A LLaVA-OneVision model's video processing: a frame's tokens are its features pooled,
    (ceil(features a side / POOL_STRIDE))², the side that of the processor's
    `num_image_tokens` (`llava_onevision_tile_features`)."""

    token = "<video>"

    @classmethod
    def load(cls, model_dir: Path, preprocessor: Preprocessor,
             video_token_id: int) -> LlavaOnevisionVideo:
        config = AutoConfig.from_pretrained(model_dir)
        features_a_side = int(math.sqrt(llava_onevision_tile_features(model_dir, config)))
        pooled = -(-features_a_side // POOL_STRIDE)
        settings = SquareFrameSettings.read(
            model_dir, family="LLaVA-OneVision", processor="LlavaOnevisionVideoProcessor",
            tile=config.vision_config.image_size, frame_tokens=pooled * pooled)
        return cls(video_token_id=video_token_id, settings=settings)

    def count_tokens(self, frames: int, width: int, height: int) -> int:
        if frames < 1:
            raise ValueError("a video needs at least one frame")
        return frames * self.settings.frame_tokens + VIDEO_NEWLINES

    def model_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """A batch of one video: (1, frames, 3, side, side)."""
        return pixels[None]

    def _token_layout(self, frames: int, width: int, height: int) -> str:
        return f"{self.settings.frame_tokens} a frame and {VIDEO_NEWLINES} newline"


# ---------------------------------------------------------------- InternVL


INTERNVL_FRAME_SEPARATOR = "\n"
"""What InternVLProcessor puts between two frames' texts."""


@dataclass(frozen=True, eq=False, kw_only=True)
class InternVLVideo(SquareFrameVideo):
    """An InternVL model's video processing. Each frame is an image of one tile: its span is
    "FrameN: <img>", a video token for each of its `image_seq_length` features, "</img>", the
    frames' spans joined by newlines (vLLM's processor's; transformers' has <IMG_CONTEXT> where
    vLLM writes the video token)."""

    spans: Callable[[int], tuple[int, ...]] = field(repr=False, compare=False)
    """A video's span by its frame count: `internvl_video_text` tokenized alone, as vLLM's
    processor tokenizes it (`cached_encode`)."""

    token = "<video>"
    model_features = ("get_image_features", "pixel_values")

    @classmethod
    def load(cls, model_dir: Path, preprocessor: Preprocessor,
             video_token_id: int) -> InternVLVideo:
        """The frames' size is the image processor's, as vLLM sets it over the video
        processor's own."""
        config = AutoConfig.from_pretrained(model_dir)
        height, width = config.vision_config.image_size
        if height != width:
            raise ModelDirError(f"{model_dir}: InternVL's vision tower takes {width}x{height} "
                                "tiles; mmlane renders videos for square ones only")
        size = preprocessor.image_processor.size
        settings = SquareFrameSettings.read(
            model_dir, family="InternVL", processor="InternVLVideoProcessor", tile=height,
            frame_tokens=internvl_tile_tokens(model_dir, config),
            size={"height": size.height, "width": size.width})
        backend = preprocessor.tokenizer.backend_tokenizer

        @lru_cache(maxsize=64)  # a few frame counts recur: each tokenized once
        def spans(frames: int) -> tuple[int, ...]:
            text = internvl_video_text(cls.token, settings.frame_tokens, frames)
            return tuple(backend.encode(text, add_special_tokens=False).ids)

        return cls(video_token_id=video_token_id, settings=settings, spans=spans)

    def count_tokens(self, frames: int, width: int, height: int) -> int:
        if frames < 1:
            raise ValueError("a video needs at least one frame")
        return len(self.spans(frames))

    def expand_item(self, tensors: Mapping[str, np.ndarray]) -> Sequence[int]:
        return self.spans(len(tensors[VIDEO_PIXELS]))

    def _span(self, frames: int, metadata: Mapping[str, Any]) -> tuple[int, ...]:
        return self.spans(frames)

    def _token_layout(self, frames: int, width: int, height: int) -> str:
        return (f"{self.settings.frame_tokens} {self.token} a frame, each frame's between "
                "\"FrameN: <img>\" and \"</img>\"")


def internvl_video_text(token: str, features: int, frames: int) -> str:
    """InternVLProcessor's text for a video of `frames` frames of `features` features each
    (`token` for each feature: vLLM's video token; transformers' <IMG_CONTEXT>)."""
    return INTERNVL_FRAME_SEPARATOR.join(f"Frame{number}: {internvl_image_text(token, features)}"
                                         for number in range(1, frames + 1))


# ---------------------------------------------------------------- SmolVLM


SMOLVLM_PROCESSOR_DEFAULTS: Mapping[str, Any] = {
    "size": {"longest_edge": 4 * 364},
    "max_image_size": {"longest_edge": 364},
    "resample": PILImageResampling.LANCZOS,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": IMAGENET_STANDARD_MEAN,
    "image_std": IMAGENET_STANDARD_STD,
}
"""transformers' `SmolVLMVideoProcessor` class defaults."""

SMOLVLM_SAMPLING_DEFAULTS = {"fps": 1, "max_frames": 64}
"""The frames kept where the model directory has no `video_sampling`: SmolVLM2's."""

SMOLVLM_MAX_SIDE = 4096
"""The video processor's first resize takes the longest edge to at most this (MAX_IMAGE_SIZE)."""

_SMOLVLM_RESIZE = {PILImageResampling.LANCZOS: "lanczos", PILImageResampling.BICUBIC: "bicubic"}
"""The resample filters the processor's torchvision backend runs natively on uint8, as torch's
interpolation modes."""


@dataclass(frozen=True, eq=False, kw_only=True)
class SmolVLMVideo(VideoPreprocessor):
    """A SmolVLM (SmolVLM2) model's video processing, transformers' own (vLLM 0.32 has none:
    `--backend vllm` takes no SmolVLM video). Frames are sampled by `SmolVLMVideoProcessor.
    sample_frames` (mmlane.mm_worker.video's `SmolVLMSampling`), resized twice as the processor
    does (the longest edge to `longest_edge`, sides even, then to the square `side`), with its
    filter (LANCZOS: torchvision 0.27's uint8 kernel, torch's `lanczos` mode; where torchvision
    is older transformers falls back to bicubic, and so would its pixels), and are images of
    one tile each: a frame is "<fake_token_around_image><global-img>", `image_seq_len` image
    tokens and "<fake_token_around_image>", through the model's `get_image_features`.

    SmolVLMProcessor writes a video as text around those frames: "You are provided the
    following series of {count in words} frames from a {H:MM:SS} [H:MM:SS] video.\n", then per
    frame "\nFrame from {MM:SS}:" and the frame, then "\n\n". It tokenizes that text with the
    prompt's, so the words before the first frame and after the last merge with the prompt's
    own text around the placeholder. `VideoItem.token_ids` holds them tokenized alone around the
    span; the MM worker tokenizes each with its neighbours (`Preprocessor.merge_text_edges`),
    and the span the engine checks is the frames and their timestamps (`expand_item`, from
    `frame_seconds`: each kept frame's whole second)."""

    image_token_id: int
    side: int
    """Frames end as side x side pixels (`max_image_size`'s longest edge)."""
    longest_edge: int
    """The first resize's longest edge (`size`'s, which overrides `video_sampling`'s
    `video_size` as the processor's constructor does)."""
    resize: str
    """torch's interpolation mode for the processor's filter."""
    norm: PixelNorm
    fps: float
    """Frames kept a second, by default (`video_sampling`'s)."""
    max_frames: int
    """Frames kept at most, by default (`video_sampling`'s)."""
    frame: tuple[int, ...]
    """A frame's tokens: "<fake_token_around_image><global-img>", the image tokens, and
    "<fake_token_around_image>"."""
    encode: Callable[[str], tuple[int, ...]] = field(repr=False, compare=False)
    """Text tokenized alone (no special tokens added), as the processor's tokenizer does."""

    token = "<video>"
    loader = "smolvlm"
    model_types = ("smolvlm",)
    text_joins_prompt = True
    model_features = ("get_image_features", "pixel_values")

    @classmethod
    def load(cls, model_dir: Path, preprocessor: Preprocessor,
             video_token_id: int) -> SmolVLMVideo:
        where, own = _processor_settings(model_dir, {})
        raw = {**SMOLVLM_PROCESSOR_DEFAULTS, **own}
        resize = _SMOLVLM_RESIZE.get(raw["resample"])
        if not raw["do_resize"] or resize is None:
            raise ModelDirError(f"{where}: mmlane renders SmolVLM videos with the processor's "
                                f"LANCZOS or bicubic resize (do_resize true, resample 1 or 3), "
                                f"got do_resize {raw['do_resize']}, resample {raw['resample']}")
        sampling = own.get("video_sampling") or {}
        size = own.get("size") or sampling.get("video_size") or raw["size"]
        side, longest = raw["max_image_size"].get("longest_edge"), size.get("longest_edge")
        config = AutoConfig.from_pretrained(model_dir)
        if side != config.vision_config.image_size or not longest:
            raise ModelDirError(
                f"{where}: SmolVLM's vision tower takes frames of {config.vision_config.image_size}"
                f" pixels a side; the video processor makes max_image_size "
                f"{dict(raw['max_image_size'])}, size {dict(size)}")
        backend = preprocessor.tokenizer.backend_tokenizer
        around = backend.token_to_id("<fake_token_around_image>")
        image = backend.token_to_id("<global-img>")
        seq_len = idefics3_image_seq_len(model_dir, config)

        @lru_cache(maxsize=256)  # the timestamps recur: each tokenized once
        def encode(text: str) -> tuple[int, ...]:
            return tuple(backend.encode(text, add_special_tokens=False).ids)

        # merge_text_edges decodes the prompt's text tokens to tokenize them again with the
        # span's words: exact where decoding gives the text back (byte-level BPE, SmolVLM's).
        probe = "User: You are provided\n\nFrame from 00:01: what happens?"
        if backend.decode(list(encode(probe)), skip_special_tokens=False) != probe:
            raise ModelDirError(f"the tokenizer in {model_dir} does not decode its tokens back "
                                "to their text; mmlane renders SmolVLM videos with one that does")

        return cls(video_token_id=video_token_id, image_token_id=preprocessor.image_token_id,
                   side=side, longest_edge=min(longest, SMOLVLM_MAX_SIDE), resize=resize,
                   norm=_torchvision_norm(raw),
                   fps=sampling.get("fps", SMOLVLM_SAMPLING_DEFAULTS["fps"]),
                   max_frames=sampling.get("max_frames", SMOLVLM_SAMPLING_DEFAULTS["max_frames"]),
                   frame=(around, image, *(preprocessor.image_token_id,) * seq_len, around),
                   encode=encode)

    @property
    def pixel_norm(self) -> PixelNorm:
        return self.norm

    @property
    def item_fields(self) -> tuple[str, ...]:
        return (VIDEO_PIXELS, "frame_seconds")

    @property
    def feature_token_id(self) -> int:
        return self.image_token_id

    def model_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """The frames as one sample's images: (1, frames, 3, side, side)."""
        return pixels[None]

    def count_tokens(self, frames: int, width: int, height: int) -> int:
        """The frames' tokens alone (the timestamps' and the words' come with the metadata)."""
        if frames < 1:
            raise ValueError("a video needs at least one frame")
        return frames * len(self.frame)

    def check_item(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        pixels, seconds = tensors[VIDEO_PIXELS], tensors["frame_seconds"]
        _check_square_frames(where, pixels, self.side)
        if seconds.dtype != np.int64 or seconds.shape != (len(pixels),) or \
                np.any(seconds < 0) or np.any(np.diff(seconds) < 0):
            raise RequestError(f"{where}.frame_seconds is {seconds.dtype} {seconds.shape}, "
                               f"needs int64 ({len(pixels)},): each frame's second, ascending "
                               "from 0 up")

    def count_item_tokens(self, tensors: Mapping[str, np.ndarray]) -> int:
        return len(self.expand_item(tensors))

    def expand_item(self, tensors: Mapping[str, np.ndarray]) -> Sequence[int]:
        """Its frames, each after the one before by its timestamp (the first's timestamp is
        among the words before the span: `_span`)."""
        span: list[int] = list(self.frame)
        for second in tensors["frame_seconds"][1:].tolist():
            span += self.encode(_smolvlm_timestamp(second)) + self.frame
        return span

    def _span(self, frames: int, metadata: Mapping[str, Any]) -> tuple[int, ...]:
        seconds = _frame_seconds(metadata)
        duration = metadata.get("duration")
        words = smolvlm_text.DEFAULT_VIDEO_INTRO.format(
            frame_count=num2words(frames),
            video_duration=str(timedelta(seconds=int(duration if duration is not None
                                                     else seconds[-1]))))
        frames_span = self.expand_item({"frame_seconds": np.array(seconds, np.int64)})
        return (*self.encode(words + _smolvlm_timestamp(seconds[0])), *frames_span,
                *self.encode(smolvlm_text.DEFAULT_MEDIA_OUTTRO))

    def _token_layout(self, frames: int, width: int, height: int) -> str:
        return f"{len(self.frame)} a frame, and its timestamp"

    def _tensors(self, frames: np.ndarray, metadata: Mapping[str, Any],
                 index: int) -> dict[str, np.ndarray]:
        import torch
        from transformers.models.smolvlm.video_processing_smolvlm import (
            get_resize_output_image_size,
        )

        video = torch.from_numpy(frames).permute(0, 3, 1, 2)
        height, width = get_resize_output_image_size(video, self.longest_edge)
        video = _resized(video, height, width, self.resize)
        return {VIDEO_PIXELS: _resized(video, self.side, self.side, self.resize)
                .contiguous().numpy(),
                "frame_seconds": np.array(_frame_seconds(metadata), np.int64)}


def _frame_seconds(metadata: Mapping[str, Any]) -> list[int]:
    """Each kept frame's whole second, as SmolVLMProcessor's timestamps count them (its index
    over the source's rate)."""
    return [int(index / metadata["fps"]) for index in metadata["frames_indices"]]


def _smolvlm_timestamp(second: int) -> str:
    minutes, seconds = divmod(second, 60)
    return smolvlm_text.FRAME_TIMESTAMP_MESSAGE.format(timestamp=f"{minutes:02d}:{seconds:02d}")


# ---------------------------------------------------------------- loading, and the shared steps


VIDEO_FAMILIES: Mapping[str, type[VideoPreprocessor]] = {
    QWEN2_VL.name: Qwen2VLVideo,
    LLAVA_ONEVISION.name: LlavaOnevisionVideo,
    INTERNVL.name: InternVLVideo,
    IDEFICS3.name: SmolVLMVideo,
}
"""The families mmlane renders videos for, by name, and their video processing."""

VIDEO_MODELS = ", ".join(f"{name} ({', '.join(kind.model_types)} only)" if kind.model_types
                         else name for name, kind in VIDEO_FAMILIES.items())
"""Those families, for a refusal's message: "qwen2_vl, ..., idefics3 (smolvlm only)"."""


def video_token_id(preprocessor: Preprocessor) -> int | None:
    """The id of the video placeholder of the model `preprocessor` loaded; None where mmlane
    renders no video for its family, or its tokenizer has no video token."""
    kind = VIDEO_FAMILIES.get(preprocessor.family.name)
    if kind is None:
        return None
    token_id: int | None = preprocessor.tokenizer.backend_tokenizer.token_to_id(kind.token)
    return token_id


def load_video_preprocessor(model_dir: str | Path, preprocessor: Preprocessor
                            ) -> VideoPreprocessor:
    """The video processing of the model in `model_dir`, whose `preprocessor` (loaded from the
    same directory) gives the tokenizer; UnsupportedModelError for a family without one here,
    ModelDirError for settings this does not reproduce."""
    model_dir = resolve_model_dir(model_dir)
    kind = VIDEO_FAMILIES.get(preprocessor.family.name)
    if kind is None:
        raise UnsupportedModelError(f"{model_dir}: mmlane renders videos for the "
                                    f"{VIDEO_MODELS} families only, not the "
                                    f"{preprocessor.family.name} family")
    if kind.model_types:
        model_type = AutoConfig.from_pretrained(model_dir).model_type
        if model_type not in kind.model_types:
            raise UnsupportedModelError(f"{model_dir}: of the {preprocessor.family.name} family "
                                        f"mmlane renders videos for model_type "
                                        f"{', '.join(kind.model_types)} only, not {model_type}")
    token_id = video_token_id(preprocessor)
    if token_id is None:
        raise ModelDirError(f"the tokenizer in {model_dir} lacks the video token {kind.token!r}")
    return kind.load(model_dir, preprocessor, token_id)


def videos_of(model_dir: str | Path, preprocessor: Preprocessor) -> VideoPreprocessor | None:
    """`load_video_preprocessor`'s, or None for a family mmlane renders no video for (an engine
    whose spec then refuses video items)."""
    try:
        return load_video_preprocessor(model_dir, preprocessor)
    except UnsupportedModelError:
        return None


def _processor_settings(model_dir: Path, defaults: Mapping[str, Any]
                        ) -> tuple[Path, dict[str, Any]]:
    """The file AutoVideoProcessor reads the settings from, and them over the class's
    `defaults`."""
    processor = model_dir / "processor_config.json"
    nested = read_json(processor).get("video_processor") if processor.is_file() else None
    if nested is not None:
        return processor, {**defaults, **nested}
    for name in _SETTINGS_FILES:
        if (model_dir / name).is_file():
            return model_dir / name, {**defaults, **read_json(model_dir / name)}
    raise ModelDirError(f"{model_dir} has no video processor settings "
                        f"({', '.join(_SETTINGS_FILES)})")


def _check_bicubic(where: Path, raw: Mapping[str, Any], processor: str) -> None:
    if not raw["do_resize"] or raw["resample"] != PILImageResampling.BICUBIC:
        raise ModelDirError(f"{where}: mmlane renders videos as {processor} does with its "
                            f"bicubic resize (do_resize true, resample 3), got do_resize "
                            f"{raw['do_resize']}, resample {raw['resample']}")


def _check_square_frames(where: str, pixels: np.ndarray, side: int) -> None:
    """RequestError naming `where` unless a video's pixel_values_videos are uint8 frames of
    (3, side, side), at least one."""
    frame = (RGB, side, side)
    if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[1:] != frame or \
            not len(pixels):
        raise RequestError(f"{where}.pixel_values_videos is {pixels.dtype} {pixels.shape}, "
                           f"the model takes uint8 (frames, {', '.join(map(str, frame))}) "
                           "with at least one frame")


def _torchvision_norm(raw: Mapping[str, Any]) -> PixelNorm:
    """The rescale and normalise of a video processor with these settings: transformers'
    torchvision backend, whatever its settings say."""
    return PixelNorm.of(SimpleNamespace(**{**raw, "backend": "torchvision"}))


def _resized(frames: np.ndarray | torch.Tensor, height: int, width: int,
             mode: str = "bicubic") -> torch.Tensor:
    """A video's frames ((n, h, w, 3) uint8, or a result of this) resized as the torchvision
    backend resizes them (the module docstring; `mode` "lanczos": torchvision 0.27's native
    uint8 kernel, which is torch's): (n, 3, height, width) uint8."""
    import torch  # the MM worker's: the frontend loads this module without torch

    # (n, h, w, 3) viewed as (n, 3, h, w): channels-last in memory, which torch's uint8 kernel
    # resizes without the processor's contiguous copy, to the same values.
    video = frames if isinstance(frames, torch.Tensor) else \
        torch.from_numpy(frames).permute(0, 3, 1, 2)
    if (height, width) == tuple(video.shape[2:]):  # torchvision returns a same-size frame
        return video
    return torch.nn.functional.interpolate(video, size=(height, width), mode=mode,
                                           align_corners=False, antialias=True)
