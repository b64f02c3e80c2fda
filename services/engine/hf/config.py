"""The Hugging Face backend's settings, nested in EngineConfig as `hf` (import-light: no torch)."""

from __future__ import annotations

import msgspec

from services.common.config import IMAGE_NICE, _positive, check_nice
from services.common.feature_cache import capacity_bytes


class HFConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda[:N]'."""
    prefill_chunk_tokens: int = 128
    """The prompt tokens one prefill unit runs, the same for every request (chunk boundaries
    change a prompt's bits, so every start and replica gives a request the same tokens): what a
    text request waits for behind another prompt's prefill. 128 took 3.7-4.4 ms on the tiny
    model on a 2-core CPU."""
    max_batch: int = 16
    """The most requests one decode step runs together (1: one at a time). A batched step
    gives each request the same logits, bit for bit, as a step of its own (see runner.py)."""
    torch_threads: int = 0
    """Threads torch may use for one CPU operation. 0: every core this process may run on but
    two, and at least one, since an MM worker and a frontend on the same machine need theirs:
    torch threads that wait for a busy core make each unit many times slower."""
    vision_threads: int = 0
    """Threads torch may use for one CPU operation of a vision pass, which runs on the engine's
    vision lane, beside the model thread's units. 0: as --torch-threads."""
    image_nice: int = IMAGE_NICE
    """Nice steps (0-19) below text work that the vision lane's thread runs (`mmlane serve`
    sets the MM worker's --image-nice too). Where cores are shared, a text request's unit takes
    one first, and image work gets what text leaves idle (at 10 about a tenth of a core that
    text fills). 0: off. Linux counts niceness per thread."""
    grammar_cache_size: int = 64
    """Structured-output grammars kept compiled, the most recently used (one per JSON schema):
    a request whose schema is among them starts without compiling it."""
    encoder_cache_gb: float = 1.0
    """GiB of vision-encoder outputs kept by image hash, the most recently used, on the model's
    device: a repeated image (one the MM worker hashed: its cache on, or a client uuid) skips
    its vision pass, with the same bits as running it again. 0: off."""

    def __post_init__(self) -> None:
        _positive(self, "prefill_chunk_tokens", "max_batch", "grammar_cache_size")
        capacity_bytes(self.encoder_cache_gb, "encoder_cache_gb")  # refuses negative, NaN
        check_nice(self, "image_nice")
        for name in ("torch_threads", "vision_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (automatic) or more, "
                                 f"got {getattr(self, name)}")
