"""The HF runner's prefix cache, in process with the real tiny models: no mocks.

A request served after another that shares a prefix of its prompt (a system prompt, an image)
must get exactly what it gets from a runner without the cache: the same greedy tokens and the
same logprobs, bit for bit. The counters say what was reused; the vision-unit histogram says
which vision passes ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec.structs import replace
from test_engine import DEVICE, make_request, served_alone, start_engine, to, tokens_of
from test_unit_budget import TINY_MS

from conftest import stop_role
from peers import StandInFrontend, wait_for_stats
from protocol.errors import FatalError
from protocol.messages import EngineRequest
from services.common.config import load_config
from services.engine.config import EngineConfig
from services.engine.hf.runner import HFRunner
from services.model import Preprocessor, load_preprocessor

FAMILIES = ["qwen2_vl", "llava"]
CHUNK = 16
SYSTEM = ("You are a careful assistant. Answer in one short sentence, name what you see, "
          "and never guess at what the picture does not show.")
IMAGE = (640, 480)
LEAD_IN = "Look at this picture closely, then tell me in a few words: "
"""Shared text after an image, so that the chunk its last placeholders lie in is shared too
(an image that ends in the chunk where two prompts part needs its features again)."""
Served = tuple[list[int], list[object]]


@pytest.fixture(scope="module")
def preps(model_dirs: dict[str, Path]) -> dict[str, Preprocessor]:
    return {family: load_preprocessor(model_dirs[family]) for family in FAMILIES}


@pytest.fixture(scope="module")
def uncached(model_dirs: dict[str, Path]) -> dict[str, HFRunner]:
    """Runners without the prefix cache (nor the encoder cache): the reference."""
    return {family: HFRunner.load(str(model_dirs[family]), DEVICE, prefill_chunk_tokens=CHUNK)
            for family in FAMILIES}


def cached(model_dirs: dict[str, Path], family: str, capacity: int = 1 << 30,
           max_unit_ms: float | None = None) -> HFRunner:
    """A runner with the prefix cache; with `max_unit_ms`, units bounded by it and the chunk
    size derived (TINY_MS: the smallest, CHUNK)."""
    runner = HFRunner.load(str(model_dirs[family]), DEVICE, max_unit_ms=max_unit_ms,
                           prefill_chunk_tokens=None if max_unit_ms else CHUNK,
                           prefix_cache_bytes=capacity)
    assert runner.prefill_chunk_tokens == CHUNK
    return runner


def request(prep: Preprocessor, text: str, *images: str, image_seed: int = 0,
            system: str = "") -> EngineRequest:
    """A request asking `text` (greedy, with logprobs) about one `IMAGE` per hash in `images`."""
    made = make_request(prep, text, (IMAGE,) * len(images), system=system,
                        image_seed=image_seed, max_tokens=6, logprobs=3)
    items = [replace(item, mm_hash=mm_hash) for item, mm_hash in zip(made.mm_items, images,
                                                                       strict=True)]
    return replace(made, mm_items=items)


def serve(runner: HFRunner, req: EngineRequest) -> Served:
    """The request's tokens and per-token logprobs, served alone."""
    tokens, logprobs = served_alone(runner, req)
    assert len(logprobs) == len(tokens)
    return tokens, logprobs


def vision_units(runner: HFRunner) -> int:
    histogram = runner.metrics.histograms.get("engine_step:vision")
    return 0 if histogram is None else histogram.count


def shared_chunks(first: EngineRequest, second: EngineRequest) -> int:
    """Tokens of the full chunks the two prompts share."""
    same = 0
    for a, b in zip(first.prompt_token_ids, second.prompt_token_ids, strict=False):
        if a != b:
            break
        same += 1
    return same // CHUNK * CHUNK


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_system_prompt_is_reused_bit_for_bit(family, model_dirs, preps,
                                                      uncached) -> None:
    prep, runner = preps[family], cached(model_dirs, family)
    first = request(prep, "what is the capital of france?", system=SYSTEM)
    second = request(prep, "name three colours.", system=SYSTEM)
    assert shared_chunks(first, second) >= 2 * CHUNK
    assert serve(runner, first) == serve(uncached[family], first)
    assert serve(runner, second) == serve(uncached[family], second)
    counters = runner.metrics.counters
    assert (counters["prefix_cache_misses"], counters["prefix_cache_hits"]) == (1, 1)
    assert counters["prefix_cache_hit_tokens"] == shared_chunks(first, second)
    assert counters["prefix_cache_bytes"] > 0


@pytest.mark.parametrize("max_unit_ms", [None, TINY_MS])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_image_asked_again_skips_its_vision_pass(family, model_dirs, preps,
                                                          uncached, max_unit_ms) -> None:
    prep, runner = preps[family], cached(model_dirs, family, max_unit_ms=max_unit_ms)
    first = request(prep, LEAD_IN + "what is in it?", "photo")
    second = request(prep, LEAD_IN + "which colours does it have?", "photo")
    (item,) = second.mm_items
    assert shared_chunks(first, second) >= item.offset + item.length  # the image is inside
    serve(runner, first)
    before = vision_units(runner)
    assert before > 0
    assert serve(runner, second) == serve(uncached[family], second)
    assert vision_units(runner) == before  # the encoder cache is off: the prefix held it
    counters = runner.metrics.counters
    assert (counters["prefix_cache_hits"], counters["prefix_cache_hit_images"]) == (1, 1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_unit_ms", [None, TINY_MS])
def test_a_request_that_arrived_with_another_shares_what_that_one_stored(
    family, model_dirs, preps, uncached, max_unit_ms
) -> None:
    """Image prompts prefill in arrival order: the second looks its prefix up at its first
    prefill unit, after its image's pass on the vision lane (the first's job: one pass), and
    after the first has stored it. With a unit budget, a text request beside them makes their
    units the smallest (one chunk) while it decodes."""
    prep, runner = preps[family], cached(model_dirs, family, max_unit_ms=max_unit_ms)
    requests = [request(prep, LEAD_IN + question, "photo")
                for question in ("what is in it?", "which colours does it have?")]
    for handle, req in enumerate(requests):
        runner.add(handle, req)
    text = make_request(prep, SYSTEM, max_tokens=100, ignore_eos=True)
    if max_unit_ms:
        runner.add(2, text)
    served: dict[int, Served] = {0: ([], []), 1: ([], []), 2: ([], [])}
    while runner.has_work():
        for output in runner.step():
            assert output.error is None, output.error
            served[output.handle][0].extend(output.token_ids)
            served[output.handle][1].extend(output.logprobs or [])
    assert [served[0], served[1]] == [serve(uncached[family], req) for req in requests]
    counters = runner.metrics.counters
    # The text runs first: the first image's prompt may start with its chunks (Qwen2-VL's
    # chat template has a system prompt).
    hits = 1 + bool(max_unit_ms and shared_chunks(text, requests[0]))
    assert (counters["prefix_cache_hits"], counters["prefix_cache_hit_images"]) == (hits, 1)
    assert counters["encoder_cache_misses"] == 1  # one vision pass started, for both


def prefill_units(runner: HFRunner) -> int:
    histogram = runner.metrics.histograms.get("engine_step:prefill")
    return 0 if histogram is None else histogram.count


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_prompt_again_runs_no_prefill_and_gets_the_same_bits(
    family, model_dirs, preps, uncached
) -> None:
    """The whole prompt held: its first token comes from the stored logits, with no unit; and
    whatever the second request samples with, it gets what it gets alone."""
    prep, runner = preps[family], cached(model_dirs, family)
    first = request(prep, "what is in it?", "photo")
    sampled = replace(first, sampling=replace(first.sampling, temperature=0.8, seed=7))
    assert serve(runner, first) == serve(uncached[family], first)
    units = (prefill_units(runner), vision_units(runner))
    for again in (first, sampled):
        assert serve(runner, again) == serve(uncached[family], again)
    assert (prefill_units(runner), vision_units(runner)) == units
    counters = runner.metrics.counters
    assert (counters["prefix_cache_hits"], counters["prefix_cache_hit_prompts"]) == (2, 2)
    assert counters["prefix_cache_hit_tokens"] == 2 * len(first.prompt_token_ids)
    assert counters["prefix_cache_hit_images"] == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_that_ends_on_a_chunk_boundary_is_held_whole_too(family, model_dirs, preps,
                                                                   uncached) -> None:
    prep, runner = preps[family], cached(model_dirs, family)
    words = ["name"]
    while len(request(prep, " ".join(words), system=SYSTEM).prompt_token_ids) % CHUNK:
        words.append("more")
    whole = request(prep, " ".join(words), system=SYSTEM)
    longer = request(prep, " ".join(words) + " please", system=SYSTEM)
    for req in (whole, whole, longer):
        assert serve(runner, req) == serve(uncached[family], req)
    counters = runner.metrics.counters
    assert (counters["prefix_cache_hits"], counters["prefix_cache_hit_prompts"]) == (2, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_another_image_with_the_same_token_ids_does_not_hit(family, model_dirs, preps,
                                                            uncached) -> None:
    prep, runner = preps[family], cached(model_dirs, family)
    first = request(prep, "what is in this picture?", "a")
    other = request(prep, "what is in this picture?", "b", image_seed=1)
    assert first.prompt_token_ids == other.prompt_token_ids
    (item,) = first.mm_items
    serve(runner, first)
    # Only chunks wholly before the image may be reused (a chat template's own system prompt).
    for again in (other, replace(first, mm_items=[replace(item, mm_hash="")])):  # no hash: no key
        hit_tokens = runner.metrics.counters["prefix_cache_hit_tokens"]
        assert serve(runner, again) == serve(uncached[family], again)
        assert runner.metrics.counters["prefix_cache_hit_tokens"] - hit_tokens <= item.offset
    assert runner.metrics.counters["prefix_cache_hit_images"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_eviction_under_a_tiny_budget_keeps_results_exact(family, model_dirs, preps,
                                                          uncached) -> None:
    prep = preps[family]
    first = request(prep, "what is the capital of france?", system=SYSTEM)
    second = request(prep, "name three colours.", system=SYSTEM)
    probe = cached(model_dirs, family)
    serve(probe, first)
    chunk_bytes = probe.metrics.counters["prefix_cache_bytes"] // (
        len(first.prompt_token_ids) // CHUNK)
    shared = shared_chunks(first, second) // CHUNK
    runner = cached(model_dirs, family, capacity=(shared + 1) * chunk_bytes)
    expected = {id(req): serve(uncached[family], req) for req in (first, second)}
    for req in (first, second, first, second, first):
        assert serve(runner, req) == expected[id(req)]
    counters = runner.metrics.counters
    assert counters["prefix_cache_evictions"] > 0
    assert counters["prefix_cache_bytes"] <= (shared + 1) * chunk_bytes
    assert counters["prefix_cache_hits"] == 4  # the shared chunks were never evicted


def test_an_engine_process_reuses_a_prefix_and_says_so_in_its_stats(run_dir, preps,
                                                                   uncached) -> None:
    """The setting reaches the runner through the role's config; the counters its stats."""
    prep = preps["qwen2_vl"]
    engine = start_engine(run_dir, "--prefill-chunk-tokens", str(CHUNK), "--prefix-cache-gb",
                          "0.01", "--stats-interval", "0.1")
    try:
        with StandInFrontend.connected(engine, run_dir) as frontend:
            first = to(frontend, request(prep, "what is the capital of france?", system=SYSTEM))
            second = to(frontend, request(prep, "name three colours.", system=SYSTEM))
            for req in (first, second):
                replies = frontend.run(req)[req.request_id]
                logprobs = [position for reply in replies for position in reply.logprobs or []]
                assert (tokens_of(replies), logprobs) == serve(uncached["qwen2_vl"], req)
        wait_for_stats(run_dir, lambda stats: stats.role == "engine"
                       and stats.counters.get("prefix_cache_hits") == 1
                       and stats.counters.get("prefix_cache_misses") == 1,
                       "the engine's stats count the prefix cache's hit")
    finally:
        assert stop_role(engine) == 0


def test_the_prefix_cache_setting_is_checked() -> None:
    assert load_config(EngineConfig, {}).hf.prefix_cache_gb > 0
    with pytest.raises(FatalError, match="prefix_cache_gb must be a number >= 0"):
        load_config(EngineConfig, {"hf": {"prefix_cache_gb": -1}})
