"""The engine's scheduling as seen from outside: real engine processes, real sockets, no mocks.

What is checked is ordering and content, never timing: a request's tokens do not depend on how
its work was cut or what ran beside it; a text request that arrives during an image's work
finishes first; image work still completes under a steady stream of text; a request past its
deadline, or aborted, gets one terminal reply and frees its place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from msgspec.structs import replace
from test_engine import (
    DEVICE,
    REPLY_TIMEOUT_S,
    Frontend,
    Reply,
    assert_streamed,
    generate_greedy,
    load_runner,
    make_request,
    start_engine,
    to,
    tokens_of,
)
from transformers import DynamicCache

from bench.images import encode, make_image
from conftest import start_role, stop_role
from mmlane.cli import build_parser, role_config
from mmlane.client import Client, user_message
from mmlane.common.config import load_config
from mmlane.engine.config import EngineConfig, HFConfig
from mmlane.engine.hf.scheduler import pick
from mmlane.engine.hf.sequence import Sequence
from mmlane.launcher import SERVE_SETTINGS, Child, serve_config, stop_all
from mmlane.model import Preprocessor, load_model
from mmlane.protocol.errors import FatalError
from mmlane.protocol.messages import (
    AbortRequests,
    EngineOutput,
    EngineRequest,
    MMItem,
    RequestFailed,
    SamplingParams,
)
from peers import StandInEngine

SMALL_CHUNK = 4  # splits every image's prompt mid-way: an image takes many units

LONG_TEXT = " ".join(f"word{i}" for i in range(120))  # a text prompt of several chunks
CASES = {
    "short-text": ("hi",),
    "long-text": (LONG_TEXT,),
    "small-image": ("what is this?", ((64, 48),)),
    "big-image": ("and this one?", ((640, 480),)),
    "two-images": ("compare them", ((100, 60), (56, 84))),
}


@pytest.fixture(scope="module")
def reference(qwen_dir: Path) -> torch.nn.Module:
    return load_model(qwen_dir, DEVICE)


@pytest.fixture(scope="module")
def small_chunk_engine(module_run_dir: Path, qwen_dir: Path) -> Iterator[Child]:
    engine = start_engine(module_run_dir, "--prefill-chunk-tokens", str(SMALL_CHUNK))
    yield engine
    assert stop_role(engine) == 0


@pytest.fixture
def frontend(small_chunk_engine: Child, run_dir: Path) -> Iterator[Frontend]:
    with Frontend.connected(small_chunk_engine, run_dir) as fe:
        yield fe


def next_terminal(fe: Frontend) -> str:
    """Receive replies until one is terminal; the id of the request it ends."""
    while True:
        reply = fe.take()
        if isinstance(reply, RequestFailed) or reply.finished:
            fe.finished_order.append(reply.request_id)
            return reply.request_id


# ---------------------------------------------------------------- same tokens however run


@pytest.mark.parametrize("chunk", [SMALL_CHUNK, 37])
def test_tokens_are_the_same_alone_chunked_or_interleaved(
    run_dir: Path, prep, reference, chunk: int
) -> None:
    engine = start_engine(run_dir, "--prefill-chunk-tokens", str(chunk))
    try:
        reply_to = f"ipc://{run_dir}/reply.sock"
        with zmq.Context() as ctx, Frontend(ctx, engine.endpoint, reply_to) as fe:
            greedy = [make_request(prep, *case, max_tokens=10) for case in CASES.values()]
            sampled = [
                make_request(prep, *case, max_tokens=10, temperature=1.0, seed=3)
                for case in (CASES["short-text"], CASES["big-image"])
            ]
            requests = [to(fe, r) for r in greedy + sampled]
            alone = {}
            for request in requests:
                alone.update(fe.run(request))
            together = fe.run(*[replace(r, request_id=r.request_id + "-again") for r in requests])
    finally:
        assert stop_role(engine) == 0
    for request in requests:
        assert_streamed(alone[request.request_id], request)
        tokens = tokens_of(alone[request.request_id])
        assert tokens_of(together[request.request_id + "-again"]) == tokens, request.request_id
    for request in greedy:  # and chunked is what the unchunked Hugging Face generate makes
        assert tokens_of(alone[request.request_id]) == generate_greedy(reference, prep, request)


# ---------------------------------------------------------------- who finishes first


def test_text_arriving_during_an_image_finishes_before_it(frontend, prep) -> None:
    image = to(frontend, make_request(prep, "look", ((640, 480), (480, 640)), max_tokens=2))
    frontend.send(image)
    for i in range(3):
        # Sent after the image on the same socket, so the engine holds the image by then; each
        # text request is only sent once the one before has finished: all arrive mid-image.
        text = to(frontend, make_request(prep, f"quick question {i}", max_tokens=8))
        frontend.send(text)
        assert next_terminal(frontend) == text.request_id
    assert next_terminal(frontend) == image.request_id


def test_an_image_completes_while_text_keeps_arriving(frontend, prep) -> None:
    """A strict text-first policy would never run the image here: four text requests are always
    in the engine. The image's prompt chunks take their turns with their decode steps: it
    finishes."""
    image = to(frontend, make_request(prep, "look", ((640, 480),), max_tokens=3))
    in_flight = set()

    def send_text(i: int) -> None:
        text = to(frontend, make_request(prep, f"stream {i}", max_tokens=16))
        frontend.send(text)
        in_flight.add(text.request_id)

    for i in range(4):
        send_text(i)
    frontend.send(image)
    texts_done = 0
    while (done := next_terminal(frontend)) != image.request_id:
        assert texts_done < 500, "the image request starved"  # it takes about 20
        in_flight.discard(done)
        texts_done += 1
        send_text(texts_done + 4)
    assert texts_done > 0  # text kept flowing meanwhile
    while in_flight:
        in_flight.discard(next_terminal(frontend))


def test_text_runs_while_an_image_is_on_the_vision_lane(qwen_dir: Path, prep) -> None:
    """The model thread waits for no vision pass: with the vision lane held inside an image's
    pass, a text request that arrives meanwhile still runs to its end. The image's tokens are
    then what it gets alone."""
    gate, held = threading.Event(), threading.Event()
    runner = load_runner(qwen_dir)
    encode = runner._lane._encode

    def held_at_the_gate(tensors: Any) -> Any:
        held.set()
        gate.wait(REPLY_TIMEOUT_S)
        return encode(tensors)

    runner._lane._encode = held_at_the_gate
    try:
        image = make_request(prep, "look", ((64, 48),), max_tokens=3)
        runner.add(0, image)
        tokens: dict[int, list[int]] = {0: [], 1: []}

        def step() -> None:
            for output in runner.step(0.01):
                assert output.error is None, output.error
                tokens[output.handle] += output.token_ids

        while not held.is_set():  # its vision pass starts on the lane
            step()
        runner.add(1, make_request(prep, "quick question", max_tokens=4))
        while len(tokens[1]) < 4:
            step()
        assert tokens[0] == []  # the image's pass is still held
        gate.set()
        while runner.has_work():
            step()
        runner.add(2, image)
        alone: list[int] = []
        while runner.has_work():
            alone += [token for output in runner.step(0.01) for token in output.token_ids]
        assert tokens[0] == alone and len(alone) == 3
    finally:
        gate.set()
        runner.close()


# ---------------------------------------------------------------- deadlines and aborts


def replies_until(fe: Frontend, last_id: str) -> list[Reply]:
    """Every reply, for any request, until `last_id` has had its terminal one."""
    replies: list[Reply] = []
    while True:
        reply = fe.take()
        replies.append(reply)
        terminal = isinstance(reply, RequestFailed) or reply.finished
        if terminal and reply.request_id == last_id:
            return replies


def terminal_replies(replies: list[Reply], request_id: str) -> list[Reply]:
    return [
        r for r in replies
        if r.request_id == request_id and (isinstance(r, RequestFailed) or r.finished)
    ]


@pytest.fixture
def one_slot_engine(run_dir: Path, qwen_dir: Path) -> Iterator[Frontend]:
    """An engine that holds one request at most: a second is refused until the first is freed."""
    engine = start_engine(run_dir, "--max-queued-requests", "1")
    with Frontend.connected(engine, run_dir) as fe:
        yield fe
    assert stop_role(engine) == 0


def long_request(fe: Frontend, prep: Preprocessor, **fields: object) -> EngineRequest:
    """Thousands of decode steps: still running long after any deadline or abort below."""
    return replace(to(fe, make_request(prep, "hello there, what is new", max_tokens=4000)),
                   **fields)


def test_a_request_past_its_deadline_is_dropped_and_frees_its_place(
    one_slot_engine: Frontend, prep
) -> None:
    fe = one_slot_engine
    already_late = long_request(fe, prep, deadline=time.time() - 1)
    fe.send(already_late)
    (late,) = replies_until(fe, already_late.request_id)
    assert isinstance(late, RequestFailed) and late.error.code == "timeout"

    running = long_request(fe, prep, deadline=time.time() + 0.5)
    after = to(fe, make_request(prep, "next one", max_tokens=3))
    fe.send(running)
    replies = replies_until(fe, running.request_id)
    *outputs, last = [r for r in replies if r.request_id == running.request_id]
    assert outputs and all(isinstance(o, EngineOutput) and not o.finished for o in outputs)
    assert isinstance(last, RequestFailed), "it finished before its deadline"
    assert (last.error.kind, last.error.code) == ("retryable", "timeout")
    fe.send(after)  # the one slot is free again: not refused as overloaded
    replies += replies_until(fe, after.request_id)
    assert isinstance(replies[-1], EngineOutput) and replies[-1].finish_reason == "length"
    assert len(terminal_replies(replies, running.request_id)) == 1


def test_an_aborted_request_is_dropped_and_frees_its_place(one_slot_engine: Frontend, prep) -> None:
    fe = one_slot_engine
    running = long_request(fe, prep)
    fe.send(running)
    first = fe.take()  # its first token: it is running
    assert isinstance(first, EngineOutput) and first.request_id == running.request_id
    fe.send_frames(fe.codec.encode(AbortRequests(request_ids=["unknown", running.request_id])))
    replies = replies_until(fe, running.request_id)
    assert isinstance(replies[-1], RequestFailed)
    assert (replies[-1].error.kind, replies[-1].error.code) == ("retryable", "aborted")
    after = to(fe, make_request(prep, "next one", max_tokens=3))
    fe.send(after)
    replies += replies_until(fe, after.request_id)
    assert isinstance(replies[-1], EngineOutput) and replies[-1].finish_reason == "length"
    assert len(terminal_replies(replies, running.request_id)) == 1


def test_a_request_aborted_before_it_arrives_is_refused_not_run(
    one_slot_engine: Frontend, prep
) -> None:
    """An image request's abort can reach the engine before its MM worker sends the request."""
    fe = one_slot_engine
    late = long_request(fe, prep)
    fe.send_frames(fe.codec.encode(AbortRequests(request_ids=[late.request_id])))
    fe.send(late)
    replies = replies_until(fe, late.request_id)
    assert len(replies) == 1 and isinstance(replies[0], RequestFailed)  # no token was made
    assert (replies[0].error.kind, replies[0].error.code) == ("retryable", "aborted")
    after = to(fe, make_request(prep, "next one", max_tokens=3))
    fe.send(after)  # its place was given back
    replies = replies_until(fe, after.request_id)
    assert isinstance(replies[-1], EngineOutput) and replies[-1].finish_reason == "length"


def test_the_frontend_sends_deadlines_and_aborts_what_it_timed_out(
    run_dir: Path, qwen_dir: Path
) -> None:
    """Frontend and MM worker as real processes; this test stands in for the engine socket."""
    engine_endpoint = f"ipc://{run_dir}/engine.sock"
    mm_endpoint = f"ipc://{run_dir}/mm.sock"
    common = ["--model", str(qwen_dir), "--engine-endpoint", engine_endpoint]
    image_path = run_dir / "small.png"
    image_path.write_bytes(encode(make_image(64, 48), "PNG"))
    with zmq.Context() as ctx, StandInEngine.at(ctx, engine_endpoint) as engine:
        children = [
            start_role("mm-worker", [*common, "--mm-worker-endpoint", mm_endpoint], run_dir),
            start_role("frontend", [
                *common, "--mm-worker-endpoint", mm_endpoint, "--port", "0",
                "--output-endpoint", f"ipc://{run_dir}/out.sock", "--request-timeout", "2",
            ], run_dir),
        ]
        try:
            with Client(children[1].endpoint, timeout_s=REPLY_TIMEOUT_S) as client:
                sent_at = time.time()
                ids = [client.submit([user_message("hello")]),
                       client.submit([user_message("look", [str(image_path)])])]
                requests, aborted = [], []
                while len(requests) < 2 or len(aborted) < 2:  # nobody answers: both time out
                    message = engine.take()
                    if isinstance(message, AbortRequests):
                        aborted += message.request_ids
                    else:
                        requests.append(message)
                results = client.collect(ids)
        finally:
            stop_all(children)
    assert {bool(r.mm_items) for r in requests} == {False, True}  # one direct, one via the worker
    for request in requests:  # the deadline is the frontend's: 2 s after it took the request
        assert sent_at + 1 < request.deadline < time.time() + 2
    assert sorted(aborted) == sorted(r.request_id for r in requests)
    for result in results.values():
        assert result.error is not None and result.error.code == "timeout"


# ---------------------------------------------------------------- the setting


def test_serve_hands_the_scheduling_settings_to_the_engine(run_dir: Path) -> None:
    serve = serve_config(SERVE_SETTINGS.parse(
        ["--prefill-chunk-tokens", "64", "--torch-threads", "3", "--vision-threads", "5",
         "--max-batch", "4", "--run-dir", str(run_dir)]
    ))
    config_json = msgspec.json.encode(serve.engine).decode()
    args = build_parser().parse_args(["engine", "--config-json", config_json])
    config = role_config("engine", args)
    hf = config.hf
    assert (hf.prefill_chunk_tokens, hf.torch_threads, config.vision.vision_threads,
            hf.max_batch) == (64, 3, 5, 4)
    assert load_config(EngineConfig, {}).hf == HFConfig()
    with pytest.raises(FatalError, match="max_batch must be positive"):
        load_config(EngineConfig, {"hf": {"max_batch": 0}})
    with pytest.raises(FatalError, match="prefill_chunk_tokens must be positive"):
        load_config(EngineConfig, {"hf": {"prefill_chunk_tokens": 0}})
    for section, name in (("hf", "torch_threads"), ("vision", "vision_threads")):
        with pytest.raises(FatalError, match=f"{name} must be 0"):
            load_config(EngineConfig, {section: {name: -1}})


# ---------------------------------------------------------------- the policy, in process


def sequence(handle: int, *, image: bool, prefilled: bool | None = None) -> Sequence:
    """A request for the scheduler alone: by default an image one still in its prefill, or a
    text one decoding."""
    items = [MMItem(offset=0, length=4, tensors={})] if image else []
    request = EngineRequest(request_id=f"s{handle}", reply_to="", prompt_token_ids=[1] * 4,
                            sampling=SamplingParams(), mm_items=items)
    seq = Sequence(handle, request, torch.ones(1, 4), DynamicCache(), frozenset(), arrived=0.0,
                   chunk_tokens=2)
    if not image if prefilled is None else prefilled:
        seq.num_cached = seq.prompt_len
    return seq


def run_batches(seqs: list[Sequence], count: int, max_batch: int = 1) -> list[list[Sequence]]:
    """Pick `count` units, in turn."""
    picked = []
    for unit in range(count):
        batch = pick(seqs, max_batch=max_batch)
        assert batch is not None
        for seq in batch:
            seq.last_run = unit
        picked.append(batch)
    return picked


def test_prefill_chunks_go_round_robin_with_decode_steps() -> None:
    """An image prompt's chunk and a text request's decode steps take turns, one unit each."""
    image, text_a, text_b = (sequence(handle, image=handle == 0) for handle in range(3))
    assert handles(run_batches([image, text_a, text_b], 4)) == [[0], [1], [2], [0]]
    image, text_a, text_b = (sequence(handle, image=handle == 0) for handle in range(3))
    assert handles(run_batches([image, text_a, text_b], 2, max_batch=8)) == [[0], [1, 2]]
    assert pick([], max_batch=1) is None


def handles(batches: list[list[Sequence]]) -> list[list[int]]:
    return [[seq.handle for seq in batch] for batch in batches]


def test_decode_steps_batch_least_recently_run_first() -> None:
    decoding = [sequence(handle, image=False) for handle in range(5)]
    picked = run_batches(decoding, 4, max_batch=2)
    assert handles(picked) == [[0, 1], [2, 3], [4, 0], [1, 2]]  # round robin, two at a time
    assert handles(run_batches(decoding, 1, max_batch=8)) == [[3, 0, 4, 1, 2]]


def test_a_new_text_request_runs_before_a_decode_batch_and_alone() -> None:
    decoding = [sequence(handle, image=False) for handle in range(3)]
    for seq in decoding:
        seq.last_run = 0
    new = sequence(3, image=False, prefilled=False)
    image_decoding = sequence(4, image=True, prefilled=True)
    image_decoding.last_run = 0
    picked = run_batches([*decoding, new, image_decoding], 3, max_batch=8)
    # The new request's prefill first, alone; then every decoding request, the image one too.
    # It is not decoding yet (one prefill unit of this scheduler-only test does not fill it).
    assert handles(picked) == [[3], [0, 1, 2, 4], [3]]
