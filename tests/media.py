"""Deterministic test images and the URLs that carry them."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def make_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth gradient plus seeded noise: compresses like a photo, same pixels every run."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 32, size=(height, width, 3))
    image = Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")
    return image.convert(mode)


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Uniform random pixels in every band, alpha included: for exact parity and compositing."""
    bands = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, bands), np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if bands == 1 else pixels)


def encode(image: Image.Image, fmt: str = "JPEG", **save_args: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_args)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def jpeg_uri(width: int, height: int, seed: int = 0) -> str:
    return data_uri(encode(make_image(width, height, seed)))


def png_uri(image: Image.Image) -> str:
    """A lossless data URI: the receiver decodes exactly these pixels."""
    return data_uri(encode(image, "PNG"), "image/png")
