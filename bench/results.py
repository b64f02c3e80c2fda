"""What `python -m bench` writes to its JSON file: the schema, as msgspec Structs.

`python -m bench --schema` prints it as JSON Schema. Times are milliseconds (`*_ms`) or seconds
(`*_s`); a figure that does not apply to a mode, or had no samples, is null.

    BenchResult
    ├── schema            "mmlane-bench/1"; a new field gets a default, a changed one a new number
    ├── started_at, duration_s, command, machine (cpus, load averages at start and end, versions)
    ├── settings          the BenchConfig the run used
    ├── modes[]           ModeResult, one per mode, in the order they ran
    │   ├── text          text latency idle and under the saturating image load, and the ratios
    │   ├── engine_hold   time until the engine holds the preprocessed request (estimate, and
    │   │                 the exact handoff where the bench can see it: shared, split)
    │   ├── image         image-request latency and images/s under the saturating load
    │   ├── probe[]       tokenizer-probe wait per probe image size
    │   ├── cpu           CPU seconds per text request, per image, per request, by process
    │   ├── engine_service_ms   the calibration that engine_hold subtracts
    │   └── phases[]      PhaseResult: every figure of every phase, the summaries' source
    └── goals[]           issue 5's goals, judged on the mmlane mode of this run

A `Latency` is the percentiles of one set of samples; `n` is 0 and the rest null when empty.
Definitions of every figure: the `bench` package docstring.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from bench.config import BenchConfig

SCHEMA = "mmlane-bench/1"


class Latency(msgspec.Struct, kw_only=True):
    """Percentiles (nearest rank) of one set of durations, in milliseconds."""

    n: int
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    max_ms: float | None = None


class PhaseResult(msgspec.Struct, kw_only=True):
    """One phase of one mode's workload."""

    name: str
    kind: Literal["idle", "load", "probe-idle", "probe"]
    seconds: float
    """How long arrivals were offered."""
    drain_s: float
    """How long the phase's last requests took to finish after arrivals stopped."""
    offered_text_per_s: float
    offered_images_per_s: float
    """Image requests per second times images per request (probe phases: closed loops, 0)."""
    image_size: str | None
    """Probe phases: the size of the probe loops' images."""
    requests: dict[str, int]
    """Requests finished (replied to, failed ones included), by kind: text, image, probe."""
    images: int
    """Images in the image requests that finished without an error."""
    unfinished: int
    """Requests still without a reply when the drain timed out."""
    errors: dict[str, int]
    """Requests that failed, by error code (a probe's expected reply is not an error)."""
    images_per_s: float | None
    """Images finished per second, from the phase's first image submit to its last image reply
    (drain included): under a saturating load, the throughput."""
    text: Latency
    image: Latency
    text_engine_hold: Latency
    image_engine_hold: Latency
    text_handoff: Latency | None
    """shared, split: exact time from submit until the server handed the request to the engine."""
    image_handoff: Latency | None
    probe_roundtrip: Latency | None
    probe_executor_wait: Latency | None
    """shared, split: wait of the no-op submitted to the tokenizer executor every interval."""
    cpu_s: dict[str, float | None]
    """CPU seconds each process used from the phase's start to the end of its drain, and under
    'others' what the rest of the machine used meanwhile (other users, other modes' idle
    processes): the sign of a busy machine."""


class TextResult(msgspec.Struct, kw_only=True):
    idle: Latency
    """The idle phase: text requests only."""
    loaded: Latency
    """The last load phase: text requests under the saturating image load."""
    ratio_p50: float | None
    ratio_p99: float | None
    """loaded p99 / idle p99: the isolation figure."""


class EngineHoldResult(msgspec.Struct, kw_only=True):
    """The estimate (first output - submit - engine service time) for every mode; the exact
    submit-to-handoff time where the bench sees the handoff (shared, split; else null)."""

    text_idle: Latency
    text_loaded: Latency
    image_loaded: Latency
    exact_text_idle: Latency | None
    exact_text_loaded: Latency | None
    exact_image_loaded: Latency | None


class ImageResult(msgspec.Struct, kw_only=True):
    latency: Latency
    """Image requests of the last load phase, submit to finished."""
    images_per_s: float | None
    offered_images_per_s: float
    saturated: bool | None
    """True when the load phase finished fewer than 90% of the images it offered per second."""


class ProbeResult(msgspec.Struct, kw_only=True):
    image_size: str
    wait: Latency
    """The added wait of the tokenizer probe under image load: each probe's round trip minus
    the median round trip of the probe-idle phase (at least 0). The figure compared across modes."""
    roundtrip: Latency
    roundtrip_idle: Latency
    executor_wait: Latency | None
    """shared, split: vLLM's probe, a no-op on the tokenizer executor, submit to start."""
    images_per_s: float | None
    """What the closed image loops got through meanwhile."""


class CpuResult(msgspec.Struct, kw_only=True):
    text_request_s: dict[str, float | None]
    """CPU seconds per text request, by process: the idle phase's CPU / its text requests."""
    image_s: dict[str, float | None]
    """CPU seconds per image, by process: the last load phase's CPU, less its text requests at
    the idle phase's cost, / its images."""
    per_request_s: dict[str, float | None]
    """CPU seconds per request of any kind, by process, over the idle and load phases."""
    others_cores_loaded: float | None
    """Cores' worth of CPU the rest of the machine used during the saturating load phase."""


class ModeResult(msgspec.Struct, kw_only=True):
    mode: str
    design: str
    """One line: where tokenization and image preprocessing run in this mode."""
    processes: dict[str, int]
    """Process name to pid ('bench' is the load generator, the same in every mode)."""
    engine_service_ms: dict[str, float]
    """Request class ('text', an image size, or sizes joined by '+') to the idle engine's time
    from receiving a preprocessed request to its first output reaching the sender."""
    text: TextResult
    engine_hold: EngineHoldResult
    image: ImageResult
    probe: list[ProbeResult]
    cpu: CpuResult
    errors: dict[str, int]
    phases: list[PhaseResult]


class Goal(msgspec.Struct, kw_only=True):
    name: str
    description: str
    value: float | None
    target: float
    met: bool | None
    """None when the run lacks a mode the goal needs."""


class Machine(msgspec.Struct, kw_only=True):
    cpus: int
    platform: str
    python: str
    torch: str
    transformers: str
    load_avg_start: list[float]
    """1, 5 and 15 minute load averages when the run started."""
    load_avg_end: list[float]


class BenchResult(msgspec.Struct, kw_only=True):
    """One run of `python -m bench`."""

    schema: str = SCHEMA
    started_at: str
    """UTC, ISO 8601."""
    duration_s: float
    command: list[str]
    machine: Machine
    settings: BenchConfig
    modes: list[ModeResult]
    goals: list[Goal]
