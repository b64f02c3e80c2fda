"""mmlane.model.video: a decoded video's tensors, token count and prompt for the tiny Qwen2-VL,
Qwen2.5-VL, LLaVA-OneVision and InternVL, against transformers' own processor as vLLM 0.32 calls
it.

The videos are made here with PyAV (tests/test_video.py's `encode`) and decoded with
mmlane.mm_worker.video's `decode_video`, as vLLM's loader samples them. The reference is the
model's AutoProcessor: `videos=[frames]`, `return_tensors="pt"`, and for Qwen2.5-VL the
decoder's metadata (less `do_sample_frames`), which is how vLLM calls it: our uint8 pixels
equal its output with rescale and normalise off (Qwen2-VL's call in vLLM), and once normalised
its default output (LLaVA-OneVision's and InternVL's, one video a call). transformers' video
processor needs torchvision: the tests that run it skip where it does not import (the main test
environment has none; the vLLM environment has it: `.venv-vllm/bin/python -m pytest
tests/test_video_render.py`).
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from test_video import Video, frame_image

from bench.images import make_image
from mmlane.mm_worker.render import PreparedItem
from mmlane.mm_worker.video import (
    DecodedVideo,
    FrameSampling,
    Qwen2VLSampling,
    SmolVLMSampling,
    UniformSampling,
    VideoSource,
    decode_video,
)
from mmlane.model import ModelDirError, Preprocessor, UnsupportedModelError, load_preprocessor
from mmlane.model import normalize as normalise
from mmlane.model.loading import expand_placeholder
from mmlane.model.tiny import INTERNVL_IMAGE_PROCESSOR
from mmlane.model.video import (
    QWEN2_VL_PROCESSOR_DEFAULTS,
    SQUARE_FRAME_PROCESSOR_DEFAULTS,
    Qwen2VLVideoSettings,
    SmolVLMVideo,
    SquareFrameVideo,
    VideoPreprocessor,
    load_video_preprocessor,
)
from mmlane.protocol.errors import RequestError

MODELS = ["qwen2_vl", "qwen2_5_vl"]
NO_LIMIT = 10**9


class Case(NamedTuple):
    video: Video
    sampling: FrameSampling

    @property
    def name(self) -> str:
        return self.video.name

    def decoded(self) -> DecodedVideo:
        return decode_video(self.video.data, 0, self.sampling)


CASES = [
    # 64x48 becomes 56x56: vLLM's default sampling (2 fps, at least 4 frames) of a 1 s clip.
    Case(Video("mpeg4-4-frames", "mpeg4", 64, 48, 30, Fraction(30)), Qwen2VLSampling()),
    Case(Video("h264-ntsc-fps4", "libx264", 160, 90, 60, Fraction(30000, 1001)),
         Qwen2VLSampling(fps=4)),
    Case(Video("h264-10fps-fps0.5", "libx264", 96, 64, 100, Fraction(10)),
         Qwen2VLSampling(fps=0.5)),
    # Already whole patches: no resize (the processor's resize returns a same-size frame).
    Case(Video("mpeg4-unresized", "mpeg4", 84, 56, 24, Fraction(24)), Qwen2VLSampling()),
    # Odd counts: the processor repeats the last frame into a whole temporal patch.
    Case(Video("mpeg4-5-frames", "mpeg4", 100, 60, 25, Fraction(25)),
         UniformSampling(num_frames=5)),
    Case(Video("mpeg4-1-frame", "mpeg4", 48, 100, 10, Fraction(10)), UniformSampling(num_frames=1)),
    # Over max_pixels (1280 * 28 * 28): scaled down.
    Case(Video("mpeg4-over-max-pixels", "mpeg4", 1296, 800, 8, Fraction(4)), Qwen2VLSampling()),
]


ONEVISION_CASES = [
    # vLLM's default loader for LLaVA-OneVision: 32 of 60 frames, evenly spaced.
    Case(Video("h264-ntsc-32-frames", "libx264", 160, 90, 60, Fraction(30000, 1001)),
         UniformSampling()),
    # Already the tower's tile: no resize.
    Case(Video("mpeg4-tile", "mpeg4", 384, 384, 6, Fraction(6)), UniformSampling(num_frames=3)),
]
SMOLVLM_CASES = [
    # SmolVLM2's sampling (1 fps, 64 frames at most) of a 2 s clip: its first and last frame.
    # The first resize takes the longest edge up to 2048 (the stock `size`), the second down to
    # the 512-pixel tile.
    Case(Video("h264-ntsc-smolvlm", "libx264", 160, 90, 60, Fraction(30000, 1001)),
         SmolVLMSampling(fps=1, max_frames=64)),
    Case(Video("mpeg4-tall-smolvlm", "mpeg4", 48, 100, 30, Fraction(10)),
         SmolVLMSampling(fps=2, max_frames=5)),
    # 75 s: the first and last second skipped, timestamps past a minute, 64 frames.
    Case(Video("mpeg4-75s-smolvlm", "mpeg4", 64, 48, 150, Fraction(2)),
         SmolVLMSampling(fps=1, max_frames=64)),
]
SQUARE_FRAME_SIZES = ["mpeg4-4-frames", "h264-10fps-fps0.5", "mpeg4-5-frames", "mpeg4-1-frame",
                   "mpeg4-over-max-pixels"]
"""CASES that LLaVA-OneVision and InternVL render too: up- and downscaled, wide and tall, 1 to 5
frames."""


@pytest.fixture(scope="module")
def decoded() -> dict[str, DecodedVideo]:
    return {case.name: case.decoded() for case in CASES + ONEVISION_CASES + SMOLVLM_CASES}


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest, model_dirs: dict[str, Path]
          ) -> tuple[Path, Preprocessor, VideoPreprocessor]:
    return video_model(model_dirs[request.param])


def video_model(model_dir: Path) -> tuple[Path, Preprocessor, VideoPreprocessor]:
    """A model directory, its preprocessor and its video preprocessor."""
    preprocessor = load_preprocessor(model_dir)
    return model_dir, preprocessor, load_video_preprocessor(model_dir, preprocessor)


def hf_processor(model_dir: Path) -> Any:
    """The model's AutoProcessor, with its video processor (which needs torchvision)."""
    pytest.importorskip("torchvision", reason="transformers' video processor needs torchvision")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def hf_call(processor: Any, videos: list[DecodedVideo], **inputs: Any) -> dict[str, Any]:
    """`processor(...)` as vLLM calls it for these videos (module docstring)."""
    from transformers.video_utils import VideoMetadata

    if "second_per_grid_ts" in processor.model_input_names:  # Qwen2_5_VLProcessor
        inputs["video_metadata"] = [
            VideoMetadata(**{k: v for k, v in video.hf_metadata().items()
                             if k != "do_sample_frames"})
            for video in videos]
    return dict(processor(videos=[video.frames for video in videos], return_tensors="pt",
                          **inputs))


def as_processor_output(items: list, video: VideoPreprocessor) -> dict[str, torch.Tensor]:
    """Our items as the processor's batch: pixels normalised, every field concatenated."""
    fields = items[0].tensors
    joined = {field: torch.from_numpy(np.concatenate([item.tensors[field] for item in items]))
              for field in fields}
    joined["pixel_values_videos"] = normalise(joined["pixel_values_videos"], video.pixel_norm)
    return joined


def assert_equal_tensors(ours: dict[str, torch.Tensor], expected: dict[str, Any]) -> None:
    fields = {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} & expected.keys()
    assert ours.keys() == fields
    for field in fields:
        assert ours[field].dtype == expected[field].dtype, field
        assert torch.equal(ours[field], expected[field]), field


def video_chat(*parts: str) -> list[dict]:
    content = [{"type": part} if part != "text" else {"type": "text", "text": "what happens?"}
               for part in parts]
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("case", [case.name for case in CASES])
def test_tensors_tokens_and_prompt_are_the_processors(model, decoded, case: str) -> None:
    """pixel_values_videos (normalised), video_grid_thw and, for Qwen2.5-VL, second_per_grid_ts
    are the processor's bit for bit; the uint8 pixels are its output with rescale and normalise
    off; the prompt expands to its input ids."""
    video = model[2]
    item, expected, uint8 = processed_alone(model, decoded[case])
    assert_equal_tensors(as_processor_output([item], video), expected)
    assert torch.equal(torch.from_numpy(item.tensors["pixel_values_videos"]), uint8)


def processed_alone(model: tuple[Path, Any, VideoPreprocessor],
                    decoded_video: Any) -> tuple[Any, Any, torch.Tensor]:
    """One video in a chat, ours and the processor's: our item, the processor's output (its
    default call) and its uint8 pixels (rescale and normalise off). Checks that the chat's ids
    expand to the processor's, and the token count made before any pixel work."""
    model_dir, preprocessor, video = model
    processor = hf_processor(model_dir)
    prompt = preprocessor.render_prompt(video_chat("video", "text"))
    expected = hf_call(processor, [decoded_video], text=[prompt])
    item = video.process_video(decoded_video.frames, decoded_video.hf_metadata(), index=0,
                               max_tokens=NO_LIMIT)
    uint8 = processor.video_processor(videos=[decoded_video.frames], do_rescale=False,
                                      do_normalize=False, return_tensors="pt")

    [token_ids] = preprocessor.tokenize_batch([prompt])
    expanded = video.expand_placeholders(token_ids, [item])
    assert as_transformers_writes(expanded, preprocessor, video) == \
        expected["input_ids"][0].tolist()
    assert item.num_tokens == len(expanded) - len(token_ids) + 1
    frames, height, width = decoded_video.frames.shape[:3]
    assert video.count_tokens(frames, width, height) == item.num_tokens
    return item, expected, uint8["pixel_values_videos"]


def as_transformers_writes(token_ids: list[int], preprocessor: Preprocessor,
                           video: VideoPreprocessor) -> list[int]:
    """Our ids (vLLM's) as transformers' processor writes them: InternVL's video features are
    its image token there, where vLLM's processor writes the video token."""
    if preprocessor.family.name != "internvl":
        return token_ids
    return [preprocessor.image_token_id if token == video.video_token_id else token
            for token in token_ids]


def test_a_chat_with_images_and_videos_is_the_processors(model, decoded) -> None:
    """Two videos of different sizes and an image between them: one processor call, as vLLM
    makes it for a prompt, and its ids with both kinds of placeholder expanded."""
    model_dir, preprocessor, video = model
    processor = hf_processor(model_dir)
    videos = [decoded["h264-ntsc-fps4"], decoded["mpeg4-5-frames"]]
    image = make_image(200, 150, seed=3)
    prompt = preprocessor.render_prompt(video_chat("video", "image", "text", "video"))
    expected = hf_call(processor, videos, text=[prompt], images=[image])

    items = [video.process_video(v.frames, v.hf_metadata(), index=i, max_tokens=NO_LIMIT)
             for i, v in enumerate(videos)]
    assert_equal_tensors(as_processor_output(items, video), expected)
    [token_ids] = preprocessor.tokenize_batch([prompt])
    with_images = preprocessor.expand_placeholders(token_ids, [preprocessor.process_image(image)])
    assert video.expand_placeholders(with_images, items) == expected["input_ids"][0].tolist()


def test_the_defaults_are_the_video_processors() -> None:
    pytest.importorskip("torchvision", reason="transformers' video processor needs torchvision")
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    for name, value in QWEN2_VL_PROCESSOR_DEFAULTS.items():
        assert getattr(Qwen2VLVideoProcessor, name) == value, name


SETTINGS_FILES = {
    # The tiny models' own preprocessor_config.json (min_pixels and max_pixels).
    "image-processor-file": {},
    "video-processor-file": {"video_preprocessor_config.json": {
        "size": {"shortest_edge": 56 * 56, "longest_edge": 8 * 28 * 28}, "merge_size": 2}},
    # qwen-vl-utils' total budget, small enough to bite on a few frames.
    "cap-pixels-per-frame": {"video_preprocessor_config.json": {
        "min_pixels": 28 * 28, "max_pixels": 64 * 28 * 28, "cap_pixels_per_frame": True,
        "max_video_tokens": 80}},
    "nested-in-processor-config": {"processor_config.json": {"video_processor": {
        "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}},
}


def model_dir_with(model_dir: Path, tmp_path: Path, files: dict[str, dict]) -> Path:
    copy = tmp_path / model_dir.name
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    for name, settings in files.items():
        (copy / name).write_text(json.dumps(settings))
    return copy


@pytest.mark.parametrize("files", list(SETTINGS_FILES))
def test_settings_are_read_as_the_processor_reads_them(model, decoded, tmp_path: Path,
                                                       files: str) -> None:
    model_dir, preprocessor, _ = model
    model_dir = model_dir_with(model_dir, tmp_path, SETTINGS_FILES[files])
    video = load_video_preprocessor(model_dir, preprocessor)
    processor = hf_processor(model_dir)
    hf = processor.video_processor
    settings = video.settings
    assert (settings.min_pixels, settings.max_pixels) == (hf.size.shortest_edge,
                                                          hf.size.longest_edge)
    assert settings.cap_pixels_per_frame == bool(hf.cap_pixels_per_frame)
    for case in ("mpeg4-over-max-pixels", "mpeg4-5-frames"):
        item = video.process_video(decoded[case].frames, decoded[case].hf_metadata(), index=0,
                                   max_tokens=NO_LIMIT)
        assert_equal_tensors(as_processor_output([item], video),
                             hf_call(processor, [decoded[case]], text=["<|video_pad|>"]))


# ---------------------------------------------------------------- LLaVA-OneVision


@pytest.fixture(scope="module")
def onevision(model_dirs: dict[str, Path]) -> tuple[Path, Preprocessor, VideoPreprocessor]:
    return video_model(model_dirs["llava_onevision"])


def onevision_pixels(item: Any, video: VideoPreprocessor) -> torch.Tensor:
    """A video's pixels as LlavaOnevisionProcessor returns them: normalised, a batch of one."""
    pixels = torch.from_numpy(item.tensors["pixel_values_videos"])
    return video.model_pixels(normalise(pixels, video.pixel_norm))


@pytest.mark.parametrize("case", SQUARE_FRAME_SIZES + [case.name for case in ONEVISION_CASES])
def test_onevision_tensors_tokens_and_prompt_are_the_processors(onevision, decoded,
                                                               case: str) -> None:
    """pixel_values_videos, normalised, are the processor's bit for bit (its default call, as
    vLLM makes it for LLaVA-OneVision), the uint8 pixels its output with rescale and normalise
    off; the prompt expands to its input ids: 196 pooled features a frame and a newline."""
    video = onevision[2]
    decoded_video = decoded[case]
    item, expected, uint8 = processed_alone(onevision, decoded_video)
    assert set(item.tensors) == set(video.item_fields) == {"pixel_values_videos"}
    assert torch.equal(onevision_pixels(item, video), expected["pixel_values_videos"])
    assert torch.equal(torch.from_numpy(item.tensors["pixel_values_videos"])[None], uint8)
    assert item.num_tokens == len(decoded_video.frames) * 196 + 1


def test_a_onevision_chat_with_an_image_and_a_video_is_the_processors(onevision,
                                                                      decoded) -> None:
    """An image and a video in one processor call: its ids, both kinds of placeholder expanded
    (the template puts a message's images before its videos)."""
    video = onevision[2]
    item, expected, ours = a_video_and_an_image(onevision, decoded["h264-ntsc-32-frames"])
    assert torch.equal(onevision_pixels(item, video), expected["pixel_values_videos"])
    assert ours == expected["input_ids"][0].tolist()


def a_video_and_an_image(model: tuple[Path, Any, VideoPreprocessor],
                         clip: Any) -> tuple[Any, Any, list[int]]:
    """A chat of a video and an image, ours and the processor's (one call): our video's item,
    the processor's output, and our prompt's ids with both kinds of placeholder expanded."""
    model_dir, preprocessor, video = model
    processor = hf_processor(model_dir)
    image = make_image(200, 150, seed=3)
    prompt = preprocessor.render_prompt(video_chat("video", "image", "text"))
    expected = hf_call(processor, [clip], text=[prompt], images=[image])
    item = video.process_video(clip.frames, clip.hf_metadata(), index=0, max_tokens=NO_LIMIT)
    [token_ids] = preprocessor.tokenize_batch([prompt])
    with_images = preprocessor.expand_placeholders(token_ids, [preprocessor.process_image(image)])
    return item, expected, video.expand_placeholders(with_images, [item])


@pytest.mark.parametrize("processor", [
    "llava_onevision.video_processing_llava_onevision.LlavaOnevisionVideoProcessor",
    "internvl.video_processing_internvl.InternVLVideoProcessor",
])
def test_the_square_frame_defaults_are_the_video_processors(processor: str) -> None:
    pytest.importorskip("torchvision", reason="transformers' video processor needs torchvision")
    module, name = processor.rsplit(".", 1)
    processor_class = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    for setting, value in SQUARE_FRAME_PROCESSOR_DEFAULTS.items():  # a setting it lacks: None
        assert getattr(processor_class, setting, None) == value, setting


def test_onevision_settings_are_read_as_the_processor_reads_them(onevision, decoded,
                                                                 tmp_path: Path) -> None:
    """A video processor file of its own, with the class's CLIP mean and std (a value of its
    own for each channel; the tiny model's image processor file has 0.5 for all three)."""
    model_dir, preprocessor, _ = onevision
    model_dir = model_dir_with(model_dir, tmp_path, {"video_preprocessor_config.json": {
        "video_processor_type": "LlavaOnevisionVideoProcessor",
        "size": {"height": 384, "width": 384}}})
    video = load_video_preprocessor(model_dir, preprocessor)
    assert video.pixel_norm.mean != (0.5, 0.5, 0.5)
    processor = hf_processor(model_dir)
    for case in ("mpeg4-over-max-pixels", "mpeg4-5-frames"):
        item = video.process_video(decoded[case].frames, decoded[case].hf_metadata(), index=0,
                                   max_tokens=NO_LIMIT)
        expected = hf_call(processor, [decoded[case]], text=["<video>"])
        assert torch.equal(onevision_pixels(item, video), expected["pixel_values_videos"])


@pytest.mark.parametrize(("settings", "refusal"), [
    ({"resample": 2}, "bicubic resize"),
    ({"size": {"height": 336, "width": 336}}, "takes frames of 384x384 pixels"),
    ({"size": {"shortest_edge": 384}}, "takes frames of 384x384 pixels"),
    ({"do_center_crop": True, "crop_size": {"height": 384, "width": 384}},
     "do_center_crop True"),
])
def test_onevision_settings_it_does_not_reproduce_are_refused(onevision, tmp_path: Path,
                                                              settings: dict,
                                                              refusal: str) -> None:
    model_dir, preprocessor, _ = onevision
    model_dir = model_dir_with(model_dir, tmp_path,
                               {"video_preprocessor_config.json": settings})
    with pytest.raises(ModelDirError, match=refusal):
        load_video_preprocessor(model_dir, preprocessor)


def test_a_onevision_video_over_the_token_limit_is_refused_before_any_pixel_work(
    onevision,
) -> None:
    _, _, video = onevision
    frames = np.broadcast_to(np.uint8(0), (256, 1080, 1920, 3))  # never materialised
    with pytest.raises(RequestError, match=r"^video 2: its 256 frames of 1920x1080 make 50177 "
                                           r"tokens \(196 a frame and 1 newline\), more than "
                                           r"the 32768 it may take$") as refused:
        video.process_video(frames, {}, index=2, max_tokens=32768)
    assert refused.value.code == "video_too_large"
    two = np.stack([frame_image(i, 64, 48) for i in range(2)])
    assert video.process_video(two, {}, index=0, max_tokens=393).num_tokens == 393
    with pytest.raises(RequestError, match="video 0: .* make 393 tokens"):
        video.process_video(two, {}, index=0, max_tokens=392)


# ---------------------------------------------------------------- InternVL


@pytest.fixture(scope="module")
def internvl(model_dirs: dict[str, Path]) -> tuple[Path, Preprocessor, VideoPreprocessor]:
    return video_model(model_dirs["internvl"])


def internvl_pixels(item: Any, video: VideoPreprocessor) -> torch.Tensor:
    """A video's pixels as InternVLProcessor returns them: normalised, its frames among
    `pixel_values` (an image's tiles' rows there)."""
    return normalise(torch.from_numpy(item.tensors["pixel_values_videos"]), video.pixel_norm)


@pytest.mark.parametrize("case", SQUARE_FRAME_SIZES + [case.name for case in ONEVISION_CASES])
def test_internvl_tensors_tokens_and_prompt_are_the_processors(internvl, decoded,
                                                              case: str) -> None:
    """Each frame resized to the 448-pixel tile: the processor's pixel_values bit for bit once
    normalised (its default call, as vLLM makes it), the uint8 pixels its video processor's
    output with rescale and normalise off; the prompt expands to its input ids, each frame
    "FrameN: <img>", its 256 features, "</img>" (vLLM's video token for each feature)."""
    _, preprocessor, video = internvl
    decoded_video = decoded[case]
    item, expected, uint8 = processed_alone(internvl, decoded_video)
    assert set(item.tensors) == set(video.item_fields) == {"pixel_values_videos"}
    assert torch.equal(internvl_pixels(item, video), expected["pixel_values"])
    assert torch.equal(torch.from_numpy(item.tensors["pixel_values_videos"])[None], uint8)
    assert item.token_ids.count(video.video_token_id) == len(decoded_video.frames) * 256
    assert preprocessor.image_token_id not in item.token_ids


def test_an_internvl_chat_with_an_image_and_a_video_is_the_processors(internvl,
                                                                     decoded) -> None:
    """A video and an image in one processor call: its ids, both kinds of placeholder expanded,
    and the video's frames where the processor puts them among pixel_values: in prompt order,
    before the image's tiles."""
    _, preprocessor, video = internvl
    clip = decoded["h264-ntsc-32-frames"]
    item, expected, ours = a_video_and_an_image(internvl, clip)
    assert torch.equal(internvl_pixels(item, video), expected["pixel_values"][:len(clip.frames)])
    assert as_transformers_writes(ours, preprocessor, video) == expected["input_ids"][0].tolist()


def test_internvl_settings_are_read_as_the_processor_reads_them(internvl, decoded,
                                                                tmp_path: Path) -> None:
    """A video processor file of its own, with the class's CLIP mean and std (the tiny
    model's image processor file has ImageNet's), and its size: vLLM's is the image
    processor's, which the tiny model's is too."""
    model_dir, preprocessor, _ = internvl
    model_dir = model_dir_with(model_dir, tmp_path, {"video_preprocessor_config.json": {
        "video_processor_type": "InternVLVideoProcessor", "size": {"height": 448, "width": 448}}})
    video = load_video_preprocessor(model_dir, preprocessor)
    assert video.pixel_norm.mean == (0.48145466, 0.4578275, 0.40821073)
    processor = hf_processor(model_dir)
    for case in ("mpeg4-over-max-pixels", "mpeg4-5-frames"):
        item = video.process_video(decoded[case].frames, decoded[case].hf_metadata(), index=0,
                                   max_tokens=NO_LIMIT)
        expected = hf_call(processor, [decoded[case]], text=["<video>"])
        assert torch.equal(internvl_pixels(item, video), expected["pixel_values"])


def test_internvl_frames_take_the_image_processors_size(internvl, tmp_path: Path) -> None:
    """vLLM gives InternVL's video processor the image processor's size over its own."""
    model_dir, preprocessor, _ = internvl
    model_dir = model_dir_with(model_dir, tmp_path, {"video_preprocessor_config.json": {
        "size": {"height": 384, "width": 384}}})
    video = load_video_preprocessor(model_dir, preprocessor)
    assert isinstance(video, SquareFrameVideo)
    assert video.settings.side == 448


@pytest.mark.parametrize(("files", "refusal"), [
    ({"video_preprocessor_config.json": {"resample": 2}}, "bicubic resize"),
    ({"video_preprocessor_config.json": {"do_center_crop": True,
                                         "crop_size": {"height": 448, "width": 448}}},
     "do_center_crop True"),
    ({"preprocessor_config.json": {**INTERNVL_IMAGE_PROCESSOR, "size": {"height": 336,
                                                                        "width": 336}}},
     "takes frames of 448x448 pixels"),
])
def test_internvl_settings_it_does_not_reproduce_are_refused(internvl, tmp_path: Path,
                                                             files: dict, refusal: str) -> None:
    model_dir = model_dir_with(internvl[0], tmp_path, files)
    with pytest.raises(ModelDirError, match=refusal):
        load_video_preprocessor(model_dir, load_preprocessor(model_dir))


def test_an_internvl_video_over_the_token_limit_is_refused_before_any_pixel_work(
    internvl,
) -> None:
    _, _, video = internvl
    frames = np.broadcast_to(np.uint8(0), (128, 1080, 1920, 3))  # never materialised
    tokens = video.count_tokens(128, 1920, 1080)
    assert tokens > 128 * (256 + 2)  # "FrameN: " and the newlines too
    with pytest.raises(RequestError, match=rf"^video 2: its 128 frames of 1920x1080 make "
                                           rf"{tokens} tokens \(256 <video> a frame, each "
                                           r"frame's between \"FrameN: <img>\" and \"</img>\"\), "
                                           r"more than the 32768 it may take$") as refused:
        video.process_video(frames, {}, index=2, max_tokens=32768)
    assert refused.value.code == "video_too_large"
    two = np.stack([frame_image(i, 64, 48) for i in range(2)])
    fits = video.count_tokens(2, 64, 48)
    assert video.process_video(two, {}, index=0, max_tokens=fits).num_tokens == fits
    with pytest.raises(RequestError, match=f"video 0: .* make {fits} tokens"):
        video.process_video(two, {}, index=0, max_tokens=fits - 1)


# ---------------------------------------------------------------- bounds and refusals


def test_a_video_over_the_token_limit_is_refused_before_any_pixel_work(model) -> None:
    _, _, video = model
    # 256 frames of 1080p, never materialised: refused from their count and size alone.
    frames = np.broadcast_to(np.uint8(0), (256, 1080, 1920, 3))
    tokens = video.count_tokens(256, 1920, 1080)
    assert tokens == 128 * (728 // 14) * (1316 // 14) // 4  # each frame 1316x728: max_pixels
    with pytest.raises(RequestError, match=rf"^video 3: its 256 frames of 1920x1080 make "
                                           rf"{tokens} tokens .* more than the 32768 it may take"
                       ) as refused:
        video.process_video(frames, {}, index=3, max_tokens=32768)
    assert refused.value.code == "video_too_large"


def test_a_video_at_the_limit_is_taken(model) -> None:
    _, _, video = model
    frames = np.stack([frame_image(i, 64, 48) for i in range(4)])
    metadata = {"fps": 30.0, "total_num_frames": 30, "frames_indices": [0, 7, 15, 22]}
    item = video.process_video(frames, metadata, index=0, max_tokens=8)
    assert item.num_tokens == 8  # resized to 56x56: 2 temporal patches of 4x4, merged 2x2
    with pytest.raises(RequestError, match="video 0: .* make 8 tokens") as refused:
        video.process_video(frames, metadata, index=0, max_tokens=7)
    assert refused.value.code == "video_too_large"


def test_frames_the_processor_would_refuse_are_invalid(model) -> None:
    _, _, video = model
    with pytest.raises(RequestError, match="video 1: its 2 frames of 2010x10 cannot be processed"
                                           ": absolute aspect ratio") as refused:
        video.process_video(np.zeros((2, 10, 2010, 3), np.uint8), {}, index=1, max_tokens=NO_LIMIT)
    assert refused.value.code == "invalid_video"


def test_qwen2_5_vl_needs_the_frame_rate(model_dirs: dict[str, Path]) -> None:
    preprocessor = load_preprocessor(model_dirs["qwen2_5_vl"])
    video = load_video_preprocessor(model_dirs["qwen2_5_vl"], preprocessor)
    frames = np.zeros((2, 56, 56, 3), np.uint8)
    with pytest.raises(RequestError, match="video 0: its frame rate is unknown") as refused:
        video.process_video(frames, {"fps": 0.0, "total_num_frames": 2, "frames_indices": [0, 1]},
                            index=0, max_tokens=NO_LIMIT)
    assert refused.value.code == "invalid_video"


# ---------------------------------------------------------------- SmolVLM


@pytest.fixture(scope="module")
def smolvlm(model_dirs: dict[str, Path]) -> tuple[Path, Preprocessor, VideoPreprocessor]:
    return video_model(model_dirs["smolvlm"])


def smolvlm_prompt(preprocessor: Preprocessor, video: VideoPreprocessor, text: str,
                   items: list[Any]) -> list[int]:
    """A chat of the videos and `text`, expanded as the MM worker expands it: the spans' words
    tokenized with the prompt's text around them, then the frames in place."""
    content = [{"type": "video"} for _ in items] + [{"type": "text", "text": text}]
    [token_ids] = preprocessor.tokenize_batch([preprocessor.render_prompt(
        [{"role": "user", "content": content}])])
    merged, spans = preprocessor.merge_text_edges(
        token_ids, video.video_token_id,
        [PreparedItem.processed("", item).expansion(video.video_token_id) for item in items])
    return expand_placeholder(merged, video.video_token_id, spans, "video")


SMOLVLM_TEXTS = ["what happens?", " what happens?", "\n\nwhat happens?"]
"""What follows the video in the chat: its words before the first frame follow the template's
": ", its "\n\n" after the last frame merges with a newline or a word."""


@pytest.mark.parametrize("text", SMOLVLM_TEXTS)
@pytest.mark.parametrize("case", [case.name for case in SMOLVLM_CASES])
def test_smolvlm_tensors_and_prompt_are_the_processors(smolvlm, decoded, case: str,
                                                       text: str) -> None:
    """The frames resized twice with LANCZOS: the processor's pixel_values bit for bit once
    normalised, the uint8 pixels its video processor's output with rescale and normalise off;
    the prompt is its input ids, each frame a one-tile image after its timestamp, between the
    words SmolVLMProcessor writes, tokenized with the chat's text."""
    model_dir, preprocessor, video = smolvlm
    processor = hf_processor(model_dir)
    from transformers.video_utils import VideoMetadata

    clip = decoded[case]
    item = video.process_video(clip.frames, clip.hf_metadata(), index=0, max_tokens=NO_LIMIT)
    metadata = VideoMetadata(**{k: v for k, v in clip.hf_metadata().items()
                                if k != "do_sample_frames"})
    prompt = preprocessor.render_prompt(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}])
    expected = processor(text=[prompt], videos=[[clip.frames]], video_metadata=[[metadata]],
                         return_tensors="pt")
    assert smolvlm_prompt(preprocessor, video, text, [item]) == \
        expected["input_ids"][0].tolist()
    pixels = normalise(torch.from_numpy(item.tensors["pixel_values_videos"]), video.pixel_norm)
    assert torch.equal(video.model_pixels(pixels), expected["pixel_values"])
    uint8 = processor.video_processor(videos=[clip.frames], do_rescale=False, do_normalize=False,
                                      return_tensors="pt")
    assert torch.equal(torch.from_numpy(item.tensors["pixel_values_videos"])[None],
                       uint8["pixel_values"])


@pytest.mark.parametrize("case", [case.name for case in SMOLVLM_CASES])
def test_smolvlm_prompt_is_the_processors_text_tokenized(smolvlm, decoded, case: str) -> None:
    """Without torchvision too: SmolVLMProcessor's own text for the video (its
    `replace_video_token`) in place of the placeholder, the chat tokenized whole, is our
    expansion; the engine's span (the frames and their timestamps) is in it, as `expand_item`
    makes it from the tensors; two videos side by side, their words merged between them."""
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor
    from transformers.video_utils import VideoMetadata

    _, preprocessor, video = smolvlm
    clip = decoded[case]
    item = video.process_video(clip.frames, clip.hf_metadata(), index=0, max_tokens=NO_LIMIT)
    metadata = VideoMetadata(**{k: v for k, v in clip.hf_metadata().items()
                                if k != "do_sample_frames"})
    tokens = SimpleNamespace(image_seq_len=64, image_token="<image>",
                             fake_image_token="<fake_token_around_image>",
                             global_image_token="<global-img>")
    words = SmolVLMProcessor.replace_video_token(tokens, {  # transformers 5.19 counts pixels
        "video_metadata": [metadata], "pixel_values": np.empty((1, len(clip.frames)))}, 0)
    for count in (1, 2):
        text = " what happens?"
        prompt = preprocessor.render_prompt([{"role": "user", "content": [
            *[{"type": "video"}] * count, {"type": "text", "text": text}]}])
        [expected] = preprocessor.tokenize_batch([prompt.replace("<video>", words)])
        ours = smolvlm_prompt(preprocessor, video, text, [item] * count)
        assert ours == expected
    span = list(video.expand_item(item.tensors))
    assert len(span) < item.num_tokens
    assert any(ours[at:at + len(span)] == span for at in range(len(ours)))
    assert item.tensors["frame_seconds"].tolist() == [int(i / clip.source.fps)
                                                      for i in clip.frames_indices]


def test_smolvlm_sampling_is_the_processors() -> None:
    """transformers' `SmolVLMVideoProcessor.sample_frames`, index for index, over frame counts,
    rates and settings drawn at random (the long videos skip their first and last second)."""
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(0)
    for _ in range(2000):
        source = VideoSource(total_frames=int(rng.integers(1, 5000)),
                             fps=float(rng.choice([0.5, 7.5, 24, 30000 / 1001, 30, 60])))
        fps, most = float(rng.choice([0.1, 0.5, 1, 2, 3.3])), int(rng.integers(1, 100))
        expected = SmolVLMVideoProcessor.sample_frames(
            SimpleNamespace(), VideoMetadata(total_num_frames=source.total_frames,
                                             fps=source.fps, duration=source.duration),
            num_frames=most, fps=fps)
        assert SmolVLMSampling(fps=fps, max_frames=most).indices(source, 0) == \
            expected.tolist()
    with pytest.raises(RequestError, match="frame rate is unknown"):
        SmolVLMSampling(fps=1, max_frames=8).indices(VideoSource(total_frames=10, fps=0), 3)


@pytest.mark.parametrize(("settings", "longest_edge"), [
    ({}, 2048),  # the stock file: its `size` overrides video_sampling's video_size
    ({"size": None}, 512),  # video_size alone
    ({"size": {"longest_edge": 9000}}, 4096),  # the processor's bound
])
def test_smolvlm_settings_are_read_as_the_processor_reads_them(smolvlm, decoded, tmp_path: Path,
                                                              settings: dict,
                                                              longest_edge: int) -> None:
    model_dir, preprocessor, _ = smolvlm
    stock = json.loads((model_dir / "preprocessor_config.json").read_text())
    files = {"preprocessor_config.json": {k: v for k, v in {**stock, **settings}.items()
                                          if v is not None}}
    copy = model_dir_with(model_dir, tmp_path, files)
    video = load_video_preprocessor(copy, preprocessor)
    assert isinstance(video, SmolVLMVideo)
    assert (video.longest_edge, video.side, video.fps, video.max_frames) == \
        (longest_edge, 512, 1, 64)
    if importlib.util.find_spec("torchvision") is not None:
        hf = hf_processor(copy).video_processor
        clip = decoded["mpeg4-tall-smolvlm"]
        item = video.process_video(clip.frames, clip.hf_metadata(), index=0, max_tokens=NO_LIMIT)
        uint8 = hf(videos=[clip.frames], do_rescale=False, do_normalize=False,
                   return_tensors="pt")
        assert torch.equal(torch.from_numpy(item.tensors["pixel_values_videos"])[None],
                           uint8["pixel_values"])


@pytest.mark.parametrize(("settings", "refusal"), [
    ({"resample": 2}, "LANCZOS or bicubic resize"),
    ({"max_image_size": {"longest_edge": 384}}, "takes frames of 512 pixels a side"),
])
def test_smolvlm_settings_it_does_not_reproduce_are_refused(smolvlm, tmp_path: Path,
                                                           settings: dict, refusal: str) -> None:
    model_dir, preprocessor, _ = smolvlm
    stock = json.loads((model_dir / "preprocessor_config.json").read_text())
    copy = model_dir_with(model_dir, tmp_path, {"preprocessor_config.json": {**stock, **settings}})
    with pytest.raises(ModelDirError, match=refusal):
        load_video_preprocessor(copy, preprocessor)


def test_a_smolvlm_video_over_the_token_limit_is_refused_before_any_pixel_work(smolvlm) -> None:
    _, _, video = smolvlm
    frames = np.zeros((4, 1, 1, 3), np.uint8)
    metadata = {"fps": 1.0, "duration": 4.0, "frames_indices": [0, 1, 2, 3]}
    taken = video.process_video(frames[:, :, :, :], metadata, index=0, max_tokens=NO_LIMIT)
    with pytest.raises(RequestError, match=r"^video 1: its 4 frames of 1x1 make \d+ tokens "
                                           r"\(67 a frame, and its timestamp\)") as refused:
        video.process_video(frames, metadata, index=1, max_tokens=taken.num_tokens - 1)
    assert refused.value.code == "video_too_large"


def test_only_the_qwen2_vl_onevision_internvl_and_smolvlm_models_render_videos(
    model_dirs: dict[str, Path],
) -> None:
    llava = model_dirs["llava"]
    with pytest.raises(UnsupportedModelError, match=re.escape(
            "mmlane renders videos for the qwen2_vl, llava_onevision, internvl, idefics3 "
            "(smolvlm only) families only, not the llava family")):
        load_video_preprocessor(llava, load_preprocessor(llava))
    idefics3 = model_dirs["idefics3"]  # SmolVLM's family: its processor has no video
    with pytest.raises(UnsupportedModelError, match="of the idefics3 family mmlane renders "
                                                    "videos for model_type smolvlm only, not "
                                                    "idefics3"):
        load_video_preprocessor(idefics3, load_preprocessor(idefics3))


@pytest.mark.parametrize(("settings", "refusal"), [
    ({"resample": 2}, "bicubic resize"),
    ({"do_resize": False}, "bicubic resize"),
    ({"size": {"min_pixels": 3136, "max_pixels": 50176}}, "needs a shortest_edge"),
])
def test_settings_it_does_not_reproduce_are_refused(model, tmp_path: Path, settings: dict,
                                                    refusal: str) -> None:
    model_dir, preprocessor, _ = model
    stock = json.loads((model_dir / "preprocessor_config.json").read_text())
    stock = {k: v for k, v in stock.items() if k not in ("min_pixels", "max_pixels")}
    model_dir = model_dir_with(model_dir, tmp_path,
                               {"preprocessor_config.json": {**stock, **settings}})
    with pytest.raises(ModelDirError, match=refusal):
        Qwen2VLVideoSettings.read(model_dir)
