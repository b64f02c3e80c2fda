"""The boundary between the engine role and whatever runs the model: a backend's runner.

The engine owns sockets, admission, validation and replies; a runner owns the model and decides
which piece of work runs next. Which runner the engine gets is the `backend` setting: BACKENDS
names each backend's factory as 'module:function', imported only when chosen, so the engine
role (and its config) never import a backend it does not run. The factory gets the whole
EngineConfig and reads its own sub-config (e.g. `config.hf`).

A synchronous backend (the built-in "hf") runs a bounded unit of work in each `step`; an
asynchronous one (a serving engine that runs on its own threads or processes, such as vLLM's
AsyncLLM) collects the outputs that are ready. Either way `step` waits, up to its timeout, only
while it has nothing to return, and `wake` ends that wait when new work arrives, so the engine
loop neither spins nor polls.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mmlane.common import cpu_wheels
from mmlane.protocol.errors import MMLaneError
from mmlane.protocol.messages import EngineRequest, MMItem, TokenLogprobs

if TYPE_CHECKING:
    from mmlane.common.stats import Metrics
    from mmlane.engine.config import EngineConfig
    from mmlane.model import PixelNorm
    from mmlane.model.video import VideoPreprocessor

BACKENDS: dict[str, str] = {
    "hf": "mmlane.engine.hf.runner:load",
    "vllm": "mmlane.engine.vllm.runner:load",
    "vllm-remote": "mmlane.engine.vllm.remote:load",
}
"""The factory of each `backend` setting: 'module:function', called as
`function(config, metrics) -> ModelRunner`."""


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
    """How many image tokens (features) an image with these (shape-checked) tensors has."""
    expand_image: Callable[[Mapping[str, np.ndarray]], Sequence[int]]
    """The tokens an image with these (shape-checked) tensors puts in place of its placeholder
    (its span, whose length is the item's `length`): its image tokens, and the family's other
    tokens among them where it has some."""
    check_items: Callable[[list[MMItem]], None]
    """Raises RequestError when the images' tensors have shapes the model cannot take (the
    family's check, services/model/families.py)."""
    pixel_norm: PixelNorm
    """What turns an item's uint8 pixels into the processor's (for rendered requests)."""
    video: VideoPreprocessor | None = None
    """The model's video processing, where the backend runs videos (None: it takes none):
    their tensors' checks, token counts, video token and pixel norm."""

    @classmethod
    def of(cls, preprocessor: Any, model_config: Any, *, vocab_size: int,
           max_context: int, video: VideoPreprocessor | None = None) -> ModelSpec:
        """The spec of a model directory loaded by mmlane.model: its Preprocessor, its
        transformers config (which the family's shape check reads), and what the backend
        runs it with (its vocabulary and context length, its video processing)."""
        family = preprocessor.family
        return cls(
            family=family.name,
            model_id=preprocessor.model_id,
            image_token_id=preprocessor.image_token_id,
            eos_token_ids=frozenset(preprocessor.eos_token_ids),
            max_context=max_context,
            vocab_size=vocab_size,
            image_fields=family.item_fields,
            count_image_tokens=preprocessor.count_image_tokens,
            expand_image=preprocessor.expand_image,
            check_items=family.item_checker(model_config),
            pixel_norm=preprocessor.pixel_norm,
            video=video,
        )


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request: new tokens, and how it ended if it did."""

    handle: int
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop' (an eos token, included in token_ids) or 'length' (max_tokens reached)."""
    error: MMLaneError | None = None
    """Set when running the request failed; the request is over."""
    logprobs: list[TokenLogprobs] | None = None
    """One per token of `token_ids` when the request asked for `sampling.logprobs`."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class ModelRunner(Protocol):
    """Runs validated requests to completion and reports their tokens as `StepOutput`s.

    The engine calls `add`, `step` and `abort` from its main thread only, and `wake` from any.
    After `abort(handle)`, no output for that handle may follow; a request's last output has
    `finished` set, and after it the handle is forgotten.
    """

    spec: ModelSpec

    def add(self, handle: int, request: EngineRequest, *, arrived: float | None = None) -> None:
        """Take a validated request; `handle` names it in outputs and in `abort`. `arrived` is
        when the engine received it (`time.monotonic()`; None: now), for queue-wait stats."""
        ...

    def step(self, timeout: float) -> list[StepOutput]:
        """The outputs of the next bounded piece of work, which may advance several requests
        (a batched decode step: one output each). With none ready, wait up to `timeout`
        seconds for some, or until `wake`; [] when none came."""
        ...

    def wake(self) -> None:
        """End a `step` that is waiting, or the next one, now: the engine has new work."""
        ...

    def abort(self, handle: int) -> None:
        """Forget a request and free what it holds (its KV cache)."""
        ...

    def close(self) -> None:
        """Free what the runner holds beyond this process's memory (vLLM's processes); the
        engine calls it last."""
        ...


RunnerFactory = Callable[["EngineConfig", "Metrics"], ModelRunner]


def backend_factory(backend: str) -> RunnerFactory:
    """The factory BACKENDS names for `backend`, imported now (and only now), after
    `cpu_wheels.apply()`: every backend imports transformers' model code, which imports
    torchvision, before anything else of ours would apply it."""
    cpu_wheels.apply()
    module, _, function = BACKENDS[backend].partition(":")
    factory: RunnerFactory = getattr(importlib.import_module(module), function)
    return factory
