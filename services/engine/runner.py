"""The boundary between the engine role and whatever runs the model.

The engine owns sockets, admission, validation and replies; a runner owns the model and decides
which piece of work runs next. The embedded default is `HFRunner` (hf_runner.py); a backend that
hands rendered requests to a serving engine such as vLLM fits the same interface.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from protocol.errors import MMLaneError
from protocol.messages import EngineRequest, MMItem


@dataclass(frozen=True)
class ModelSpec:
    """What a request is checked against before a runner takes it."""

    family: str
    model_id: str
    """The loaded model's name (its folder's), as health checks and stats report it."""
    image_token_id: int
    eos_token_ids: frozenset[int]
    max_context: int
    """Prompt plus output tokens, at most."""
    vocab_size: int
    image_fields: tuple[str, ...]
    """The tensor names of one image, e.g. pixel_values and image_grid_thw."""
    count_image_tokens: Callable[[Mapping[str, np.ndarray]], int]
    """How many placeholder tokens an image with these (shape-checked) tensors expands to."""
    check_items: Callable[[list[MMItem]], None]
    """Raises RequestError when the images' tensors have shapes the model cannot take."""


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request: new tokens, and how it ended if it did."""

    handle: int
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop' (an eos token, included in token_ids) or 'length' (max_tokens reached)."""
    error: MMLaneError | None = None
    """Set when running the request failed; the request is over."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class ModelRunner(Protocol):
    """Runs validated requests to completion, a bounded piece of work per `step`."""

    spec: ModelSpec

    def add(self, handle: int, request: EngineRequest, *, arrived: float | None = None) -> None:
        """Take a validated request; `handle` names it in outputs and in `abort`. `arrived` is
        when the engine received it (`time.monotonic()`; None: now), for queue-wait stats."""
        ...

    def step(self) -> list[StepOutput]:
        """Run the next bounded unit of work, which may advance several requests (a batched
        decode step: one output each); a request's last output has `finished` set."""
        ...

    def abort(self, handle: int) -> None:
        """Forget a request and free what it holds (its KV cache)."""
        ...

    def has_work(self) -> bool: ...
