"""What the engine receives equals what the in-process Hugging Face processor produces.

Real frontend and MM worker processes for each family; this test binds the engine's socket and
compares every EngineRequest with `processor.apply_chat_template` + `processor(text, images)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq
from msgspec.structs import replace

from bench.images import jpeg_uri, make_image, png_uri
from conftest import as_processor_output, hf_processor_call, reference_items, start_role
from mmlane.client import Client, user_message
from mmlane.launcher import stop_all
from mmlane.model import PixelNorm, family_for
from mmlane.protocol.messages import EngineRequest
from peers import StandInEngine, frames_for


@dataclass
class Lane:
    client: Client
    engine: StandInEngine

    def received(self) -> EngineRequest:
        request, frames = self.engine.take_frames()
        assert frames == frames_for(t for item in request.mm_items for t in item.tensors.values())
        return request


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "llava", "llava_next",
                                                "llava_onevision", "mistral3", "internvl",
                                                "idefics3", "smolvlm"])
def lane(request, module_run_dir: Path, model_dirs: dict[str, Path]) -> Iterator[Lane]:
    family = request.param
    run = module_run_dir / family
    # This test plays the engine and never answers: the roles must not drain at stop.
    model = ["--model", str(model_dirs[family]), "--drain-timeout", "0"]
    mm_endpoint = f"ipc://{run}/mm.sock"
    engine = StandInEngine.at(zmq.Context.instance(), f"ipc://{run}/engine.sock")
    children = [
        start_role("mm-worker", [*model, "--engine-endpoint", engine.endpoint,
                                 "--mm-worker-endpoint", mm_endpoint], run),
        start_role("frontend", [*model, "--engine-endpoint", engine.endpoint,
                                "--mm-worker-endpoint", mm_endpoint,
                                "--output-endpoint", f"ipc://{run}/out.sock",
                                "--port", "0"], run),
    ]
    client = Client(children[1].endpoint)
    yield Lane(client, engine)
    client.close()
    stop_all(children)
    engine.close()


SIZES = [(56, 56), (333, 500), (1024, 768), (1200, 90)]


@pytest.mark.parametrize(
    ("sizes", "text_first"),
    [([SIZES[0]], False), ([SIZES[1]], False), ([SIZES[2]], False), ([SIZES[3]], False),
     (SIZES[:3], False), ([SIZES[3], SIZES[1]], True)],
    ids=["56x56", "333x500", "1024x768", "1200x90", "three", "two-after-the-text"],
)
def test_engine_receives_what_the_hf_processor_makes(
    lane: Lane, hf_processors: dict, request: pytest.FixtureRequest, sizes: list,
    text_first: bool,
) -> None:
    family = request.node.callspec.params["lane"]
    processor = hf_processors[family]
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    # Send lossless PNGs so the worker decodes exactly the pixels the reference sees.
    urls = [png_uri(image) for image in images]
    message = user_message("Compare these.", urls)
    if text_first:
        *parts, text_part = message.content
        message = replace(message, content=[text_part, *parts])
    lane.client.submit([message], max_tokens=4)
    got = lane.received()

    content = [{"type": "image"} for _ in images]
    text = [{"type": "text", "text": "Compare these."}]
    content = text + content if text_first else content + text
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    expected = hf_processor_call(processor, prompt, images)
    assert got.prompt_token_ids == expected["input_ids"][0].tolist()
    # Image by image: a batch may pad its images to one shape (LLaVA-NeXT's tiles).
    wanted = reference_items(family, processor, expected, images)
    # One frame of a Qwen2-VL image travels; the engine lays it out as the model takes it.
    norm = PixelNorm.of(processor.image_processor,
                        family_for(family).frames(processor.image_processor))
    for item, want in zip(got.mm_items, wanted, strict=True):
        tensors = as_processor_output(item.tensors, norm)
        assert tensors.keys() == want.keys()
        for name in tensors:
            assert tensors[name].dtype == want[name].dtype
            assert np.array_equal(tensors[name], want[name]), name


def test_text_only_request_goes_straight_to_the_engine(lane: Lane, hf_processors: dict,
                                                       request: pytest.FixtureRequest) -> None:
    processor = hf_processors[request.node.callspec.params["lane"]]
    lane.client.submit([user_message("Just text.")], max_tokens=4)
    got = lane.received()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Just text."}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert got.mm_items == []
    assert got.prompt_token_ids == hf_processor_call(processor, prompt)["input_ids"][0].tolist()


def test_jpeg_items_carry_offsets_into_the_expanded_prompt(
    lane: Lane, preprocessors: dict, request: pytest.FixtureRequest
) -> None:
    preprocessor = preprocessors[request.node.callspec.params["lane"]]
    lane.client.submit([user_message("Two.", [jpeg_uri(100, 80), jpeg_uri(80, 100)])])
    got = lane.received()
    ids = got.prompt_token_ids
    for item in got.mm_items:  # each span is its image's expansion: its image tokens at least
        span = ids[item.offset: item.offset + item.length]
        assert span == list(preprocessor.expand_image(item.tensors))
        assert preprocessor.image_token_id in span
    assert got.mm_items[0].offset + got.mm_items[0].length <= got.mm_items[1].offset
