"""The bench's settings: one typed, validated Struct, built from `python -m bench`'s arguments."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from mmlane.common.config import default_of
from mmlane.frontend.config import FrontendConfig
from mmlane.launcher import ServeConfig
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.protocol.errors import FatalError

MODES = ("shared", "split", "mmlane")
"""Every mode the bench knows, in the order it runs them (see the package docstring)."""

_SIZE = re.compile(r"^(\d+)(?:x(\d+))?$")


class ImageSpec(msgspec.Struct, frozen=True):
    """A generated test image's size; `name` is how settings and results spell it."""

    width: int
    height: int

    @property
    def name(self) -> str:
        return str(self.width) if self.width == self.height else f"{self.width}x{self.height}"


def parse_size(text: str) -> ImageSpec:
    """`512` (a square) or `4032x3024` (width x height)."""
    match = _SIZE.match(text.strip())
    if match is None or int(match[1]) < 1 or int(match[2] or match[1]) < 1:
        raise ValueError(f"image size {text!r} is not N or WxH with positive integers")
    width = int(match[1])
    return ImageSpec(width, int(match[2] or width))


class BenchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    modes: list[str] = msgspec.field(default_factory=lambda: list(MODES))
    """Which modes to run, in this order."""
    model: str | None = None
    """Local Hugging Face model directory; None uses the embedded tiny-qwen2-vl."""
    text_rate: float = 20.0
    """Text-only requests per second (Poisson arrivals) in the idle and in every load phase."""
    text_words: int = 32
    """Words in each text request's prompt."""
    image_rates: list[float] = msgspec.field(default_factory=lambda: [1.0, 3.0, 8.0])
    """Image requests per second (Poisson) of each load phase, in order; the last one is the
    'saturating' load the goals are judged at, so make it more than the machine can take."""
    image_sizes: list[str] = msgspec.field(
        default_factory=lambda: ["512", "1024", "2048", "4032x3024"]
    )
    """Sizes of the generated JPEGs that load-phase image requests carry, used in turn."""
    image_files: list[str] = []
    """Real image files to send instead of generated ones (used in turn), as they are on disk."""
    images_per_request: int = 1
    idle_s: float = 10.0
    """Length of the idle phase: text requests only."""
    phase_s: float = 20.0
    """Length of each load phase (arrivals are offered for this long, then it drains). Long
    enough that the saturating phase's images/s is steady state, not its fill and drain."""
    max_tokens: int = 1
    """Output tokens each text and image request asks for."""
    pool_size: int = 4
    """`shared` mode: threads of the one pool that tokenizes and preprocesses images."""
    tokenizer_workers: int = default_of(FrontendConfig, "tokenizer_workers")
    """`split` and `mmlane` modes: tokenizer threads (split's MM executor has one thread, like
    mmlane's MM worker)."""
    probe_sizes: list[str] = msgspec.field(default_factory=lambda: ["512", "1024", "2048"])
    """Image sizes of the probe workload: one probe phase per size."""
    probe_loops: int = 4
    """Closed-loop image clients during each probe phase (each keeps one request in flight)."""
    probe_s: float = 4.0
    """Length of each probe phase."""
    probe_idle_s: float = 2.0
    """Length of the probe baseline phase (probes only, no image load)."""
    probe_interval_ms: float = 10.0
    """How often a probe is sent."""
    drain_timeout_s: float = 60.0
    """How long a phase may take to finish its requests after its arrivals stop."""
    seed: int = 0
    """Seeds the arrival times, the prompts and the generated images."""
    mmlane_endpoint: str | None = None
    """A running mmlane's client address to measure instead of starting one (then its engine
    service time and its processes' CPU are not known: those figures are null)."""
    serve_args: list[str] = []
    """Extra `mmlane serve` arguments: mmlane's roles start as serve starts them with these, and
    the engine every mode shares gets serve's engine arguments (e.g. `--torch-threads 1`)."""
    startup_timeout_s: float = default_of(ServeConfig, "startup_timeout_s")
    """Seconds to wait for every process the bench starts to report ready (as serve's)."""
    max_image_pixels: int = default_of(MMWorkerConfig, "max_image_pixels")
    """Images with more pixels are refused, in every mode (as the MM worker's)."""
    throughput: bool = False
    """Run the MM lane throughput comparison instead of the modes: images/s of in-process
    designs (1 and 2 threads; float and uint8 pixels) and of MM worker processes
    (bench/throughput.py)."""
    throughput_size: str = "4032x3024"
    """The throughput run's JPEG size."""
    throughput_images: int = 24
    """Images each design preprocesses per round of the throughput run."""
    throughput_processes: list[int] = []
    """The MM workers' `--mm-processes` settings in the throughput run; empty: 1, 2 and every
    core."""
    throughput_rounds: int = 2
    """Rounds of the throughput run, the designs alternating within each."""

    def __post_init__(self) -> None:
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes must be some of {', '.join(MODES)}, got {self.modes}")
        for name in ("text_words", "images_per_request", "max_tokens", "pool_size",
                     "tokenizer_workers", "probe_loops", "max_image_pixels",
                     "throughput_images", "throughput_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("text_rate", "idle_s", "phase_s", "probe_s", "probe_idle_s",
                     "probe_interval_ms", "drain_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.image_rates or any(rate <= 0 for rate in self.image_rates):
            raise ValueError(f"image_rates must be positive numbers, got {self.image_rates}")
        for size in [*self.image_sizes, *self.probe_sizes, self.throughput_size]:
            parse_size(size)
        if any(n < 1 for n in self.throughput_processes):
            raise ValueError(f"throughput_processes must be at least 1, got "
                             f"{self.throughput_processes}")
        if not self.image_sizes and not self.image_files:
            raise ValueError("give at least one image size or image file")
        for path in self.image_files:
            if not Path(path).is_file():
                raise ValueError(f"image file {path!r} does not exist")

    @property
    def sweep_sizes(self) -> list[ImageSpec]:
        return [parse_size(size) for size in self.image_sizes]

    @property
    def probe_specs(self) -> list[ImageSpec]:
        return [parse_size(size) for size in self.probe_sizes]


def load_bench_config(values: dict) -> BenchConfig:
    """Build the config, refusing unknown keys and bad values with a message naming them."""
    try:
        return msgspec.convert(values, BenchConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise FatalError(f"invalid bench settings: {exc}", code="bad_config") from exc
