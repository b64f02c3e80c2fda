"""Everything the HF runner does differently per model family for a request's positions.

Each request gets its own position ids. Qwen2-VL needs explicit 3-D (M-RoPE) positions: the
model would otherwise keep one `rope_deltas` on itself, shared by every request it serves.
LLaVA, LLaVA-NeXT and Mistral 3 use plain positions, which the model derives from the request's
own KV cache in a prefill; a decode step gets them explicitly, as a batched step runs without
that cache (runner.py). What differs per family in an image's vision pass is the encoder's
(services/engine/vision.py); the checks of an image's tensor shapes are the family's, in
services/model/families.py, so every backend makes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmlane.engine.vision import to_device
from mmlane.protocol.messages import MMItem


class Positions:
    """Plain position ids of one request."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def prompt(self, start: int, end: int) -> torch.Tensor:
        """The ids of prompt tokens [start, end), shaped as one batch row: (1, end - start); a
        forward of several requests' chunks joins theirs on dimension -1."""
        return torch.arange(start, end, device=self._device)[None]

    def decode(self, position: int) -> torch.Tensor:
        """The ids of the token at `position` (the KV cache's length), shaped as one batch row:
        (1, 1); rows of several requests are joined on dimension -2."""
        return torch.full((1, 1), position, device=self._device)


class MRopePositions(Positions):
    """Qwen2-VL's 3-D positions: computed for the whole prompt once, then `delta` + position."""

    def __init__(self, prompt_ids: torch.Tensor, delta: int) -> None:
        super().__init__(prompt_ids.device)
        self._prompt_ids = prompt_ids  # (3, 1, prompt_len)
        self._delta = delta

    def prompt(self, start: int, end: int) -> torch.Tensor:
        return self._prompt_ids[:, :, start:end]

    def decode(self, position: int) -> torch.Tensor:
        return torch.full((3, 1, 1), position + self._delta, device=self._device)


class Adapter:
    """Plain positions, whatever the request's images."""

    def __init__(self, model: Any) -> None:
        self.model = model  # a transformers model (Any: its submodules are untyped)

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        return Positions(prompt.device)


class Qwen2VLAdapter(Adapter):
    """Qwen2-VL's and Qwen2.5-VL's M-RoPE positions, from the model's own `get_rope_index`:
    images' and videos' tokens by their grids, Qwen2.5-VL's videos' temporal patches spaced by
    their `second_per_grid_ts` (its seconds per grid step; Qwen2-VL's get_rope_index ignores
    it)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.image_token_id = model.config.image_token_id
        self.video_token_id = model.config.video_token_id

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        if not items:  # text: the same position on all three axes. Explicit, so the model never
            # falls back on the rope_deltas it keeps on itself.
            ids = torch.arange(prompt.shape[1], device=prompt.device)
            return MRopePositions(ids.view(1, 1, -1).expand(3, 1, -1), 0)
        videos = [item.tensors for item in items if item.is_video]
        images = [item.tensors for item in items if not item.is_video]
        # get_rope_index's token types: text 0, image 1, video 2
        token_types = (prompt == self.image_token_id).to(torch.int32) + \
            2 * (prompt == self.video_token_id).to(torch.int32)
        ids, deltas = self.model.model.get_rope_index(
            prompt, mm_token_type_ids=token_types,
            image_grid_thw=_joined(images, "image_grid_thw", prompt.device),
            video_grid_thw=_joined(videos, "video_grid_thw", prompt.device),
            second_per_grid_ts=_joined(videos, "second_per_grid_ts", prompt.device),
        )
        return MRopePositions(ids, int(deltas[0, 0]))


def _joined(items: Sequence[Mapping[str, np.ndarray]], name: str,
            device: torch.device) -> torch.Tensor | None:
    """The items' `name` tensors joined on their first axis (None: none has it); grids as
    int64."""
    found = [to_device(tensors[name], device) for tensors in items if name in tensors]
    if not found:
        return None
    joined = torch.cat(found)
    return joined if joined.is_floating_point() else joined.long()


ADAPTERS: dict[str, type[Adapter]] = {
    "qwen2_vl": Qwen2VLAdapter, "llava": Adapter, "llava_next": Adapter,
    "llava_onevision": Adapter,
    "mistral3": Adapter,
    "internvl": Adapter,
    "idefics3": Adapter,
}


def adapter_for(family: str, model: Any) -> Adapter:
    if family not in ADAPTERS:
        raise ValueError(f"the engine has no runner for model family {family!r}")
    return ADAPTERS[family](model)
