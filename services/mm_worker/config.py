"""The MM worker role's settings. Import-light (no torch): the CLI and the launcher read it
without loading the image stack."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from mmlane.common.config import (
    IMAGE_NICE,
    MM_CACHE_GB,
    ImageBackend,
    OpsConfig,
    SecurityConfig,
    _positive,
    check_nice,
    ipc,
    process_name,
    usable_cores,
)
from mmlane.common.feature_cache import capacity_bytes

VIDEO_THREADS = 2
"""Videos decoded at once without a pool, by default (`MMWorkerConfig.video_processes`)."""


class VideoLimits(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How big a video may be; over any bound the video is refused (`video_too_large`).

    Together the bounds cap a video's memory: at most `max_video_frames * max_video_frame_pixels
    * 3` bytes of frames (1.6 GB with the defaults), plus `max_video_bytes` of input and the few
    frames the decoder holds for reference.
    """

    max_video_bytes: int = 256 * 1024 * 1024
    """Largest encoded video accepted, in bytes (256 MiB)."""
    max_video_duration_s: float = 600.0
    """A video's seconds at most, as its container claims them and as its frames' timestamps
    run (10 minutes)."""
    max_video_frames: int = 256
    """Frames the sampling may keep of one video (Qwen2-VL's default 2 fps keeps 256 from
    128 s); a request's `mm_processor_kwargs.num_frames` may ask for no more."""
    max_video_frame_pixels: int = 1920 * 1080
    """Width times height of one video frame (1080p)."""
    max_video_decode_s: float = 60.0
    """Wall-clock seconds to open, scan and decode one video (with a pool, a process that holds
    one twice as long, stuck in a decoder call, is stopped)."""

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if not getattr(self, name) > 0:
                raise ValueError(f"VideoLimits.{name} must be positive, got {getattr(self, name)}")


class MMWorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """Local Hugging Face model directory (its tokenizer and image processor are used)."""
    mm_worker_endpoint: str = ""
    """Where this MM worker binds its job socket (PULL); frontends connect. "": ipc://RUN_DIR/mm-worker.sock."""
    engine_endpoint: str = ""
    """The engine's request socket. "": ipc://RUN_DIR/engine.sock."""
    allowed_media_dir: str | None = None
    """file:// image paths are allowed only under this folder; None refuses every file:// URL."""
    max_image_pixels: int = 64_000_000
    """Images with more pixels are refused before the full decode (decompression-bomb guard)."""
    max_image_bytes: int = 64 * 1024 * 1024
    """Largest encoded image accepted, in bytes."""
    mm_cache_gb: float = MM_CACHE_GB
    """Capacity of each lane's sender cache (images, videos), in GiB of the tensors it stands
    for: the engine holds them, mirroring it; 0 turns the feature cache off for this worker.
    Sized for a laptop; on a server, what repeats: 4 or more."""
    mm_hash: Literal["blake3", "sha256"] = "blake3"
    """The hash that names an image in the caches (sha256 where FIPS requires it)."""
    allowed_media_schemes: list[str] = msgspec.field(default_factory=lambda: ["data", "https"])
    """URL schemes image URLs may use: any of data, https, http (file:// has its own rule,
    `allowed_media_dir`)."""
    allow_http_media: bool = False
    """Also allow plain http:// image URLs (adds http to `allowed_media_schemes`)."""
    allowed_media_domains: list[str] = []
    """When set, http(s) image hosts must be one of these domains or a subdomain of one."""
    allow_internal_media: bool = False
    """Allow image URLs that resolve to loopback or private addresses (link-local, multicast
    and reserved addresses stay refused)."""
    media_max_redirects: int = 3
    """Redirects followed when fetching an image; each target is checked again."""
    media_connect_timeout_s: float = 5.0
    """Seconds to open one connection to an image's host."""
    media_fetch_timeout_s: float = 20.0
    """Seconds one image fetch may take in all, retries included."""
    media_fetch_retries: int = 2
    """Retries, with backoff, after a timeout or a 5xx answer (never after another error)."""
    fetch_ahead_jobs: int = 64
    """Jobs received ahead of the one being processed, so their image fetches start early."""
    image_backend: ImageBackend = "auto"
    """The image processor's backend: auto (torchvision when it imports, as transformers and
    vLLM choose; else pil), pil (the reference; no torchvision needed) or torchvision."""
    mm_processes: int = 0
    """Processes that decode and process images for this worker, in order all the same (1: the
    worker's own thread does it); 0: one per 4 cores this process may use, at least 1, but one
    per core under `mmlane serve --backend vllm-remote` without --encoder-lane (no model on the
    host: its cores are the preprocessing tier's, image work niced below text)."""
    video_processes: int = 0
    """How many videos are decoded and processed at once: in that many of the `mm_processes`
    pool processes (images go first to whichever process is free, so a stream of videos delays
    them by no more than these processes), or without a pool (`mm_processes` 1) on that many
    threads of the video lane's own, beside the image lane's thread. 0: half the pool, at least
    1; without a pool, 2 (where a busy engine shares the cores, two niced decodes get about
    twice the CPU of one: BENCHMARKS.md, "Video")."""
    jpeg_draft: bool = False
    """Decode a JPEG at least twice as large on both sides as the image processor resizes it
    to at 1/2, 1/4 or 1/8 of its size (libjpeg's reduce-on-decode), never below the processor's
    size and only where its tensor shapes and token count stay the same: about 2x less work
    per 12 MP photo for a 1 MP model, but NOT bit-exact (README; BENCHMARKS.md measures the
    difference). The image hash covers the setting, so a drafted image and the same bytes
    decoded exactly never share a hash in any cache (the engine's, vLLM's)."""
    shm_transport_mb: float = 1024.0
    """With an ipc:// engine endpoint (the engine on this host), tensors of 1 MiB or more go to
    the engine through shared-memory slots (/dev/shm, reused) rather than as ZMQ frames: at
    most this many MiB of slots; a tensor that finds none free and no room goes as a frame.
    0: frames only."""
    image_nice: int = IMAGE_NICE
    """Nice steps (0-19) below its own start this worker runs (every thread, and its image
    processes): where it shares cores with a frontend or an engine, their text work takes a
    core first, and images get what text leaves idle (at 10 about a tenth of a core that text
    fills). 0: off. Linux counts niceness per thread."""
    video: VideoLimits = msgspec.field(default_factory=VideoLimits)
    ops: OpsConfig = msgspec.field(default_factory=OpsConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        capacity_bytes(self.mm_cache_gb)
        check_nice(self, "image_nice")
        if self.shm_transport_mb < 0:
            raise ValueError(f"shm_transport_mb must be 0 or more, got {self.shm_transport_mb}")
        self.allowed_media_schemes = [s.lower() for s in self.allowed_media_schemes]
        if self.allow_http_media and "http" not in self.allowed_media_schemes:
            self.allowed_media_schemes.append("http")
        self.allowed_media_domains = [d.lower() for d in self.allowed_media_domains]
        unknown = set(self.allowed_media_schemes) - {"data", "https", "http"}
        if unknown:
            raise ValueError(f"allowed_media_schemes: unknown scheme(s) {sorted(unknown)} "
                             "(choose from data, https, http)")
        _positive(self, "media_connect_timeout_s", "media_fetch_timeout_s", "fetch_ahead_jobs")
        if self.mm_processes < 0:
            raise ValueError(f"mm_processes must be 0 (by the cores) or more, got "
                             f"{self.mm_processes}")
        self.mm_processes = self.mm_processes or max(1, usable_cores() // 4)
        pooled = self.mm_processes > 1
        if self.video_processes < 0 or (pooled and self.video_processes > self.mm_processes):
            raise ValueError(f"video_processes must be 0 (the default) or more, at most "
                             f"mm_processes ({self.mm_processes}) with a pool, got "
                             f"{self.video_processes}")
        self.video_processes = self.video_processes or (
            max(1, self.mm_processes // 2) if pooled else VIDEO_THREADS)
        if self.media_max_redirects < 0 or self.media_fetch_retries < 0:
            raise ValueError("media_max_redirects and media_fetch_retries must be 0 or more")
        self.mm_worker_endpoint = self.mm_worker_endpoint or ipc("mm-worker")
        self.ops = self.ops.named(process_name("mm-worker", self.mm_worker_endpoint))
        self.engine_endpoint = self.engine_endpoint or ipc("engine")
        _positive(self, "max_image_pixels", "max_image_bytes")
        if self.allowed_media_dir is not None and not Path(self.allowed_media_dir).is_dir():
            raise ValueError(f"allowed_media_dir {self.allowed_media_dir!r} is not a directory")
