"""The engine role's settings; each backend's own settings are a nested sub-config.

Import-light (no torch): the CLI and the launcher read it without loading a backend.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from services.common.config import (
    MM_CACHE_GB,
    OpsConfig,
    SecurityConfig,
    _positive,
    ipc,
    process_name,
)
from services.common.feature_cache import capacity_bytes
from services.engine.hf.config import HFConfig
from services.engine.vllm.config import VLLMConfig

Backend = Literal["hf", "vllm"]
"""What runs the model; each name has a factory in services/engine/runner.py's BACKENDS."""


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """Local Hugging Face model directory; None builds and uses the embedded tiny-qwen2-vl."""
    engine_endpoint: str = ""
    """Where the engine binds its request socket (PULL); frontends and MM workers connect."""
    max_queued_requests: int = 1024
    """Requests held at once; above it new ones get an 'overloaded' error."""
    mm_cache_gb: float = MM_CACHE_GB
    """The most GiB of tensors one MM worker's receiver cache may hold; 0 caches nothing. Each
    receiver cache mirrors its MM worker's own --mm-cache-gb, which must not be larger."""
    backend: Backend = "hf"
    """What runs the model: 'hf' (transformers and torch in this process) or 'vllm' (vLLM's
    AsyncLLM, which runs its engine core and workers in processes of its own; needs the vllm
    extra: see README, "Serving with vLLM")."""
    hf: HFConfig = msgspec.field(default_factory=HFConfig)
    """The 'hf' backend's settings."""
    vllm: VLLMConfig = msgspec.field(default_factory=VLLMConfig)
    """The 'vllm' backend's settings."""
    ops: OpsConfig = msgspec.field(default_factory=OpsConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        self.engine_endpoint = self.engine_endpoint or ipc("engine")
        self.ops = self.ops.named(process_name("engine", self.engine_endpoint))
        capacity_bytes(self.mm_cache_gb)
        _positive(self, "max_queued_requests")
