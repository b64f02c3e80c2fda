"""The vLLM backend's settings, nested in EngineConfig as `vllm` (import-light: no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import msgspec

from protocol.errors import FatalError
from services.common.settings import WHOLE


class VLLMConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
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
