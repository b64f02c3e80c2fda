"""Reading an image's bytes and decoding them to RGB: where foreign errors become ours.

    load_bytes(url, index, policy, fetched, medium)
                                           an image's or a video's (`Medium`): data:...;base64
                                           URI, allow-listed file:// path, or the result of an
                                           http(s) fetch started earlier
    decode_image(data, index, max_pixels, resized_size)
                                           encoded bytes -> upright RGB PIL image; with the
                                           processor's resize rule, big JPEGs decode reduced

Every failure here is the request's fault and leaves as a `RequestError` whose message starts
with the image's position in the request (`image 2: ...`; a video's: `video 0: ...`), so a
client sending several knows which one was wrong. Codes: `invalid_image` (unreadable data,
missing file), `media_not_allowed` (a scheme or path we refuse) and `image_too_large` (bytes
or pixels); a video's bytes: `invalid_video`, `video_too_large`.
Pillow's exceptions become ours through `mmlane.protocol.errors.translated` (running out of memory
while decoding is no fault of the request's: `overloaded`).

Reduce-on-decode (`--jpeg-draft`, off by default): libjpeg can decode a JPEG at 1/2, 1/4 or 1/8
of its size (Pillow's `Image.draft`), skipping most of the inverse DCT and colour conversion,
which is most of a decode. The image processor then resizes the smaller image to the same size
it would have resized the whole one to: the same tensors' shapes and token count, but not the
same pixels (BENCHMARKS.md, "JPEG reduce-on-decode", has the difference).
"""

from __future__ import annotations

import binascii
import concurrent.futures
import io
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pybase64
from PIL import ExifTags, Image, ImageOps

from mmlane.common.config import default_of
from mmlane.common.memory import keep_freed_memory
from mmlane.mm_worker.config import MMWorkerConfig, VideoLimits
from mmlane.protocol.errors import RequestError, translated

# Modes whose alpha channel is composited on white; other modes carrying a `transparency`
# entry (P, L, RGB with a tRNS colour key) are composited too.
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_16_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_DRAFT_FORMATS = frozenset({"JPEG", "MPO"})  # MPO: a phone's JPEG with extra frames after it
_DRAFT_SCALES = (8, 4, 2)  # libjpeg's reductions that Pillow's draft picks from
_SIDES_SWAPPED = frozenset({5, 6, 7, 8})  # EXIF orientations that exif_transpose turns by 90°

ResizedSize = Callable[[int, int], tuple[int, int]]
"""`(width, height) -> (width, height)`: the image processor's resize rule for an upright image
(`Preprocessor.resized_size`)."""


@dataclass(frozen=True)
class Medium:
    """What a URL is read for: an image or a video, which names it in errors, the data URI
    types it takes, its size bound and its error codes."""

    name: str
    """'image' or 'video': errors start with `{name} {index}: `."""
    max_bytes: int
    bound: str
    """The setting `max_bytes` comes from, named in errors."""

    def invalid(self, index: int, problem: str) -> RequestError:
        return RequestError(f"{self.name} {index}: {problem}", code=f"invalid_{self.name}")

    def too_large(self, index: int, size: str) -> RequestError:
        return RequestError(f"{self.name} {index}: encoded {self.name} is {size}, more than "
                            f"{self.bound} {self.max_bytes}", code=f"{self.name}_too_large")

    def named(self, index: int, exc: RequestError) -> RequestError:
        """A fetch's error (which knows no position, and says image_too_large) as this
        medium's."""
        code = f"{self.name}_too_large" if exc.code == "image_too_large" else exc.code
        return RequestError(f"{self.name} {index}: {exc.message}", code=code)


@dataclass(frozen=True, kw_only=True)
class MediaPolicy:
    """Which image sources are allowed and how big they may be."""

    allowed_media_dir: Path | None
    """Resolved folder that file:// paths must stay inside; None refuses file:// URLs."""
    max_image_bytes: int
    max_image_pixels: int
    allowed_schemes: frozenset[str] = frozenset(
        default_of(MMWorkerConfig, "allowed_media_schemes"))
    """Schemes allowed besides file:// (data, https, http)."""
    jpeg_draft: bool = default_of(MMWorkerConfig, "jpeg_draft")
    """Decode big JPEGs reduced (`MMWorkerConfig.jpeg_draft`; not bit-exact)."""
    video_limits: VideoLimits = VideoLimits()
    """The bounds of a video (`MMWorkerConfig.video`)."""

    @property
    def image(self) -> Medium:
        return Medium("image", self.max_image_bytes, "max_image_bytes")

    @property
    def video(self) -> Medium:
        return Medium("video", self.video_limits.max_video_bytes, "max_video_bytes")

    @classmethod
    def from_config(cls, config: MMWorkerConfig) -> MediaPolicy:
        folder = config.allowed_media_dir
        return cls(
            allowed_media_dir=Path(os.path.realpath(folder)) if folder is not None else None,
            max_image_bytes=config.max_image_bytes,
            max_image_pixels=config.max_image_pixels,
            allowed_schemes=frozenset(config.allowed_media_schemes),
            jpeg_draft=config.jpeg_draft,
            video_limits=config.video,
        )


def is_fetched(url: str) -> bool:
    """Whether this URL is fetched over the network (http or https)."""
    scheme = url.partition(":")[0].lower()
    return scheme in ("http", "https")


def configure_pillow(max_image_pixels: int) -> None:
    """Set up a process that decodes images (it is process-wide, so set it once): Pillow's own
    bomb guard agrees with ours, and the memory of one image's pixels is kept for the next.

    `Image.open` raises `DecompressionBombError` above twice this limit and only warns between
    one and two times it; `decode_image` refuses that band itself, so the warning is noise.
    """
    Image.MAX_IMAGE_PIXELS = max_image_pixels
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    keep_freed_memory()


# ---------------------------------------------------------------- reading the bytes


def load_bytes(
    url: str, index: int, policy: MediaPolicy,
    fetched: concurrent.futures.Future[bytes] | None = None, medium: Medium | None = None,
) -> bytes:
    """The encoded bytes an image's (or `medium`'s: `policy.video`) URL points to; raises
    RequestError naming it.

    An http(s) URL's bytes come from `fetched`, the fetch the worker started when the job
    arrived (`MediaFetcher.submit`); waiting on it here is waiting for this job's own media.
    """
    medium = medium or policy.image
    name = medium.name
    scheme, colon, _ = url.partition(":")
    scheme = scheme.lower() if colon else ""
    if scheme == "file":
        return _read_file_url(url, index, medium, policy)
    if scheme in ("data", "https", "http") and scheme not in policy.allowed_schemes:
        hint = " (allowed with --allow-http-media)" if scheme == "http" else ""
        allowed = ", ".join(sorted(policy.allowed_schemes)) or "none"
        raise RequestError(
            f"{name} {index}: {scheme}: {name} URLs are not allowed{hint} (allowed: {allowed})",
            code="media_not_allowed",
        )
    if scheme == "data":
        return _read_data_uri(url, index, medium)
    if scheme in ("https", "http") and fetched is not None:
        return _fetched_bytes(fetched, index, medium)
    shown = f"{_shorten(scheme, 20)!r} URLs are" if scheme else "a URL without a scheme is"
    raise RequestError(
        f"{name} {index}: {shown} not supported; send a data:{name}/<format>;base64,... URI, "
        "an http(s) URL or a file:// path",
        code="media_not_allowed",
    )


def _fetched_bytes(fetched: concurrent.futures.Future[bytes], index: int,
                   medium: Medium) -> bytes:
    try:
        return fetched.result()
    except RequestError as exc:  # the fetcher's message does not know the position
        raise medium.named(index, exc) from exc


def _read_data_uri(url: str, index: int, medium: Medium) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    media_type, *params = (part.strip().lower() for part in header.split(";"))
    name, max_bytes = medium.name, medium.max_bytes
    if not comma:
        raise medium.invalid(index, "data URI has no ',' before its data")
    if not media_type.startswith(f"{name}/"):
        raise medium.invalid(index, f"data URI has media type {_shorten(media_type, 40)!r}, "
                                    f"not {name}/*")
    if "base64" not in params:
        raise medium.invalid(index, f"data URI is not base64 (expected data:{name}/<format>;"
                                    "base64,...)")
    if len(payload) // 4 * 3 > max_bytes + 3:  # refuse before decoding megabytes for nothing
        raise medium.too_large(index, f"about {len(payload) // 4 * 3} bytes")
    try:  # pybase64 (SIMD): 20x the stdlib's speed on a 7 MB URI, what vLLM decodes with too
        data = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise medium.invalid(index, "data URI is not valid base64") from exc
    if len(data) > max_bytes:
        raise medium.too_large(index, f"{len(data)} bytes")
    return data


def _read_file_url(url: str, index: int, medium: Medium, policy: MediaPolicy) -> bytes:
    folder = policy.allowed_media_dir
    if folder is None:
        raise RequestError(
            f"{medium.name} {index}: file:// URLs are disabled; start with --allowed-media-dir",
            code="media_not_allowed",
        )
    path = _file_url_path(url, index, medium)
    # realpath resolves '..' and every symlink, so a link inside the folder that points
    # outside it is refused like the outside path itself.
    resolved = Path(os.path.realpath(path))
    if not resolved.is_relative_to(folder):
        raise RequestError(
            f"{medium.name} {index}: {_shorten(url, 120)} is outside the allowed media folder",
            code="media_not_allowed",
        )
    return _read_regular_file(resolved, url, index, medium)


def _file_url_path(url: str, index: int, medium: Medium) -> str:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestError(
            f"{medium.name} {index}: file:// URL names host {_shorten(parts.netloc, 40)!r}; "
            "only local paths are allowed",
            code="media_not_allowed",
        )
    if parts.query or parts.fragment:
        raise medium.invalid(index, "file:// URL has a query or fragment (percent-encode '?' "
                                    "and '#')")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise medium.invalid(index, f"file:// URL {_shorten(url, 120)} is not an absolute path")
    return path


def _read_regular_file(path: Path, url: str, index: int, medium: Medium) -> bytes:
    # O_NONBLOCK: opening a FIFO someone placed in the folder must not stall the loop.
    max_bytes = medium.max_bytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise medium.invalid(index, f"no such file: {_shorten(url, 120)}") from exc
    except OSError as exc:
        raise medium.invalid(index, f"cannot open {_shorten(url, 120)}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise medium.invalid(index, f"{_shorten(url, 120)} is not a regular file")
        if info.st_size > max_bytes:
            raise medium.too_large(index, f"{info.st_size} bytes")
        with open(fd, "rb", closefd=False) as file:  # reads until EOF, unlike one os.read
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise medium.invalid(index, f"cannot read {_shorten(url, 120)}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # the file grew after fstat
        raise medium.too_large(index, f"more than {max_bytes} bytes")
    return data


# ---------------------------------------------------------------- decoding


def decode_image(data: bytes, index: int, max_pixels: int,
                 resized_size: ResizedSize | None = None) -> Image.Image:
    """Decode encoded bytes into an upright RGB image; raises RequestError naming the image.

    The pixel count is checked from the header, before the pixels are decoded. With
    `resized_size`, the image processor's resize rule, a JPEG is decoded reduced by
    `jpeg_draft_scale` (not bit-exact); without it, or for any other format, exactly.
    """
    if not data:
        raise _invalid(index, "image is empty (0 bytes)")
    # Decoders of hostile data raise anything (OSError, ValueError, SyntaxError, Pillow's bomb
    # guard): FOREIGN_ERRORS names the types that are not simply an invalid image.
    with translated(f"image {index}", default="invalid_image"), _cut_short(index):
        try:
            image: Image.Image = Image.open(io.BytesIO(data))  # lazy: reads the header only
        except Image.DecompressionBombError as exc:  # above twice the limit: Pillow's guard
            pixels = re.search(r"\((\d+) pixels\)", str(exc))
            size = f"{pixels[1]} pixels" if pixels else "its size"
            raise RequestError(f"image {index}: {size}, more than max_image_pixels "
                               f"{max_pixels}", code="image_too_large") from exc
    _check_pixels(image, index, max_pixels)
    with translated(f"image {index}: cannot decode the {image.format} data",
                    default="invalid_image"), _cut_short(index, image.format):
        if resized_size is not None and image.format in _DRAFT_FORMATS:
            _draft(image, resized_size)
        image.load()
    with translated(f"image {index}: cannot convert the {image.mode} image to RGB",
                    default="invalid_image"):
        ImageOps.exif_transpose(image, in_place=True)
        image = to_rgb(image)
    return image


def jpeg_draft_scale(width: int, height: int, resized_size: ResizedSize) -> int:
    """By how much a JPEG of this upright size may be reduced on decode: the largest of 8, 4
    and 2 that leaves both sides at least as long as the processor resizes them to (so the
    JPEG is at least twice that size on both sides), and from which the processor's rule gives
    that same size, so that the tensors' shapes and token count stay the exact decode's.
    1: decode it whole."""
    try:
        target = resized_size(width, height)
        for scale in _DRAFT_SCALES:
            reduced = (-(-width // scale), -(-height // scale))  # libjpeg rounds up
            if (reduced[0] >= target[0] and reduced[1] >= target[1]
                    and resized_size(*reduced) == target):
                return scale
    except ValueError:  # a size the processor refuses: it says so after the exact decode
        pass
    return 1


def _draft(image: Image.Image, resized_size: ResizedSize) -> None:
    """Make the JPEG decoder reduce `image` by `jpeg_draft_scale` (before `load`)."""
    width, height = image.size
    swapped = image.getexif().get(ExifTags.Base.Orientation) in _SIDES_SWAPPED
    scale = jpeg_draft_scale(*((height, width) if swapped else (width, height)), resized_size)
    if scale > 1:
        # draft picks the largest scale whose reduced size is at least the size asked for:
        # asking for the floor of size/scale gets exactly `scale`.
        image.draft(image.mode, (width // scale, height // scale))


def _check_pixels(image: Image.Image, index: int, max_pixels: int) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise _invalid(index, f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise RequestError(
            f"image {index}: {width}x{height} is {width * height} pixels, "
            f"more than max_image_pixels {max_pixels}",
            code="image_too_large",
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """Any mode to RGB; transparent pixels are composited on white, 16-bit gray scaled down."""
    if image.mode in _16_BIT_MODES:
        # Pillow's own conversion clips 16-bit values at 255, turning most pixels white.
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


# ---------------------------------------------------------------- errors


@contextmanager
def _cut_short(index: int, image_format: str | None = None) -> Iterator[None]:
    """Pillow's word for data that ends early ("Truncated File Read", "image file is
    truncated") said plainly, Pillow's own in parentheses."""
    try:
        yield
    except OSError as exc:
        if "truncated" not in str(exc).lower():
            raise
        what = f"the {image_format} data" if image_format else "the image data"
        raise _invalid(index, f"{what} ends early: the file is cut short or corrupt "
                              f"({exc})") from exc


def _invalid(index: int, problem: str) -> RequestError:
    return RequestError(f"image {index}: {problem}", code="invalid_image")


def _shorten(text: str, limit: int) -> str:
    """Client text quoted in an error, cut so a huge URL cannot flood logs and replies."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
