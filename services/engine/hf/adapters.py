"""Everything the HF runner does differently per model family, in one place.

An adapter runs the vision encoder for one image and gives a request its own position ids (the
checks of an image's tensor shapes are the family's, in services/model/families.py, so every
backend makes them). Qwen2-VL needs explicit 3-D (M-RoPE) positions: the model
would otherwise keep one `rope_deltas` on itself, shared by every request it serves. LLaVA,
LLaVA-NeXT and Mistral 3 use plain positions, which the model derives from the request's own KV
cache in a prefill; a decode step gets them explicitly, as a batched step runs without that
cache (runner.py).

The vision encoder runs whole, through the model's own `get_image_features` (LLaVA-NeXT's with
the image's `image_sizes`, so the tile grid, the unpadding and the image_newline are
transformers' own; Idefics3's with the image's tiles as one sample), on the vision lane's thread
(vision_lane.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from protocol.messages import MMItem
from services.model import PixelNorm, normalize


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
    """The family-independent part: tensors go to the device, the vision tower's pooled output
    (one row per image token) is what replaces the image tokens of the image's span (the runner
    places them; the span's other tokens keep their own embeddings, as the model's forward
    leaves them)."""

    def __init__(self, model: Any, pixel_norm: PixelNorm) -> None:
        self.model = model  # a transformers model (Any: its submodules are untyped)
        self.pixel_norm = pixel_norm

    def image_features(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        """The image's embeddings, (image tokens, hidden), on the model's device."""
        inputs = {name: self._to_device(array) for name, array in tensors.items()
                  if name != "pixel_values"}
        inputs["pixel_values"] = self._pixels(tensors)
        pooled = self.model.model.get_image_features(**inputs, return_dict=True).pooler_output
        return torch.cat(list(pooled))

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        return Positions(prompt.device)

    def _pixels(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        """The uint8 pixel_values normalised on the device, as the HF processor would have
        (services/model/pixels.py), in the model's dtype."""
        pixels = to_device(tensors["pixel_values"], self.model.device)
        return normalize(pixels, self.pixel_norm).to(self.model.dtype)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = to_device(array, self.model.device)
        dtype = self.model.dtype if tensor.is_floating_point() else torch.long
        return tensor.to(dtype)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A received array (a read-only view of a ZMQ frame or a shared-memory slot) as a tensor
    of its own on `device`, on the calling thread's current stream. On CUDA it is copied once
    into pinned host memory and from there without blocking the thread (torch's pinned-memory
    cache keeps the block until the copy has run); on the CPU it is one plain copy."""
    if device.type != "cuda":
        return torch.from_numpy(np.array(array))
    dtype = torch.from_numpy(np.empty(0, array.dtype)).dtype
    staging = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    staging.numpy()[...] = array
    return staging.to(device, non_blocking=True)


class Qwen2VLAdapter(Adapter):
    def __init__(self, model: Any, pixel_norm: PixelNorm) -> None:
        super().__init__(model, pixel_norm)
        self.image_token_id = model.config.image_token_id

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


class Idefics3Adapter(Adapter):
    """Idefics3 (and SmolVLM): the image's tiles are one sample of the model's batch of
    samples x tiles; rows and cols only shape the prompt. No pixel_attention_mask: an image's
    own tiles are whole, the mask the model makes without one."""

    def image_features(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        pixels = self._pixels(tensors)[None]
        pooled = self.model.model.get_image_features(pixels, return_dict=True).pooler_output
        # a list of one (tokens, hidden) tensor per sample: this sample's tiles, pooled
        return torch.cat(list(pooled))


ADAPTERS: dict[str, type[Adapter]] = {
    "qwen2_vl": Qwen2VLAdapter, "llava": Adapter, "llava_next": Adapter,
    "llava_onevision": Adapter,
    "mistral3": Adapter,
    "internvl": Adapter,
    "idefics3": Idefics3Adapter,
}


def adapter_for(family: str, model: Any, pixel_norm: PixelNorm) -> Adapter:
    if family not in ADAPTERS:
        raise ValueError(f"the engine has no runner for model family {family!r}")
    return ADAPTERS[family](model, pixel_norm)
