"""The engine role as a real process: requests over real sockets to the tiny model, no mocks.

One engine process serves the module, started as the launcher starts it (conftest's
`start_role`, the real ready handshake); each test talks to it as a frontend would, with its own
reply socket. Greedy outputs are checked against the same Hugging Face model's `generate` run here.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from msgspec.structs import replace
from transformers import AutoConfig

from bench.images import make_image
from conftest import DEVICE, as_processor_output, start_role, stop_role
from mmlane.engine.config import HFConfig, VisionConfig
from mmlane.engine.hf.runner import HFRunner
from mmlane.engine.outbox import _Waiting
from mmlane.engine.runner import ModelSpec
from mmlane.engine.validation import validate_request
from mmlane.engine.vision import IMAGES_AHEAD_OF_A_VIDEO, VisionLane
from mmlane.launcher import Child
from mmlane.mm_worker.render import placeholder_offsets
from mmlane.model import Preprocessor, load_model, load_preprocessor
from mmlane.protocol import shm
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import ErrorInfo, RequestError, RetryableError
from mmlane.protocol.messages import (
    VIDEO_PIXELS,
    EngineInput,
    EngineOutput,
    EngineRequest,
    MMItem,
    Ready,
    RequestFailed,
    SamplingParams,
)
from mmlane.protocol.sampling import StructuredOutputs
from mmlane.protocol.shm import ShmWriter
from peers import StandInFrontend as Frontend
from peers import counter, counters

REPLY_TIMEOUT_S = 60
_ids = itertools.count()

Reply = EngineOutput | RequestFailed


# ---------------------------------------------------------------- processes and sockets


MAX_BATCH = HFConfig().max_batch


def load_runner(model_dir: Path, **settings: Any) -> HFRunner:
    """An HF runner on `model_dir`, loaded as an engine with these `hf` and `vision` settings
    would be."""
    vision = {name: settings.pop(name) for name in VisionConfig.__struct_fields__
              if name in settings}
    return HFRunner.load(str(model_dir), HFConfig(device=DEVICE, **settings),
                         VisionConfig(**vision))


def start_engine(run_dir: Path, *args: str) -> Child:
    """`mmlane engine ARGS`, once it has said Ready on its endpoint."""
    endpoint = f"ipc://{run_dir}/e.sock"
    argv = ["--device", DEVICE, "--engine-endpoint", endpoint, *args]
    engine = start_role("engine", argv, run_dir)
    assert engine.endpoint == endpoint
    return engine


@pytest.fixture(scope="module")
def engine(module_run_dir: Path, qwen_dir: Path) -> Iterator[Child]:
    engine = start_engine(module_run_dir)
    yield engine
    assert stop_role(engine) == 0


@pytest.fixture
def frontend(engine: Child, run_dir: Path) -> Iterator[Frontend]:
    with Frontend.connected(engine, run_dir) as fe:
        yield fe


# ---------------------------------------------------------------- requests and the reference


@pytest.fixture(scope="module")
def reference(qwen_dir: Path) -> torch.nn.Module:
    return load_model(qwen_dir, DEVICE)


def make_request(
    prep: Preprocessor, text: str, images: tuple[tuple[int, int], ...] = (), *,
    system: str = "", image_seed: int = 0, **sampling: object
) -> EngineRequest:
    """A request rendered as the frontend and MM worker render it: chat template, expansion.
    With a `system` message when given; image i is `make_image`'s of seed `image_seed` + i."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    if system:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
    prompt = prep.render_prompt(messages)
    items = [prep.process_image(make_image(w, h, seed=image_seed + i))
             for i, (w, h) in enumerate(images)]
    [unexpanded] = prep.tokenize_batch([prompt])
    ids = prep.expand_placeholders(unexpanded, items)
    offsets = placeholder_offsets(unexpanded, {
        prep.image_token_id: [item.num_tokens for item in items]})
    mm_items = [MMItem(offset=offset, length=item.num_tokens, tensors=item.tensors)
                for (offset, _, _), item in zip(offsets, items, strict=True)]
    params = SamplingParams(**{"max_tokens": 12, **sampling})  # type: ignore[arg-type]
    return EngineRequest(
        request_id=f"r{next(_ids)}", reply_to="", prompt_token_ids=ids, sampling=params,
        mm_items=mm_items,
    )


def to(frontend: Frontend, request: EngineRequest) -> EngineRequest:
    return replace(request, reply_to=frontend.reply_to)


def generate_greedy(model: Any, prep: Preprocessor, request: EngineRequest) -> list[int]:
    """What HF `generate` makes of the same request: the correctness anchor."""
    out = generate(model, prep, request)
    return out.sequences[0, len(request.prompt_token_ids):].tolist()


def generate(model: Any, prep: Preprocessor, request: EngineRequest, **options: Any) -> Any:
    """HF `generate`'s greedy output for the request (return_dict_in_generate), with `options`."""
    ids = torch.tensor([request.prompt_token_ids], device=model.device)
    inputs: dict[str, torch.Tensor] = {}
    if request.mm_items:
        # The HF processor's float pixels (tests/test_pixels.py shows normalising is exact).
        joined = as_processor_output(
            prep.family.join_items([item.tensors for item in request.mm_items]), prep.pixel_norm
        )
        inputs = {name: torch.from_numpy(array).to(model.device) for name, array in joined.items()}
        if prep.family.name == "qwen2_vl":
            inputs["mm_token_type_ids"] = (ids == prep.image_token_id).int()
        if prep.family.name == "idefics3":  # one sample of tiles; rows, cols shape the prompt
            inputs = {"pixel_values": inputs["pixel_values"][None]}
    with torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=request.sampling.max_tokens, return_dict_in_generate=True,
            **inputs, **options,
        )


def tokens_of(replies: list[Reply]) -> list[int]:
    assert all(isinstance(r, EngineOutput) for r in replies), replies
    return [t for r in replies for t in r.token_ids]  # type: ignore[union-attr]


def assert_streamed(replies: list[Reply], request: EngineRequest) -> None:
    """One token per output, the prompt echoed on the first only, exactly one terminal output."""
    outputs = [r for r in replies if isinstance(r, EngineOutput)]
    assert len(outputs) == len(replies), replies
    assert outputs[0].prompt_token_ids == request.prompt_token_ids
    assert all(o.prompt_token_ids is None for o in outputs[1:])
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert all(len(o.token_ids) == 1 for o in outputs)
    last = outputs[-1]
    assert len(outputs) == request.sampling.max_tokens or last.finish_reason == "stop"
    assert last.finish_reason in ("stop", "length")


# ---------------------------------------------------------------- serving


TEXT = ("hello there, what is new",)
ONE_IMAGE = ("what is in this picture?", ((64, 48),))
BIG_IMAGE = ("and this one?", ((640, 480),))
TWO_IMAGES = ("compare them", ((100, 60), (56, 84)))


@pytest.mark.parametrize("case", [TEXT, ONE_IMAGE, BIG_IMAGE, TWO_IMAGES],
                         ids=["text", "image", "big-image", "two-images"])
def test_greedy_output_equals_hf_generate(frontend, prep, reference, case) -> None:
    request = to(frontend, make_request(prep, *case, max_tokens=16))
    replies = frontend.run(request)[request.request_id]
    assert_streamed(replies, request)
    assert tokens_of(replies) == generate_greedy(reference, prep, request)
    assert all(reply.logprobs is None for reply in replies)  # none asked for


@pytest.mark.parametrize("case", [TEXT, ONE_IMAGE], ids=["text", "image"])
def test_logprobs_are_the_log_softmax_of_the_model_logits(frontend, prep, reference,
                                                          case) -> None:
    top = 5
    request = to(frontend, make_request(prep, *case, max_tokens=8, logprobs=top))
    replies = frontend.run(request)[request.request_id]
    out = generate(reference, prep, request, output_logits=True)
    expected = torch.cat(out.logits).float().log_softmax(-1)  # (tokens, vocab): vLLM's raw ones
    tokens = tokens_of(replies)
    assert tokens == out.sequences[0, len(request.prompt_token_ids):].tolist()
    positions = [position for reply in replies for position in reply.logprobs]
    assert len(positions) == len(tokens) == len(expected)
    for token, position, row in zip(tokens, positions, expected, strict=True):
        assert len(position.top_token_ids) == len(position.top_logprobs) == top
        assert position.top_token_ids[0] == token  # greedy picks the most likely
        assert position.top_logprobs == sorted(position.top_logprobs, reverse=True)
        best = row.topk(top)
        torch.testing.assert_close(torch.tensor(position.top_logprobs), best.values)
        torch.testing.assert_close(torch.tensor(position.top_logprobs),
                                   row[position.top_token_ids])
        torch.testing.assert_close(torch.tensor(position.logprob), row[token])


def test_concurrent_requests_each_get_one_terminal_reply(frontend, prep, reference) -> None:
    cases = [TEXT, ONE_IMAGE, TEXT, BIG_IMAGE, TWO_IMAGES, ("short",)]
    requests = [
        to(frontend, make_request(prep, *case, max_tokens=4 + 3 * i))
        for i, case in enumerate(cases)
    ]
    replies = frontend.run(*requests)
    assert set(replies) == {r.request_id for r in requests}
    for request in requests:
        assert_streamed(replies[request.request_id], request)
        # Interleaved with the others, each still makes exactly what it makes alone.
        assert tokens_of(replies[request.request_id]) == generate_greedy(reference, prep, request)


def test_a_frontend_reading_slower_than_tokens_come_loses_none(engine, module_run_dir,
                                                              run_dir) -> None:
    """Thousands of one-token outputs to a frontend that reads none for a while: its socket's
    queue fills, what its socket does not take waits in the engine, merged, and every token
    arrives in order (with its logprobs), then exactly one terminal output."""
    sampling = SamplingParams(max_tokens=3500, ignore_eos=True, logprobs=5)
    with zmq.Context() as ctx, Frontend(ctx, engine.endpoint, f"ipc://{run_dir}/slow.sock") as fe:
        burst = EngineRequest(request_id=f"r{next(_ids)}", reply_to=fe.reply_to,
                              prompt_token_ids=[9, 10, 11], sampling=sampling)
        made = counters(module_run_dir, "engine").get("tokens_out", 0)
        fe.send(burst)
        counter(module_run_dir, "engine", "tokens_out", made + 3500)  # none read yet
        replies = fe.collect([burst.request_id])[burst.request_id]
        assert counters(module_run_dir, "engine").get("replies_waited", 0) > 0
        again = replace(burst, request_id=f"r{next(_ids)}")  # read as it comes: one per token
        alone = fe.run(again)[again.request_id]
    assert tokens_of(replies) == tokens_of(alone) and len(tokens_of(replies)) == 3500
    assert len(replies) < len(alone)  # merged while they waited
    assert [r.finished for r in replies] == [False] * (len(replies) - 1) + [True]
    assert replies[0].prompt_token_ids == burst.prompt_token_ids
    assert [p.logprob for r in replies for p in r.logprobs] == [
        p.logprob for r in alone for p in r.logprobs]


def test_replies_that_wait_keep_each_requests_order_and_merge_its_outputs() -> None:
    """The outbox's queue for one frontend (outbox.py): a request's outputs merge into its one
    still waiting, never past another message of the same request; the others keep their
    places; an output after the merged one has gone waits on its own."""
    failed = RequestFailed(request_id="b", error=ErrorInfo("retryable", "timeout", "late"))
    waiting = _Waiting(now=0.0)
    for key, message in enumerate([
        EngineOutput(request_id="a", token_ids=[1], prompt_token_ids=[7]),
        EngineOutput(request_id="b", token_ids=[10]),
        EngineOutput(request_id="a", token_ids=[2]),
        failed,
        EngineOutput(request_id="a", token_ids=[3]),
    ]):
        waiting.add(key, message)
    assert list(waiting.messages.values()) == [
        EngineOutput(request_id="a", token_ids=[1, 2, 3], prompt_token_ids=[7]),
        EngineOutput(request_id="b", token_ids=[10]), failed]
    waiting.sent_first(now=1.0)
    waiting.add(5, EngineOutput(request_id="a", token_ids=[4], finished=True,
                                finish_reason="length"))
    waiting.add(6, EngineOutput(request_id="b", token_ids=[11]))  # after its failure: alone
    assert [(getattr(m, "token_ids", None), m.request_id) for m in waiting.messages.values()] == [
        ([10], "b"), (None, "b"), ([4], "a"), ([11], "b")]
    assert waiting.progress == 1.0


def test_seeded_sampling_is_reproducible(frontend, prep) -> None:
    def sampled(seed: int, *case: object) -> EngineRequest:
        request = make_request(prep, *case, max_tokens=24, temperature=1.0, top_p=0.9, seed=seed)
        return to(frontend, request)

    first = [sampled(7, *TEXT), sampled(7, *ONE_IMAGE)]
    again = [sampled(7, *TEXT), sampled(7, *ONE_IMAGE), sampled(8, *TEXT)]
    alone = frontend.run(*first)
    together = frontend.run(*again)  # run concurrently: each request has its own generator
    for a, b in zip(first, again[:2], strict=True):
        assert tokens_of(alone[a.request_id]) == tokens_of(together[b.request_id])
    assert tokens_of(alone[first[0].request_id]) != tokens_of(together[again[2].request_id])


def test_a_text_request_finishes_before_a_running_image_request(frontend, prep) -> None:
    image = to(frontend, make_request(prep, *BIG_IMAGE, max_tokens=200))
    text = to(frontend, make_request(prep, *TEXT, max_tokens=3))
    frontend.send(image)
    frontend.send(text)
    frontend.collect([image.request_id, text.request_id])
    # Ordering, not timing: text goes in the interactive lane, ahead of the image's work.
    assert frontend.finished_order[-2:] == [text.request_id, image.request_id]


# ---------------------------------------------------------------- bad input

Change = Callable[[EngineRequest], EngineRequest]


def sampling_with(**kw: object) -> Change:
    return lambda r: replace(r, sampling=replace(r.sampling, **kw))


def item_with(**kw: object) -> Change:
    return lambda r: replace(r, mm_items=[replace(r.mm_items[0], **kw)])


def tensors_with(change: Callable[[dict[str, np.ndarray]], object]) -> Change:
    def edit(r: EngineRequest) -> EngineRequest:
        tensors = dict(r.mm_items[0].tensors)
        change(tensors)
        return replace(r, mm_items=[replace(r.mm_items[0], tensors=tensors)])

    return edit


def drop_one_image_token(r: EngineRequest) -> EngineRequest:
    """Prompt and item agree on one token fewer; the image's tensors do not."""
    item = r.mm_items[0]
    ids = r.prompt_token_ids[: item.offset] + r.prompt_token_ids[item.offset + 1 :]
    return replace(r, prompt_token_ids=ids, mm_items=[replace(item, length=item.length - 1)])


def _set(name: str, value: Callable[[dict[str, np.ndarray]], object]) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(name, value(t))


BAD_REQUESTS = {
    "max_tokens_zero": (sampling_with(max_tokens=0), "max_tokens must be at least 1"),
    "negative_temperature": (sampling_with(temperature=-0.5), "temperature must be >= 0"),
    "top_p_zero": (sampling_with(top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top_p_above_one": (sampling_with(top_p=1.5), r"top_p must be in \(0, 1\]"),
    "logit_bias_outside_vocab": (
        sampling_with(logit_bias={10**6: 1.0}), "sampling.logit_bias: 1000000 is outside"
    ),
    "schema_that_cannot_compile": (
        sampling_with(structured_outputs=StructuredOutputs(json='{"type": "strin"}')),
        "structured_outputs: the JSON schema cannot be used: Invalid type: strin",
    ),
    "empty_prompt": (
        lambda r: replace(r, prompt_token_ids=[], mm_items=[]), "prompt_token_ids is empty"
    ),
    "beyond_context": (sampling_with(max_tokens=5000), "exceeds the model's context of 4096"),
    "token_outside_vocab": (
        lambda r: replace(r, prompt_token_ids=[10**6, *r.prompt_token_ids[1:]]),
        r"prompt_token_ids\[0\] = 1000000 is outside the vocabulary",
    ),
    "item_beyond_prompt": (
        lambda r: item_with(offset=len(r.prompt_token_ids) - 2)(r), "beyond the prompt"
    ),
    "item_length_short": (
        lambda r: item_with(length=r.mm_items[0].length - 1)(r),
        r"mm_items\[0\]\.length is \d+ but its tensors make \d+ tokens",
    ),
    "item_off_image_tokens": (
        lambda r: item_with(offset=r.mm_items[0].offset - 1)(r),
        "covers tokens that are not its image's span",
    ),
    "image_items_missing": (
        lambda r: replace(r, mm_items=[]), "image-token positions but mm_items cover 0"
    ),
    "item_length_not_tensors": (
        drop_one_image_token,
        r"mm_items\[0\]\.length is \d+ but its tensors make \d+ tokens",
    ),
    "tensor_missing": (tensors_with(lambda t: t.pop("image_grid_thw")), "needs.*image_grid_thw"),
    "tensor_extra": (tensors_with(_set("extra", lambda t: np.zeros(3, "f4"))), r"has \['extra'"),
    "pixel_rows_short": (
        tensors_with(_set("pixel_values", lambda t: t["pixel_values"][:-4])),
        r"pixel_values has shape \(\d+, 588\), grid \(1, \d+, \d+\) needs \(\d+, 588\)",
    ),
    "pixel_values_float": (
        tensors_with(_set("pixel_values", lambda t: t["pixel_values"].astype("f4"))),
        "pixel_values must be a 2-D array of kind 'u'",
    ),
    "grid_not_mergeable": (
        tensors_with(_set("image_grid_thw", lambda t: np.array([[1, 1, 16]], "i8"))),
        "h and w must be multiples of 2",
    ),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_fails_alone_with_a_named_problem(frontend, prep, name) -> None:
    change, message = BAD_REQUESTS[name]
    bad = to(frontend, change(make_request(prep, *ONE_IMAGE)))
    good = to(frontend, make_request(prep, *TEXT, max_tokens=2))
    replies = frontend.run(bad, good)
    (failed,) = replies[bad.request_id]
    assert isinstance(failed, RequestFailed)
    assert failed.error.kind == "request"
    expected_code = "prompt_too_long" if name == "beyond_context" else "invalid_request"
    assert failed.error.code == expected_code
    assert re.search(message, failed.error.message), failed.error.message
    assert replies[good.request_id][-1].finished  # the engine serves on


def test_undecodable_or_unanswerable_messages_are_dropped(frontend, prep) -> None:
    valid = to(frontend, make_request(prep, *ONE_IMAGE))
    body, *tensor_frames = frontend.codec.encode(valid)
    garbage = [
        [b"\x00not msgpack"],
        [b""],
        [msgspec.msgpack.encode(Ready(role="x", pid=1, endpoint="y"))],  # another socket's
        [body],  # its tensor frames missing
        [body, tensor_frames[0][:-8], *tensor_frames[1:]],  # a tensor frame cut short
    ]
    for frames in garbage:
        frontend.send_frames([bytes(f) for f in frames])
    frontend.send(replace(valid, reply_to="no address at all"))  # readable, but unanswerable
    replies = frontend.run(to(frontend, make_request(prep, *TEXT, max_tokens=2)))
    assert len(replies) == 1  # nothing came back for the garbage: it had no readable address


def test_pixels_through_shared_memory_give_the_same_tokens_and_lost_ones_a_retryable_error(
    frontend, prep, tmp_path, request
) -> None:
    """The engine reads an ipc socket, so it takes tensors from shared memory (protocol/shm.py),
    as an MM worker on its host sends the big ones."""

    def sender(name: str) -> Codec:
        writer = ShmWriter(shm.sender_tag(f"{tmp_path}/{name}"), threshold=1024,
                           capacity=1 << 30, max_age_s=60)
        request.addfinalizer(writer.close)
        return Codec(EngineInput, shm_writer=writer)

    framed = to(frontend, make_request(prep, "what is in this picture?", ((224, 224),)))
    shared = replace(framed, request_id="shared")
    frontend.send_frames(sender("live").encode(shared))
    frontend.send(framed)
    replies = frontend.collect([shared.request_id, framed.request_id])
    assert tokens_of(replies["shared"]) == tokens_of(replies[framed.request_id])
    frames = sender("killed").encode(replace(framed, request_id="lost"))
    for path in shm.SHM_DIR.glob(f"mmlane-{shm.sender_tag(f'{tmp_path}/killed')}-*"):
        path.unlink()  # as the successor of a killed MM worker does
    frontend.send_frames(frames)
    [failed] = frontend.collect(["lost"])["lost"]
    assert isinstance(failed, RequestFailed) and failed.error.code == "tensors_lost"
    assert failed.error.kind == "retryable"
    assert tokens_of(frontend.run(replace(framed, request_id="after"))["after"])  # serves on


# ---------------------------------------------------------------- limits and stopping


def test_overload_is_refused_and_stop_fails_held_requests(run_dir: Path, prep, qwen_dir) -> None:
    # No drain time: at the stop, the held requests fail at once instead of running to the end.
    engine = start_engine(run_dir, "--max-queued-requests", "2", "--drain-timeout", "0")
    with zmq.Context() as ctx, Frontend(ctx, engine.endpoint, f"ipc://{run_dir}/reply.sock") as fe:
        held = [to(fe, make_request(prep, *TEXT, max_tokens=4000)) for _ in range(2)]
        refused = [to(fe, make_request(prep, *TEXT)) for _ in range(3)]
        fe.send(*held, *refused)
        replies = fe.collect([r.request_id for r in refused])
        for request in refused:
            (failed,) = replies[request.request_id]
            assert isinstance(failed, RequestFailed)
            assert (failed.error.kind, failed.error.code) == ("retryable", "overloaded")
            assert "overloaded" in failed.error.message
        assert stop_role(engine) == 0
        replies = fe.collect([r.request_id for r in held])
        for request in held:
            *outputs, last = replies[request.request_id]
            assert all(isinstance(o, EngineOutput) and not o.finished for o in outputs)
            assert isinstance(last, RequestFailed) and last.error.code == "peer_restarted"


# ---------------------------------------------------------------- the runner in process


@pytest.mark.parametrize("max_batch", [1, MAX_BATCH])
@pytest.mark.parametrize(
    "family",
    ["qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "llava_onevision", "mistral3", "internvl",
     "idefics3", "smolvlm"],
)
def test_runner_chunked_prefill_and_interleaving_match_generate(
    family, max_batch, model_dirs
) -> None:
    model_dir = model_dirs[family]
    prep = load_preprocessor(model_dir)
    requests = [make_request(prep, "look", ((90, 70),), max_tokens=10), make_request(prep, "hi")]
    expected = None
    for chunk in (4096, 5):  # 5 splits the image's placeholders across prefill units
        runner = load_runner(model_dir, max_batch=max_batch, prefill_chunk_tokens=chunk)
        for request in requests:
            validate_request(request, runner.spec)
        expected = expected or [generate_greedy(runner.model, prep, r) for r in requests]
        for handle, request in enumerate(requests):
            runner.add(handle, request)
        tokens: dict[int, list[int]] = {0: [], 1: []}
        while runner.has_work():
            for output in runner.step():
                assert output.error is None
                tokens[output.handle] += output.token_ids
        assert [tokens[0], tokens[1]] == expected
        runner.close()


def test_an_idefics3_span_must_be_its_tiles_expansion(model_dirs) -> None:
    """Its image tokens alone are not enough: the row/column tokens among them must be those
    of the item's grid of tiles."""
    model_dir = model_dirs["idefics3"]
    prep = load_preprocessor(model_dir)
    spec = ModelSpec.of(prep, AutoConfig.from_pretrained(model_dir),
                        vocab_size=len(prep.tokenizer), max_context=prep.max_context)
    request = make_request(prep, "look", ((500, 333),))  # a 3x4 grid
    validate_request(request, spec)
    ids = list(request.prompt_token_ids)
    tile = ids.index(prep.tokenizer.convert_tokens_to_ids("<row_1_col_2>"))
    ids[tile] = prep.tokenizer.convert_tokens_to_ids("<row_2_col_1>")
    with pytest.raises(RequestError, match="not the idefics3 expansion of its tensors"):
        validate_request(replace(request, prompt_token_ids=ids), spec)


def test_runner_fails_one_request_on_a_model_error(qwen_dir, prep) -> None:
    runner = load_runner(qwen_dir)
    good = make_request(prep, *ONE_IMAGE, max_tokens=3)
    # NaN pixels (refused by validation, which this skips) make NaN probabilities, which
    # sampling cannot draw from: a real exception inside the model step.
    nan = np.float32(np.nan)
    broken = tensors_with(_set("pixel_values", lambda t: np.full(t["pixel_values"].shape, nan)))(
        replace(good, sampling=replace(good.sampling, temperature=1.0))
    )
    runner.add(0, broken)
    runner.add(1, good)
    outputs = []
    while runner.has_work():
        outputs += runner.step()
    (error,) = [o.error for o in outputs if o.handle == 0]
    assert error is not None and error.code == "model_error"
    assert "model failed on this request" in error.message
    assert [o.finish_reason for o in outputs if o.handle == 1][-1] == "length"


def test_a_prefill_chunk_that_fails_fails_its_request_alone(
    qwen_dir, prep, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception in an image prompt's prefill chunk fails that request with model_error; a
    text request beside it and the next image still finish."""
    run = HFRunner._run

    def failing_for_the_first(runner: HFRunner, batch: list, *args: object,
                              **kwargs: object) -> object:
        if batch[0].handle == 0:
            raise ValueError("a forward pass that failed")
        return run(runner, batch, *args, **kwargs)

    monkeypatch.setattr(HFRunner, "_run", failing_for_the_first)
    runner = load_runner(qwen_dir, max_batch=1)  # the decode steps: one request each
    try:
        runner.add(0, make_request(prep, *ONE_IMAGE, max_tokens=3))
        runner.add(1, make_request(prep, "and meanwhile?", max_tokens=3))
        runner.add(2, make_request(prep, *ONE_IMAGE, max_tokens=3, image_seed=1))
        outputs = []
        while runner.has_work():
            outputs += runner.step()
    finally:
        runner.close()
    (error,) = [o.error for o in outputs if o.handle == 0]
    assert error is not None and error.code == "model_error"
    assert "the model failed on this request: ValueError" in error.message
    for handle in (1, 2):
        assert [o.finish_reason for o in outputs if o.handle == handle][-1] == "length"
        assert all(o.error is None for o in outputs if o.handle == handle)


def _tokens_alone(runner: HFRunner, request: EngineRequest) -> list[int]:
    return served_alone(runner, request)[0]


def served_alone(runner: HFRunner, request: EngineRequest) -> tuple[list[int], list[object]]:
    """The request's tokens and their logprobs, run alone."""
    runner.add(0, request)
    tokens: list[int] = []
    logprobs: list[object] = []
    while runner.has_work():
        for output in runner.step():
            assert output.error is None, output.error
            tokens += output.token_ids
            logprobs += output.logprobs or []
    return tokens, logprobs


def test_the_vision_lane_runs_whole_passes_with_its_own_torch_threads(qwen_dir, prep,
                                                                      reference) -> None:
    """--vision-threads 2 beside --torch-threads 1: the lane's thread keeps its own count
    (torch keeps it per thread), the runner's stays 1; the same tokens as HF `generate`."""
    request = make_request(prep, *BIG_IMAGE, max_tokens=6)
    runner = load_runner(qwen_dir, torch_threads=1, vision_threads=2)
    assert runner._lane.threads == 2
    assert _tokens_alone(runner, request) == generate_greedy(reference, prep, request)
    assert torch.get_num_threads() == 1
    assert runner.metrics.histograms["engine_step:vision"].count == 1  # one whole pass
    runner.close()


def _hashed(request: EngineRequest, mm_hash: str) -> EngineRequest:
    return replace(request, mm_items=[replace(item, mm_hash=mm_hash)
                                      for item in request.mm_items])


def _serve(runner: HFRunner, requests: dict[int, EngineRequest]) -> dict[int, list[object]]:
    """Each request's outputs, all added at once and stepped to the end."""
    for handle, request in requests.items():
        runner.add(handle, request)
    outputs: dict[int, list[object]] = {handle: [] for handle in requests}
    while runner.has_work():
        for output in runner.step():
            outputs[output.handle].append(output)
    return outputs


def test_the_same_image_in_requests_arriving_together_runs_one_pass(qwen_dir, prep,
                                                                    reference) -> None:
    """The second waits for the first's job on the vision lane (an encoder-cache hit)."""
    runner = load_runner(qwen_dir)
    request = _hashed(make_request(prep, *BIG_IMAGE, max_tokens=6), "same")
    outputs = _serve(runner, {0: request, 1: request})
    expected = generate_greedy(reference, prep, request)
    assert [[t for o in outputs[h] for t in o.token_ids] for h in (0, 1)] == [expected] * 2
    assert runner.metrics.histograms["engine_step:vision"].count == 1
    counters = runner.metrics.counters
    assert (counters["encoder_cache_misses"], counters["encoder_cache_hits"]) == (1, 1)


@pytest.mark.parametrize(("raised", "message"), [
    (torch.OutOfMemoryError("no memory for this image"), "out of device memory"),
    (SystemExit(3), "the vision pass died (SystemExit: 3); the lane serves on"),
], ids=["out of memory", "not an Exception"])
def test_a_failed_vision_pass_fails_the_requests_that_wait_for_it_alone(
    qwen_dir, prep, raised: BaseException, message: str
) -> None:
    """Whatever the pass raises (out of memory; even what is not an Exception, which would end
    the lane's thread) is those requests' retryable error, once each; the lane goes on with the
    next image."""
    runner = load_runner(qwen_dir)
    broken = _hashed(make_request(prep, "look", ((90, 70),), max_tokens=3), "broken")
    good = make_request(prep, *ONE_IMAGE, max_tokens=3)
    encode = runner._lane._encode

    def failing(tensors):
        if tensors is broken.mm_items[0].tensors:
            raise raised
        return encode(tensors)

    runner._lane._encode = failing
    outputs = _serve(runner, {0: broken, 1: broken, 2: good})
    for handle in (0, 1):
        [output] = outputs[handle]
        assert isinstance(output.error, RetryableError), output.error
        assert message in output.error.message
    assert outputs[2][-1].finish_reason == "length"
    assert not runner._vision_jobs  # the failed job is gone: the image may come again
    runner._lane._encode = encode
    assert _serve(runner, {3: broken})[3][-1].finish_reason == "length"


def test_images_pass_before_waiting_videos_and_a_video_waits_through_a_bounded_number() -> None:
    """A video that waits behind the pass under way lets the images that come after it go
    first, up to IMAGES_AHEAD_OF_A_VIDEO of them; images keep their order, videos theirs."""
    running, release, order = threading.Event(), threading.Event(), []

    def encode(tensors):
        running.set()
        release.wait(30)
        order.append(int(tensors["job"][0]))
        return torch.zeros(1, 1)

    finished = threading.Semaphore(0)
    lane = VisionLane(encode, threads=1, device=torch.device("cpu"), wake=finished.release,
                      nice=0)
    try:
        def submit(job: int, video: bool) -> None:
            tensors = {"job": np.array([job])}
            lane.submit(job, {**tensors, VIDEO_PIXELS: np.zeros(1)} if video else tensors)

        submit(0, video=True)  # under way while the others come
        running.wait(30)
        submit(1, video=True)
        images = IMAGES_AHEAD_OF_A_VIDEO + 2
        for job in range(2, 2 + images):
            submit(job, video=False)
        submit(2 + images, video=True)
        release.set()
        for _ in range(images + 3):
            assert finished.acquire(timeout=30)
    finally:
        lane.close()
    passed_over = list(range(2, 2 + IMAGES_AHEAD_OF_A_VIDEO))
    assert order == [0, *passed_over, 1, 2 + IMAGES_AHEAD_OF_A_VIDEO,
                     3 + IMAGES_AHEAD_OF_A_VIDEO, 2 + images]
    assert [result.job for result in lane.finished()] == order


def test_a_request_aborted_while_its_image_is_encoded_gets_nothing(qwen_dir, prep) -> None:
    """Its pass still runs or is skipped; no output for it, and the next request with the
    same image is served."""
    runner = load_runner(qwen_dir)
    request = _hashed(make_request(prep, *BIG_IMAGE, max_tokens=3), "aborted")
    runner.add(0, request)
    assert runner.step() == []  # its images go to the lane
    runner.abort(0)
    assert not runner.has_work()
    assert _serve(runner, {1: request})[1][-1].finish_reason == "length"
    assert not runner._vision_jobs


def test_a_repeated_image_takes_its_features_from_the_encoder_cache(qwen_dir, prep,
                                                                      reference) -> None:
    """Same tokens as HF `generate` each time; the second request runs no vision pass."""
    runner = load_runner(qwen_dir, prefill_chunk_tokens=16)
    request = make_request(prep, *BIG_IMAGE, max_tokens=8)
    hashed = replace(request, mm_items=[replace(item, mm_hash="big")
                                        for item in request.mm_items])
    expected = generate_greedy(reference, prep, request)
    assert _tokens_alone(runner, hashed) == expected
    counters = runner.metrics.counters
    assert (counters["encoder_cache_misses"], counters["encoder_cache_hits"]) == (1, 0)
    vision_units = runner.metrics.histograms["engine_step:vision"].count
    assert _tokens_alone(runner, hashed) == expected
    assert (counters["encoder_cache_misses"], counters["encoder_cache_hits"]) == (1, 1)
    assert runner.metrics.histograms["engine_step:vision"].count == vision_units
    # An image without a hash (its MM worker's cache off) is never kept.
    assert _tokens_alone(runner, request) == expected
    assert (counters["encoder_cache_misses"], counters["encoder_cache_hits"]) == (1, 1)


def test_an_encoder_cache_too_small_for_an_image_keeps_nothing(qwen_dir, prep) -> None:
    runner = load_runner(qwen_dir, encoder_cache_gb=1024 / 2**30)
    request = make_request(prep, *BIG_IMAGE, max_tokens=2)
    hashed = replace(request, mm_items=[replace(item, mm_hash="big")
                                        for item in request.mm_items])
    assert _tokens_alone(runner, hashed) == _tokens_alone(runner, hashed)
    assert runner.metrics.counters["encoder_cache_misses"] == 2
    assert runner.metrics.counters.get("encoder_cache_hits", 0) == 0


def test_the_vllm_encoder_lane_runs_one_pass_per_image_and_keeps_it(
    qwen_dir: Path, prep: Preprocessor
) -> None:
    """--encoder-lane's face on a vLLM runner's loop (vllm/lane.py; no vLLM needed): three
    requests for one image at once share one pass, and a later one takes it from the encoder
    cache, each with the vision tower's own embeddings. A request cancelled while its image
    waits alone cancels the pass, and the image runs a pass the next time. A cached image
    whose span holds another count of image tokens is refused, naming both counts."""
    from mmlane.common.stats import Metrics
    from mmlane.engine.vision import load_encoder
    from mmlane.engine.vllm.lane import EncoderLane

    def hashed(request: EngineRequest, mm_hash: str) -> EngineRequest:
        return replace(request, mm_items=[replace(request.mm_items[0], mm_hash=mm_hash)])

    encoder = load_encoder(qwen_dir, prep, "cpu")
    metrics = Metrics("engine", "test")
    loop = asyncio.new_event_loop()
    lane = EncoderLane(encoder, prep.image_token_id, VisionConfig(image_nice=0), loop, metrics)
    image = hashed(make_request(prep, "what is it?", ((64, 48),)), "image")
    busy = hashed(make_request(prep, "and this?", ((1024, 768),), image_seed=1), "busy")
    dropped = hashed(make_request(prep, "or this?", ((320, 240),), image_seed=2), "dropped")
    other_size = hashed(make_request(prep, "what is it?", ((128, 96),)), "image")

    def passes() -> int:
        return sum(metrics.histograms["engine_step:vision"].counts)

    async def story() -> None:
        together = await asyncio.gather(*(lane.embeddings(image, [0]) for _ in range(3)))
        later = await lane.embeddings(image, [0])
        with torch.inference_mode():
            expected = encoder(image.mm_items[0].tensors)
        assert all(torch.equal(embeds, expected) for [embeds] in [*together, later])
        assert (metrics.counters["encoder_cache_misses"], metrics.counters["encoder_cache_hits"],
                passes()) == (1, 3, 1)
        first = asyncio.ensure_future(lane.embeddings(busy, [0]))
        waiting = asyncio.ensure_future(lane.embeddings(dropped, [0]))
        while metrics.counters["encoder_cache_misses"] < 3:  # both submitted: the lane runs
            await asyncio.sleep(0)                             # the large image's pass first
        waiting.cancel()
        await first
        await lane.embeddings(dropped, [0])  # a pass of its own: the cancelled one never ran
        assert (metrics.counters["encoder_cache_misses"], passes()) == (4, 3)
        with pytest.raises(RequestError, match=r"mm_items\[0\] has \d+ image tokens, but its "
                                               r"image made \d+ image embeddings"):
            await lane.embeddings(other_size, [0])

    try:
        loop.run_until_complete(story())
    finally:
        lane.close()
        loop.close()
