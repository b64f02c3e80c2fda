"""The backend seam: the real engine role, over real sockets, with a pure-Python fake backend.

`FakeRunner` is an asynchronous backend in miniature (as vLLM's AsyncLLM would be): a thread of
its own makes the tokens, and `step` only collects what is ready. Whatever a backend does, every
request gets exactly one terminal reply: tokens stream, aborts, deadlines, the backend's own
errors and a drain. And choosing a backend is lazy: the engine's package and config import none.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest
import zmq
from test_engine import Frontend, Reply, assert_streamed, start_engine

from conftest import free_port
from mmlane.common.config import OpsConfig
from mmlane.common.lifecycle import Stop
from mmlane.common.stats import Metrics
from mmlane.engine import Engine, EngineConfig, ModelSpec, StepOutput
from mmlane.engine.config import Backend
from mmlane.engine.engine import POLL_S
from mmlane.engine.runner import BACKENDS, backend_factory
from mmlane.launcher import stop_all
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import (
    AbortRequests,
    EngineOutput,
    EngineRequest,
    RequestFailed,
    SamplingParams,
)
from replica_server import ID, MESSAGE, StandInReplica

TICK_S = 0.005
"""How often the fake backend's own thread makes a token for each request it holds."""
FAILS = 7
"""A prompt that starts with this token fails in the backend after its first token."""
REFUSED = 8
"""A prompt that starts with this token is refused by the backend's `add`."""
BREAKS = 11
"""A prompt that starts with this token makes the backend's next `step` raise (a backend bug)."""
FOREVER = 10**6
"""max_tokens of a request that runs until something stops it."""

SPEC = ModelSpec(
    family="fake", model_id="fake", image_token_id=0, eos_token_ids=frozenset({1}),
    max_context=FOREVER + 100, vocab_size=100, image_fields=(),
    count_image_tokens=lambda tensors: 0, expand_image=lambda tensors: (),
    check_items=lambda items: None, pixel_norm=None,  # no images: no pixels to render
)
_ids = itertools.count()


class FakeRunner:
    """Replays each request's prompt as its output, a token every TICK_S, on its own thread;
    `step` collects the outputs ready, waiting for them (or `wake`) without spinning."""

    def __init__(self) -> None:
        self.spec = SPEC
        self.steps = 0
        self._break_next_step = False
        self._lock = threading.Lock()
        self._making: dict[int, EngineRequest] = {}  # the thread's: requests still producing
        self._made: dict[int, int] = {}  # tokens made so far, per request
        self._live: set[int] = set()  # the engine's thread's: added, not finished or aborted
        self._ready: queue.Queue[StepOutput | None] = queue.Queue()  # None: a wake
        self._stopped = threading.Event()
        threading.Thread(target=self._produce, name="fake-backend", daemon=True).start()

    def add(self, handle: int, request: EngineRequest, *, arrived: float | None = None) -> None:
        if request.prompt_token_ids[0] == REFUSED:
            raise RuntimeError("the fake backend refuses this prompt")
        self._break_next_step = request.prompt_token_ids[0] == BREAKS
        self._live.add(handle)
        with self._lock:
            self._making[handle] = request
            self._made[handle] = 0

    def step(self, timeout: float) -> list[StepOutput]:
        self.steps += 1
        if self._break_next_step:
            self._break_next_step = False
            raise RuntimeError("the fake backend's step broke")
        ready = []
        with contextlib.suppress(queue.Empty):
            ready.append(self._ready.get(timeout=timeout))
            while True:
                ready.append(self._ready.get_nowait())
        outputs = [out for out in ready if out is not None and out.handle in self._live]
        self._live -= {out.handle for out in outputs if out.finished}
        return outputs

    def wake(self) -> None:
        self._ready.put(None)

    def abort(self, handle: int) -> None:
        self._live.discard(handle)
        with self._lock:
            self._making.pop(handle, None)

    def close(self) -> None:
        self._stopped.set()

    def _produce(self) -> None:
        while not self._stopped.wait(TICK_S):
            with self._lock:
                for handle, request in list(self._making.items()):
                    output = self._next_output(handle, request)
                    if output.finished:
                        del self._making[handle]
                    self._ready.put(output)

    def _next_output(self, handle: int, request: EngineRequest) -> StepOutput:
        made = self._made[handle]
        prompt = request.prompt_token_ids
        if made == 1 and prompt[0] == FAILS:
            return StepOutput(handle, [], error=RequestError("the fake model failed",
                                                             code="model_error"))
        self._made[handle] = made + 1
        done = made + 1 == request.sampling.max_tokens
        return StepOutput(handle, [prompt[made % len(prompt)]], "length" if done else None)


@contextlib.contextmanager
def serving(run_dir: Path, drain_timeout_s: float = 0.0) -> Iterator[tuple[Engine, Frontend, Stop]]:
    """The engine role, its runner a FakeRunner built by the factory it is given, serving on
    its own thread; a stand-in frontend connected to it; and the role's Stop (set: drain)."""
    runner = FakeRunner()

    def make_runner(config: EngineConfig, metrics: Metrics) -> FakeRunner:
        return runner

    config = EngineConfig(engine_endpoint=f"ipc://{run_dir}/e.sock",
                          ops=OpsConfig(drain_timeout_s=drain_timeout_s))
    engine = Engine(config, make_runner)
    stop = Stop(drain_timeout_s)
    serve = threading.Thread(target=engine.serve, args=(stop,), name="engine-main")
    serve.start()
    try:
        with zmq.Context() as ctx:
            frontend = Frontend(ctx, engine.endpoint, f"ipc://{run_dir}/reply.sock")
            try:
                yield engine, frontend, stop
            finally:
                stop.set()
                serve.join(timeout=30)
                assert not serve.is_alive(), "serve did not return"
                frontend.close()
    finally:
        engine.close()
        runner.close()


@pytest.fixture
def engine(run_dir: Path) -> Iterator[tuple[Engine, Frontend, Stop]]:
    with serving(run_dir) as served:
        yield served


def request(frontend: Frontend, prompt: list[int], max_tokens: int = 5,
            deadline: float = 0.0) -> EngineRequest:
    return EngineRequest(
        request_id=f"b{next(_ids)}", reply_to=frontend.reply_to, prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens), deadline=deadline,
    )


def started(frontend: Frontend, *requests: EngineRequest) -> dict[str, list[Reply]]:
    """The replies read until each of `requests` has had an output: the backend runs them."""
    replies: dict[str, list[Reply]] = {}
    while not {r.request_id for r in requests} <= set(replies):
        reply = frontend.take()
        replies.setdefault(reply.request_id, []).append(reply)
    return replies


def failed(replies: list[Reply]) -> RequestFailed:
    """The terminal error of a request whose outputs before it were not terminal."""
    *outputs, last = replies
    assert all(isinstance(r, EngineOutput) and not r.finished for r in outputs)
    assert isinstance(last, RequestFailed), replies
    return last


def assert_nothing_more(frontend: Frontend) -> None:
    """No reply follows the terminal ones (each request had exactly one)."""
    frontend.replies.assert_quiet(int(20 * TICK_S * 1000))  # no reply after the terminal ones


# ---------------------------------------------------------------- the role over a fake backend


def test_tokens_stream_and_each_request_ends_once(engine) -> None:
    _, frontend, _ = engine
    requests = [request(frontend, [3, 4, 5]), request(frontend, [9], 2), request(frontend, [2, 6])]
    replies = frontend.run(*requests)
    for r in requests:
        assert_streamed(replies[r.request_id], r)
        tokens = [t for reply in replies[r.request_id] for t in reply.token_ids]
        prompt = r.prompt_token_ids
        assert tokens == [prompt[i % len(prompt)] for i in range(r.sampling.max_tokens)]
    assert_nothing_more(frontend)


def test_an_abort_ends_a_running_request_and_frees_its_place(engine) -> None:
    _, frontend, _ = engine
    endless = request(frontend, [3], FOREVER)
    frontend.send(endless)
    started(frontend, endless)
    frontend.send(AbortRequests(request_ids=[endless.request_id]))
    replies = frontend.collect([endless.request_id])
    assert failed(replies[endless.request_id]).error.code == "aborted"
    after = request(frontend, [4])
    assert_streamed(frontend.run(after)[after.request_id], after)
    assert_nothing_more(frontend)


def test_a_deadline_ends_a_request_the_backend_is_running(engine) -> None:
    _, frontend, _ = engine
    deadline = time.time() + 0.3
    late = request(frontend, [3], FOREVER, deadline=deadline)
    assert failed(frontend.run(late)[late.request_id]).error.code == "timeout"
    assert time.time() - deadline < POLL_S + 0.5  # the runner's wait ends at the deadline
    assert_nothing_more(frontend)


def test_the_backends_errors_end_their_request_alone(engine) -> None:
    _, frontend, _ = engine
    broken, refused, fine = (request(frontend, prompt) for prompt in ([FAILS, 3], [REFUSED], [5]))
    replies = frontend.run(broken, refused, fine)
    assert failed(replies[broken.request_id]).error.code == "model_error"
    assert len(replies[broken.request_id]) == 2  # its first token, then the error
    (refusal,) = replies[refused.request_id]
    assert isinstance(refusal, RequestFailed) and "refuses this prompt" in refusal.error.message
    assert_streamed(replies[fine.request_id], fine)
    assert_nothing_more(frontend)


def test_a_step_that_raises_fails_what_the_backend_held_and_the_engine_serves_on(engine) -> None:
    _, frontend, _ = engine
    running = request(frontend, [3, 4], FOREVER)
    frontend.send(running)
    started(frontend, running)
    breaking = request(frontend, [BREAKS, 2], FOREVER)
    frontend.send(breaking)
    replies = frontend.collect([breaking.request_id, running.request_id])
    (error,) = replies[breaking.request_id]
    assert isinstance(error, RequestFailed) and error.error.kind == "internal"
    assert "the engine's backend failed" in error.error.message
    assert "step broke" in error.error.message
    assert failed(replies[running.request_id]).error.kind == "internal"
    after = request(frontend, [5, 6])
    assert_streamed(frontend.run(after)[after.request_id], after)
    assert_nothing_more(frontend)


def test_an_idle_engine_waits_in_step_and_an_arrival_wakes_it(engine) -> None:
    served, frontend, _ = engine
    steps = served.runner.steps
    time.sleep(0.5)
    assert served.runner.steps - steps <= 0.5 / POLL_S + 2  # it waits: no spinning
    waits = []
    for _ in range(5):  # each sent as the engine begins a new wait: woken, not polled
        one = request(frontend, [3], 1)
        sent_at = time.monotonic()
        frontend.run(one)
        waits.append(time.monotonic() - sent_at)
    assert sorted(waits)[2] < POLL_S / 2, waits


def test_a_drain_finishes_what_it_can_then_fails_the_rest(run_dir: Path) -> None:
    with serving(run_dir, drain_timeout_s=0.5) as (_, frontend, stop):
        short, endless = request(frontend, [3], 40), request(frontend, [4], FOREVER)
        frontend.send(short, endless)
        early = started(frontend, short, endless)
        stop.set()
        refused = request(frontend, [5])
        later = frontend.run(refused)
        later |= frontend.collect([short.request_id, endless.request_id])
        assert_streamed(early[short.request_id] + later[short.request_id], short)
        assert failed(later[endless.request_id]).error.code == "peer_restarted"
        (refusal,) = later[refused.request_id]
        assert isinstance(refusal, RequestFailed) and refusal.error.code == "peer_restarted"
        assert_nothing_more(frontend)


# ---------------------------------------------------------------- choosing a backend


def test_a_remote_replica_that_does_not_answer_fails_each_request_retryable(
    qwen_dir: Path, run_dir: Path,
) -> None:
    """--backend vllm-remote with nothing at its --vllm-url (a replica down when the engine
    starts): the engine starts, each request gets exactly one reply, a retryable error naming
    the replica, and the engine serves on."""
    url = f"http://127.0.0.1:{free_port()}"
    engine = start_engine(run_dir, "--backend", "vllm-remote", "--model", str(qwen_dir),
                          "--vllm-url", url)
    try:
        with Frontend.connected(engine, run_dir) as frontend:
            first, second = request(frontend, [3, 4]), request(frontend, [5])
            replies = frontend.run(first, second)
            for sent in (first, second):
                error = failed(replies[sent.request_id]).error
                assert error.code == "backend_unavailable", error
                assert url in error.message
            assert_nothing_more(frontend)
    finally:
        stop_all([engine])


@contextlib.contextmanager
def remote_engine(run_dir: Path, model_dir: Path, *urls: str) -> Iterator[Frontend]:
    """An engine role on --backend vllm-remote in front of `urls`, and a frontend for it."""
    replicas = [arg for url in urls for arg in ("--vllm-url", url)]
    engine = start_engine(run_dir, "--backend", "vllm-remote", "--model", str(model_dir),
                          *replicas)
    try:
        with Frontend.connected(engine, run_dir) as frontend:
            yield frontend
    finally:
        stop_all([engine])


def test_a_request_whose_replica_fails_before_its_first_token_goes_to_another(
    qwen_dir: Path, run_dir: Path,
) -> None:
    """One replica answers 500 to every generate (its /health says it is up): each request
    that goes there first is sent to the other one, and every request is served in full."""
    failing, working = StandInReplica("5xx"), StandInReplica()
    try:
        with remote_engine(run_dir, qwen_dir, failing.base_url, working.base_url) as frontend:
            sent = [request(frontend, [3 + index, 4], 3) for index in range(8)]
            replies = frontend.run(*sent)
            for one in sent:
                assert_streamed(replies[one.request_id], one)
                assert {t for r in replies[one.request_id] for t in r.token_ids} == {ID}
            assert_nothing_more(frontend)
        assert failing.generated >= 1 and working.generated == len(sent)
    finally:
        failing.close()
        working.close()


def test_the_requests_of_a_replica_that_stops_answering_go_to_another(
    qwen_dir: Path, run_dir: Path,
) -> None:
    """One replica takes connections and answers nothing, /health neither (stopped): its
    health check fails, and each request that went there, before any token, is sent to the
    other one and served in full, long before its deadline. tests/test_vllm_remote_failures.py
    stops a real replica mid-stream."""
    stalled, working = StandInReplica("stalled"), StandInReplica()
    try:
        with remote_engine(run_dir, qwen_dir, stalled.base_url, working.base_url) as frontend:
            sent = [request(frontend, [3 + index, 4], 3) for index in range(8)]
            began = time.monotonic()
            replies = frontend.run(*sent)
            for one in sent:
                assert_streamed(replies[one.request_id], one)
            assert time.monotonic() - began < 30
            assert_nothing_more(frontend)
        assert stalled.generated >= 1 and working.generated == len(sent)
    finally:
        stalled.close()
        working.close()


@pytest.mark.parametrize(("mode", "code", "tokens"), [
    ("4xx", "invalid_request", 0),  # the request's fault: not sent elsewhere
    ("413", "request_too_large", 0),  # a body limit in front of the replica: the same
    ("cut", "backend_unavailable", 1),  # after its first token: not sent elsewhere either
    ("error chunk", "aborted", 1),
])
def test_a_replica_s_failure_is_the_request_s_one_reply(
    mode: str, code: str, tokens: int, qwen_dir: Path, run_dir: Path,
) -> None:
    """A replica that refuses the request (4xx: its message is the error's), drops the stream
    after the first token, or ends it with an error: the tokens that came, then one terminal
    error, and the engine serves on (the next request too)."""
    replica = StandInReplica(mode)
    try:
        with remote_engine(run_dir, qwen_dir, replica.base_url) as frontend:
            sent = request(frontend, [3, 4], 3)
            replies = frontend.run(sent)[sent.request_id]
            error = failed(replies).error
            assert error.code == code, error
            assert sum(len(r.token_ids) for r in replies[:-1]) == tokens
            if mode != "cut":
                assert MESSAGE in error.message
            assert replica.generated == 1
            replica.mode = "ok"
            again = request(frontend, [5], 2)
            assert_streamed(frontend.run(again)[again.request_id], again)
            assert_nothing_more(frontend)
    finally:
        replica.close()


def test_every_backend_setting_has_a_factory() -> None:
    assert set(BACKENDS) == set(get_args(Backend))
    from mmlane.engine.hf.runner import load

    assert backend_factory("hf") is load


def test_the_engine_and_its_config_import_no_backend() -> None:
    code = (
        "import sys, mmlane.engine, mmlane.engine.config; "
        "loaded = {'torch', 'transformers', 'mmlane.engine.hf.runner'} & set(sys.modules); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
