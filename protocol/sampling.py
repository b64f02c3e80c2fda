"""Sampling settings, declared once: the client's request carries them and the engine request
carries them on, and one function checks them wherever they arrive.

    SamplingFields       the fields, their defaults and meanings (as in vLLM's SamplingParams)
    SamplingParams       those fields as the engine request's compact part
    check_sampling(...)  raise RequestError naming the first field out of range
"""

from __future__ import annotations

import msgspec

from protocol.errors import RequestError

MAX_LOGPROBS = 20
"""The most `logprobs` a request may ask for (OpenAI's bound on top_logprobs, vLLM's default
max_logprobs)."""


class SamplingFields(msgspec.Struct, kw_only=True, frozen=True):
    """How to pick output tokens: greedy when temperature is 0, else seeded sampling. Each
    field is named and means as in vLLM's SamplingParams (the vllm backend passes them on)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    """Go on past the model's end-of-sequence tokens (benchmarks ask for exactly max_tokens)."""
    min_tokens: int = 0
    """No end-of-sequence or stop token is picked before this many output tokens."""
    stop_token_ids: list[int] = []
    """More tokens that end the output (finish_reason "stop"), included in it as eos is."""
    logprobs: int | None = None
    """Return each output token's log probability and those of this many most likely tokens at
    its position (0: the output token's alone); None: none."""


class SamplingParams(SamplingFields, array_like=True):
    """The sampling fields of a request on its way to the engine."""


def sampling_of(fields: SamplingFields) -> SamplingParams:
    """The SamplingParams part of anything that carries the sampling fields."""
    return SamplingParams(**{name: getattr(fields, name)
                             for name in SamplingFields.__struct_fields__})


def check_sampling(fields: SamplingFields, *, vocab_size: int | None = None,
                   prefix: str = "") -> None:
    """Raise RequestError naming the first field (as `prefix` + its name) out of its range;
    token ids are checked against `vocab_size` where it is known."""
    if fields.max_tokens < 1:
        raise RequestError(f"{prefix}max_tokens must be at least 1, got {fields.max_tokens}")
    if not fields.temperature >= 0:  # also refuses NaN
        raise RequestError(f"{prefix}temperature must be >= 0, got {fields.temperature}")
    if not 0 < fields.top_p <= 1:
        raise RequestError(f"{prefix}top_p must be in (0, 1], got {fields.top_p}")
    if not 0 <= fields.min_tokens <= fields.max_tokens:
        raise RequestError(f"{prefix}min_tokens must be in 0..{prefix}max_tokens "
                           f"({fields.max_tokens}), got {fields.min_tokens}")
    if fields.logprobs is not None and not 0 <= fields.logprobs <= MAX_LOGPROBS:
        raise RequestError(f"{prefix}logprobs must be in 0..{MAX_LOGPROBS}, "
                           f"got {fields.logprobs}")
    top = vocab_size - 1 if vocab_size is not None else None
    outside = [token for token in fields.stop_token_ids
               if token < 0 or (top is not None and token > top)]
    if outside:
        where = f"outside the vocabulary (0..{top})" if top is not None else "not a token id"
        raise RequestError(f"{prefix}stop_token_ids: {outside[0]} is {where}")
