"""Batched decode in the HF runner, in process with the real tiny models: no mocks.

A batched decode step must give each request exactly what it gets alone, whatever else is in the
batch: the same greedy tokens, the same seeded samples, the same tokens after another request of
the batch is aborted. The checks compare tokens for equality, never timings; the runner's startup
check (`max_batch` stays as asked) is what says the logits themselves were the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace
from test_engine import MAX_BATCH, generate_greedy, load_runner, make_request

from mmlane.common.config import load_config
from mmlane.engine.config import EngineConfig
from mmlane.engine.hf.runner import HFRunner
from mmlane.model import Preprocessor, load_preprocessor
from mmlane.protocol.errors import FatalError
from mmlane.protocol.messages import EngineRequest

FAMILIES = ["qwen2_vl", "llava", "llava_next", "llava_onevision", "mistral3", "internvl",
            "idefics3", "smolvlm"]
LONG_TEXT = " ".join(f"word{i}" for i in range(60))

CASES = {  # prompts of different lengths, text and image, and two requests with the same prompt
    "short-text": ("hi",),
    "text": ("hello there, what is new",),
    "same-text": ("hello there, what is new",),
    "long-text": (LONG_TEXT,),
    "image": ("what is this?", ((64, 48),)),
    "two-images": ("compare them", ((100, 60), (56, 84))),
}


@pytest.fixture(scope="module")
def preps(model_dirs: dict[str, Path]) -> dict[str, Preprocessor]:
    return {family: load_preprocessor(path) for family, path in model_dirs.items()}


@pytest.fixture(scope="module")
def runners(model_dirs: dict[str, Path]) -> Iterator[dict[tuple[str, int], HFRunner]]:
    """A runner per family and max_batch: 1 (no batching), 4 (fewer rows than the cases, so
    batches change as requests rotate through them) and the default."""
    yield {
        (family, max_batch): load_runner(model_dirs[family], max_batch=max_batch)
        for family in FAMILIES for max_batch in (1, 4, MAX_BATCH)
    }


def requests_for(prep: Preprocessor, **sampling: object) -> dict[int, EngineRequest]:
    """One request per case, each with a different max_tokens so that batches shrink."""
    return {
        handle: make_request(prep, *case, **{"max_tokens": 10 + 3 * handle, **sampling})
        for handle, case in enumerate(CASES.values())
    }


class Run:
    """Requests run to completion in one runner: each one's tokens, and each step's decode
    tokens (its decode batch's rows in use; 0 for a step that ran no decode)."""

    def __init__(
        self, runner: HFRunner, requests: dict[int, EngineRequest],
        abort: tuple[int, int] | None = None,
    ) -> None:
        """`abort` = (handle, n): abort that request once it has n tokens."""
        assert not runner.has_work()
        for handle, request in requests.items():
            runner.add(handle, request)
        self.tokens: dict[int, list[int]] = {handle: [] for handle in requests}
        self.decode_sizes: list[int] = []
        counters = runner.metrics.counters
        while runner.has_work():
            decoded = counters["decode_tokens"]
            outputs = runner.step()
            self.decode_sizes.append(counters["decode_tokens"] - decoded)
            for output in outputs:
                assert output.error is None, output.error
                self.tokens[output.handle] += output.token_ids
                if abort is not None and len(self.tokens[abort[0]]) == abort[1]:
                    runner.abort(abort[0])


def alone(runner: HFRunner, requests: dict[int, EngineRequest]) -> dict[int, list[int]]:
    """Each request's tokens when it is the only one in the runner."""
    return {handle: Run(runner, {handle: request}).tokens[handle]
            for handle, request in requests.items()}


# ---------------------------------------------------------------- the same tokens as alone


@pytest.mark.parametrize("max_batch", [4, MAX_BATCH])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_tokens_equal_each_request_alone(runners, preps, family, max_batch) -> None:
    runner = runners[family, max_batch]
    assert runner.max_batch == max_batch  # the startup check found a row's bits independent
    requests = requests_for(preps[family])
    together = Run(runner, requests)
    assert 1 < max(together.decode_sizes) <= max_batch  # it did batch
    assert together.tokens == alone(runner, requests)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_tokens_equal_unbatched_and_hf_generate(runners, preps, family) -> None:
    """A batched step's logits differ from an unbatched one's by float noise (up to about 3e-7,
    BENCHMARKS.md), too little to change these requests' greedy tokens."""
    prep, requests = preps[family], requests_for(preps[family])
    batched = Run(runners[family, MAX_BATCH], requests).tokens
    unbatched = Run(runners[family, 1], requests)
    assert set(unbatched.decode_sizes) == {0, 1}  # max_batch 1: one request's step at a time
    assert batched == unbatched.tokens
    model = runners[family, 1].model
    assert batched == {handle: generate_greedy(model, prep, request)
                       for handle, request in requests.items()}


def test_seeded_sampling_is_the_same_whatever_is_in_the_batch(runners, preps) -> None:
    runner, prep = runners["qwen2_vl", MAX_BATCH], preps["qwen2_vl"]
    sampled = {0: make_request(prep, "tell me a story", max_tokens=24, temperature=1.0,
                               top_p=0.9, seed=11)}
    greedy_company = {handle + 1: request for handle, request in requests_for(prep).items()}
    sampled_company = {
        handle + 1: request
        for handle, request in requests_for(prep, temperature=0.8, seed=5).items()
    }
    tokens = alone(runner, sampled)[0]
    assert Run(runner, sampled | greedy_company).tokens[0] == tokens
    assert Run(runner, sampled | sampled_company).tokens[0] == tokens
    reseeded = {0: replace(sampled[0], sampling=replace(sampled[0].sampling, seed=12))}
    assert Run(runner, reseeded | greedy_company).tokens[0] != tokens  # the seed does matter


@pytest.mark.parametrize("family", FAMILIES)
def test_an_abort_mid_batch_leaves_the_others_unchanged(runners, preps, family) -> None:
    runner = runners[family, MAX_BATCH]
    requests = requests_for(preps[family])
    expected = alone(runner, requests)
    aborted = 1
    run = Run(runner, requests, abort=(aborted, 4))  # after its first 3 decode steps
    assert run.tokens.pop(aborted) == expected.pop(aborted)[:4]
    assert run.tokens == expected


# ---------------------------------------------------------------- the setting


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(FatalError, match="max_batch must be positive, got 0"):
        load_config(EngineConfig, {"hf": {"max_batch": 0}})
