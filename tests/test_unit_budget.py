"""Units bounded by time (`--max-unit-ms`, hf/budget.py), in process with the real tiny models.

Which sizes a unit takes depends on timings, so what is checked is never a time: the derived
chunk size is one of the sizes the calibration may pick (the smallest for a budget nothing fits,
the largest for one everything fits), units grow while nothing interactive waits and shrink
while something does (counted in units, not measured), and a request's tokens are the same
whatever ran beside it: alone (with an idle budget everything fits: whole passes, a prompt's
whole chunks in one forward pass), in a mix (the smallest units), and as HF `generate` makes
them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace
from test_batching import CASES, LONG_TEXT
from test_engine import DEVICE, generate_greedy, make_request

from protocol.messages import EngineRequest
from services.engine.hf.budget import (
    MIN_CHUNK_TOKENS,
    QUIET_S,
    UnitBudget,
    chunk_sizes,
    derive_chunk_tokens,
)
from services.engine.hf.runner import HFRunner
from services.model import Preprocessor, load_model, load_preprocessor

TINY_MS = 1e-6
"""A budget no unit fits: the smallest chunks, one chunk per unit while interactive work
waits."""
HUGE_MS = 1e9
"""A budget every unit fits."""


@pytest.fixture(scope="module")
def preps(model_dirs: dict[str, Path]) -> dict[str, Preprocessor]:
    return {family: load_preprocessor(model_dirs[family]) for family in ("qwen2_vl", "llava")}


@pytest.fixture(scope="module")
def tiny_budget(model_dirs: dict[str, Path]) -> Iterator[dict[str, HFRunner]]:
    """Runners with a budget no unit fits while interactive work waits, and one every unit
    fits while none does and text is quiet: Qwen2-VL and LLaVA."""
    yield {family: HFRunner.load(str(model_dirs[family]), DEVICE, max_unit_ms=TINY_MS,
                                 idle_unit_ms=HUGE_MS)
           for family in ("qwen2_vl", "llava")}


def run(runner: HFRunner, requests: list[EngineRequest]) -> list[list[int]]:
    """Each request's tokens, all added at once and stepped to the end."""
    for handle, request in enumerate(requests):
        runner.add(handle, request)
    tokens: list[list[int]] = [[] for _ in requests]
    while runner.has_work():
        for output in runner.step():
            assert output.error is None, output.error
            tokens[output.handle] += output.token_ids
    return tokens


def unit_counts(runner: HFRunner, since: tuple[int, ...] = (0, 0, 0, 0)) -> tuple[int, ...]:
    """Vision passes (run whole on the vision lane), the feature rows they made, prefill units
    and the chunks they ran, since the counts `since`."""
    histograms, counters = runner.metrics.histograms, runner.metrics.counters
    vision, prefill = (histograms[name].count if name in histograms else 0
                       for name in ("engine_step:vision", "engine_step:prefill"))
    counts = (vision, counters["vision_rows"], prefill, counters["prefill_chunks"])
    return tuple(now - then for now, then in zip(counts, since, strict=True))


# ---------------------------------------------------------------- calibration


def test_the_chunk_size_is_the_largest_power_of_two_that_fits() -> None:
    timed: list[int] = []

    def seconds_for(size: int) -> float:
        timed.append(size)
        return size * 1e-3

    assert derive_chunk_tokens(seconds_for, 0.1, 32768) == (64, 1e-3)
    assert timed == [16, 32, 64, 128]  # it stops at the first size over the budget
    assert derive_chunk_tokens(seconds_for, 1e-9, 32768)[0] == MIN_CHUNK_TOKENS
    assert derive_chunk_tokens(seconds_for, 1e9, 100)[0] == 64  # not past the context
    assert chunk_sizes(8) == [MIN_CHUNK_TOKENS]


@pytest.mark.parametrize(("max_unit_ms", "which"), [(TINY_MS, 0), (5.0, None), (HUGE_MS, -1)])
def test_calibration_derives_a_chunk_size_and_logs_it(qwen_dir, caplog, max_unit_ms,
                                                      which) -> None:
    with caplog.at_level(logging.INFO, logger="services.engine.hf.runner"):
        runner = HFRunner.load(str(qwen_dir), DEVICE, max_unit_ms=max_unit_ms)
    chunk = runner.prefill_chunk_tokens
    sizes = chunk_sizes(runner.spec.max_context)
    assert chunk in sizes if which is None else chunk == sizes[which]
    assert f"prefill chunks of {chunk} tokens (derived;" in caplog.text


def test_a_fixed_chunk_size_stays(qwen_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="services.engine.hf.runner"):
        runner = HFRunner.load(str(qwen_dir), DEVICE, prefill_chunk_tokens=37, max_unit_ms=5.0)
    assert runner.prefill_chunk_tokens == 37
    assert "prefill chunks of 37 tokens (fixed;" in caplog.text


def test_chunks_merge_only_where_the_runner_s_attention_stands_in(qwen_dir, caplog) -> None:
    """PER_CHUNK attention calls SDPA: over a model with another text attention, the startup
    check keeps one forward pass per chunk, and says why."""
    runner = HFRunner.load(str(qwen_dir), DEVICE, max_unit_ms=5.0)
    assert runner.merges_chunks
    runner.model.config.get_text_config()._attn_implementation_internal = "eager"
    with caplog.at_level(logging.WARNING, logger="services.engine.hf.runner"):
        assert not runner._chunks_merge()
    assert "prefill units run one chunk per forward pass: its text attention is 'eager'" in (
        caplog.text)
    runner._across_equal = lambda chunk: False  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="services.engine.hf.runner"):
        assert not runner._requests_batch()
    assert "prefill forwards run one request's chunks: a request's chunks get other bits" in (
        caplog.text)


# ---------------------------------------------------------------- the same tokens


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_tokens_are_the_same_alone_in_a_mix_and_from_generate(family, model_dirs, preps,
                                                              tiny_budget) -> None:
    """Alone, every prompt is one unit; in the mix, every unit is the smallest (one chunk),
    and vision passes run beside other requests' units: the same tokens."""
    prep, runner = preps[family], tiny_budget[family]
    greedy = [make_request(prep, *case, max_tokens=8) for case in CASES.values()]
    sampled = make_request(prep, *CASES["image"], max_tokens=8, temperature=1.0, seed=3)
    requests = [*greedy, sampled]
    alone = [run(runner, [request])[0] for request in requests]
    together = run(runner, requests)
    assert [together[handle] for handle in range(len(requests))] == alone
    model = load_model(model_dirs[family], DEVICE)
    assert alone[: len(greedy)] == [generate_greedy(model, prep, r) for r in greedy]


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "llava", "llava_next", "mistral3", "internvl", "idefics3"])
def test_requests_prefill_together_with_the_tokens_they_get_alone(family, model_dirs) -> None:
    """With room in a unit after one request's whole chunks, the next requests' whole chunks
    (never a prompt's last) go into the same forward pass: each request's tokens are those it
    gets alone. Of two requests that share a prefix, the second does not join the first: it
    reuses the first's chunks."""
    prep = load_preprocessor(model_dirs[family])

    def load(**caches: int) -> HFRunner:
        return HFRunner.load(str(model_dirs[family]), DEVICE, prefill_chunk_tokens=16,
                             max_unit_ms=HUGE_MS, **caches)

    runner = load(encoder_cache_bytes=1 << 30)
    assert runner.batches_prefill  # the startup check found them the same bits
    texts = [make_request(prep, f"{number} {LONG_TEXT}", max_tokens=6) for number in range(3)]
    images = [make_request(prep, "what is this?", ((224, 168),), image_seed=seed, max_tokens=6)
              for seed in range(2)]
    images = [replace(request, mm_items=[replace(item, mm_hash=f"image{seed}")
                                         for item in request.mm_items])
              for seed, request in enumerate(images)]  # their features cached when alone
    requests = [*texts, *images]
    alone = [run(runner, [request])[0] for request in requests]
    counters = runner.metrics.counters
    for group in (texts, images, requests):
        before = counters["prefill_forwards_across_requests"]
        assert run(runner, group) == [alone[requests.index(request)] for request in group]
        assert counters["prefill_forwards_across_requests"] > before

    system = f"You answer briefly. {LONG_TEXT}"
    requests = [*(make_request(prep, question, system=system, max_tokens=6)
                  for question in ("first?", "second?")), texts[0]]
    alone = [run(runner, [request])[0] for request in requests]
    runner = load(prefix_cache_bytes=1 << 30)
    assert run(runner, requests) == alone
    counters = runner.metrics.counters
    assert counters["prefill_forwards_across_requests"] > 0  # the first and third
    assert counters["prefix_cache_hits"] == 1  # the second, of the first's chunks


# ---------------------------------------------------------------- unit sizes


def beside_text(runner: HFRunner, prep: Preprocessor,
                image: EngineRequest) -> tuple[list[int], tuple[int, ...]]:
    """The image request's tokens, served while a text request decodes all along, and the
    `unit_counts` of its serving."""
    text = make_request(prep, "tell me a long story", max_tokens=100_000, ignore_eos=True)
    runner.add(1, text)
    while not runner.step():  # its prefill, to its first token
        pass
    start = unit_counts(runner)
    runner.add(0, image)
    tokens: list[int] = []
    while runner.has_work() and len(tokens) < image.sampling.max_tokens:
        tokens += [token for output in runner.step() if output.handle == 0
                   for token in output.token_ids]
    runner.abort(1)
    return tokens, unit_counts(runner, start)


def test_the_idle_budget_waits_for_text_to_be_quiet() -> None:
    budget = UnitBudget(0.005, idle_unit_s=0.1, prefill_token_s=1e-4)
    assert budget.unit_s(busy=False) == 0.1  # no text yet
    assert budget.unit_s(busy=True) == 0.005
    budget.text_arrived(time.monotonic() - QUIET_S)
    assert budget.unit_s(busy=False) == 0.1
    budget.text_arrived(time.monotonic())
    assert budget.unit_s(busy=False) == 0.005
    assert budget.prefill_chunks(10, busy=False) == 5  # 5 ms of 1 ms chunks
    budget.text_arrived(time.monotonic() - QUIET_S)  # an older arrival changes nothing
    assert budget.unit_s(busy=False) == 0.005

    budget = UnitBudget(0.005, idle_unit_s=0.1, prefill_token_s=1e-4)
    budget.text_arrived(long_ago := time.monotonic() - QUIET_S)
    budget.text_arrived(now := time.monotonic())
    assert budget.unit_s(busy=False, own_arrival=now) == 0.1  # its own arrival keeps none small
    assert budget.unit_s(busy=False, own_arrival=long_ago) == 0.005  # another's does
    assert budget.unit_s(busy=True, own_arrival=now) == 0.005
    budget.text_arrived(time.monotonic())
    assert budget.unit_s(busy=False, own_arrival=now) == 0.005


def test_units_grow_while_nothing_interactive_waits_and_shrink_while_it_does(
    preps, tiny_budget
) -> None:
    """A text prompt's units shrink while another request decodes; an image prompt's, on the
    bulk lane, which no text request waits for, do not."""
    prep, runner = preps["qwen2_vl"], tiny_budget["qwen2_vl"]
    long_text = make_request(prep, LONG_TEXT, max_tokens=4)
    image = make_request(prep, *CASES["image"], max_tokens=4)
    time.sleep(QUIET_S)  # text requests of earlier tests keep units small until then
    start = unit_counts(runner)
    [text_alone] = run(runner, [long_text])
    _, _, prefills, chunks = unit_counts(runner, start)
    assert runner.merges_chunks  # the startup check found merged chunks the same bits
    tail = len(long_text.prompt_token_ids) % runner.prefill_chunk_tokens > 0
    assert prefills == 1 + tail < chunks  # whole chunks in one unit, a short last one
    busy, after = beside_text(runner, prep, long_text)
    assert busy == text_alone
    assert after[2] == after[3] == chunks  # the same chunks, one per unit

    start = unit_counts(runner)
    [alone] = run(runner, [image])
    vision, rows, prefills, chunks = unit_counts(runner, start)
    tail = len(image.prompt_token_ids) % runner.prefill_chunk_tokens > 0
    assert (vision, prefills) == (1, 1 + tail)  # a whole pass; whole chunks, a short last one
    assert chunks > 1 + tail and rows > 0  # of several chunks, in one unit
    busy, after = beside_text(runner, prep, image)
    assert busy == alone
    assert after == (vision, rows, prefills, chunks)  # the same units beside text


def test_units_stay_small_for_a_while_after_a_text_request_arrives(preps, tiny_budget) -> None:
    """A text request that has come and gone still keeps a text prompt's units small for
    QUIET_S (the next may come while a large unit runs); then they grow again. An image
    prompt's units, on the bulk lane, are large all along; a text prompt's own arrival keeps
    none small."""
    prep, runner = preps["qwen2_vl"], tiny_budget["qwen2_vl"]
    first, later = (make_request(prep, f"{number} {LONG_TEXT}", max_tokens=1)
                    for number in (1, 2))
    image = make_request(prep, *CASES["image"], max_tokens=1, image_seed=7)
    run(runner, [make_request(prep, "hi", max_tokens=1)])
    start = unit_counts(runner)
    run(runner, [first])
    _, _, prefills, chunks = unit_counts(runner, start)
    assert prefills == chunks > 1  # one chunk per unit, though nothing interactive was held

    for request in (image, later):  # the image at once, the text after QUIET_S
        if request is later:
            time.sleep(QUIET_S)
        start = unit_counts(runner)
        run(runner, [request])
        _, _, prefills, chunks = unit_counts(runner, start)
        tail = len(request.prompt_token_ids) % runner.prefill_chunk_tokens > 0
        assert prefills == 1 + tail < chunks  # whole chunks in one unit, a short last one
