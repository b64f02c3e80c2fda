"""Video served end to end on the hf backend: the job's render and its cache (in process), the HF
runner against transformers' own `generate`, and real MM worker and frontend processes (a video
lane that holds no image back, on its own thread or in the worker's process pool; hostile videos
over the socket, a pool process killed on a video; the HTTP API's video parts).

The videos are made here with PyAV (tests/test_video.py's encoders); the engine is the test's
stand-in where the roles run as processes (tests/peers.py), the real HF runner in process.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import functools
import io
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import msgspec
import numpy as np
import openai
import pytest
import torch
import zmq
from test_http import _answered
from test_mm_worker import RECV_TIMEOUT_S, Peers, start_worker
from test_video import BY_NAME, HOSTILE, frame_image
from test_video_render import as_transformers_writes

from bench.images import jpeg_uri
from conftest import (
    DEVICE,
    as_processor_output,
    free_port,
    pool_pids,
    role_log,
    start_role,
    stop_role,
)
from mmlane.common.feature_cache import new_epoch
from mmlane.engine.config import HFConfig
from mmlane.engine.hf.runner import HFRunner
from mmlane.engine.validation import validate_request
from mmlane.launcher import Child, stop_all
from mmlane.mm_worker.cache import ImageHasher, SenderCache
from mmlane.mm_worker.jobs import JobRenderer, VideoRendering, video_sampling
from mmlane.mm_worker.media import MediaPolicy
from mmlane.mm_worker.video import Qwen2VLSampling, SmolVLMSampling, UniformSampling
from mmlane.model import Preprocessor, load_model, load_preprocessor
from mmlane.model.video import VideoPreprocessor, load_video_preprocessor
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import (
    EngineOutput,
    EngineRequest,
    ImageUrl,
    MMJob,
    SamplingParams,
    Stats,
    VideoSampling,
)
from peers import StandInEngine, wait_for_stats, wait_until

CLIP = BY_NAME["h264"]  # 96x64, 50 frames at 25 fps: 2 s
REPLACED_WITHIN_S = 120.0
"""How long a killed pool's new processes may take to serve (each loads torch and the model's
processors)."""
HOSTILE_BY_NAME = {name: make for name, make, _, _ in HOSTILE}


def video_uri(data: bytes) -> str:
    return f"data:video/mp4;base64,{base64.b64encode(data).decode()}"


@functools.cache
def slow_video() -> bytes:
    """A video that takes seconds to decode: 6000 frames of 640x360 H.264 (200 s at 30 fps)
    in one run from its one keyframe, so every frame up to the last kept one is decoded."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as output:
        stream = output.add_stream("libx264", rate=30, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 640, 360, "yuv420p"
        stream.codec_context.gop_size = 6000
        frames = [av.VideoFrame.from_ndarray(frame_image(i, 640, 360), format="rgb24")
                  for i in range(2)]
        for i in range(6000):
            output.mux(stream.encode(frames[i % 2]))
        output.mux(stream.encode())
    return buffer.getvalue()


def prompt_ids(pre: Preprocessor, *kinds: str, text: str = "What happens?") -> list[int]:
    """A user turn's ids with a placeholder per kind ('image', 'video'), in that order."""
    content: list[dict[str, Any]] = [{"type": kind} for kind in kinds]
    content.append({"type": "text", "text": text})
    [ids] = pre.tokenize_batch([pre.render_prompt([{"role": "user", "content": content}])])
    return list(ids)


# ---------------------------------------------------------------- rendering and the cache


class Rendering:
    """A JobRenderer for videos, in this process, with its sender cache in use (only `sent`
    commits to it: fps=1 stands for the videos sent)."""

    def __init__(self, model_dir: Path) -> None:
        self.pre = load_preprocessor(model_dir)
        self.video = load_video_preprocessor(model_dir, self.pre)
        self.cache = SenderCache("test", 1 << 30)
        self.cache.see_engine_epoch(new_epoch())
        media = MediaPolicy(allowed_media_dir=None, max_image_bytes=1 << 26,
                            max_image_pixels=1 << 26)
        settings = {type(self.video).__name__: self.video.hashed_settings()}
        self.renderer = JobRenderer(
            self.pre, media, self.cache, ImageHasher("blake3", self.pre.model_id, {}),
            video=VideoRendering(self.video, ImageHasher("blake3", self.pre.model_id, settings)))

    def job(self, *kinds: str, video: bytes = CLIP.data, fps: float | None = None,
            num_frames: int | None = None, max_tokens: int = 8) -> MMJob:
        return MMJob(
            request_id="r", reply_to="", prompt_token_ids=prompt_ids(self.pre, *kinds),
            images=[ImageUrl(url=jpeg_uri(64, 48)) for kind in kinds if kind == "image"],
            videos=[ImageUrl(url=video_uri(video)) for kind in kinds if kind == "video"],
            sampling=SamplingParams(max_tokens=max_tokens),
            video_sampling=VideoSampling(fps=fps, num_frames=num_frames),
        )

    def sent(self, job: MMJob) -> EngineRequest:
        """The job's request, committed to the sender cache as the worker commits it."""
        request = self.renderer.render(job)
        self.cache.commit(request)
        return request

    def decodes(self) -> int:
        return self.renderer.metrics.histograms["video_decode"].count


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def rendering(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Rendering:
    return Rendering(model_dirs[request.param])


def test_a_video_is_placed_in_prompt_order_with_its_tokens(rendering: Rendering) -> None:
    request = rendering.renderer.render(rendering.job("video", "image", fps=4))
    video, image = request.mm_items
    assert video.offset < image.offset
    assert set(video.tensors) == set(rendering.video.item_fields)
    grid = video.tensors["video_grid_thw"]
    assert grid.tolist() == [[4, 4, 6]]  # 8 frames at 4 fps; 96x64 resized to 84x56: 6x4 patches
    tokens = request.prompt_token_ids[video.offset:video.offset + video.length]
    assert tokens == [rendering.video.video_token_id] * (4 * 4 * 6 // 4) == \
        [rendering.video.video_token_id] * video.length
    if rendering.video.timed:  # 2 frames a temporal patch, 4 kept a second: half a second
        assert video.tensors["second_per_grid_ts"].tolist() == [0.5]


def test_a_repeated_video_is_sent_as_its_hash_and_not_decoded_again(
    rendering: Rendering,
) -> None:
    first = rendering.sent(rendering.job("video", fps=1))
    decodes = rendering.decodes()
    again = rendering.sent(rendering.job("video", fps=1))
    assert rendering.decodes() == decodes
    assert again.mm_items[0].tensors == {}
    assert again.mm_items[0].mm_hash == first.mm_items[0].mm_hash
    assert again.prompt_token_ids == first.prompt_token_ids


def test_a_video_hash_covers_its_bytes_sampling_and_processor(rendering: Rendering) -> None:
    def hash_of(job: MMJob, renderer: JobRenderer = rendering.renderer) -> str:
        return renderer.start(job).hashes[-1]

    base = hash_of(rendering.job("video", fps=1))
    assert hash_of(rendering.job("video", fps=1)) == base
    assert hash_of(rendering.job("video", fps=2)) != base
    assert hash_of(rendering.job("video", fps=1, video=BY_NAME["mpeg4"].data)) != base
    other_settings = VideoRendering(rendering.video, ImageHasher(
        "blake3", rendering.pre.model_id, {"video": "other settings"}))
    renderer = JobRenderer(rendering.pre, rendering.renderer.media, rendering.cache,
                           rendering.renderer.hasher, video=other_settings)
    assert hash_of(rendering.job("video", fps=1), renderer) != base


@pytest.fixture(scope="module")
def video_processing(model_dirs: dict[str, Path]) -> dict[str, VideoPreprocessor]:
    """The video processing of the tiny Qwen2-VL, LLaVA-OneVision, InternVL and SmolVLM."""
    return {family: load_video_preprocessor(model_dirs[family],
                                            load_preprocessor(model_dirs[family]))
            for family in ("qwen2_vl", "llava_onevision", "internvl", "smolvlm")}


@pytest.mark.parametrize(("family", "asked", "message"), [
    ("qwen2_vl", VideoSampling(fps=0.0), r"^mm_processor_kwargs\.fps: must be above 0, got 0$"),
    ("qwen2_vl", VideoSampling(num_frames=1),
     r"^mm_processor_kwargs\.num_frames: must be 2 \(one temporal patch\) to 256 "),
    ("qwen2_vl", VideoSampling(num_frames=257), r"\(max_video_frames\), got 257$"),
    ("llava_onevision", VideoSampling(num_frames=0),
     r"^mm_processor_kwargs\.num_frames: must be 1 to 256 \(max_video_frames\), got 0$"),
])
def test_a_requests_sampling_is_bounded_by_the_servers(
    video_processing: dict[str, VideoPreprocessor], family: str, asked: VideoSampling,
    message: str,
) -> None:
    with pytest.raises(RequestError, match=message):
        video_sampling(asked, 256, video_processing[family])


def test_a_requests_sampling_sets_the_rate_and_caps_the_frames(
    video_processing: dict[str, VideoPreprocessor],
) -> None:
    qwen = video_processing["qwen2_vl"]
    assert video_sampling(VideoSampling(), 256, qwen) == Qwen2VLSampling()
    assert video_sampling(VideoSampling(fps=4, num_frames=6), 256, qwen) == \
        Qwen2VLSampling(fps=4, max_frames=6)
    # vLLM's default loader (LLaVA-OneVision's and InternVL's): 32 frames evenly spaced, fewer
    # where a rate keeps fewer.
    for family in ("llava_onevision", "internvl"):
        default = video_processing[family]
        assert video_sampling(VideoSampling(), 256, default) == UniformSampling(num_frames=32)
        assert video_sampling(VideoSampling(fps=1), 256, default) == \
            UniformSampling(num_frames=32, fps=1)
        assert video_sampling(VideoSampling(num_frames=8), 256, default) == \
            UniformSampling(num_frames=8)
    # SmolVLM's own (transformers'): the model's video_sampling by default, its most frames
    # within the server's.
    smolvlm = video_processing["smolvlm"]
    assert video_sampling(VideoSampling(), 256, smolvlm) == SmolVLMSampling(fps=1, max_frames=64)
    assert video_sampling(VideoSampling(), 16, smolvlm) == SmolVLMSampling(fps=1, max_frames=16)
    assert video_sampling(VideoSampling(fps=2, num_frames=6), 256, smolvlm) == \
        SmolVLMSampling(fps=2, max_frames=6)


# ---------------------------------------------------------------- the HF runner


def generate_greedy(model: Any, pre: Preprocessor, video: VideoPreprocessor,
                    request: EngineRequest) -> list[int]:
    """transformers' own `generate` on the request's ids (as the processor writes them) and
    float tensors (the processor's output: the uint8 pixels normalised as the processor
    normalises them, a video's as the model takes one; each name's items joined in prompt
    order, so that InternVL's frames and image tiles are one `pixel_values`, as there)."""
    ids = torch.tensor([as_transformers_writes(request.prompt_token_ids, pre, video)],
                       device=model.device)
    joined: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    for item in request.mm_items:
        if item.is_video:
            arrays = dict(item.tensors)
            arrays.pop("frame_seconds", None)  # SmolVLM's timestamps: its prompt's, not the model's
            pixels = as_processor_output({"pixel_values": arrays.pop("pixel_values_videos")},
                                         video.pixel_norm)["pixel_values"]
            tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
            tensors[video.model_features[1]] = video.model_pixels(torch.from_numpy(pixels))
        else:
            tensors = {name: torch.from_numpy(array) for name, array
                       in as_processor_output(item.tensors, pre.pixel_norm).items()}
        for name, tensor in tensors.items():
            joined[name].append(tensor)
    inputs = {name: torch.cat(tensors).to(model.device) for name, tensors in joined.items()}
    if pre.family.name == "qwen2_vl":  # get_rope_index's token types: text 0, image 1, video 2
        inputs["mm_token_type_ids"] = ((ids == pre.image_token_id).int()
                                       + 2 * (ids == video.video_token_id).int())
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=request.sampling.max_tokens, **inputs)
    return list(out[0, ids.shape[1]:].tolist())


def run_alone(runner: HFRunner, request: EngineRequest) -> list[int]:
    validate_request(request, runner.spec)
    runner.add(0, request)
    tokens: list[int] = []
    while runner.has_work():
        for output in runner.step():
            assert output.error is None, output.error
            tokens += output.token_ids
    return tokens


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> Iterator[dict[str, tuple[HFRunner, Any]]]:
    """An HF runner and transformers' own model, by model id, loaded when first asked for."""
    loaded: dict[str, tuple[HFRunner, Any]] = {}
    yield loaded
    for runner, _ in loaded.values():
        runner.close()


def _reference(rendering: Rendering, model_dirs: dict[str, Path],
               references: dict[str, tuple[HFRunner, Any]]) -> tuple[HFRunner, Any]:
    model_id = rendering.pre.model_id
    if model_id not in references:
        model_dir = next(path for path in model_dirs.values() if path.name == model_id)
        references[model_id] = (HFRunner.load(str(model_dir), HFConfig(device=DEVICE)),
                                load_model(model_dir, DEVICE))
    return references[model_id]


@pytest.mark.parametrize("kinds", [("video",), ("video", "image")], ids=["video", "mixed"])
def test_greedy_video_output_equals_hf_generate(
    rendering: Rendering, model_dirs: dict[str, Path],
    references: dict[str, tuple[HFRunner, Any]], kinds: tuple[str, ...],
) -> None:
    """Qwen2-VL's video grid through the vision tower, and Qwen2.5-VL's seconds per grid step
    (half a second here, at 4 fps) in its rotary positions: the tokens transformers makes."""
    runner, model = _reference(rendering, model_dirs, references)
    request = rendering.renderer.render(rendering.job(*kinds, fps=4, max_tokens=12))
    assert run_alone(runner, request) == generate_greedy(model, rendering.pre, rendering.video,
                                                         request)


@pytest.mark.parametrize("kinds", [("video",), ("image", "video")], ids=["video", "mixed"])
def test_greedy_onevision_video_output_equals_hf_generate(
    model_dirs: dict[str, Path], references: dict[str, tuple[HFRunner, Any]],
    kinds: tuple[str, ...],
) -> None:
    """LLaVA-OneVision's frames through the vision tower, pooled 2x2 and closed by the
    image_newline, in place of its video tokens (beside an image's anyres tiles): the tokens
    transformers makes."""
    onevision = Rendering(model_dirs["llava_onevision"])
    runner, model = _reference(onevision, model_dirs, references)
    request = onevision.renderer.render(onevision.job(*kinds, num_frames=4, max_tokens=12))
    video = next(item for item in request.mm_items if item.is_video)
    assert video.tensors["pixel_values_videos"].shape == (4, 3, 384, 384)
    assert video.length == 4 * 196 + 1
    assert run_alone(runner, request) == generate_greedy(model, onevision.pre, onevision.video,
                                                         request)


def test_two_onevision_videos_side_by_side_are_taken(
    model_dirs: dict[str, Path], references: dict[str, tuple[HFRunner, Any]],
) -> None:
    """The template puts a message's videos side by side. LLaVA-OneVision's features go where
    each video's span is, so two touching videos are taken (Qwen2-VL's are refused: its M-RoPE
    would read them as one)."""
    onevision = Rendering(model_dirs["llava_onevision"])
    runner, _ = _reference(onevision, model_dirs, references)
    request = onevision.renderer.render(onevision.job("video", "video", num_frames=2))
    first, second = request.mm_items
    assert second.offset == first.offset + first.length
    assert second.tensors == {}  # the same video again: sent as its hash, filled in as P1 would
    validate_request(msgspec.structs.replace(request, mm_items=[
        first, msgspec.structs.replace(second, tensors=first.tensors)]), runner.spec)


@pytest.mark.parametrize("kinds", [("video",), ("image", "video"), ("video", "video")],
                         ids=["video", "mixed", "two videos"])
def test_greedy_internvl_video_output_equals_hf_generate(
    model_dirs: dict[str, Path], references: dict[str, tuple[HFRunner, Any]],
    kinds: tuple[str, ...],
) -> None:
    """InternVL's frames, each an image of one tile through get_image_features, in place of
    the video tokens of their "FrameN: <img>...</img>" spans (beside an image's tiles, or
    another video's frames): the tokens transformers makes, where the processor puts all of
    them in one pixel_values with <IMG_CONTEXT> at every feature."""
    internvl = Rendering(model_dirs["internvl"])
    runner, model = _reference(internvl, model_dirs, references)
    request = as_held(internvl.renderer.render(internvl.job(*kinds, num_frames=3,
                                                           max_tokens=12)))
    videos = [item for item in request.mm_items if item.is_video]
    assert videos[0].tensors["pixel_values_videos"].shape == (3, 3, 448, 448)
    assert videos[0].length == internvl.video.count_tokens(3, 448, 448) > 3 * 256
    assert run_alone(runner, request) == generate_greedy(model, internvl.pre, internvl.video,
                                                         request)


@pytest.mark.parametrize("kinds", [("video",), ("video", "video")], ids=["video", "two videos"])
def test_greedy_smolvlm_video_output_equals_hf_generate(
    model_dirs: dict[str, Path], references: dict[str, tuple[HFRunner, Any]],
    kinds: tuple[str, ...],
) -> None:
    """SmolVLM's frames, each an image of one tile through get_image_features, in place of the
    image tokens of their spans, each after its timestamp, the words SmolVLMProcessor writes
    around them tokenized with the chat's text: the tokens transformers makes (its processor
    takes a chat's images or its videos, not both)."""
    smolvlm = Rendering(model_dirs["smolvlm"])
    runner, model = _reference(smolvlm, model_dirs, references)
    request = as_held(smolvlm.renderer.render(smolvlm.job(*kinds, fps=2, max_tokens=12)))
    videos = [item for item in request.mm_items if item.is_video]
    assert videos[0].tensors["pixel_values_videos"].shape == (4, 3, 512, 512)
    assert videos[0].tensors["frame_seconds"].tolist() == [0, 0, 1, 1]
    assert videos[0].length > 4 * 67  # the frames, and the 3 timestamps between them
    assert run_alone(runner, request) == generate_greedy(model, smolvlm.pre, smolvlm.video,
                                                         request)


def as_held(request: EngineRequest) -> EngineRequest:
    """The request with each item sent as its hash alone (the same video again) given the
    tensors of the item before it with that hash, as the engine's P1 fills it in."""
    held: dict[str, dict[str, np.ndarray]] = {}
    items = []
    for item in request.mm_items:
        items.append(msgspec.structs.replace(item, tensors=item.tensors or held[item.mm_hash]))
        held[item.mm_hash] = items[-1].tensors
    return msgspec.structs.replace(request, mm_items=items)


def _tensors(change: Any) -> Any:
    """A request change: the first item's tensors changed by `change(tensors)` (in a copy)."""
    def changed(request: EngineRequest) -> EngineRequest:
        item, *rest = request.mm_items
        tensors = dict(item.tensors)
        change(tensors)
        return msgspec.structs.replace(
            request, mm_items=[msgspec.structs.replace(item, tensors=tensors), *rest])
    return changed


BAD_VIDEOS = {
    "rows short": (_tensors(lambda t: t.update(pixel_values_videos=t["pixel_values_videos"][:-4])),
                   r"^mm_items\[0\]\.pixel_values_videos is uint8 \(92, 1176\), grid \(4, 4, 6\) "
                   r"needs uint8 \(96, 1176\)$"),
    "float pixels": (_tensors(lambda t: t.update(
        pixel_values_videos=t["pixel_values_videos"].astype("f4"))), r"is float32 \(96, 1176\)"),
    "grid not mergeable": (_tensors(lambda t: t.update(
        video_grid_thw=np.array([[4, 3, 8]], "i8"))), r"h and w must be multiples of 2, got 3x8"),
    "a tensor missing": (_tensors(lambda t: t.pop("video_grid_thw")),
                         r"^mm_items\[0\]\.tensors has \['pixel_values_videos'.*needs"),
    "span short": (lambda r: msgspec.structs.replace(r, mm_items=[msgspec.structs.replace(
        r.mm_items[0], length=r.mm_items[0].length - 1)]),
        r"^mm_items\[0\]\.length is 23 but its tensors make 24 tokens$"),
}


@pytest.mark.parametrize("name", list(BAD_VIDEOS))
def test_the_engine_refuses_a_malformed_video_item_by_name(
    rendering: Rendering, model_dirs: dict[str, Path],
    references: dict[str, tuple[HFRunner, Any]], name: str,
) -> None:
    runner, _ = _reference(rendering, model_dirs, references)
    change, message = BAD_VIDEOS[name]
    request = change(rendering.renderer.render(rendering.job("video", fps=4)))
    with pytest.raises(RequestError, match=message):
        validate_request(request, runner.spec)
    without_video = dataclasses.replace(runner.spec, video=None)
    with pytest.raises(RequestError, match=r"^mm_items\[0\] is a video; this engine"):
        validate_request(rendering.renderer.render(rendering.job("video")), without_video)


BAD_SMOLVLM_VIDEOS = {
    "seconds descending": (lambda t: t.update(frame_seconds=np.array([1, 0], "i8")),
                           r"^mm_items\[0\]\.frame_seconds is int64 \(2,\), needs int64 \(2,\)"),
    "seconds not int64": (lambda t: t.update(frame_seconds=t["frame_seconds"].astype("f8")),
                          r"^mm_items\[0\]\.frame_seconds is float64 \(2,\)"),
    "frames not the tile": (lambda t: t.update(
        pixel_values_videos=t["pixel_values_videos"][:, :, :256]),
        r"^mm_items\[0\]\.pixel_values_videos is uint8 \(2, 3, 256, 512\), the model takes "
        r"uint8 \(frames, 3, 512, 512\)"),
    # Another timestamp than the span's ("01:15" for "00:01"): another span, one token shorter.
    "seconds not the span's": (lambda t: t.update(frame_seconds=np.array([0, 75], "i8")),
                               r"^mm_items\[0\]\.length is 145 but its tensors make 144 "
                               r"tokens$"),
}


@pytest.mark.parametrize("name", list(BAD_SMOLVLM_VIDEOS))
def test_the_engine_refuses_a_malformed_smolvlm_video_item_by_name(
    model_dirs: dict[str, Path], references: dict[str, tuple[HFRunner, Any]], name: str,
) -> None:
    """SmolVLM's frames must be its tile; its `frame_seconds` (from which the engine rebuilds
    the span's timestamps) one int64 a frame, ascending, and the span's."""
    smolvlm = Rendering(model_dirs["smolvlm"])
    runner, _ = _reference(smolvlm, model_dirs, references)
    change, message = BAD_SMOLVLM_VIDEOS[name]
    request = smolvlm.renderer.render(smolvlm.job("video"))
    validate_request(request, runner.spec)
    with pytest.raises(RequestError, match=message):
        validate_request(_tensors(change)(request), runner.spec)


# ---------------------------------------------------------------- the MM worker's lanes


@pytest.fixture(scope="module")
def video_peers(module_run_dir: Path) -> Iterator[Peers]:
    peers = Peers(module_run_dir)
    yield peers
    peers.close()


@pytest.fixture(scope="module")
def media_dir(module_run_dir: Path) -> Path:
    folder = module_run_dir / "media"
    folder.mkdir()
    return folder


@pytest.fixture(scope="module")
def thread_video_worker(module_run_dir: Path, qwen_dir: Path, media_dir: Path,
                        video_peers: Peers) -> Iterator[Child]:
    """No pool: its video lane's two threads (the default) decode and process."""
    worker = start_worker("mm-worker", module_run_dir, qwen_dir, video_peers.engine_endpoint,
                          "--allowed-media-dir", str(media_dir), "--mm-processes", "1",
                          "--stats-interval", "0.1")
    yield worker
    assert stop_role(worker) == 0, role_log(worker)


@pytest.fixture(scope="module")
def pool_video_worker(module_run_dir: Path, qwen_dir: Path, media_dir: Path,
                      video_peers: Peers) -> Iterator[Child]:
    """Three pool processes, two of which may hold a video at once."""
    worker = start_worker("pool-mm-worker", module_run_dir, qwen_dir,
                          video_peers.engine_endpoint, "--allowed-media-dir", str(media_dir),
                          "--mm-processes", "3", "--video-processes", "2")
    yield worker
    assert stop_role(worker) == 0, role_log(worker)


@pytest.fixture(scope="module", params=["lane thread", "pool"])
def video_worker(request: pytest.FixtureRequest) -> Child:
    """Each of the two ways a worker decodes videos."""
    name = "thread_video_worker" if request.param == "lane thread" else "pool_video_worker"
    worker: Child = request.getfixturevalue(name)
    return worker


def worker_job(pre: Preprocessor, request_id: str, reply_to: str, *, images: list[str] = (),
               videos: list[str] = (), fps: float | None = None) -> MMJob:
    kinds = ["image"] * len(images) + ["video"] * len(videos)
    return MMJob(request_id=request_id, reply_to=reply_to, prompt_token_ids=prompt_ids(pre, *kinds),
                 images=[ImageUrl(url=url) for url in images],
                 videos=[ImageUrl(url=url) for url in videos],
                 sampling=SamplingParams(max_tokens=4), video_sampling=VideoSampling(fps=fps))


def test_an_image_sent_after_a_slow_video_is_not_held_behind_it(
    video_worker: Child, video_peers: Peers, prep: Preprocessor, media_dir: Path,
) -> None:
    """A video that takes seconds to decode, then an image job: the image's request reaches the
    engine first (in one FIFO it would wait for the video)."""
    (media_dir / "slow.mp4").write_bytes(slow_video())
    slow = worker_job(prep, "slow-video", video_peers.reply_to,
                      videos=[(media_dir / "slow.mp4").as_uri()], fps=0.1)
    image = worker_job(prep, "image-after", video_peers.reply_to, images=[jpeg_uri(64, 48)])
    video_peers.send(video_worker, slow)
    time.sleep(0.2)  # the video lane has taken it (its decoding takes seconds)
    video_peers.send(video_worker, image)
    first, _ = video_peers.next_request()
    second, _ = video_peers.next_request()
    assert [first.request_id, second.request_id] == ["image-after", "slow-video"]
    assert second.mm_items[0].tensors["video_grid_thw"][0, 0] == 10  # 20 frames of 200 s


def test_without_a_pool_two_videos_decode_at_once_and_leave_in_arrival_order(
    thread_video_worker: Child, video_peers: Peers, prep: Preprocessor, media_dir: Path,
    module_run_dir: Path,
) -> None:
    """No pool: a slow video, then a short one. The short one is decoded on the lane's second
    thread while the slow one decodes (the worker's stats count its decode while nothing has
    reached the engine), yet it leaves after the slow one."""
    (media_dir / "slow-2.mp4").write_bytes(slow_video())
    pid = thread_video_worker.process.pid
    decoded = video_decodes(module_run_dir, pid)
    slow = worker_job(prep, "slow", video_peers.reply_to,
                      videos=[(media_dir / "slow-2.mp4").as_uri()], fps=0.11)  # not yet cached
    short = worker_job(prep, "short", video_peers.reply_to, videos=[video_uri(CLIP.data)],
                       fps=1.25)
    video_peers.send(thread_video_worker, slow, short)
    wait_for_stats(module_run_dir, lambda stats: stats.pid == pid and video_decodes_in(stats)
                   == decoded + 1, "the short video decoded")
    video_peers.assert_quiet()  # the slow one still decodes; the short one waits behind it
    arrived = [video_peers.next_request()[0].request_id for _ in range(2)]
    assert arrived == ["slow", "short"]


def video_decodes(run_dir: Path, pid: int) -> int:
    """The videos worker `pid` has decoded, as its stats say now."""
    return video_decodes_in(wait_for_stats(run_dir, lambda stats: stats.pid == pid,
                                           "the worker's stats"))


def video_decodes_in(stats: Stats) -> int:
    histogram = stats.histograms.get("video_decode")
    return 0 if histogram is None else sum(histogram.counts)


def test_pool_videos_leave_in_arrival_order_and_hold_no_image_behind_them(
    pool_video_worker: Child, video_peers: Peers, prep: Preprocessor, media_dir: Path,
    qwen_dir: Path,
) -> None:
    """Slow, fast, slow, slow videos, then an image, to a pool of three of which two may hold a
    video: the fast one is done while the first is decoding, yet leaves after it; the image
    takes the third process while the two hold videos (were every process free for videos,
    all three would hold one, and the image would wait seconds for them)."""
    (media_dir / "slow.mp4").write_bytes(slow_video())
    slow = (media_dir / "slow.mp4").as_uri()
    videos = [worker_job(prep, f"video-{i}", video_peers.reply_to, videos=[url], fps=0.1)
              for i, url in enumerate([slow, video_uri(CLIP.data), slow, slow])]
    image = worker_job(prep, "image-after", video_peers.reply_to, images=[jpeg_uri(64, 48)])
    video_peers.send(pool_video_worker, *videos)
    time.sleep(1.0)  # the video lane has started them all (a slow one decodes for seconds)
    video_peers.send(pool_video_worker, image)
    arrived = [video_peers.next_request()[0] for _ in range(5)]
    assert [request.request_id for request in arrived] == \
        ["image-after", "video-0", "video-1", "video-2", "video-3"]
    assert [request.mm_items[0].tensors["video_grid_thw"][0, 0] for request in arrived[1:]] == \
        [10, 2, 10, 10]  # 20 frames of 200 s; 4 of 2 s (min_frames)
    expected = Rendering(qwen_dir).renderer.render(videos[1])  # as a lane's thread renders it
    assert arrived[2].prompt_token_ids == expected.prompt_token_ids
    for name, tensor in expected.mm_items[0].tensors.items():
        assert np.array_equal(arrived[2].mm_items[0].tensors[name], tensor), name


def test_a_pool_process_killed_on_a_video_fails_that_job_alone_by_name(
    pool_video_worker: Child, video_peers: Peers, prep: Preprocessor,
) -> None:
    """Every pool process frozen, a video job sent, then every process killed: the job fails
    with a retryable error naming its video; the processes are replaced, and serve on."""
    before = pool_pids(pool_video_worker.process.pid)
    assert len(before) == 3
    for pid in before:
        os.kill(pid, signal.SIGSTOP)
    job = worker_job(prep, "held", video_peers.reply_to, videos=[video_uri(CLIP.data)])
    video_peers.send(pool_video_worker, job)
    time.sleep(0.5)  # the one sleep: nothing tells when the video is in a frozen process
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    failure = video_peers.next_failure()
    assert failure.request_id == "held"
    assert failure.error.kind == "retryable" and failure.error.code == "peer_restarted"
    assert re.match(r"^video 0: the process decoding it died \(status -9\); it was replaced$",
                    failure.error.message), failure.error.message
    wait_until(lambda: len(pool_pids(pool_video_worker.process.pid)) == 3,
               "the pool processes were replaced")
    video_peers.send(pool_video_worker, msgspec.structs.replace(job, request_id="after"))
    try:  # once a new process has loaded the model's processors (slow on a busy machine)
        request = video_peers.engine.take(REPLACED_WITHIN_S)
    except AssertionError:
        raise AssertionError(role_log(pool_video_worker)) from None
    assert request.request_id == "after" and request.mm_items[0].tensors
    video_peers.assert_quiet()


def test_a_pool_process_stuck_on_a_video_is_stopped_and_the_video_refused(
    run_dir: Path, qwen_dir: Path, prep: Preprocessor,
) -> None:
    """A process that holds a video twice `max_video_decode_s` (here frozen, as one stuck in a
    decoder call would be) is killed: the video is refused by name, and the worker serves on."""
    peers = Peers(run_dir)
    worker = start_worker("stuck-mm-worker", run_dir, qwen_dir, peers.engine_endpoint,
                          "--mm-processes", "2", "--max-video-decode", "1")
    try:
        before = pool_pids(worker.process.pid)
        for pid in before:
            os.kill(pid, signal.SIGSTOP)
        job = worker_job(prep, "stuck", peers.reply_to, videos=[video_uri(CLIP.data)])
        peers.send(worker, job)
        failure = peers.next_failure()
        assert failure.request_id == "stuck" and failure.error.code == "video_too_large"
        assert failure.error.message == ("video 0: still being decoded after 2 s, 2 times "
                                         "max_video_decode_s 1; its process was stopped")
        for pid in before:  # the other one, idle
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        peers.send(worker, msgspec.structs.replace(job, request_id="after"))
        assert peers.engine.take(REPLACED_WITHIN_S).request_id == "after"
        assert worker.process.poll() is None
    finally:
        assert stop_role(worker) == 0, role_log(worker)
        peers.close()


@pytest.mark.parametrize(("make", "code", "message"),
                         [case[1:] for case in HOSTILE if case[0] in (
                             "corrupt frames", "index cut off", "audio only", "random bytes")],
                         ids=["corrupt frames", "index cut off", "audio only", "random bytes"])
def test_a_hostile_video_fails_its_job_by_name_and_the_worker_serves_on(
    video_worker: Child, video_peers: Peers, prep: Preprocessor, make: Any, code: str,
    message: str,
) -> None:
    bad = worker_job(prep, "bad", video_peers.reply_to,
                     images=[jpeg_uri(32, 32)], videos=[video_uri(make())])
    good = worker_job(prep, "good", video_peers.reply_to, videos=[video_uri(CLIP.data)])
    video_peers.send(video_worker, bad, good)
    failure = video_peers.next_failure()
    assert failure.request_id == "bad"
    assert failure.error.code == code
    assert failure.error.message.startswith("video 0: ")
    request, _ = video_peers.next_request()
    assert request.request_id == "good"
    assert video_worker.process.poll() is None


def test_a_video_url_is_fetched_under_the_image_urls_rules(
    video_worker: Child, video_peers: Peers, prep: Preprocessor,
) -> None:
    """The same fetcher and address policy as images: no loopback address without
    --allow-internal-media, the error naming the video."""
    job = worker_job(prep, "loopback", video_peers.reply_to,
                     videos=["https://127.0.0.1:9/clip.mp4"])
    video_peers.send(video_worker, job)
    failure = video_peers.next_failure()
    assert failure.error.code == "media_not_allowed"
    assert re.match(r"^video 0: 127\.0\.0\.1 resolves to loopback address 127\.0\.0\.1, "
                    r"which is refused", failure.error.message), failure.error.message


# ---------------------------------------------------------------- the HTTP API


class Served:
    """A frontend and an MM worker before this test's stand-in engine, for one model."""

    def __init__(self, run: Path, model_dir: Path, media_dir: Path) -> None:
        run.mkdir()
        self.model = model_dir.name
        self.engine = StandInEngine.at(zmq.Context.instance(), f"ipc://{run}/engine.sock")
        args = ["--model", str(model_dir), "--drain-timeout", "0", "--engine-endpoint",
                self.engine.endpoint, "--mm-worker-endpoint", f"ipc://{run}/mm.sock"]
        port = free_port()
        self.children = [
            start_role("mm-worker", [*args, "--allowed-media-dir", str(media_dir)], run,
                       log_dir=run / "mm-worker"),
            start_role("frontend", [*args, "--output-endpoint", f"ipc://{run}/out.sock",
                                    "--port", "0", "--http-port", str(port)], run,
                       log_dir=run / "frontend"),
        ]
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                    max_retries=0, timeout=RECV_TIMEOUT_S)

    def chat(self, content: list[dict[str, Any]], **fields: Any) -> Any:
        return functools.partial(self.client.chat.completions.create, model=self.model,
                                 messages=[{"role": "user", "content": content}], max_tokens=4,
                                 **fields)

    def close(self) -> None:
        self.client.close()
        stop_all(self.children)
        self.engine.close()


@pytest.fixture(scope="module")
def served(module_run_dir: Path, model_dirs: dict[str, Path],
           media_dir: Path) -> Iterator[dict[str, Served]]:
    """The tiny Qwen2-VL's, LLaVA-OneVision's, InternVL's and SmolVLM's, and LLaVA's (a
    family without video)."""
    served = {family: Served(module_run_dir / f"api-{family}", model_dirs[family], media_dir)
              for family in ("qwen2_vl", "llava_onevision", "internvl", "smolvlm", "llava")}
    yield served
    for one in served.values():
        one.close()


@pytest.fixture
def qwen_engine(served: dict[str, Served]) -> StandInEngine:
    """The Qwen2-VL frontend's stand-in engine (a test that has it answer requests holds it
    itself: the reply sockets it opens are then the fixture's, not a leak)."""
    return served["qwen2_vl"].engine


@pytest.fixture
def family_engine(served: dict[str, Served], family: str) -> StandInEngine:
    """The stand-in engine of the frontend of the test's `family` (its parameter), as
    `qwen_engine`."""
    return served[family].engine


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


TEXT = {"type": "text", "text": "What happens?"}


def test_a_video_url_part_is_served_sampled_as_the_request_asks(
    served: dict[str, Served], qwen_engine: StandInEngine, media_dir: Path,
) -> None:
    qwen = served["qwen2_vl"]
    (media_dir / "clip.mp4").write_bytes(CLIP.data)
    # 4 frames at 2 fps, 8 at 4: a 2x4x6 or 4x4x6 patch grid, a token per 2x2 patches
    for url, fps, tokens in [(video_uri(CLIP.data), None, 12),
                             ((media_dir / "clip.mp4").as_uri(), 4, 24)]:
        extra = {} if fps is None else {"extra_body": {"mm_processor_kwargs": {"fps": fps}}}
        call = qwen.chat([video_part(url), TEXT], **extra)
        completion = _answered(qwen_engine, call, functools.partial(_answer, tokens=tokens))
        assert completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize("family", ["llava_onevision", "internvl"])
def test_a_video_is_sampled_as_vllms_default_loader_samples_it(
    served: dict[str, Served], video_processing: dict[str, VideoPreprocessor], family: str,
    family_engine: StandInEngine,
) -> None:
    """LLaVA-OneVision's and InternVL's: 32 of the clip's 50 frames, or one a second where
    asked (OneVision's each 196 tokens, and the video a newline; InternVL's each 256 in its
    "FrameN: <img>...</img>")."""
    model = served[family]
    for extra, frames in [({}, 32), ({"extra_body": {"mm_processor_kwargs": {"fps": 1}}}, 2)]:
        call = model.chat([video_part(video_uri(CLIP.data)), TEXT], **extra)
        tokens = video_processing[family].count_tokens(frames, CLIP.width, CLIP.height)
        completion = _answered(family_engine, call, functools.partial(_answer, tokens=tokens))
        assert completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize("family", ["smolvlm"])
def test_a_smolvlm_video_is_sampled_as_its_processor_samples_it(
    served: dict[str, Served], video_processing: dict[str, VideoPreprocessor], family: str,
    family_engine: StandInEngine,
) -> None:
    """SmolVLM's (transformers' sample_frames): the model's 1 fps keeps the 2 s clip's first
    and last frame, 2 fps four; the engine's span is the frames and the timestamps between
    them (the words around them are the prompt's)."""
    model, smolvlm = served["smolvlm"], video_processing["smolvlm"]
    for extra, seconds in [({}, [0, 1]),
                           ({"extra_body": {"mm_processor_kwargs": {"fps": 2}}}, [0, 0, 1, 1])]:
        call = model.chat([video_part(video_uri(CLIP.data)), TEXT], **extra)
        tokens = len(smolvlm.expand_item({"frame_seconds": np.array(seconds)}))
        completion = _answered(family_engine, call, functools.partial(_answer, tokens=tokens))
        assert completion.choices[0].finish_reason == "length"


def _answer(request: EngineRequest, tokens: int) -> Any:
    """The stand-in engine's answer, once the request carries one video of `tokens` tokens."""
    [item] = request.mm_items
    assert item.is_video and item.length == tokens, item.length
    return EngineOutput(request_id=request.request_id, token_ids=[42], finished=True,
                        finish_reason="length", prompt_token_ids=request.prompt_token_ids)


@pytest.mark.parametrize(("family", "content", "fields", "status", "code", "message"), [
    ("qwen2_vl", [{"type": "input_audio", "input_audio": {}}, TEXT], {}, 400, "invalid_request",
     r"^messages\[0\]\.content\[0\]\.type: 'input_audio' is not supported; the content part "
     r"types are text, image_url, video_url$"),
    ("llava", [video_part(video_uri(CLIP.data)), TEXT], {}, 400, "invalid_request",
     r"^messages: this model \(llava family\) takes no video"),
    ("qwen2_vl", [video_part(video_uri(CLIP.data)), TEXT],
     {"extra_body": {"mm_processor_kwargs": {"fps": 1, "max_pixels": 5}}}, 400,
     "invalid_request", r"^mm_processor_kwargs: max_pixels not supported by this server \(it "
     r"takes fps, num_frames\)$"),
    ("qwen2_vl", [video_part(video_uri(CLIP.data)), TEXT],
     {"extra_body": {"mm_processor_kwargs": {"num_frames": 100000}}}, 400, "invalid_request",
     r"^mm_processor_kwargs\.num_frames: must be 2 \(one temporal patch\) to 256"),
    ("qwen2_vl", [video_part("data:image/png;base64,AAAA"), TEXT], {}, 400, "invalid_video",
     r"^video 0: data URI has media type 'image/png', not video/\*$"),
    ("qwen2_vl", [video_part("file:///etc/passwd"), TEXT], {}, 400, "media_not_allowed",
     r"^video 0: file:///etc/passwd is outside the allowed media folder$"),
    ("qwen2_vl", [video_part(video_uri(HOSTILE_BY_NAME["audio only"]())), TEXT], {}, 400,
     "invalid_video", r"^video 0: the file has no video stream \(audio\)$"),
], ids=["unknown part", "family without video", "unknown kwarg", "too many frames",
        "not a video", "outside the media folder", "audio only"])
def test_a_bad_video_request_gets_a_clear_400(
    served: dict[str, Served], family: str, content: list[dict[str, Any]],
    fields: dict[str, Any], status: int, code: str, message: str,
) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        served[family].chat(content, **fields)()
    error = caught.value
    assert error.status_code == status, error.body
    body = error.response.json()["error"]
    assert body["code"] == code
    assert re.search(message, body["message"]), body["message"]
    assert body["param"] in ("messages", "mm_processor_kwargs") or "content" in body["param"]
