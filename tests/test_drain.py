"""Graceful stop (SIGTERM) of each role, and cancels that reach the MM worker.

Each test starts the role under test as a real process (conftest's `start_role`, its log under
RUN_DIR/logs) and plays its peers on real sockets, so it sees every message the role sends:

    engine      a stand-in frontend pushes EngineRequests and gathers the replies
    MM worker   a stand-in engine and frontend gather the rendered requests and the errors
    frontend    a native client; a stand-in engine and MM worker that answer when told to

At SIGTERM a role refuses new work at once with a retryable error, finishes what it holds within
its drain timeout, fails the rest with a retryable error, and exits 0: every request gets exactly
one terminal reply. The last test stops a whole cluster the way `mmlane serve` does.
"""

from __future__ import annotations

import itertools
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from bench.images import jpeg_uri
from conftest import role_log, start_role
from mmlane.cli import config_from_argv
from mmlane.client import user_message
from mmlane.launcher import Child, start_roles, stop_all
from mmlane.model import Preprocessor
from mmlane.ops.health import ping_all
from mmlane.protocol.messages import (
    AbortRequests,
    CancelChat,
    CancelJobs,
    ChatError,
    ChatOutput,
    ChatRequest,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    ImageUrl,
    MMJob,
    MMWorkerInput,
    RequestFailed,
    SamplingParams,
)
from peers import (
    PATIENCE_S,
    Inbox,
    StandInEngine,
    is_terminal,
    push,
    send,
    wait_for_stats,
    wait_until,
)

DRAINING = ("retryable", "peer_restarted")
"""(kind, code) of the error a stopping role answers with."""
_ids = itertools.count()


# ---------------------------------------------------------------- processes and sockets


class Site:
    """One test's run dir and ZMQ context, and the roles it started (stopped at its end)."""

    def __init__(self, run_dir: Path, model_dir: Path, ctx: zmq.Context) -> None:
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.ctx = ctx
        self.children: list[Child] = []

    def ipc(self, name: str) -> str:
        return f"ipc://{self.run_dir}/{name}.sock"

    def start(self, role: str, drain_timeout_s: float, *args: str) -> Child:
        """`mmlane ROLE ARGS`, answering pings on ipc://RUN_DIR/control-ROLE.sock."""
        argv = ["--model", str(self.model_dir), "--drain-timeout", str(drain_timeout_s),
                "--control-endpoint", self.ipc(f"control-{role}"), *args]
        child = start_role(role, argv, self.run_dir, log_dir=self.run_dir / "logs")
        self.children.append(child)
        return child

    def sigterm_and_wait_until_draining(self, child: Child) -> None:
        """SIGTERM, then ping the role until it says 'draining': from then on it refuses work."""
        child.process.send_signal(signal.SIGTERM)
        control = self.ipc(f"control-{child.role}")
        wait_until(lambda: _state(control) == "draining", f"{child.role} saying 'draining'")


@pytest.fixture
def site(run_dir: Path, qwen_dir: Path) -> Iterator[Site]:
    ctx = zmq.Context()
    site = Site(run_dir, qwen_dir, ctx)
    try:
        yield site
    finally:
        stop_all(site.children)  # those a failed test left running
        ctx.destroy(linger=0)


def _state(control_endpoint: str) -> str:
    (answer,) = ping_all([control_endpoint], PATIENCE_S)
    assert answer.pong is not None, answer.problem
    return answer.pong.state


def exit_status(child: Child) -> int:
    return child.process.wait(timeout=PATIENCE_S)


def single_terminal(replies: list[Any]) -> Any:
    """The one terminal reply among a request's replies, which it must end with."""
    terminal = [r for r in replies if is_terminal(r)]
    assert len(terminal) == 1 and terminal[0] is replies[-1], replies
    return terminal[0]


def error_of(reply: Any) -> tuple[str, str]:
    assert isinstance(reply, RequestFailed | ChatError), reply
    return reply.error.kind, reply.error.code


def prompt_ids(prep: Preprocessor, images: int = 0) -> list[int]:
    """A prompt as the frontend renders it: chat template, one placeholder per image."""
    content = [{"type": "image"} for _ in range(images)]
    content.append({"type": "text", "text": "Tell me about lanes."})
    [ids] = prep.tokenize_batch([prep.render_prompt([{"role": "user", "content": content}])])
    return list(ids)


# ---------------------------------------------------------------- the engine


def text_request(prep: Preprocessor, reply_to: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{next(_ids)}", reply_to=reply_to, prompt_token_ids=prompt_ids(prep),
        sampling=SamplingParams(max_tokens=max_tokens),
    )


def engine_with_held_requests(
    site: Site, prep: Preprocessor, drain_timeout_s: float, max_tokens: int
) -> tuple[Child, zmq.Socket, Inbox, list[EngineRequest]]:
    """An engine holding four running requests (each has streamed its first token)."""
    engine = site.start("engine", drain_timeout_s, "--device", "cpu",
                        "--engine-endpoint", site.ipc("engine"))
    replies = Inbox.bound(site.ctx, site.ipc("frontend"), FrontendInput)
    requests = push(site.ctx, site.ipc("engine"))
    held = [text_request(prep, replies.endpoint, max_tokens) for _ in range(4)]
    send(requests, *held)
    while set(replies.by_request()) != {r.request_id for r in held}:
        replies.take()
    return engine, requests, replies, held


def test_engine_finishes_held_requests_and_refuses_new_ones(site: Site, prep: Preprocessor) -> None:
    engine, requests, replies, held = engine_with_held_requests(
        site, prep, drain_timeout_s=PATIENCE_S, max_tokens=400
    )
    started = time.monotonic()
    site.sigterm_and_wait_until_draining(engine)
    late = text_request(prep, replies.endpoint, max_tokens=4)
    send(requests, late)
    replies.take_until_answered([r.request_id for r in [*held, late]])
    assert exit_status(engine) == 0, role_log(engine)[-3000:]
    stopped_s = time.monotonic() - started
    replies.take_all()

    by_request = replies.by_request()
    for request in held:
        last = single_terminal(by_request[request.request_id])
        assert isinstance(last, EngineOutput) and last.finish_reason in ("stop", "length")
    assert [error_of(r) for r in by_request[late.request_id]] == [DRAINING]
    terminal_order = [r.request_id for r in replies.received if is_terminal(r)]
    assert terminal_order[0] == late.request_id  # refused at once, while the others ran on
    print(f"engine drained 4 held requests in {stopped_s:.1f} s")
    assert "draining 4 requests (up to 60 s)" in role_log(engine)


def test_engine_fails_what_is_unfinished_at_the_drain_timeout(
    site: Site, prep: Preprocessor
) -> None:
    engine, _, replies, held = engine_with_held_requests(
        site, prep, drain_timeout_s=0, max_tokens=4000
    )
    engine.process.send_signal(signal.SIGTERM)
    replies.take_until_answered([r.request_id for r in held])
    assert exit_status(engine) == 0, role_log(engine)[-3000:]
    replies.take_all()

    by_request = replies.by_request()
    for request in held:
        assert error_of(single_terminal(by_request[request.request_id])) == DRAINING
    assert "drain timeout: failing 4 unfinished requests" in role_log(engine)


# ---------------------------------------------------------------- the MM worker


class WorkerPeers:
    """A real MM worker, with the test as its engine and its frontend."""

    def __init__(self, site: Site, drain_timeout_s: float) -> None:
        self.engine = StandInEngine.at(site.ctx, site.ipc("engine"))
        self.frontend = Inbox.bound(site.ctx, site.ipc("frontend"), FrontendInput)
        self.worker = site.start("mm-worker", drain_timeout_s,
                                 "--engine-endpoint", self.engine.endpoint,
                                 "--mm-worker-endpoint", site.ipc("mm-worker"))
        self.jobs = push(site.ctx, site.ipc("mm-worker"))

    def job(self, prep: Preprocessor, image: str) -> MMJob:
        """An image job; engine epoch 1 turns the sender cache on (as a frontend that has heard
        from an engine)."""
        return MMJob(
            request_id=f"j{next(_ids)}", reply_to=self.frontend.endpoint,
            prompt_token_ids=prompt_ids(prep, images=1), images=[ImageUrl(url=image)],
            sampling=SamplingParams(max_tokens=4), engine_epoch=1,
        )

    def outcomes(self, jobs: list[MMJob]) -> list[str]:
        """Per job, in job order: 'sent' (rendered, at the engine) or its error code; each job
        has exactly one."""
        sent = [r.request_id for r in self.engine.received]
        failed = {r.request_id: r.error.code for r in self.frontend.received}
        assert len(set(sent)) == len(sent) and not set(sent) & set(failed)
        assert set(sent) | set(failed) == {job.request_id for job in jobs}
        assert sent == [job.request_id for job in jobs if job.request_id in sent]  # FIFO
        return ["sent" if job.request_id in sent else failed[job.request_id] for job in jobs]


def big_images(count: int) -> list[str]:
    """Images that each take the worker a while (new pixels each: no cache hits)."""
    return [jpeg_uri(1600, 1200, seed=seed) for seed in range(count)]


def test_mm_worker_processes_queued_jobs_and_refuses_new_ones(
    site: Site, prep: Preprocessor
) -> None:
    peers = WorkerPeers(site, drain_timeout_s=PATIENCE_S)
    queued = [peers.job(prep, image) for image in big_images(6)]
    send(peers.jobs, *queued)
    peers.engine.take()  # the first is done: the others wait in the worker's queue
    started = time.monotonic()
    site.sigterm_and_wait_until_draining(peers.worker)
    late = peers.job(prep, jpeg_uri(64, 48))
    send(peers.jobs, late)
    assert exit_status(peers.worker) == 0, role_log(peers.worker)[-3000:]
    stopped_s = time.monotonic() - started
    peers.engine.take_all()
    peers.frontend.take_all()

    assert peers.outcomes(queued + [late]) == ["sent"] * 6 + ["peer_restarted"]
    (refusal,) = peers.frontend.received
    assert error_of(refusal) == DRAINING
    print(f"MM worker drained its queue in {stopped_s:.1f} s")
    # The job in progress at the signal is not counted: it is no longer queued.
    assert re.search(r"draining [45] requests \(up to 60 s\)", role_log(peers.worker))


def test_mm_worker_fails_what_is_unprocessed_at_the_drain_timeout(
    site: Site, prep: Preprocessor
) -> None:
    peers = WorkerPeers(site, drain_timeout_s=0)
    queued = [peers.job(prep, image) for image in big_images(8)]
    send(peers.jobs, *queued)
    peers.engine.take()
    peers.worker.process.send_signal(signal.SIGTERM)
    assert exit_status(peers.worker) == 0, role_log(peers.worker)[-3000:]
    peers.engine.take_all()
    peers.frontend.take_all()

    outcomes = peers.outcomes(queued)
    finished = outcomes.count("sent")
    print(f"MM worker at the drain timeout: {finished} of 8 jobs sent, the rest failed")
    assert outcomes == ["sent"] * finished + ["peer_restarted"] * (8 - finished)
    assert 1 <= finished < 8
    assert all(error_of(r) == DRAINING for r in peers.frontend.received)


def test_mm_worker_skips_a_cancelled_queued_job(site: Site, prep: Preprocessor) -> None:
    peers = WorkerPeers(site, drain_timeout_s=PATIENCE_S)
    shared = jpeg_uri(320, 240, seed=99)
    slow, cancelled, after = (peers.job(prep, image) for image in (*big_images(1), shared, shared))
    # All four are on the socket before the slow job is done: the cancel finds its job queued.
    send(peers.jobs, slow, cancelled, after, CancelJobs(request_ids=[cancelled.request_id]))
    first, second = peers.engine.take(), peers.engine.take()
    stop_all([peers.worker])
    peers.engine.take_all()
    peers.frontend.take_all()

    assert [first.request_id, second.request_id] == [slow.request_id, after.request_id]
    assert peers.engine.received == [first, second] and peers.frontend.received == []
    # The skipped job committed nothing: the next one is the next commit, and its image (the
    # skipped job's too) is no hit: it travels with its tensors.
    assert second.mm_cache.seq == first.mm_cache.seq + 1
    assert second.mm_items[0].tensors
    log = role_log(peers.worker)
    assert f"request {cancelled.request_id} cancelled by its frontend: skipped" in log
    assert '"cancelled": 1' in log


# ---------------------------------------------------------------- the frontend


class FrontendPeers:
    """A real frontend; the test is its client, its engine and its MM worker."""

    def __init__(self, site: Site, drain_timeout_s: float, *args: str) -> None:
        self.engine = StandInEngine.at(site.ctx, site.ipc("engine"))
        self.output = site.ipc("output")
        self.mm_worker = Inbox.bound(site.ctx, site.ipc("mm-worker"), MMWorkerInput)
        self.frontend = site.start("frontend", drain_timeout_s,
                                   "--engine-endpoint", self.engine.endpoint,
                                   "--mm-worker-endpoint", self.mm_worker.endpoint,
                                   "--output-endpoint", self.output, "--port", "0", *args)
        assert self.frontend.endpoint is not None
        self.client = Inbox.client(site.ctx, self.frontend.endpoint)

    def submit(self, *images: str) -> str:
        request_id = f"c{next(_ids)}"
        message = user_message("Tell me about lanes.", list(images))
        send(self.client.sock, ChatRequest(request_id=request_id, messages=[message]))
        return request_id

    def answer(self, request_id: str) -> None:
        """Answer, as the engine, with one last token."""
        self.engine.answer(self.output, request_id)


def test_frontend_serves_requests_in_flight_and_refuses_new_ones(site: Site) -> None:
    peers = FrontendPeers(site, PATIENCE_S)
    text, image = peers.submit(), peers.submit(jpeg_uri(64, 48))
    engine_request, job = peers.engine.take(), peers.mm_worker.take()
    site.sigterm_and_wait_until_draining(peers.frontend)
    late = peers.submit()
    refusal = peers.client.take()  # at once: the two in flight are not answered yet
    peers.answer(engine_request.request_id)
    peers.answer(job.request_id)
    assert exit_status(peers.frontend) == 0, role_log(peers.frontend)[-3000:]
    peers.client.take_all()

    assert refusal.request_id == late and error_of(refusal) == DRAINING
    by_request = peers.client.by_request()
    for request_id in (text, image):
        last = single_terminal(by_request[request_id])
        assert isinstance(last, ChatOutput) and last.finish_reason == "length"
    peers.engine.take_all(wait_s=0.2)
    peers.mm_worker.take_all(wait_s=0.2)
    assert peers.engine.received == [engine_request] and peers.mm_worker.received == [job]
    assert "draining 2 requests (up to 60 s)" in role_log(peers.frontend)


def test_frontend_fails_and_stops_what_is_unfinished_at_the_drain_timeout(site: Site) -> None:
    peers = FrontendPeers(site, 0)
    text, image = peers.submit(), peers.submit(jpeg_uri(64, 48))
    engine_request, job = peers.engine.take(), peers.mm_worker.take()
    peers.frontend.process.send_signal(signal.SIGTERM)
    assert exit_status(peers.frontend) == 0, role_log(peers.frontend)[-3000:]
    peers.client.take_all()
    peers.engine.take_all()
    peers.mm_worker.take_all()

    by_request = peers.client.by_request()
    for request_id in (text, image):
        assert error_of(single_terminal(by_request[request_id])) == DRAINING
    (abort,) = peers.engine.received[1:]
    assert isinstance(abort, AbortRequests)
    assert sorted(abort.request_ids) == sorted([engine_request.request_id, job.request_id])
    assert peers.mm_worker.received[1:] == [CancelJobs(request_ids=[job.request_id])]


def test_frontend_cancel_and_deadline_reach_the_mm_worker(site: Site) -> None:
    peers = FrontendPeers(site, PATIENCE_S, "--request-timeout", "3")
    cancelled = peers.submit(jpeg_uri(64, 48, seed=1))
    job = peers.mm_worker.take()
    send(peers.client.sock, CancelChat(request_id=cancelled))
    assert peers.mm_worker.take() == CancelJobs(request_ids=[job.request_id])
    assert peers.engine.take() == AbortRequests(request_ids=[job.request_id])

    expired = peers.submit(jpeg_uri(64, 48, seed=2))
    late_job = peers.mm_worker.take()
    timeout = peers.client.take()  # never answered downstream: its deadline passes
    assert timeout.request_id == expired and error_of(timeout) == ("retryable", "timeout")
    assert peers.mm_worker.take() == CancelJobs(request_ids=[late_job.request_id])
    assert peers.engine.take() == AbortRequests(request_ids=[late_job.request_id])
    assert [r.request_id for r in peers.client.received] == [expired]  # none for the cancelled


def test_a_request_cancelled_while_tokenized_reaches_nobody_downstream(site: Site) -> None:
    """Sent nowhere yet, it is dropped when its tokens come: no abort goes to the engine (which
    would remember it as an early abort for a request that never comes), no reply to the client;
    the next request is the first thing the engine hears of."""
    peers = FrontendPeers(site, PATIENCE_S)
    long_prompt = ChatRequest(request_id="long", messages=[user_message("lanes " * 300_000)])
    send(peers.client.sock, long_prompt, CancelChat(request_id="long"))  # read in one go
    after = peers.submit()
    first = peers.engine.take()
    assert isinstance(first, EngineRequest) and len(first.prompt_token_ids) < 100
    wait_for_stats(site.run_dir, lambda s: s.role == "frontend" and s.queues["tokenizing"] == 0,
                   "the frontend done with the long prompt's tokens")
    peers.answer(first.request_id)
    peers.client.take_all()
    peers.engine.take_all(wait_s=0.2)
    assert [reply.request_id for reply in peers.client.received] == [after]
    assert peers.engine.received == [first]


# ---------------------------------------------------------------- a cluster, stopped as serve does


def test_stopping_a_cluster_frontend_first_finishes_everything_in_flight(site: Site) -> None:
    engine, mm_worker = site.ipc("engine"), site.ipc("mm-worker")
    common = ["--model", str(site.model_dir), "--engine-endpoint", engine,
              "--drain-timeout", str(PATIENCE_S)]
    argv = {
        "engine": [*common, "--device", "cpu"],
        "mm-worker": [*common, "--mm-worker-endpoint", mm_worker],
        "frontend": [*common, "--mm-worker-endpoint", mm_worker, "--port", "0",
                     "--output-endpoint", site.ipc("output")],
    }
    site.children = children = start_roles(
        {role: config_from_argv(role, args, site.run_dir) for role, args in argv.items()},
        site.run_dir, PATIENCE_S * 3, log_dir=site.run_dir / "logs")
    frontend = children[-1].endpoint  # the port it bound
    assert frontend is not None
    client = Inbox.client(site.ctx, frontend)
    ids = []
    for seed, image in enumerate(big_images(4)):
        ids += [f"img{seed}", f"txt{seed}"]
        send(client.sock, ChatRequest(request_id=f"img{seed}", max_tokens=8,
                                      messages=[user_message("What is it?", [image])]),
             ChatRequest(request_id=f"txt{seed}", max_tokens=8,
                         messages=[user_message("Tell me about lanes.")]))
    client.take()  # serving: the images wait in the MM worker's queue, behind the first
    started = time.monotonic()
    stop_all(children)
    stopped_s = time.monotonic() - started
    client.take_all()

    assert [child.process.returncode for child in children] == [0, 0, 0]
    by_request = client.by_request()
    for request_id in ids:
        last = single_terminal(by_request[request_id])
        assert isinstance(last, ChatOutput), (request_id, last)
    print(f"cluster stopped in {stopped_s:.1f} s with all {len(ids)} requests answered")
