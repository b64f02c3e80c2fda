"""Decoding a video's bytes into the frames vLLM 0.32 samples from it: where PyAV's errors
become ours.

    decode_video(data, index, sampling, limits)
                        encoded bytes -> `DecodedVideo`: the kept frames as one (n, h, w, 3)
                        uint8 RGB array and vLLM's metadata for the HF video processor
    Qwen2VLSampling     vLLM's `qwen2_vl` loader: the one vLLM picks for Qwen2-VL and
                        Qwen2.5-VL (their video processor is `Qwen2VLVideoProcessor`)
    UniformSampling     vLLM's default loader (`VLLM_VIDEO_LOADER_BACKEND=opencv`): the one
                        it picks for LLaVA-OneVision and InternVL (and every model
                        without a loader)
    SmolVLMSampling     transformers' own for SmolVLM, which vLLM 0.32 takes no video of
    VideoLimits         the bounds, each with a safe default (MMWorkerConfig.video's)

Sampling. vLLM reads the source's frame count and rate through OpenCV (`CAP_PROP_FRAME_COUNT`:
the container's `nb_frames`, else its duration times the rate; `CAP_PROP_FPS`: FFmpeg's
`av_guess_frame_rate`), picks frame indices from them with its loader's rule, then grabs every
frame up to the last index and converts only the picked ones to RGB. `VideoSource` reads the same
numbers through PyAV, and the two rules here are vLLM's, index for index
(tests/test_vllm_video.py compares them with vLLM's own functions). The metadata is what vLLM
hands the HF processor (`DecodedVideo.hf_metadata`), but for `video_backend`, which says "pyav".

Decoding. One pass over the packets (demuxing only, no decoding) counts the frames the file really
holds, checks their timestamps against `max_video_duration_s`, and notes each frame's timestamp and
which frames are keyframes (`_Timeline`). The decoder then runs from the start and stops after the
last kept frame; where the next kept frame's keyframe lies `_SEEK_MIN_FRAMES` or more ahead, it
seeks there instead of decoding the frames in between. vLLM's indices count the frames the decoder
gives, not timestamps, so every frame decoded on that path must carry the timestamp of its index;
if one does not (frames shown in another order than their timestamps say, hidden frames, split
fields), the video is decoded again frame by frame, as it is where two frames share a timestamp or
one has none. Only the kept frames are converted: as OpenCV converts them (swscale, bicubic, to
BGR, the channels swapped: from 8-bit 4:2:0 the same as straight to RGB, from 10-bit not, by up to
25 levels), turned upright by their display matrix (multiples of 90°).

The pixels are vLLM's bit for bit (tests/test_vllm_video.py: H.264, 10-bit HEVC, VP9, MPEG-4
Part 2, MJPEG; measured as well on AV1, VP8, FFV1, 10-bit H.264, 4:2:2, 4:4:4, grey, BT.709,
full range) except where the stream is tagged with BT.2020 primaries: OpenCV 5.1's newer
swscale maps them to BT.709's, PyAV 18's does not (max abs difference about 160, most values).

Every failure is the request's fault and leaves as a `RequestError` whose message starts with
the video's position in the request (`video 2: ...`). Codes: `invalid_video` (not a video we can
decode: corrupt, cut short, no video stream, no frames, an unknown codec, an unknown frame rate)
and `video_too_large` (over a bound of `VideoLimits`). Running out of memory is `overloaded`, as
for images.
"""

from __future__ import annotations

import array
import io
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import av.container
import av.video.stream
import numpy as np

from mmlane.mm_worker.config import VideoLimits
from mmlane.protocol.errors import RequestError, translated

VIDEO_BACKEND = "pyav"
"""`video_backend` in the metadata: vLLM says which of its decoders it used ("opencv")."""

_SEEK_MIN_FRAMES = 16
"""Seek only where that skips this many frames: a seek drops the frames in the decoder (H.264
holds up to 16 to reorder them) and reads from the keyframe again."""
_TIMELINE_MAX_FRAMES = 1 << 20
"""Frames whose timestamps the scan keeps (8 MiB); a video with more is decoded frame by frame."""
_CV_ROTATIONS = {90: -1, 180: 2, 270: 1}
"""OpenCV's upright turn (its angle: clockwise degrees) as `np.rot90`'s `k` (counterclockwise
quarter turns)."""


DEFAULT_LIMITS = VideoLimits()


@dataclass(frozen=True)
class VideoSource:
    """What vLLM knows of a video before sampling it (its `VideoSourceMetadata`)."""

    total_frames: int
    """The container's frame count (`nb_frames`, else duration times rate, rounded), or the
    frames the file holds where that is fewer by more than one (vLLM's edit-list check)."""
    fps: float
    """The stream's frame rate as FFmpeg guesses it; 0 when unknown."""

    @property
    def duration(self) -> float:
        """Seconds: `total_frames / fps` (0 when the rate is unknown), as vLLM computes it."""
        return self.total_frames / self.fps if self.fps > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class Qwen2VLSampling:
    """vLLM 0.32's `qwen2_vl` loader (`Qwen2VLVideoBackend`), the one it uses for Qwen2-VL and
    Qwen2.5-VL, a port of transformers' `Qwen2VLVideoProcessor.sample_frames` in fps mode.

    `total / source fps * fps` frames (fps at most 30), clamped to `[min_frames, max_frames]`
    (max_frames at most 768) and to the frame count, floored to a multiple of
    `temporal_patch_size`; the indices are `arange(0, total, total / n)` in float32 truncated,
    the last clamped to the last frame. vLLM ignores `num_frames` here, and so do we.
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2

    def __post_init__(self) -> None:
        _check_number("fps", self.fps)
        for name in ("min_frames", "max_frames", "temporal_patch_size"):
            _check_count(name, getattr(self, name), minimum=1)

    def indices(self, source: VideoSource, index: int) -> list[int]:
        """The frame indices to keep, ascending; raises RequestError naming the video."""
        total = source.total_frames
        if source.fps <= 0:
            raise _invalid(index, "its frame rate is unknown (variable or missing); "
                                  "Qwen2-VL's sampling needs one")
        patch = self.temporal_patch_size
        most = math.floor(min(self.max_frames, 768, total) / patch) * patch
        wanted = total / source.fps * min(self.fps, 30)
        count = math.floor(min(max(wanted, self.min_frames), most, total) / patch) * patch
        if count == 0:
            raise _invalid(index, f"it has {total} frame{'s' * (total != 1)}, fewer than "
                                  f"the {patch} of one Qwen2-VL temporal patch")
        return _float32_arange(total, total / count)


@dataclass(frozen=True, kw_only=True)
class UniformSampling:
    """vLLM 0.32's default loader (`opencv`, `VideoBackend`), which every model without a
    loader of its own gets: `num_frames` evenly spaced (`linspace(0, total - 1, n)` truncated),
    or one every `1/fps` seconds where that gives fewer; at least one, at most every frame.
    A value at or below 0 turns its setting off (`num_frames=-1`: all frames)."""

    num_frames: int = 32
    """vLLM's default (`VideoMediaIO`'s)."""
    fps: float = -1.0

    def __post_init__(self) -> None:
        _check_count("num_frames", self.num_frames, minimum=-1)
        _check_number("fps", self.fps)

    def indices(self, source: VideoSource, index: int) -> list[int]:
        """The frame indices to keep, ascending."""
        total = source.total_frames
        count = total
        if self.num_frames > 0:
            count = min(self.num_frames, total)
        if self.fps > 0:
            count = min(count, math.floor(source.duration * self.fps))
        count = max(1, count)
        if count == total:
            return list(range(count))
        return [int(i) for i in np.linspace(0, total - 1, count, dtype=int)]


@dataclass(frozen=True, kw_only=True)
class SmolVLMSampling:
    """transformers' `SmolVLMVideoProcessor.sample_frames` (vLLM 0.32 serves no SmolVLM
    video): `round(fps * duration)` frames, at most `max_frames`, at least one, evenly spaced
    (`linspace` truncated, repeats dropped) over the whole video, or over all but its first and
    last `skip_secs` seconds where the video lasts more than `max_frames * fps` seconds beyond
    them. The model's defaults are its `video_sampling` (SmolVLMVideo)."""

    fps: float
    max_frames: int
    skip_secs: float = 1.0

    def __post_init__(self) -> None:
        _check_number("fps", self.fps)
        _check_count("max_frames", self.max_frames, minimum=1)

    def indices(self, source: VideoSource, index: int) -> list[int]:
        """The frame indices to keep, ascending; raises RequestError naming the video."""
        if source.fps <= 0:
            raise _invalid(index, "its frame rate is unknown (variable or missing); "
                                  "SmolVLM's sampling needs one")
        total, duration = source.total_frames, source.duration
        count = max(1, min(int(round(self.fps * duration)), self.max_frames))
        start, end = 0, total - 1
        if self.skip_secs > 0 and duration - 2 * self.skip_secs > self.max_frames * self.fps:
            start = int(self.skip_secs * source.fps)
            end = int(total - self.skip_secs * source.fps)
        start, end = max(0, start), min(end, total - 1)
        if start >= end:
            start, end = 0, total - 1
        return [int(i) for i in np.unique(np.linspace(start, end, count, dtype=int))]


FrameSampling = Qwen2VLSampling | UniformSampling | SmolVLMSampling


@dataclass(frozen=True, kw_only=True)
class DecodedVideo:
    """A video's kept frames and what the HF video processor needs to know of them."""

    frames: np.ndarray
    """(kept frames, height, width, 3) uint8 RGB, upright."""
    source: VideoSource
    frames_indices: list[int]
    """The index in the video of each kept frame, ascending."""

    def hf_metadata(self) -> dict[str, Any]:
        """The metadata dict vLLM pairs with the frames (`VideoLoader.create_hf_metadata`)."""
        return {
            "total_num_frames": self.source.total_frames,
            "fps": self.source.fps,
            "duration": self.source.duration,
            "video_backend": VIDEO_BACKEND,
            "frames_indices": list(self.frames_indices),
            "do_sample_frames": len(self.frames_indices) == self.source.total_frames,
        }


def decode_video(data: bytes, index: int, sampling: FrameSampling,
                 limits: VideoLimits = DEFAULT_LIMITS) -> DecodedVideo:
    """Decode the frames `sampling` keeps from a video's encoded bytes; raises RequestError
    naming the video (`video {index}: ...`) for anything it cannot or may not decode."""
    if not data:
        raise _invalid(index, "video is empty (0 bytes)")
    if len(data) > limits.max_video_bytes:
        raise _too_large(index, f"encoded video is {len(data)} bytes",
                         f"max_video_bytes {limits.max_video_bytes}")
    deadline = _Deadline(index, limits.max_video_decode_s)
    with _open(data, index, limits) as container:
        stream = _video_stream(container, index)
        _check_header(container, stream, index, limits)
        held, timeline = _scan(container, stream, index, limits, deadline)
        source = _source(container, stream, held, index)
        if source.duration > limits.max_video_duration_s:
            raise _too_large(index, f"it lasts {source.duration:.1f} s ({source.total_frames} "
                                    f"frames at {source.fps:g} fps)",
                             f"max_video_duration_s {limits.max_video_duration_s:g}")
        wanted = sorted(set(sampling.indices(source, index)))  # OpenCV reads each index once
    if len(wanted) > limits.max_video_frames:
        raise _too_large(index, f"the sampling keeps {len(wanted)} frames",
                         f"max_video_frames {limits.max_video_frames}")
    frames = _decode_kept(data, wanted, timeline, index, limits, deadline)
    return DecodedVideo(frames=frames, source=source, frames_indices=wanted)


# ---------------------------------------------------------------- the container


def _open(data: bytes, index: int, limits: VideoLimits) -> av.container.InputContainer:
    # `timeout` arms FFmpeg's interrupt callback: a demuxer stuck on one read gives up.
    with translated(f"video {index}: not a video we can read", default="invalid_video"):
        return av.open(io.BytesIO(data), mode="r", timeout=limits.max_video_decode_s)


def _video_stream(container: av.container.InputContainer,
                  index: int) -> av.video.stream.VideoStream:
    if not container.streams.video:
        kinds = ", ".join(sorted({str(s.type) for s in container.streams})) or "no streams"
        raise _invalid(index, f"the file has no video stream ({kinds})")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # PyAV leaves it None where FFmpeg has no decoder
        raise _invalid(index, "its video codec is unknown (no decoder for it)")
    return stream


def _check_header(container: av.container.InputContainer,
                  stream: av.video.stream.VideoStream, index: int, limits: VideoLimits) -> None:
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise _invalid(index, f"its frames have no size ({width}x{height})")
    if width * height > limits.max_video_frame_pixels:
        raise _too_large(index, f"its frames are {width}x{height}, {width * height} pixels",
                         f"max_video_frame_pixels {limits.max_video_frame_pixels}")
    claimed = max(_seconds(container.duration, Fraction(1, av.time_base)),
                  _seconds(stream.duration, stream.time_base))
    if claimed > limits.max_video_duration_s:
        raise _too_large(index, f"its container claims {claimed:.1f} s",
                         f"max_video_duration_s {limits.max_video_duration_s:g}")


def _scan(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
          index: int, limits: VideoLimits, deadline: _Deadline) -> tuple[int, _Timeline | None]:
    """The video frames the file holds (its packets, read without decoding them) and, where
    their timestamps tell them apart, their timeline; refuses frames whose timestamps run past
    `max_video_duration_s`."""
    held = 0
    times, keyframes = array.array("q"), array.array("q")
    start = stream.start_time or 0
    with translated(f"video {index}: the data is corrupt", default="invalid_video"):
        for packet in container.demux(stream):
            deadline.check("scanning its packets")
            if packet.size == 0 or packet.is_discard:  # the end-of-stream marker; edit lists
                continue
            held += 1
            at = _seconds(None if packet.pts is None else packet.pts - start, stream.time_base)
            if at > limits.max_video_duration_s:
                raise _too_large(index, f"its frames run past {at:.1f} s",
                                 f"max_video_duration_s {limits.max_video_duration_s:g}")
            if packet.pts is not None and held <= _TIMELINE_MAX_FRAMES:
                times.append(packet.pts)
                if packet.is_keyframe:
                    keyframes.append(packet.pts)
    if held == 0:
        raise _invalid(index, "its video stream has no frames")
    return held, _Timeline.of(times, keyframes) if len(times) == held else None


@dataclass(frozen=True)
class _Timeline:
    """Where each frame is: the frames' timestamps in presentation order, one each, and which
    frames are keyframes, where decoding may start."""

    times: np.ndarray
    keyframes: np.ndarray
    """Indices of `times`, ascending."""

    @classmethod
    def of(cls, times: array.array[int], keyframes: array.array[int]) -> _Timeline | None:
        """None where two frames share a timestamp (hidden frames, split fields)."""
        ordered = np.sort(np.frombuffer(times, np.int64))
        if np.any(ordered[1:] == ordered[:-1]):
            return None
        return cls(ordered, np.searchsorted(ordered, np.sort(np.frombuffer(keyframes, np.int64))))

    def frame_at(self, pts: int | None) -> int:
        """The index of the frame with this timestamp; -1 for none."""
        at = int(np.searchsorted(self.times, pts)) if pts is not None else len(self.times)
        return at if at < len(self.times) and self.times[at] == pts else -1

    def keyframe_before(self, frame: int) -> int:
        """The last keyframe at or before this frame (0 where there is none)."""
        before = int(np.searchsorted(self.keyframes, frame, side="right"))
        return int(self.keyframes[before - 1]) if before else 0


def _source(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
            held: int, index: int) -> VideoSource:
    """The frame count and rate OpenCV reports for this stream, as vLLM reads them."""
    rate = stream.guessed_rate  # av_guess_frame_rate: OpenCV's CAP_PROP_FPS
    fps = float(rate) if rate else 0.0
    total = stream.frames
    if total == 0:  # OpenCV: the container's duration (else the stream's) times the rate
        seconds = _seconds(container.duration, Fraction(1, av.time_base)) or _seconds(
            stream.duration, stream.time_base)
        total = math.floor(seconds * fps + 0.5)
    if total <= 0:  # vLLM would sample frame 0 of "0 frames", or divide by zero
        raise _invalid(index, "its container says neither how many frames it holds nor how "
                              "long it lasts")
    if held < total - 1:  # vLLM: an edit list hides frames the header counts
        total = held
    return VideoSource(total_frames=total, fps=fps)


# ---------------------------------------------------------------- decoding


def _decode_kept(data: bytes, wanted: list[int], timeline: _Timeline | None, index: int,
                 limits: VideoLimits, deadline: _Deadline) -> np.ndarray:
    """The wanted frames, upright RGB: seeking past runs of frames with no wanted one where the
    timeline allows it, else decoding every frame up to the last wanted one."""
    if timeline is not None:
        with _open(data, index, limits) as container:
            try:
                return _decode(container, wanted, timeline, index, deadline)
            except _Misplaced:  # a frame is not where the timeline put it
                pass
    with _open(data, index, limits) as container:
        return _decode(container, wanted, None, index, deadline)


class _Misplaced(Exception):
    """A decoded frame's timestamp does not say the index the decoder gave it at."""


def _decode(container: av.container.InputContainer, wanted: list[int],
            timeline: _Timeline | None, index: int, deadline: _Deadline) -> np.ndarray:
    """Decode from the first frame to the last wanted one, converting only the wanted ones. With
    a timeline, each frame's timestamp must say its index (else `_Misplaced`), and the decoder
    seeks to a wanted frame's keyframe where that skips `_SEEK_MIN_FRAMES` frames or more."""
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    frames: np.ndarray | None = None
    decoded = position = 0  # frames the decoder gave; the index of the next one
    settled = True  # False after a seek until the keyframe comes (earlier frames may come first)
    kept = 0
    source = _frames(container, stream, index)
    while kept < len(wanted):
        if timeline is not None:
            keyframe = timeline.keyframe_before(wanted[kept])
            if keyframe - position >= _SEEK_MIN_FRAMES:
                _seek(container, stream, int(timeline.times[keyframe]))
                source, position, settled = _frames(container, stream, index), keyframe, False
        frame = next(source, None)
        if frame is None:
            raise _invalid(index, f"it ends early: the decoder gave {decoded} frames, frame "
                                  f"{wanted[kept]} was to be kept (the file is cut short or "
                                  "corrupt)")
        decoded += 1
        deadline.check(f"decoding frame {position}")
        if timeline is not None:
            at = timeline.frame_at(frame.pts)
            if not settled and 0 <= at < position:  # a picture shown before the keyframe
                continue
            if at != position:
                raise _Misplaced
            settled = True
        if (frame.width, frame.height) != (width, height):
            raise _invalid(index, f"frame {position} is {frame.width}x{frame.height}, "
                                  f"its stream's are {width}x{height}")
        if position == wanted[kept]:
            bgr = _upright_bgr(frame, index)
            if frames is None:  # its shape is known once the first frame says how it turns
                frames = np.empty((len(wanted), *bgr.shape), np.uint8)
            for channel in range(3):  # 3x faster than copying bgr[..., ::-1] at once
                frames[kept, ..., channel] = bgr[..., 2 - channel]
            kept += 1
        position += 1
    assert frames is not None  # wanted is never empty
    return frames


def _seek(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
          pts: int) -> None:
    """Seek to the keyframe at this timestamp; PyAV flushes the decoder."""
    try:
        container.seek(pts, stream=stream)
    except av.FFmpegError as exc:  # the frames the scan found, but a container that cannot seek
        raise _Misplaced from exc


def _frames(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
            index: int) -> Iterator[av.VideoFrame]:
    """The stream's frames in presentation order; FFmpeg's failures become invalid_video."""
    decoded = container.decode(stream)
    while True:
        with translated(f"video {index}: cannot decode the {stream.codec_context.name} data",
                        default="invalid_video"):
            frame = next(decoded, None)
        if frame is None:
            return
        yield frame


def _upright_bgr(frame: av.VideoFrame, index: int) -> np.ndarray:
    """The frame as OpenCV gives it to vLLM before vLLM swaps its channels to RGB: swscale's
    bicubic conversion to BGR (from 10-bit not the same pixels as to RGB), turned upright."""
    with translated(f"video {index}: cannot convert a {frame.format.name} frame to RGB",
                    default="invalid_video"):
        bgr = frame.to_ndarray(format="bgr24", interpolation="BICUBIC")
    turn = _CV_ROTATIONS.get(-round(frame.rotation) % 360)  # OpenCV's rotation_angle
    return bgr if turn is None else np.rot90(bgr, turn)


# ---------------------------------------------------------------- helpers


class _Deadline:
    """`max_video_decode_s` from now; `check` refuses the video once it has passed."""

    def __init__(self, index: int, seconds: float) -> None:
        self.index, self.seconds = index, seconds
        self.ends = time.monotonic() + seconds

    def check(self, doing: str) -> None:
        if time.monotonic() > self.ends:
            raise _too_large(self.index, f"still {doing} after {self.seconds:g} s",
                             f"max_video_decode_s {self.seconds:g}")


def _seconds(value: int | None, time_base: Fraction | None) -> float:
    """A timestamp or duration in seconds; 0 where the container leaves it unknown."""
    if value is None or time_base is None:
        return 0.0
    return float(value * time_base)


def _float32_arange(stop: int, step: float) -> list[int]:
    """`torch.arange(0, stop, step).int()` clamped to `stop - 1`: each value computed in
    float64, rounded to float32, truncated (vLLM's float32 index math, which numpy's float64
    arange differs from by a frame on some inputs)."""
    count = math.ceil(stop / step)
    values = (np.arange(count, dtype=np.float64) * step).astype(np.float32)
    return [min(int(v), stop - 1) for v in values]


def _check_number(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"video sampling: {name} must be a finite number, got {value!r}",
                           code="invalid_request")


def _check_count(name: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"video sampling: {name} must be an integer of at least {minimum}, "
                           f"got {value!r}", code="invalid_request")


def _invalid(index: int, problem: str) -> RequestError:
    return RequestError(f"video {index}: {problem}", code="invalid_video")


def _too_large(index: int, what: str, limit: str) -> RequestError:
    return RequestError(f"video {index}: {what}, more than {limit}", code="video_too_large")
