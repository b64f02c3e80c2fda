"""Picking the next token from logits: greedy at temperature 0, else seeded top-p sampling; and
the logprobs a request asks for."""

from __future__ import annotations

import secrets

import torch

from protocol.messages import SamplingParams, TokenLogprobs


class Sampler:
    """One request's token picker. Sampling runs on the CPU with the request's own generator, so
    a seed gives the same tokens on any device and whatever else the engine is running."""

    def __init__(self, params: SamplingParams) -> None:
        self.temperature = params.temperature
        self.top_p = params.top_p
        self._generator: torch.Generator | None = None
        if self.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token for `logits` of shape (vocab,)."""
        if self._generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            probs = _keep_top_p(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator))


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
