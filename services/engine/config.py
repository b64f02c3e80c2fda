"""The engine role's settings, each backend's in a section of its own (`hf`, `vllm`).

One home for every engine setting: the backends read their section from here, and the engine
role imports no backend. Import-light (no torch, no vLLM): the CLI and the launcher read it
without loading a backend.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from mmlane.common.config import (
    IMAGE_NICE,
    MM_CACHE_GB,
    OpsConfig,
    SecurityConfig,
    _positive,
    check_nice,
    ipc,
    process_name,
)
from mmlane.common.feature_cache import capacity_bytes
from mmlane.common.settings import WHOLE
from mmlane.protocol.errors import FatalError

Backend = Literal["hf", "vllm", "vllm-remote"]
"""What runs the model; each name has a factory in services/engine/runner.py's BACKENDS."""


class HFConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The 'hf' backend's settings (services/engine/hf/): the embedded reference runner."""

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
    grammar_cache_size: int = 64
    """Structured-output grammars kept compiled, the most recently used (one per JSON schema):
    a request whose schema is among them starts without compiling it."""
    def __post_init__(self) -> None:
        _positive(self, "prefill_chunk_tokens", "max_batch", "grammar_cache_size")
        _automatic(self, "torch_threads")


class VisionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The vision lane's settings (services/engine/vision.py): where images' vision-encoder
    passes run, on a thread of their own, apart from text work. The 'hf' backend always runs
    one; the 'vllm' and 'vllm-remote' backends with --encoder-lane."""

    vision_threads: int = 0
    """Threads torch may use for one CPU operation of a vision pass. 0: hf, as --torch-threads;
    vllm, every core this process may run on but two, and at least one."""
    image_nice: int = IMAGE_NICE
    """Nice steps (0-19) below text work that the vision lane's thread runs (`mmlane serve`
    sets the MM worker's --image-nice too). Where cores are shared, text work takes one first,
    and image work gets what text leaves idle (at 10 about a tenth of a core that text fills).
    0: off. Linux counts niceness per thread."""
    encoder_cache_gb: float = 0.125
    """GiB of vision-encoder outputs kept by image hash, the most recently used (hf: on the
    model's device; vllm --encoder-lane: in this process's memory): a repeated image (one the
    MM worker hashed: its cache on, or a client uuid) skips its vision pass, with the same bits
    as running it again. 0: off. Sized for a laptop; an image's outputs are its image tokens
    times the hidden size times the dtype's bytes (Qwen2-VL-7B, 1,280 tokens in bfloat16:
    9 MB), so a server gives a few GiB."""

    def __post_init__(self) -> None:
        check_nice(self, "image_nice")
        capacity_bytes(self.encoder_cache_gb, "encoder_cache_gb")  # refuses negative, NaN
        _automatic(self, "vision_threads")


def _automatic(config: msgspec.Struct, name: str) -> None:
    if getattr(config, name) < 0:
        raise ValueError(f"{name} must be 0 (automatic) or more, got {getattr(config, name)}")


class VLLMConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The 'vllm' backend's settings (services/engine/vllm/): import-light, no vLLM."""

    vllm_arg: Annotated[list[str], WHOLE] = []
    """A vLLM engine argument as KEY=VALUE, named as in vLLM's EngineArgs (vllm serve's options
    with underscores, no dashes): tensor_parallel_size=2, gpu_memory_utilization=0.9,
    max_model_len=8192, enable_prefix_caching=true. VALUE is read as JSON when it parses as JSON
    (numbers, true/false, null, lists, objects: commas and all), else as a string. Repeatable
    (one per line in the environment variable); passed to vLLM unchanged and after
    --vllm-args-file's."""
    vllm_args_file: str | None = None
    """A JSON or YAML file (by its suffix: .yaml/.yml is YAML) holding one mapping of vLLM engine
    arguments, as --vllm-arg takes them."""
    vllm_url: Annotated[list[str], WHOLE] = []
    """'vllm-remote' backend: the base URL of a vLLM server started with `vllm serve MODEL
    --enable-scale-out` on the same model directory (http://HOST:PORT); repeatable, one per
    replica. Requests go to its /inference/v1/generate."""
    remote_priority: bool = False
    """'vllm-remote' backend: the replicas schedule by priority (`vllm serve
    --scheduling-policy priority`): text requests are sent ahead of image requests."""
    remote_mm_cache_gb: float = 4.0
    """'vllm-remote' backend: GiB of each replica's engine-core cache of images (vLLM's
    --mm-processor-cache-gb, 4 by default) that mmlane mirrors, so that an image a replica
    holds is sent as its hash alone. Give the replicas' own setting; 0 sends every image in
    full, as is needed where a replica has no such cache (--mm-processor-cache-gb 0, or the
    'shm' cache type, several API servers, or data parallelism behind one address). A replica
    that lacks an image after all ends the request before any token, which is then sent again
    with its images in full (counted in remote_mm_cache_resends)."""
    remote_max_body_mb: float = 0.0
    """'vllm-remote' backend: MiB of the largest request body the replicas take, where a limit
    is set in front of them (a proxy's, an ingress's, a `vllm serve --middleware`; vLLM 0.32
    sets none): a request whose body would be larger (its images in full, base64) is refused
    before it is sent, with an error naming the limit. 0: none known; a replica's 413 answer
    is then the request's error."""
    encoder_lane: bool = False
    """'vllm' and 'vllm-remote' backends: run the model's vision encoder in mmlane's vision lane
    (a thread of the engine role, at --image-nice, on --encoder-device; repeated images from
    --encoder-cache-gb) and hand vLLM each image's embeddings instead of its pixels ('vllm'
    starts vLLM with enable_mm_embeds; a replica's scale-out API takes them as it is): vLLM's
    steps then run only the language model, and a text request no longer waits in a step
    behind an image's encoder pass. Opt-in: the encoder is transformers' implementation, not
    vLLM's, so logprobs may differ from `vllm serve`'s in the last digits (README, "Serving
    with vLLM"). Qwen2-VL, Qwen2.5-VL and LLaVA models (vLLM 0.32 cannot take the other
    families' image embeddings: services/engine/vllm/lane.py, NO_EMBEDS); videos still go as
    pixels."""
    encoder_device: str = "auto"
    """Where --encoder-lane runs the vision encoder: 'auto' (CUDA when available, else CPU),
    'cpu' or 'cuda[:N]' (another GPU than vLLM's keeps the two apart)."""

    def engine_args(self) -> dict[str, Any]:
        """The engine arguments these settings give, the file's first; raises FatalError
        (bad_config) naming what is malformed."""
        args: dict[str, Any] = {}
        if self.vllm_args_file is not None:
            args.update(_read_args_file(Path(self.vllm_args_file)))
        for item in self.vllm_arg:
            key, sep, value = item.partition("=")
            key = key.strip().lstrip("-").replace("-", "_")
            if not sep or not key:
                raise FatalError(f"--vllm-arg takes KEY=VALUE, got {item!r}", code="bad_config")
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
        return args

    def __post_init__(self) -> None:
        self.engine_args()  # a malformed setting fails at startup, before vLLM loads
        capacity_bytes(self.remote_mm_cache_gb, "remote_mm_cache_gb")  # refuses negative, NaN
        if not (math.isfinite(self.remote_max_body_mb) and self.remote_max_body_mb >= 0):
            raise FatalError(f"remote_max_body_mb must be a number >= 0 (MiB; 0: no limit "
                             f"known), got {self.remote_max_body_mb}", code="bad_config")


def _read_args_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FatalError(f"cannot read --vllm-args-file {path}: {exc}", code="bad_config") from exc
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # vLLM depends on PyYAML

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json's ValueError, yaml's YAMLError
        raise FatalError(f"--vllm-args-file {path} is malformed: {exc}", code="bad_config") from exc
    if not isinstance(data, dict):
        raise FatalError(
            f"--vllm-args-file {path} must hold one mapping of engine arguments, "
            f"got {type(data).__name__}", code="bad_config",
        )
    return {str(key).replace("-", "_"): value for key, value in data.items()}


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """Local Hugging Face model directory; None builds and uses the embedded tiny-qwen2-vl."""
    engine_endpoint: str = ""
    """Where the engine binds its request socket (PULL); frontends and MM workers connect."""
    max_queued_requests: int = 1024
    """Requests held at once; above it new ones get an 'overloaded' error."""
    mm_cache_gb: float = MM_CACHE_GB
    """The most GiB of tensors one receiver cache may hold; 0 caches nothing. The engine keeps
    one per MM worker lane (each worker has two: images, videos), mirroring that worker's own
    --mm-cache-gb, which must not be larger. Sized for a laptop; on a server, 4 or more."""
    backend: Backend = "hf"
    """What runs the model: 'hf' (transformers and torch in this process), 'vllm' (vLLM's
    AsyncLLM, which runs its engine core and workers in processes of its own; needs the vllm
    extra: see README, "Serving with vLLM") or 'vllm-remote' (vLLM servers of their own, at
    --vllm-url; needs the vllm-remote extra, not vLLM; every family but Mistral 3, InternVL
    and Idefics3, whose image spans vLLM's scale-out API cannot mark)."""
    hf: HFConfig = msgspec.field(default_factory=HFConfig)
    """The 'hf' backend's settings."""
    vision: VisionConfig = msgspec.field(default_factory=VisionConfig)
    """The vision lane's settings (both backends)."""
    vllm: VLLMConfig = msgspec.field(default_factory=VLLMConfig)
    """The 'vllm' backend's settings."""
    ops: OpsConfig = msgspec.field(default_factory=OpsConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        self.engine_endpoint = self.engine_endpoint or ipc("engine")
        self.ops = self.ops.named(process_name("engine", self.engine_endpoint))
        capacity_bytes(self.mm_cache_gb)
        _positive(self, "max_queued_requests")
