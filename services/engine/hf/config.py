"""The Hugging Face backend's settings, nested in EngineConfig as `hf` (import-light: no torch)."""

from __future__ import annotations

import math

import msgspec

from services.common.config import IMAGE_NICE, _positive, check_nice
from services.common.feature_cache import capacity_bytes

MAX_BATCH = 16
"""The most requests one decode step runs by default."""
GRAMMAR_CACHE_SIZE = 64
"""Structured-output grammars kept compiled by default."""
MAX_UNIT_MS = 5.0
"""About how long a unit may take while interactive work waits, by default."""
IDLE_UNIT_MS = 100.0
"""About how long a unit may take while none waits and text is quiet, by default: the tiny
model's 1024x1024 prompt (1,267 tokens) prefilled in about 4 units instead of 11 on the 2-core
CPU VM, 29-32 ms sooner (BENCHMARKS.md, "Idle units while text is quiet")."""
PREFILL_CHUNK_TOKENS = 128
"""The prefill chunk size by default: the same in every engine, so that every start and replica
gives a request the same bits. On the 2-core CPU VM a chunk of the tiny model took 3.7-4.4 ms,
about --max-unit-ms; a unit runs as many whole chunks as fit its budget (hf/budget.py)."""


class HFConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda[:N]'."""
    max_unit_ms: float = MAX_UNIT_MS
    """About how long one unit of work (a run of a text prompt's prefill chunks) may take
    while another interactive request waits for it (default 5): what a text request waits
    behind another's prefill (image prompts prefill on the bulk lane and vision passes run on
    the vision lane, beside). Costs are timed on the loaded model at startup and kept current
    from the units that run (see hf/budget.py)."""
    idle_unit_ms: float = IDLE_UNIT_MS
    """About how long a unit may take while no other interactive request waits and no other
    text-only request has arrived for 5 s (default 100): a long text prompt that comes alone
    prefills in a few large units, which cost less per token; a text request that arrives
    during one waits for all of it, so under a stream of text units keep to --max-unit-ms.
    An image prompt's units, on the bulk lane, which no text request waits for, take this
    long always. 0: always as --max-unit-ms."""
    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS
    """The tokens of one prefill chunk, fixed for every request (chunk boundaries change a
    prompt's bits, and the prefix cache shares chunks of one size). 0: derived at startup, the
    largest power of two from 16 to 4096 whose prefill takes at most --max-unit-ms on this
    device (logged); timed, so it may differ between starts and replicas, and a request's
    tokens with it."""
    max_batch: int = MAX_BATCH
    """The most requests one decode step runs together (1: one at a time). A batched step
    gives each request the same logits, bit for bit, as a step of its own (see runner.py)."""
    torch_threads: int = 0
    """Threads torch may use for one CPU operation. 0: every core this process may run on but
    two, and at least one, since an MM worker and a frontend on the same machine need theirs:
    torch threads that wait for a busy core make each unit many times slower."""
    vision_threads: int = 0
    """Threads torch may use for one CPU operation of a vision pass, which runs on the engine's
    vision lane, beside the other units. 0: as --torch-threads."""
    vision_idle_threads: int = 0
    """The same for a pass that starts while no request could run a unit meanwhile (each waits
    for an image's features, as one request at a time does): the pass is then all that stands
    between a request and its first token, and the cores the other units would take are free.
    0: every core this process may run on. Only where a probe image's features are the same
    bits on both counts (checked at startup on the CPU; else as --vision-threads)."""
    image_nice: int = IMAGE_NICE
    """Nice steps (0-19) below text work that image work runs: here the threads of the vision
    and bulk lanes (`mmlane serve` sets the MM worker's --image-nice too). Where cores are
    shared, a text request's unit takes one first, and image work gets what text leaves idle
    (at 10 about a tenth of a core that text fills). 0: off. Linux counts niceness per
    thread."""
    grammar_cache_size: int = GRAMMAR_CACHE_SIZE
    """Structured-output grammars kept compiled, the most recently used (one per JSON schema):
    a request whose schema is among them starts without compiling it."""
    encoder_cache_gb: float = 1.0
    """GiB of vision-encoder outputs kept by image hash, the most recently used, on the model's
    device: a repeated image (one the MM worker hashed: its cache on, or a client uuid) skips
    its vision pass, with the same bits as running it again. 0: off."""
    prefix_cache_gb: float = 1.0
    """GiB of prompt prefixes' KV kept, the most recently used, on the model's device, in
    chunks of --prefill-chunk-tokens: a prompt that starts with the same tokens and images as
    a recent one (a shared system prompt, the same image asked about again) prefills only the
    rest, and an image wholly inside the reused prefix skips its vision pass; the same logits
    as prefilling it again. 0: off."""

    def __post_init__(self) -> None:
        _positive(self, "max_unit_ms", "max_batch", "grammar_cache_size")
        if not math.isfinite(self.max_unit_ms):
            raise ValueError(f"max_unit_ms must be finite, got {self.max_unit_ms}")
        if not (0 <= self.idle_unit_ms < math.inf):
            raise ValueError(f"idle_unit_ms must be 0 (as max_unit_ms) or more, and finite, "
                             f"got {self.idle_unit_ms}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be 0 (derived) or more, "
                             f"got {self.prefill_chunk_tokens}")
        capacity_bytes(self.encoder_cache_gb, "encoder_cache_gb")  # refuses negative, NaN
        capacity_bytes(self.prefix_cache_gb, "prefix_cache_gb")
        check_nice(self, "image_nice")
        for name in ("torch_threads", "vision_threads", "vision_idle_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (automatic) or more, "
                                 f"got {getattr(self, name)}")
