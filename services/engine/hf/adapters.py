"""Everything the HF runner does differently per model family, in one place.

An adapter runs the vision encoder for one image and gives a request its own position ids (the
checks of an image's tensor shapes are the family's, in services/model/families.py, so every
backend makes them). Qwen2-VL needs explicit 3-D (M-RoPE) positions: the model
would otherwise keep one `rope_deltas` on itself, shared by every request it serves. LLaVA,
LLaVA-NeXT and Mistral 3 use plain positions, which the model derives from the request's own KV
cache in a prefill; a decode step gets them explicitly, as a batched step runs without that
cache (runner.py).

The vision encoder runs as a `VisionPass`, one bounded slice per unit of work. Qwen2-VL's
encoder slices by rows of patches (the patch embedding, then each block's attention by query
rows); rows do not interact within those steps, so the slices compute exactly what one call
would, and the adapter checks that against the model at startup. Other families run the whole
pass as one slice, through the model's own `get_image_features` (LLaVA-NeXT's with the image's
`image_sizes`, so the tile grid, the unpadding and the image_newline are transformers' own;
Idefics3's with the image's tiles as one sample).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping
from typing import Any

import numpy as np
import torch
from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

from protocol.messages import MMItem
from services.model import PixelNorm, normalize

log = logging.getLogger(__name__)

Slices = Generator[None, None, torch.Tensor]
"""A vision pass written as a generator: it yields between slices and returns the features."""


class VisionPass:
    """One image's vision-encoder pass, run a slice at a time."""

    def __init__(self, slices: Slices) -> None:
        self._slices = slices

    def step(self) -> torch.Tensor | None:
        """Run the next slice; the image's features once the last one has run, else None."""
        try:
            next(self._slices)
        except StopIteration as done:
            return done.value
        return None


class Positions:
    """Plain position ids of one request. A prompt's are None: the model counts them from the
    request's KV cache."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def prompt(self, start: int, end: int) -> torch.Tensor | None:
        return None

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

    def vision_pass(
        self, tensors: Mapping[str, np.ndarray], slice_tokens: int | None
    ) -> VisionPass:
        """`image_features` in slices of about `slice_tokens` image tokens each (None: one)."""
        return VisionPass(self._whole(tensors))

    def _whole(self, tensors: Mapping[str, np.ndarray]) -> Slices:
        return self.image_features(tensors)
        yield  # a generator without a yield point: the whole pass is one slice

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        return Positions(prompt.device)

    def _pixels(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        """The uint8 pixel_values normalised on the device, as the HF processor would have
        (services/model/pixels.py), in the model's dtype."""
        pixels = torch.from_numpy(np.array(tensors["pixel_values"])).to(self.model.device)
        return normalize(pixels, self.pixel_norm).to(self.model.dtype)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        # Received arrays are read-only views of ZMQ frames; torch wants its own copy anyway.
        tensor = torch.from_numpy(np.array(array))
        dtype = self.model.dtype if tensor.is_floating_point() else torch.long
        return tensor.to(self.model.device, dtype)


class Qwen2VLAdapter(Adapter):
    def __init__(self, model: Any, pixel_norm: PixelNorm) -> None:
        super().__init__(model, pixel_norm)
        vision = model.config.vision_config
        self.merge = vision.spatial_merge_size
        self.patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.image_token_id = model.config.image_token_id
        self.sliced_vision = self._slicing_matches_the_model()

    def vision_pass(
        self, tensors: Mapping[str, np.ndarray], slice_tokens: int | None
    ) -> VisionPass:
        rows = None if slice_tokens is None else slice_tokens * self.merge**2
        if not self.sliced_vision or rows is None or rows >= len(tensors["pixel_values"]):
            return super().vision_pass(tensors, slice_tokens)  # one slice: the model's own call
        return VisionPass(self._sliced(tensors, rows=rows))

    def _sliced(self, tensors: Mapping[str, np.ndarray], rows: int) -> Slices:
        """Qwen2VisionTransformerPretrainedModel.forward for one image, `rows` patches a slice."""
        visual = self.model.model.visual
        pixels = self._pixels(tensors).to(visual.dtype)
        grid = self._to_device(tensors["image_grid_thw"])
        spans = [(start, start + rows) for start in range(0, pixels.shape[0], rows)]
        embedded = []
        for start, end in spans:
            if start:  # a unit ends between two slices: the last one runs with what follows it
                yield
            embedded.append(visual.patch_embed(pixels[start:end]))
        hidden = torch.cat(embedded)
        position_ids = qwen2_vl.get_vision_position_ids(grid, visual.spatial_merge_size)
        cos, sin = visual.rotary_pos_emb(hidden, position_ids)
        for block in visual.blocks:
            attn = block.attn
            qkv = attn.qkv(block.norm1(hidden)).view(len(hidden), 3, attn.num_heads, -1)
            q, k, v = qkv.unbind(1)
            q, k = qwen2_vl.apply_rotary_pos_emb_vision(q, k, cos, sin)
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, n, dim)
            attend = qwen2_vl.ALL_ATTENTION_FUNCTIONS.get_interface(
                attn.config._attn_implementation, qwen2_vl.eager_attention_forward
            )
            rows_out = []
            for start, end in spans:  # every query row attends to all keys: rows are independent
                yield
                out, _ = attend(attn, q[:, :, start:end], k, v, attention_mask=None,
                                scaling=attn.scaling, dropout=0.0, is_causal=False)
                rows_out.append(out)
            hidden = hidden + attn.proj(torch.cat(rows_out, dim=1).reshape(len(hidden), -1))
            hidden = hidden + block.mlp(block.norm2(hidden))
        return visual.merger(hidden)

    @torch.inference_mode()
    def _slicing_matches_the_model(self) -> bool:
        """Whether `_sliced` reproduces the model's own vision forward (on a small random image):
        it follows transformers' code, which a new transformers release may change."""
        side = 4 * self.merge
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randint(
            0, 256, (side * side, self.patch_dim), generator=generator, dtype=torch.uint8
        ).numpy()
        tensors = {"pixel_values": pixels, "image_grid_thw": np.array([[1, side, side]])}
        whole = self.image_features(tensors)
        try:
            sliced = _run(VisionPass(self._sliced(tensors, rows=3 * self.merge**2)))
        except Exception:
            log.warning("sliced vision pass failed; images run as one unit", exc_info=True)
            return False
        tolerance = 1e-5 if whole.dtype == torch.float32 else 1e-2
        if sliced.shape != whole.shape or not torch.allclose(sliced, whole, tolerance, tolerance):
            log.warning("the sliced vision pass differs from the model's; images run as one unit")
            return False
        return True

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
        [features] = self.model.model.get_image_features(pixels, return_dict=True).pooler_output
        return features


ADAPTERS: dict[str, type[Adapter]] = {
    "qwen2_vl": Qwen2VLAdapter, "llava": Adapter, "llava_next": Adapter,
    "llava_onevision": Adapter,
    "mistral3": Adapter,
    "internvl": Adapter,
    "idefics3": Idefics3Adapter,
}


def _run(vision: VisionPass) -> torch.Tensor:
    while (features := vision.step()) is None:
        pass
    return features


def adapter_for(family: str, model: Any, pixel_norm: PixelNorm) -> Adapter:
    if family not in ADAPTERS:
        raise ValueError(f"the engine has no runner for model family {family!r}")
    return ADAPTERS[family](model, pixel_norm)
