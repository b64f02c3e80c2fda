"""Sampling settings, declared once: the client's request carries them and the engine request
carries them on, and one function checks them wherever they arrive.

    SamplingFields       the fields, their defaults and meanings (as in vLLM's SamplingParams)
    StructuredOutputs    a constraint on the output's form (vLLM's StructuredOutputsParams)
    SamplingParams       those fields as the engine request's compact part
    check_sampling(...)  raise RequestError naming the first field out of range
"""

from __future__ import annotations

import math

import msgspec

from mmlane.protocol.errors import RequestError

MAX_LOGPROBS = 20
"""The most `logprobs` a request may ask for (OpenAI's bound on top_logprobs, vLLM's default
max_logprobs)."""


class StructuredOutputs(msgspec.Struct, kw_only=True, frozen=True):
    """What the output must be, as in vLLM's StructuredOutputsParams: exactly one field set."""

    json: str | None = None
    """A JSON schema, as JSON text: the output is a JSON value that matches it."""
    regex: str | None = None
    """A regular expression (Rust's regex syntax, as llguidance takes it) the output matches."""
    choice: tuple[str, ...] | None = None
    """The output is one of these texts."""
    grammar: str | None = None
    """A context-free grammar, in Lark's syntax or llama.cpp's GBNF (as vLLM's guidance backend
    takes it): the output is a sentence of it."""
    json_object: bool | None = None
    """True: the output is a JSON object, any object."""
    structural_tag: str | None = None
    """vLLM's structural tag (xgrammar's StructuralTag, as JSON): the tool calls' envelope that
    the HTTP API's tool_choice sets (services/frontend/tools.py); not taken from clients."""

    def kind(self, prefix: str = "") -> str:
        """The one field set, by name; RequestError (naming `prefix`structured_outputs) unless
        exactly one is."""
        given = [name for name in self.__struct_fields__
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"{prefix}structured_outputs: set exactly one of json (a schema), "
                               "regex, choice, grammar and json_object (true), got "
                               f"{', '.join(given) or 'none'}")
        if self.choice is not None and not self.choice:
            raise RequestError(f"{prefix}structured_outputs: choice must hold at least one text")
        return given[0]

    def vllm_fields(self) -> dict[str, object]:
        """The fields as vLLM's StructuredOutputsParams (and its JSON) takes them."""
        fields = msgspec.structs.asdict(self)
        fields["choice"] = None if self.choice is None else list(self.choice)
        return fields


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
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted from the logit of every token already in the output, once."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from a token's logit once for each time it is in the output."""
    repetition_penalty: float = 1.0
    """Above 0: the logits of tokens in the prompt or the output are divided by it where
    positive and multiplied by it where negative (1: no penalty)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a bias in [-100, 100] added to its logit (before the penalties)."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain the output to a JSON schema, JSON objects, a regular expression, one of some
    texts or a grammar; it ends where that form does."""
    logprobs: int | None = None
    """Return each output token's log probability and those of this many most likely tokens at
    its position (0: the output token's alone); None: none."""


class SamplingParams(SamplingFields, array_like=True, frozen=True):
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
    _check_token_ids(f"{prefix}stop_token_ids", fields.stop_token_ids, vocab_size)
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(fields, name) <= 2:
            raise RequestError(f"{prefix}{name} must be in [-2, 2], got {getattr(fields, name)}")
    if not 0 < fields.repetition_penalty < math.inf:
        raise RequestError(f"{prefix}repetition_penalty must be above 0 and finite, "
                           f"got {fields.repetition_penalty}")
    logit_bias = fields.logit_bias or {}
    _check_token_ids(f"{prefix}logit_bias", list(logit_bias), vocab_size)
    for token, bias in logit_bias.items():
        if not -100 <= bias <= 100:
            raise RequestError(f"{prefix}logit_bias: the bias of {token} must be in "
                               f"[-100, 100], got {bias}")
    if fields.structured_outputs is not None:
        fields.structured_outputs.kind(prefix)
    if fields.logprobs is not None and not 0 <= fields.logprobs <= MAX_LOGPROBS:
        raise RequestError(f"{prefix}logprobs must be in 0..{MAX_LOGPROBS}, "
                           f"got {fields.logprobs}")


def _check_token_ids(name: str, tokens: list[int], vocab_size: int | None) -> None:
    top = vocab_size - 1 if vocab_size is not None else None
    outside = [token for token in tokens if token < 0 or (top is not None and token > top)]
    if outside:
        where = f"outside the vocabulary (0..{top})" if top is not None else "not a token id"
        raise RequestError(f"{name}: {outside[0]} is {where}")
