"""Picking the next token from logits: greedy at temperature 0, else seeded top-p sampling,
after the request's logit bias and penalties; and the logprobs a request asks for."""

from __future__ import annotations

import secrets

import torch

from mmlane.protocol.messages import SamplingParams, TokenLogprobs


class Sampler:
    """One request's token picker. Sampling runs on the CPU with the request's own generator, so
    a seed gives the same tokens on any device and whatever else the engine is running."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.temperature = params.temperature
        self.top_p = params.top_p
        self._generator: torch.Generator | None = None
        if self.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._adjust = _Adjustments.of(params, prompt_token_ids)

    def __call__(self, logits: torch.Tensor, output_ids: list[int]) -> int:
        """The next token for `logits` of shape (vocab,), after the output `output_ids`."""
        logits = self.adjusted(logits, output_ids)
        if self._generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            probs = _keep_top_p(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def adjusted(self, logits: torch.Tensor, output_ids: list[int]) -> torch.Tensor:
        """`logits` after the request's logit bias and penalties (`logits` itself when it asks
        for none): what the token is picked from."""
        return logits if self._adjust is None else self._adjust(logits, output_ids)


class _Adjustments:
    """A request's logit bias and penalties, applied as vLLM's v1 sampler does and in its order,
    to greedy and sampled requests alike: on float32 logits, the bias first, then the
    repetition penalty (on tokens of the prompt and the output), then the frequency and
    presence penalties (on tokens of the output)."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._bias = params.logit_bias or {}
        self._repetition = params.repetition_penalty
        self._frequency = params.frequency_penalty
        self._presence = params.presence_penalty
        self._prompt_token_ids = prompt_token_ids if self._repetition != 1.0 else []
        self._in_prompt: torch.Tensor | None = None  # (vocab,) bool, built at the first call

    @classmethod
    def of(cls, params: SamplingParams, prompt_token_ids: list[int]) -> _Adjustments | None:
        """The request's adjustments; None when it asks for none (they cost nothing then)."""
        asked = (params.logit_bias or params.repetition_penalty != 1.0
                 or params.frequency_penalty or params.presence_penalty)
        return cls(params, prompt_token_ids) if asked else None

    def __call__(self, logits: torch.Tensor, output_ids: list[int]) -> torch.Tensor:
        """`logits` (vocab,) adjusted, as a new float32 tensor."""
        self._prepare(logits)
        logits = logits.float()
        if self._bias:
            logits = logits.index_add(0, self._bias_ids, self._bias_values)
        output = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        if self._repetition != 1.0:
            assert self._in_prompt is not None  # built by _prepare
            seen = self._in_prompt.index_fill(0, output, True)
            scaled = torch.where(logits > 0, logits / self._repetition,
                                 logits * self._repetition)
            logits = torch.where(seen, scaled, logits)
        if self._frequency or self._presence:
            counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
            logits = logits - self._frequency * counts - self._presence * (counts > 0)
        return logits

    def _prepare(self, logits: torch.Tensor) -> None:
        """Build the bias and the prompt's tokens as tensors beside `logits`, once."""
        if self._in_prompt is not None:
            return
        device = logits.device
        self._bias_ids = torch.tensor(list(self._bias), dtype=torch.long, device=device)
        self._bias_values = torch.tensor(list(self._bias.values()), dtype=torch.float32,
                                         device=device)
        prompt = torch.tensor(self._prompt_token_ids, dtype=torch.long, device=device)
        self._in_prompt = torch.zeros(logits.shape[0], dtype=torch.bool,
                                      device=device).index_fill(0, prompt, True)


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches `top_p`."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0  # the top token always stays (its mass_before is 0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def token_logprobs(logits: torch.Tensor, token: int, count: int) -> TokenLogprobs:
    """`token`'s log probability under `logits` (vocab,) and the `count` most likely tokens',
    as vLLM v1 computes them by default (logprobs_mode "raw_logprobs", vllm/v1/sample/sampler.py):
    log_softmax in float32 of the model's raw logits, before temperature, top_p and the
    min_tokens mask; the most likely by torch.topk, so ties come in vLLM's order."""
    logprobs = logits.log_softmax(-1, dtype=torch.float32)
    top = torch.topk(logprobs, count)
    return TokenLogprobs(float(logprobs[token]), top.indices.tolist(), top.values.tolist())
