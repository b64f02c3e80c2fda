"""One request's state inside the HF runner, and the units of work it is run in.

A request advances one unit at a time: its images' vision-encoder passes (handed to the vision
lane as one step, services/engine/vision.py; it waits for their features), then its prompt's
prefill, a chunk of `prefill_chunk_tokens` per unit, then one decode step per output token;
the decode steps of several requests may run together, as one batched step (runner.py).
Everything a unit needs is kept here, per request (its own KV cache, its own position ids, its
image embeddings), so units of different requests can run in any interleaving and give the
same tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mmlane.engine.hf.adapters import Positions
from mmlane.engine.hf.sampling import Sampler
from mmlane.model.grammar import Grammar
from mmlane.protocol.messages import EngineRequest


class UnitKind(enum.IntEnum):
    """Ordered by how long a unit usually takes for the same number of tokens."""

    DECODE = 0
    PREFILL = 1
    VISION = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Unit:
    kind: UnitKind
    tokens: int
    """Tokens the unit puts through the model (for VISION, handing its images to the vision
    lane: none)."""


class Sequence:
    """A request in progress: what has been computed so far and what runs next."""

    def __init__(
        self,
        handle: int,
        request: EngineRequest,
        prompt: torch.Tensor,
        cache: DynamicCache,
        eos_token_ids: frozenset[int],
        arrived: float,
        chunk_tokens: int,
        grammar: Grammar | None = None,
    ) -> None:
        self.handle = handle
        self.request = request
        self.prompt = prompt  # (1, prompt_len) on the model's device
        self.cache = cache
        self.arrived = arrived  # time.monotonic() when the engine received the request
        self.positions: Positions | None = None  # computed by the first prefill unit
        self.image_features: list[torch.Tensor | None] = [None] * len(request.mm_items)
        self.image_positions: list[torch.Tensor] = []
        """Each image's token positions in the prompt, where its features go (the runner's)."""
        self.images_waiting = 0
        """Its images whose features the vision lane is computing: it runs no unit meanwhile."""
        self.num_cached = 0  # prompt tokens whose keys and values are in `cache`
        self.chunk_tokens = chunk_tokens
        """The most prompt tokens a prefill unit takes: a chunk's size changes its bits."""
        self.output_ids: list[int] = []
        self.sampler = Sampler(request.sampling, request.prompt_token_ids)
        self.grammar = grammar
        """Where the output is in its structured-output grammar (None: unconstrained)."""
        self.last_run = -1
        """The runner's unit number when this request last advanced (-1: never)."""
        sampling = request.sampling
        ends = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else eos_token_ids)
        self._stop_token_ids = frozenset(ends)
        """Tokens that end the output (eos unless ignored, and the request's stop tokens)."""

    @property
    def prompt_len(self) -> int:
        return self.prompt.shape[1]

    @property
    def kind(self) -> str:
        """'image' or 'text': how stats group requests."""
        return "image" if self.request.mm_items else "text"

    @property
    def decoding(self) -> bool:
        """Whether the whole prompt is in the KV cache: every unit left is a decode step."""
        return self.num_cached == self.prompt_len

    def next_unit(self) -> Unit:
        if not self.decoding:
            if any(map(self.needs_features, range(len(self.image_features)))):
                return Unit(UnitKind.VISION, 0)  # every image is encoded before the prefill
            remaining = self.prompt_len - self.num_cached
            return Unit(UnitKind.PREFILL, min(remaining, self.chunk_tokens))
        return Unit(UnitKind.DECODE, 1)

    def needs_features(self, index: int) -> bool:
        """Whether image `index` still needs its features: not had yet, and the prompt not yet
        in the KV cache."""
        return not self.decoding and self.image_features[index] is None

    def next_token(self, logits: torch.Tensor) -> int:
        """Pick the next token from `logits` (vocab,) and add it to the output: in vLLM's
        order, the grammar's mask (structured output), then the stop tokens masked while the
        output is shorter than min_tokens, then the sampler (bias, penalties, pick)."""
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        token = self.sampler(self._allowed(logits), self.output_ids)
        if self.grammar is not None:
            self.grammar.accept(token)
        self.output_ids.append(token)
        return token

    def _allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the stop tokens masked out while the output is shorter than
        min_tokens, as vLLM does; but where the grammar allows nothing else, they stay."""
        if len(self.output_ids) >= self.request.sampling.min_tokens or not self._stop_token_ids:
            return logits
        masked = logits.clone()
        masked[list(self._stop_token_ids)] = float("-inf")
        if self.grammar is not None and bool(torch.isneginf(masked).all()):
            return logits
        return masked

    def finish_reason(self) -> str | None:
        """Why the request is over after its latest token, or None while it goes on."""
        if self.output_ids[-1] in self._stop_token_ids:
            return "stop"
        if self.grammar is not None and self.grammar.done:
            return "stop"
        if len(self.output_ids) >= self.request.sampling.max_tokens:
            return "length"
        return None
