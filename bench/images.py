"""The bench's images: deterministic generated JPEGs and real files, as data URIs that are new
bytes every time they are sent; and the image makers the benchmark scripts and tests share.

Every image request must cost the server a full decode and preprocessing, in every mode: a
feature cache keyed by the image's bytes (mmlane's, or any server's) must not turn a benchmark of
preprocessing into one of cache hits. So each use inserts a unique marker into the encoded
image: a JPEG comment (COM) segment right after the start-of-image marker, or a PNG `tEXt` chunk
right after the header chunk. Decoders ignore both: the pixels are the same every time.

The marker's length keeps the bytes before the unchanged tail a multiple of 3, so the tail's
base64 is computed once and each use only encodes a few dozen bytes before it.
"""

from __future__ import annotations

import base64
import io
import itertools
import mimetypes
import struct
import threading
import zlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from bench.config import ImageSpec

JPEG_QUALITY = 90


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth colour gradient plus seeded noise: compresses like a photo, same pixels every run.

    4032x3024 becomes a JPEG of about 5 MB at quality 90, like a phone photo.
    """
    rng = np.random.default_rng(seed)
    x = (np.arange(width, dtype=np.uint32) * 255 // max(width - 1, 1)).astype(np.uint8)
    y = (np.arange(height, dtype=np.uint32) * 255 // max(height - 1, 1)).astype(np.uint8)
    pixels = np.empty((height, width, 3), np.uint8)
    pixels[..., 0] = x[None, :]
    pixels[..., 1] = y[:, None]
    pixels[..., 2] = x[None, :] + y[:, None]  # wraps around: diagonal bands
    pixels += rng.integers(0, 32, size=pixels.shape, dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Uniform random pixels in every band, alpha included: for exact parity and compositing."""
    bands = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, bands), np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if bands == 1 else pixels)


def encode(image: Image.Image, fmt: str = "JPEG", **save_args: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def jpeg_uri(width: int, height: int, seed: int = 0) -> str:
    return data_uri(encode(make_image(width, height, seed)))


def png_uri(image: Image.Image) -> str:
    """A lossless data URI: the receiver decodes exactly these pixels."""
    return data_uri(encode(image, "PNG"), "image/png")


@lru_cache(maxsize=32)
def generated_jpeg(spec: ImageSpec, seed: int = 0) -> bytes:
    """The encoded JPEG of a generated image (made once per size and seed per process)."""
    return encode(make_image(spec.width, spec.height, seed), quality=JPEG_QUALITY)


class ImageSource:
    """One encoded image that `data_uri()` hands out with a new marker each call (thread-safe)."""

    _counter = itertools.count()
    _lock = threading.Lock()

    def __init__(self, name: str, data: bytes, mime: str) -> None:
        self.name = name
        self.data = data
        self.mime = mime
        head_length, self._make_marker = _splice_point(data)
        self._head = data[:head_length]
        self._tail_b64 = base64.b64encode(data[head_length:]).decode()
        self._prefix = f"data:{mime};base64,"

    @classmethod
    def generated(cls, spec: ImageSpec, seed: int = 0) -> ImageSource:
        return cls(spec.name, generated_jpeg(spec, seed), "image/jpeg")

    @classmethod
    def from_file(cls, path: str | Path) -> ImageSource:
        path = Path(path)
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return cls(path.name, path.read_bytes(), mime)

    @property
    def unique(self) -> bool:
        """False for formats the source cannot mark: those are sent as they are."""
        return self._make_marker is not None

    def unique_bytes(self) -> bytes:
        """The image's bytes with a new marker (what `data_uri()` carries)."""
        if self._make_marker is None:
            return self.data
        return self._head + self._make_marker(self._next_id()) + self.data[len(self._head):]

    def data_uri(self) -> str:
        if self._make_marker is None:
            return self._prefix + self._tail_b64
        head = self._head + self._make_marker(self._next_id())
        return self._prefix + base64.b64encode(head).decode() + self._tail_b64

    def _next_id(self) -> bytes:
        with self._lock:
            return b"%016d" % next(self._counter)


def _splice_point(data: bytes) -> tuple[int, Callable[[bytes], bytes] | None]:
    """Where the marker goes, and a function making it from a 16-byte id (None: no marker)."""
    if data[:2] == b"\xff\xd8":  # JPEG: SOI, then a COM segment
        # 2 (SOI) + 2 (COM) + 2 (length) + 18 (payload) = 24 bytes, a multiple of 3.
        return 2, lambda uid: b"\xff\xfe" + struct.pack(">H", 20) + b"mb" + uid
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
        # Signature (8) + IHDR chunk (4 + 4 + 13 + 4) = 33, + our chunk (12 + 18) = 63 bytes.
        return 33, lambda uid: _png_chunk(b"tEXt", b"m\x00" + uid)
    return 0, None


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (struct.pack(">I", len(payload)) + kind + payload
            + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF))
