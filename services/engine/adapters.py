"""Everything the engine does differently per model family, in one place.

An adapter checks the shapes of one image's tensors, runs the vision encoder for one image, and
gives a request its own position ids. Qwen2-VL needs explicit 3-D (M-RoPE) positions: the model
would otherwise keep one `rope_deltas` on itself, shared by every request it serves. LLaVA uses
plain positions, which the model derives from the request's own KV cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from protocol.errors import RequestError
from protocol.messages import MMItem


class Positions:
    """Position ids of one request; None lets the model count from the request's KV cache."""

    def prompt(self, start: int, end: int) -> torch.Tensor | None:
        return None

    def decode(self, position: int) -> torch.Tensor | None:
        return None


class MRopePositions(Positions):
    """Qwen2-VL's 3-D positions: computed for the whole prompt once, then `delta` + position."""

    def __init__(self, prompt_ids: torch.Tensor, delta: int) -> None:
        self._prompt_ids = prompt_ids  # (3, 1, prompt_len)
        self._delta = delta

    def prompt(self, start: int, end: int) -> torch.Tensor:
        return self._prompt_ids[:, :, start:end]

    def decode(self, position: int) -> torch.Tensor:
        return torch.full((3, 1, 1), position + self._delta, device=self._prompt_ids.device)


class Adapter:
    """The family-independent part: tensors go to the device, the vision tower's pooled output
    (one row per placeholder token) is what replaces the image's placeholders."""

    name = "base"

    def __init__(self, model: Any) -> None:
        self.model = model  # a transformers model (Any: its submodules are untyped)

    def check_items(self, items: list[MMItem]) -> None:
        """Raise RequestError when an item's tensors have shapes this model cannot take."""
        for index, item in enumerate(items):
            self.check_tensors(f"mm_items[{index}]", item.tensors)

    def check_tensors(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        pass

    def image_features(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        """The image's embeddings, (num_placeholder_tokens, hidden), on the model's device."""
        inputs = {name: self._to_device(array) for name, array in tensors.items()}
        pooled = self.model.model.get_image_features(**inputs, return_dict=True).pooler_output
        return torch.cat(list(pooled))

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        return Positions()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        # Received arrays are read-only views of ZMQ frames; torch wants its own copy anyway.
        tensor = torch.from_numpy(np.array(array))
        dtype = self.model.dtype if tensor.is_floating_point() else torch.long
        return tensor.to(self.model.device, dtype)


class Qwen2VLAdapter(Adapter):
    name = "qwen2_vl"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        vision = model.config.vision_config
        self.merge = vision.spatial_merge_size
        self.patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.image_token_id = model.config.image_token_id

    def check_tensors(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        grid = _tensor(tensors, where, "image_grid_thw", ndim=2, kind="iu")
        pixels = _tensor(tensors, where, "pixel_values", ndim=2, kind="f")
        if grid.shape != (1, 3) or (grid < 1).any():
            raise RequestError(
                f"{where}.image_grid_thw must be one positive (t, h, w) row, got {grid.tolist()}"
            )
        t, h, w = (int(v) for v in grid[0])
        if h % self.merge or w % self.merge:
            raise RequestError(
                f"{where}.image_grid_thw h and w must be multiples of {self.merge}, got {h}x{w}"
            )
        if pixels.shape != (t * h * w, self.patch_dim):
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, grid {(t, h, w)} needs "
                f"({t * h * w}, {self.patch_dim})"
            )

    def check_items(self, items: list[MMItem]) -> None:
        super().check_items(items)
        # get_rope_index finds images as runs of image tokens: two touching images would merge.
        for index in range(1, len(items)):
            if items[index].offset == items[index - 1].offset + items[index - 1].length:
                raise RequestError(
                    f"mm_items[{index}] starts right where mm_items[{index - 1}] ends; "
                    "Qwen2-VL needs a token (e.g. <|vision_end|>) between two images"
                )

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        if not items:  # text: the same position on all three axes. Explicit, so the model never
            # falls back on the rope_deltas it keeps on itself.
            ids = torch.arange(prompt.shape[1], device=prompt.device)
            return MRopePositions(ids.view(1, 1, -1).expand(3, 1, -1), 0)
        grids = torch.cat([self._to_device(item.tensors["image_grid_thw"]) for item in items])
        image_tokens = (prompt == self.image_token_id).to(torch.int32)
        ids, deltas = self.model.model.get_rope_index(
            prompt, mm_token_type_ids=image_tokens, image_grid_thw=grids
        )
        return MRopePositions(ids, int(deltas[0, 0]))


class LlavaAdapter(Adapter):
    name = "llava"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        vision = model.config.vision_config
        self.pixel_shape = (1, vision.num_channels, vision.image_size, vision.image_size)

    def check_tensors(self, where: str, tensors: Mapping[str, np.ndarray]) -> None:
        pixels = _tensor(tensors, where, "pixel_values", ndim=4, kind="f")
        if pixels.shape != self.pixel_shape:
            raise RequestError(
                f"{where}.pixel_values has shape {pixels.shape}, expected {self.pixel_shape}"
            )


ADAPTERS: dict[str, type[Adapter]] = {"qwen2_vl": Qwen2VLAdapter, "llava": LlavaAdapter}


def adapter_for(family: str, model: Any) -> Adapter:
    if family not in ADAPTERS:
        raise ValueError(f"the engine has no runner for model family {family!r}")
    return ADAPTERS[family](model)


def _tensor(
    tensors: Mapping[str, Any], where: str, name: str, *, ndim: int, kind: str
) -> np.ndarray:
    array = tensors.get(name)
    if array is None:
        raise RequestError(f"{where} lacks tensor {name!r} (has {sorted(tensors)})")
    if array.ndim != ndim or array.dtype.kind not in kind:
        raise RequestError(
            f"{where}.{name} must be a {ndim}-D array of kind {kind!r}, "
            f"got {array.ndim}-D {array.dtype}"
        )
    return array
