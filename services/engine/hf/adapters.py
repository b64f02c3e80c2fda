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

from typing import Any

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
    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.image_token_id = model.config.image_token_id

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        if not items:  # text: the same position on all three axes. Explicit, so the model never
            # falls back on the rope_deltas it keeps on itself.
            ids = torch.arange(prompt.shape[1], device=prompt.device)
            return MRopePositions(ids.view(1, 1, -1).expand(3, 1, -1), 0)
        grids = torch.cat([to_device(item.tensors["image_grid_thw"], prompt.device).long()
                           for item in items])
        image_tokens = (prompt == self.image_token_id).to(torch.int32)
        ids, deltas = self.model.model.get_rope_index(
            prompt, mm_token_type_ids=image_tokens, image_grid_thw=grids
        )
        return MRopePositions(ids, int(deltas[0, 0]))


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
