"""Pixels travel as uint8; the engine normalises them, bit-identical to the HF processor.

The HF image processor (PIL backend) resizes in uint8, then rescales (`uint8 as float64 *
rescale_factor`, cast to float32) and normalises (`(x - mean) / std` in float32), then lays the
values out for the model. The MM worker stops before the rescale and sends uint8 in the model's
layout (a quarter of the bytes, and the float passes are skipped); `normalize` runs the two
remaining steps on the engine's device in the same order and dtypes. Both steps are
element-wise, so doing them after the layout instead of before changes no bit.

transformers' torchvision backend (vLLM's renderer uses it) works in float32 throughout and, with
both steps on, folds the rescale into the mean and std (`(x - mean / factor) / (std / factor)`);
`normalize` follows it for a PixelNorm of that backend's processor.

Every family's layout is channel-major after the first axis: reshaped to (N, channels, -1),
each channel's values are one block (Qwen2-VL patch rows are channel x time x patch x patch;
LLaVA's are (1, channels, height, width), LLaVA-NeXT's (tiles, channels, height, width)).

Qwen2-VL lays an image out as `temporal_patch_size` identical frames (a video's patch spans that
many frames): its rows hold each channel's patch twice. The MM worker sends one frame (half the
bytes, through the transport and the receiver cache) and the engine repeats it (`model_layout`),
after normalising where it normalises (half the work): copying values changes no bit either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

RGB = 3
"""Channels of every image the processor sees (the MM worker converts each to RGB)."""


@dataclass(frozen=True)
class PixelNorm:
    """The processor's rescale and normalise steps, as the engine applies them."""

    rescale_factor: float | None
    """None: the processor does not rescale."""
    mean: tuple[float, ...] | None
    """Per channel; None: the processor does not normalise (then std is None too)."""
    std: tuple[float, ...] | None
    torchvision: bool = False
    """The steps as transformers' torchvision backend runs them (the module docstring)."""
    frames: int = 1
    """How many times the model's layout holds each channel's values of an image, of which
    the pixels sent hold one (Qwen2-VL's temporal_patch_size; the module docstring)."""

    @classmethod
    def of(cls, image_processor: Any, frames: int = 1) -> PixelNorm:
        """The steps `image_processor` runs after its resize, with its own settings; `frames`
        as the family lays its images out."""
        rescale = float(image_processor.rescale_factor) if image_processor.do_rescale else None
        torchvision = getattr(image_processor, "backend", "pil") == "torchvision"
        if not image_processor.do_normalize:
            return cls(rescale, None, None, torchvision, frames)
        return cls(rescale, _per_channel(image_processor.image_mean),
                   _per_channel(image_processor.image_std), torchvision, frames)


def _per_channel(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in np.atleast_1d(np.asarray(values)))


def normalize(pixels: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    """The float32 tensor the HF processor would have produced from these uint8 pixels, in
    the model's layout."""
    return model_layout(_normalized(pixels, norm), norm)


Pixels = TypeVar("Pixels", np.ndarray, "torch.Tensor")


def model_layout(pixels: Pixels, norm: PixelNorm) -> Pixels:
    """Pixels as sent, in the model's layout: each row's channel blocks `norm.frames` times
    (a new array or tensor), or the same one when the layout has one frame."""
    if norm.frames == 1:
        return pixels
    rows = pixels.reshape(len(pixels), RGB, 1, -1)
    shape = (len(pixels), RGB, norm.frames, rows.shape[3])
    if isinstance(rows, np.ndarray):
        return np.broadcast_to(rows, shape).reshape(len(pixels), -1)
    return rows.expand(shape).reshape(len(pixels), -1)


def _normalized(pixels: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    import torch  # the engine's: the frontend loads this module (PixelNorm) without torch

    if norm.torchvision:
        return _normalize_as_torchvision(pixels, norm)
    if norm.rescale_factor is None:
        values = pixels.to(torch.float32)
    else:  # numpy's order: upcast to float64, multiply by the (double) factor, cast down
        values = (pixels.to(torch.float64) * norm.rescale_factor).to(torch.float32)
    if norm.mean is None or norm.std is None:
        return values
    return _per_channel_normalize(values, torch.tensor(norm.mean), torch.tensor(norm.std))


def _normalize_as_torchvision(pixels: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    # transformers' TorchvisionBackend.rescale_and_normalize, step for step.
    import torch

    values = pixels.to(torch.float32)
    if norm.mean is None or norm.std is None:
        return values if norm.rescale_factor is None else values * norm.rescale_factor
    mean, std = torch.tensor(norm.mean), torch.tensor(norm.std)
    if norm.rescale_factor is not None:
        mean, std = mean * (1.0 / norm.rescale_factor), std * (1.0 / norm.rescale_factor)
    return _per_channel_normalize(values, mean, std)


def _per_channel_normalize(values: torch.Tensor, mean: torch.Tensor,
                           std: torch.Tensor) -> torch.Tensor:
    """`(values - mean) / std` in float32, channel by channel (the layouts above)."""
    import torch

    mean = mean.to(torch.float32, copy=False).to(values.device)[:, None]
    std = std.to(torch.float32, copy=False).to(values.device)[:, None]
    channels = values.reshape(values.shape[0], len(mean), -1)
    return ((channels - mean) / std).reshape(values.shape)
