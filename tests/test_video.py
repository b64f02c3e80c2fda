"""mmlane.mm_worker.video: the frames vLLM 0.32 samples from a video, decoded with PyAV, and
every bound and every kind of hostile file refused with a message naming the video.

The videos are made here, offline, with PyAV's own encoders (MPEG-4 Part 2, H.264 with B-frames,
VP9, MJPEG, 10-bit HEVC; mp4, WebM, Matroska, AVI). Frame i carries its number: two flat bands
on top whose grey levels are its digits, above a texture that moves with i. The hostile files
are made from them: overwritten, cut, with a header patched to claim hours or giant frames.
The indices expected are vLLM's own (tests/test_vllm_video.py computes them with vLLM, and
decodes with it).
"""

from __future__ import annotations

import functools
import io
import struct
from fractions import Fraction
from typing import NamedTuple

import av
import numpy as np
import pytest

from mmlane.mm_worker.video import (
    DecodedVideo,
    Qwen2VLSampling,
    UniformSampling,
    VideoLimits,
    VideoSource,
    decode_video,
)
from mmlane.protocol.errors import RequestError

BAND = 8
"""Rows of each of the two flat bands that say a frame's number."""


def _levels(i: int) -> tuple[int, int]:
    """The grey levels of frame i's two bands: the two base-16 digits of its number modulo
    256, 13 levels apart."""
    return 24 + 13 * (i // 16 % 16), 24 + 13 * (i % 16)


def _number(frame: np.ndarray) -> int:
    """The number a decoded frame's bands say (each band's inner rows, averaged)."""
    high, low = (round((frame[rows].astype(float).mean() - 24) / 13)
                 for rows in (slice(2, BAND - 2), slice(BAND + 2, 2 * BAND - 2)))
    return 16 * high + low


def frame_image(i: int, width: int, height: int) -> np.ndarray:
    """Frame i of every test video: its numbered band above a texture moving with i."""
    yy, xx = np.mgrid[0:height, 0:width]
    image = np.stack([(xx * 3 + i * 7) % 256, (yy * 5 + i * 3) % 256,
                      ((xx + yy) * 2 + i * 11) % 256], axis=-1).astype(np.uint8)
    image[:BAND], image[BAND:2 * BAND] = _levels(i)
    return image


def encode(codec: str, width: int, height: int, frames: int, rate: Fraction | int, *,
           container: str = "mp4", pix_fmt: str = "yuv420p",
           keyframe_every: int | None = None) -> bytes:
    """A video of `frames` frames made by PyAV's encoder `codec` (its keyframe interval by
    default: 12 frames for MPEG-4, 250 for x264)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        # MPEG-4's default quantiser lets a flat band drift by 11 levels: bound it.
        stream = output.add_stream(codec, rate=rate,
                                   options={"qmax": "4"} if codec == "mpeg4" else None)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if keyframe_every is not None:
            stream.codec_context.gop_size = keyframe_every
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_image(i, width, height), format="rgb24")
            output.mux(stream.encode(frame))
        output.mux(stream.encode())
    return buffer.getvalue()


class Video(NamedTuple):
    name: str
    codec: str
    width: int
    height: int
    frames: int
    rate: Fraction
    container: str = "mp4"
    pix_fmt: str = "yuv420p"
    keyframe_every: int | None = None

    @property
    def data(self) -> bytes:
        return _encoded(self)


@functools.cache
def _encoded(video: Video) -> bytes:
    return encode(video.codec, video.width, video.height, video.frames, video.rate,
                  container=video.container, pix_fmt=video.pix_fmt,
                  keyframe_every=video.keyframe_every)


VIDEOS = [
    Video("mpeg4", "mpeg4", 64, 48, 30, Fraction(30)),
    Video("h264", "libx264", 96, 64, 50, Fraction(25)),  # B-frames, an edit list
    Video("vp9-webm", "libvpx-vp9", 80, 48, 30, Fraction(10), "webm"),  # no frame count
    Video("h264-long", "libx264", 160, 90, 240, Fraction(24)),
    Video("h264-ntsc-mkv", "libx264", 64, 36, 45, Fraction(30000, 1001), "matroska"),
    Video("mjpeg-avi", "mjpeg", 64, 64, 15, Fraction(15), "avi", "yuvj422p"),  # full range
    Video("hevc-10bit", "libx265", 96, 54, 24, Fraction(24), "mp4", "yuv420p10le"),
    # Keyframes often enough that sampling seeks past runs of frames:
    Video("h264-gop24", "libx264", 128, 72, 240, Fraction(24), keyframe_every=24),
    Video("vp9-gop10-webm", "libvpx-vp9", 64, 48, 100, Fraction(10), "webm", keyframe_every=10),
]
BY_NAME = {video.name: video for video in VIDEOS}


def reference_frames(data: bytes) -> np.ndarray:
    """Every frame of a video, decoded by PyAV with nothing skipped, converted as OpenCV
    converts (to BGR, bicubic; from 10-bit that is not the same as to RGB)."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([
            frame.to_ndarray(format="bgr24", interpolation="BICUBIC")[..., ::-1]
            for frame in container.decode(container.streams.video[0])])


def assert_numbered(decoded: DecodedVideo) -> None:
    """Each kept frame is the frame of its index: its bands say so."""
    assert [_number(frame) for frame in decoded.frames] == [i % 256 for i in decoded.frames_indices]


# ---------------------------------------------------------------- sampling rules

# vLLM 0.32's indices for these sources and settings (tests/test_vllm_video.py checks the rules
# against vLLM's functions over thousands of sources).
QWEN2VL_CASES = [
    ((30, 30.0), Qwen2VLSampling(), [0, 7, 15, 22]),  # min_frames 4
    ((30, 10.0), Qwen2VLSampling(), [0, 5, 10, 15, 20, 25]),
    ((240, 24.0), Qwen2VLSampling(fps=0.5), [0, 60, 120, 180]),
    ((240, 24.0), Qwen2VLSampling(fps=8, max_frames=6), [0, 40, 80, 120, 160, 200]),
    ((50, 25.0), Qwen2VLSampling(temporal_patch_size=3, min_frames=5), [0, 16, 33]),
    ((45, 30000 / 1001), Qwen2VLSampling(fps=8, max_frames=6), [0, 7, 15, 22, 30, 37]),
    ((3, 30.0), Qwen2VLSampling(), [0, 1]),  # floored to one temporal patch
]
UNIFORM_CASES = [
    ((30, 30.0), UniformSampling(), list(range(30))),  # fewer frames than 32: all
    ((50, 25.0), UniformSampling(num_frames=8), [0, 7, 14, 21, 28, 35, 42, 49]),
    ((240, 24.0), UniformSampling(num_frames=-1, fps=1),
     [0, 26, 53, 79, 106, 132, 159, 185, 212, 239]),
    ((30, 10.0), UniformSampling(num_frames=16, fps=3), [0, 3, 7, 10, 14, 18, 21, 25, 29]),
    ((30, 30.0), UniformSampling(num_frames=-1, fps=1), [0]),
    ((45, 30000 / 1001), UniformSampling(num_frames=-1, fps=1), [0]),  # floor(1.5 s * 1)
]


class TestSampling:
    @pytest.mark.parametrize(("source", "sampling", "expected"), QWEN2VL_CASES + UNIFORM_CASES)
    def test_indices_are_vllms(self, source: tuple[int, float],
                               sampling: Qwen2VLSampling | UniformSampling,
                               expected: list[int]) -> None:
        assert sampling.indices(VideoSource(*source), 0) == expected

    def test_qwen2vl_keeps_vllms_extra_tail_frame(self) -> None:
        # 30 frames wanted, but arange(0, 367, 367 / 30) has 31 values (367 / (367 / 30) is
        # 30.000000000000004): vLLM keeps the 31st, clamped to the last frame, and so do we.
        indices = Qwen2VLSampling().indices(VideoSource(367, 24.0), 0)
        assert len(indices) == 31 and indices[-3:] == [342, 354, 366]

    def test_qwen2vl_refuses_an_unknown_rate_and_a_single_frame(self) -> None:
        with pytest.raises(RequestError, match=r"^video 3: its frame rate is unknown") as info:
            Qwen2VLSampling().indices(VideoSource(100, 0.0), 3)
        assert info.value.code == "invalid_video"
        with pytest.raises(RequestError, match=r"^video 0: it has 1 frame, fewer than the 2"):
            Qwen2VLSampling().indices(VideoSource(1, 30.0), 0)

    @pytest.mark.parametrize(("make", "message"), [
        (lambda: Qwen2VLSampling(fps=float("nan")), "fps must be a finite number, got nan"),
        (lambda: Qwen2VLSampling(temporal_patch_size=0), "temporal_patch_size must be an "
                                                         "integer of at least 1, got 0"),
        (lambda: Qwen2VLSampling(min_frames=True), "min_frames must be an integer"),
        (lambda: UniformSampling(num_frames=-2), "num_frames must be an integer of at least -1"),
        (lambda: UniformSampling(fps="2"), "fps must be a finite number, got '2'"),
    ])
    def test_settings_are_checked(self, make, message: str) -> None:
        with pytest.raises(RequestError, match=f"^video sampling: {message}") as info:
            make()
        assert info.value.code == "invalid_request"

    def test_limits_must_be_positive(self) -> None:
        with pytest.raises(ValueError, match="VideoLimits.max_video_decode_s must be positive"):
            VideoLimits(max_video_decode_s=0)


# ---------------------------------------------------------------- decoding


class TestDecode:
    @pytest.mark.parametrize("video", VIDEOS, ids=lambda video: video.name)
    @pytest.mark.parametrize("sampling", [Qwen2VLSampling(), Qwen2VLSampling(fps=0.5),
                                          UniformSampling(num_frames=8)],
                             ids=["qwen2vl", "qwen2vl-fps0.5", "uniform8"])
    def test_keeps_the_sampled_frames_exactly(self, video: Video,
                                              sampling: Qwen2VLSampling | UniformSampling
                                              ) -> None:
        decoded = decode_video(video.data, 0, sampling)
        source = VideoSource(video.frames, float(video.rate))
        assert decoded.source == source
        assert decoded.frames_indices == sampling.indices(source, 0)
        count = len(decoded.frames_indices)
        assert decoded.frames.shape == (count, video.height, video.width, 3)
        assert decoded.frames.dtype == np.uint8 and decoded.frames.flags.c_contiguous
        assert_numbered(decoded)
        every = reference_frames(video.data)
        assert np.array_equal(decoded.frames, every[decoded.frames_indices])

    def test_a_run_of_frames_with_none_kept_is_not_decoded(self) -> None:
        # Qwen2-VL at 0.5 fps keeps frames 0, 60, 120 and 180 of 240, keyframes every 24: the
        # decoder seeks to 48, 120 and 168, past frames 1-47, 61-119 and 121-167. Frames 72-95
        # overwritten with zeros cannot be decoded, and need not be.
        video = BY_NAME["h264-gop24"]
        damaged = _zeroed_frames(video.data, range(72, 96))
        with pytest.raises(RequestError, match="cannot decode the h264 data"):
            decode_video(damaged, 0, UniformSampling(num_frames=-1, fps=24), VideoLimits(
                max_video_frames=240))  # every frame: the damage is decoded
        decoded = decode_video(damaged, 0, Qwen2VLSampling(fps=0.5))
        assert decoded.frames_indices == [0, 60, 120, 180]
        assert np.array_equal(decoded.frames, reference_frames(video.data)[[0, 60, 120, 180]])

    def test_frames_out_of_their_timestamps_order_are_decoded_in_turn(self) -> None:
        # Every composition offset the same: the timestamps follow the decoding order, not the
        # order the decoder gives the frames in, which is what the indices count (in OpenCV
        # too). Seeking cannot find frames by timestamp there: the frames are decoded in turn.
        video = BY_NAME["h264-gop24"]
        shuffled = timestamps_in_decoding_order(video.data)
        decoded = decode_video(shuffled, 0, Qwen2VLSampling(fps=0.5))
        every = reference_frames(shuffled)
        assert np.array_equal(decoded.frames, every[decoded.frames_indices])
        assert_numbered(decoded)

    def test_metadata_is_vllms(self) -> None:
        decoded = decode_video(BY_NAME["h264"].data, 0, Qwen2VLSampling())
        assert decoded.hf_metadata() == {
            "total_num_frames": 50, "fps": 25.0, "duration": 2.0, "video_backend": "pyav",
            "frames_indices": [0, 12, 25, 37], "do_sample_frames": False,
        }
        every = decode_video(BY_NAME["mpeg4"].data, 0, UniformSampling())
        assert every.hf_metadata()["do_sample_frames"] is True  # vLLM: all frames were kept
        assert every.frames_indices == list(range(30))

    def test_a_file_cut_short_is_the_frames_it_holds_as_for_vllm(self) -> None:
        # Its header says 45 frames (1.5 s); vLLM's OpenCV finds fewer by seeking to the end
        # and samples those, and so do we, counting them. (MPEG-4 here has no B-frames: every
        # frame before the cut decodes.)
        data = encode("mpeg4", 64, 36, 45, Fraction(30000, 1001), container="matroska")
        frames_at = data.index(b"\x1f\x43\xb6\x75")  # the first Cluster
        decoded = decode_video(data[: frames_at + (len(data) - frames_at) // 3], 0,
                               UniformSampling(num_frames=4))
        assert 1 < decoded.source.total_frames < 45 - 1
        assert decoded.frames_indices[-1] == decoded.source.total_frames - 1
        assert_numbered(decoded)

    @pytest.mark.parametrize(("matrix", "quarter_turns"), [
        ((0, 1, -1, 0), -1),  # FFmpeg says -90° (clockwise): OpenCV turns it 90° clockwise
        ((0, -1, 1, 0), 1),
        ((-1, 0, 0, -1), 2),
    ], ids=["cw", "ccw", "180"])
    def test_a_turned_video_comes_upright_as_opencv_turns_it(
            self, matrix: tuple[int, int, int, int], quarter_turns: int) -> None:
        plain = BY_NAME["h264"].data
        decoded = decode_video(with_display_matrix(plain, matrix), 0, UniformSampling())
        upright = decode_video(plain, 0, UniformSampling())
        assert np.array_equal(decoded.frames, np.rot90(upright.frames, quarter_turns, (1, 2)))
        assert decoded.frames.flags.c_contiguous


def timestamps_in_decoding_order(mp4: bytes) -> bytes:
    """The mp4 with each frame's composition offset (its 'ctts' entries) set to the largest."""
    at = mp4.index(b"ctts") + 4 + 4  # version and flags, then the entry count and entries
    (count,) = struct.unpack(">I", mp4[at:at + 4])
    entries = [struct.unpack(">Ii", mp4[at + 4 + 8 * i:at + 12 + 8 * i]) for i in range(count)]
    largest = max(offset for _, offset in entries)
    table = b"".join(struct.pack(">Ii", frames, largest) for frames, _ in entries)
    return mp4[:at + 4] + table + mp4[at + 4 + len(table):]


def _zeroed_frames(data: bytes, frames: range) -> bytes:
    """The video with the packets of these frames (by presentation index) zeroed in place."""
    with av.open(io.BytesIO(data)) as container:
        packets = sorted((packet.pts, packet.pos, packet.size)
                         for packet in container.demux(container.streams.video[0])
                         if packet.size)
    damaged = bytearray(data)
    for _, pos, size in (packets[i] for i in frames):
        damaged[pos:pos + size] = bytes(size)
    return bytes(damaged)


def with_display_matrix(mp4: bytes, matrix: tuple[int, int, int, int]) -> bytes:
    """The mp4 with its track header's matrix's a, b, c, d set to these (in 16.16 fixed
    point), which FFmpeg reads as the display matrix."""
    at = mp4.index(b"tkhd") + 4 + 4 + 8 + 4 + 4 + 4 + 8 + 2 + 2 + 2 + 2  # version 0 fields
    a, b, c, d = matrix
    values = struct.pack(">9i", a << 16, b << 16, 0, c << 16, d << 16, 0, 0, 0, 1 << 30)
    return mp4[:at] + values + mp4[at + 36:]


# ---------------------------------------------------------------- hostile input and bounds


def _patched(data: bytes, old: bytes, new: bytes, *, after: int = 0) -> bytes:
    at = data.index(old, after)
    return data[:at] + new + data[at + len(old):]


def _corrupt_frames() -> bytes:
    """The H.264 mp4 with the second half of its frames' data zeroed."""
    data = BY_NAME["h264"].data
    start, end = data.index(b"mdat") + 4, data.index(b"moov")  # its frames, then its index
    middle = (start + end) // 2
    return data[:middle] + bytes(end - middle) + data[end:]


def _audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as output:
        stream = output.add_stream("aac", rate=16000)
        for i in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                               layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            output.mux(stream.encode(frame))
        output.mux(stream.encode())
    return buffer.getvalue()


def _no_video_frames() -> bytes:
    """A Matroska file with a video stream that holds no frame (beside an audio stream)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as output:
        video = output.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = output.add_stream("libopus", rate=48000)
        for _ in range(5):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.float32), format="flt",
                                               layout="mono")
            frame.sample_rate = 48000
            output.mux(audio.encode(frame))
        output.mux(audio.encode())
    return buffer.getvalue()


def _unknown_codec() -> bytes:
    """The H.264 mp4 with its sample entry renamed ('avc1' -> 'zzzz'): no decoder for it."""
    data = BY_NAME["h264"].data
    return _patched(data, b"avc1", b"zzzz", after=data.index(b"stsd"))


def _giant_frames() -> bytes:
    """Raw video in Matroska whose header says 16000x16000 (FFmpeg accepts the size)."""
    data = encode("rawvideo", 320, 256, 2, 10, container="matroska")
    data = _patched(data, b"\xb0\x82\x01\x40", b"\xb0\x82\x3e\x80")  # PixelWidth 320 -> 16000
    return _patched(data, b"\xba\x82\x01\x00", b"\xba\x82\x3e\x80")  # PixelHeight 256 -> 16000


def _claims_hours() -> bytes:
    """The WebM video with its header's Duration (milliseconds, a float) set to 100 hours."""
    data = BY_NAME["vp9-webm"].data
    at = data.index(b"\x44\x89")  # the Duration element: ID, size, then the float
    size = data[at + 2] & 0x0F
    value = struct.pack(">d" if size == 8 else ">f", 100 * 3600 * 1000.0)
    return data[:at + 3] + value + data[at + 3 + size:]


def _frames_run_for_days() -> bytes:
    """The H.264 mp4 with every frame lasting an hour in its time-to-sample table and its edit
    list as long, while its headers still say about 2 s."""
    data = BY_NAME["h264"].data
    at = data.index(b"stts") + 4 + 8  # version and flags, entry count, then (count, delta)
    count, _ = struct.unpack(">II", data[at:at + 8])
    data = data[:at] + struct.pack(">II", count, 12800 * 3600) + data[at + 8:]
    at = data.index(b"elst") + 4 + 8  # version and flags, entry count, then its duration
    return data[:at] + struct.pack(">I", 2**31 - 1) + data[at + 4:]


def _jpeg() -> bytes:
    buffer = io.BytesIO()
    av.VideoFrame.from_ndarray(frame_image(0, 32, 32)).to_image().save(buffer, "JPEG")
    return buffer.getvalue()


def _corrupt_header() -> bytes:
    data = BY_NAME["mpeg4"].data
    return data[:32] + bytes(range(256)) * 4 + data[32 + 1024:]


HOSTILE = [
    ("empty", lambda: b"", "invalid_video", r"video is empty \(0 bytes\)"),
    ("random bytes", lambda: np.random.default_rng(0).bytes(5000), "invalid_video",
     r"not a video we can read"),
    ("a text file", lambda: b"hello, world\n" * 100, "invalid_video", r"not a video we can read"),
    ("an image", _jpeg, "invalid_video",
     r"its container says neither how many frames it holds nor how long it lasts"),
    ("corrupt header", _corrupt_header, "invalid_video", r"not a video we can read"),
    ("corrupt frames", _corrupt_frames, "invalid_video",
     r"cannot decode the h264 data: \[Errno \d+\] Invalid data found"),
    ("index cut off", lambda: BY_NAME["h264"].data[:-200], "invalid_video",
     r"not a video we can read"),
    ("audio only", _audio_only, "invalid_video", r"the file has no video stream \(audio\)"),
    ("no video frames", _no_video_frames, "invalid_video", r"its video stream has no frames"),
    ("unknown codec", _unknown_codec, "invalid_video", r"its video codec is unknown"),
    ("giant frames", _giant_frames, "video_too_large",
     r"its frames are 16000x16000, 256000000 pixels, more than max_video_frame_pixels 2073600"),
    ("claims hours", _claims_hours, "video_too_large",
     r"its container claims 360000\.0 s, more than max_video_duration_s 600"),
    ("frames run for days", _frames_run_for_days, "video_too_large",
     r"its frames run past 3600\.\d s, more than max_video_duration_s 600"),
]


class TestRefusals:
    @pytest.mark.parametrize(("make", "code", "message"), [case[1:] for case in HOSTILE],
                             ids=[case[0] for case in HOSTILE])
    def test_hostile_input_is_refused_by_name(self, make, code: str, message: str) -> None:
        with pytest.raises(RequestError, match=rf"^video 2: .*{message}") as info:
            decode_video(make(), 2, Qwen2VLSampling())
        assert info.value.code == code

    @pytest.mark.parametrize(("limits", "message"), [
        (VideoLimits(max_video_bytes=1000),
         r"encoded video is \d+ bytes, more than max_video_bytes 1000"),
        (VideoLimits(max_video_duration_s=1.5),
         r"its container claims 2\.0 s, more than max_video_duration_s 1\.5"),
        (VideoLimits(max_video_frames=3),
         r"the sampling keeps 4 frames, more than max_video_frames 3"),
        (VideoLimits(max_video_frame_pixels=96 * 64 - 1),
         r"its frames are 96x64, 6144 pixels, more than max_video_frame_pixels 6143"),
        (VideoLimits(max_video_decode_s=1e-9),
         r"still scanning its packets after 1e-09 s, more than max_video_decode_s 1e-09"),
    ], ids=["bytes", "duration", "frames", "pixels", "time"])
    def test_every_bound_is_refused_naming_its_limit(self, limits: VideoLimits,
                                                     message: str) -> None:
        with pytest.raises(RequestError, match=rf"^video 1: {message}$") as info:
            decode_video(BY_NAME["h264"].data, 1, Qwen2VLSampling(), limits)
        assert info.value.code == "video_too_large"

    def test_a_video_just_within_every_bound_decodes(self) -> None:
        data = BY_NAME["h264"].data
        limits = VideoLimits(max_video_bytes=len(data), max_video_duration_s=2.0,
                             max_video_frames=4, max_video_frame_pixels=96 * 64)
        assert len(decode_video(data, 0, Qwen2VLSampling(), limits).frames) == 4

    def test_the_next_video_decodes_after_each_refusal(self) -> None:
        good = BY_NAME["h264-long"]
        for _, make, _, _ in HOSTILE:
            with pytest.raises(RequestError):
                decode_video(make(), 0, Qwen2VLSampling())
            decoded = decode_video(good.data, 1, Qwen2VLSampling(fps=0.5))
            assert decoded.frames_indices == [0, 60, 120, 180]
            assert_numbered(decoded)
