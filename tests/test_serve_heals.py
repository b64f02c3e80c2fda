"""`mmlane serve` heals: a role killed with -9 is restarted, and serve ends only on a crash loop.

One real `mmlane serve` on a copy of the tiny model for the whole module; each test kills one
role under a little mixed load, or while it holds one long request. What the killed MM worker or
engine held fails with `peer_restarted` as soon as the frontend hears from the new process,
long before the request timeout (REQUEST_TIMEOUT_S). A second serve, with a long restart
backoff, shows a role while it is 'restarting'; a third removes its model and kills its MM
worker, whose restart then fails until serve gives up (a serve of its own, so that no kill of
another test counts toward its crash-loop limit, however fast or slow the machine); and a real
frontend beside this test as its engine shows which requests a restart fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from conftest import REPO, free_port, role_log, start_role, stop_role
from image_server import ImageServer
from mmlane.client import Client, user_message
from mmlane.launcher import ServeConfig
from mmlane.protocol.errors import RetryableError
from mmlane.protocol.messages import AbortRequests, EngineRequest, Stats
from peers import (
    PATIENCE_S,
    SERVE_READY,
    StandInEngine,
    all_ok,
    image_request,
    mixed_load,
    one_reply_each,
    serves_again_with_its_cache,
    wait_for_stats,
    wait_until,
)

REQUEST_TIMEOUT_S = 120.0
"""The frontend's request timeout: far beyond every wait here, so an error that comes is the
restart's, not the timeout's."""
LOST_WITH_A_FRONTEND_S = 15.0
"""How long to wait for replies that a killed frontend took with it (they never come)."""
KILLS_TOLERATED = 100
"""The module's serve's crash-loop limit: its tests kill its roles on purpose, several a minute."""
CRASH_LOOP_LIMIT = 2
"""The crash-loop test's: its kill of the MM worker, then the restart that fails to start."""
CRASH_LOOP_WINDOW_S = 600.0
"""The crash-loop test's window: far beyond the time its two exits take."""
LONG_GENERATION = 3500
"""max_tokens of a text request that runs long enough to be killed in (the tiny model has 4096
positions)."""


@dataclass
class Served:
    process: subprocess.Popen
    endpoint: str
    run_dir: Path
    model: Path
    log: Path

    def stats(self, role: str, done=lambda stats: True, what: str = "") -> Stats:
        return wait_for_stats(self.run_dir, lambda s: s.role == role and done(s),
                              what or f"stats of the {role}")


@contextlib.contextmanager
def serving(where: Path, model: Path, *flags: str) -> Iterator[Served]:
    """A real `mmlane serve` of `model` (run dir and log under `where`), stopped at the end."""
    run_dir, log = where / "run", where / "serve.log"
    port = free_port()
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "mmlane.cli", "serve", "--model", str(model),
             "--port", str(port), "--http-port", "0", "--run-dir", str(run_dir),
             "--request-timeout", str(REQUEST_TIMEOUT_S), "--stats-interval", "0.2",
             "--drain-timeout", "1", *flags],
            cwd=REPO, stdout=stderr, stderr=stderr,
        )
    served = Served(process, f"tcp://127.0.0.1:{port}", run_dir, model, log)
    wait_until(lambda: SERVE_READY in log.read_text() or process.poll() is not None,
               "serve ready", timeout_s=180)
    assert process.poll() is None, log.read_text()
    try:
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def served(module_run_dir: Path, qwen_dir: Path) -> Iterator[Served]:
    model = shutil.copytree(qwen_dir, module_run_dir / "model")
    with serving(module_run_dir, model, "--restart-backoff", "0.1",
                 "--crash-loop-limit", str(KILLS_TOLERATED),
                 "--allow-http-media", "--allow-internal-media",
                 "--media-fetch-timeout", str(REQUEST_TIMEOUT_S)) as served:
        yield served


@pytest.mark.parametrize(("setting", "value"), [
    ("crash_loop_limit", 0), ("crash_loop_window_s", 0.0), ("restart_backoff_s", -1.0),
])
def test_restart_settings_are_validated(setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=setting):
        ServeConfig(**{setting: value})


@pytest.mark.parametrize("role", ["mm-worker", "engine", "frontend"])
def test_a_role_killed_under_load_is_restarted_and_serves_again(served: Served, role: str) -> None:
    with Client(served.endpoint, timeout_s=60) as client:
        all_ok(client, image_request(client, 0))  # every role is up before the kill
        pid = served.stats(role).pid
        load = mixed_load(client, seed=100)
        os.kill(pid, signal.SIGKILL)
        replies = one_reply_each(client, load,
                                 LOST_WITH_A_FRONTEND_S if role == "frontend" else PATIENCE_S,
                                 frontend_may_die=role == "frontend")
        for rid, reply in replies.items():
            error = reply if isinstance(reply, Exception) else reply.error
            assert error is None or isinstance(error, RetryableError), f"{rid}: {reply!r}"
            if error is not None and role != "frontend":  # the restart's error, not the timeout
                assert error.code == "peer_restarted", f"{rid}: {error!r}"

        restarted = served.stats(role, lambda s: s.restarts == 1 and s.state == "serving",
                                 f"the {role} restarted once, and serving")
        assert restarted.pid != pid
        serves_again_with_its_cache(client, served.run_dir)
    assert served.process.poll() is None, served.log.read_text()


def test_health_shows_the_restarts(served: Served) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mmlane.cli", "health", "--run-dir", str(served.run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "serving (restarted 1x)" in out.stdout, out.stdout


def _long_generation(client: Client) -> str:
    return client.submit([user_message("tell me everything")], max_tokens=LONG_GENERATION,
                         ignore_eos=True)


def _slow_image_job(client: Client, image_server: ImageServer) -> str:
    return client.submit([user_message("what is it?", [image_server.url("/never-answers")])],
                         max_tokens=4)


@pytest.mark.parametrize("role", ["mm-worker", "engine"])
def test_what_a_killed_role_held_fails_as_soon_as_it_is_back(
    served: Served, image_server: ImageServer, role: str
) -> None:
    """The MM worker waits for an image that never comes; the engine runs a long generation.
    Killed, the role takes the request with it: its error comes once the frontend has heard
    from the new process, well before the request timeout, and it is the only reply."""
    before = served.stats(role)
    restarts_seen = served.stats("frontend").counters.get("peer_restarts", 0)
    with Client(served.endpoint, timeout_s=REQUEST_TIMEOUT_S) as client:
        if role == "mm-worker":
            fetches = image_server.hits.get("never-answers", 0)
            held = _slow_image_job(client, image_server)
            wait_until(lambda: image_server.hits.get("never-answers", 0) > fetches,
                       "the MM worker fetches the image")
        else:
            held = _long_generation(client)
            served.stats("engine", lambda s: s.queues.get("running", 0) > 0,
                         "the engine runs the long generation")
        timeout_at = time.monotonic() + REQUEST_TIMEOUT_S
        os.kill(before.pid, signal.SIGKILL)
        reply = one_reply_each(client, [held], PATIENCE_S)[held]
        assert time.monotonic() < timeout_at
        assert reply.error is not None and reply.error.code == "peer_restarted", reply
        assert f"the {role}" in reply.error.message and "restarted" in reply.error.message
        served.stats("frontend", lambda s: s.counters.get("peer_restarts", 0) > restarts_seen,
                     "the frontend counted the restart")
        after = served.stats(role, lambda s: s.restarts == before.restarts + 1
                             and s.state == "serving", f"the {role} restarted, and serving")
        assert after.pid != before.pid
        all_ok(client, *mixed_load(client, seed=300))


def test_a_restart_fails_only_what_the_old_process_held(run_dir: Path, qwen_dir: Path) -> None:
    """A real frontend, this test as its engine. The engine "restarts": its socket closes, and
    a new one, of another process start, binds the address again. The request the old one held
    fails at once and is aborted there; the one sent while the engine was down went to the new
    one, which answers it."""
    endpoint = f"ipc://{run_dir}/engine.sock"
    ctx = zmq.Context()
    old = StandInEngine.at(ctx, endpoint)
    frontend = start_role("frontend", [
        "--model", str(qwen_dir), "--engine-endpoint", endpoint,
        "--mm-worker-endpoint", f"ipc://{run_dir}/mm.sock", "--port", "0",
        "--output-endpoint", f"ipc://{run_dir}/out.sock",
        "--request-timeout", str(REQUEST_TIMEOUT_S),
    ], run_dir, log_dir=run_dir / "logs")
    try:
        with Client(frontend.endpoint, timeout_s=PATIENCE_S) as client:
            held = client.submit([user_message("held by the old engine")], max_tokens=4)
            request = old.take()
            assert isinstance(request, EngineRequest), request
            old.close()
            wait_until(lambda: "engine at" in role_log(frontend)
                       and "disconnected" in role_log(frontend), "the frontend saw it go")
            later = client.submit([user_message("for the new engine")], max_tokens=4)
            wait_for_stats(run_dir, lambda s: s.in_flight == 2 and not s.queues["tokenizing"],
                           "the frontend sent it")  # ZMQ keeps it while the engine is down
            with StandInEngine.at(ctx, endpoint) as new:
                assert new.started != old.started
                queued, abort = new.take(), new.take()
                assert isinstance(queued, EngineRequest), queued
                assert abort == AbortRequests(request_ids=[request.request_id]), abort
                failed = client.next_finished()
                assert failed.request_id == held, failed
                assert failed.error is not None and failed.error.code == "peer_restarted"
                new.answer(request.reply_to, queued.request_id)
                answered = one_reply_each(client, [later], PATIENCE_S)[later]
                assert answered.error is None and answered.finish_reason == "length", answered
                new.assert_quiet()
    finally:
        assert stop_role(frontend) == 0, role_log(frontend)
        ctx.destroy(linger=0)


def test_a_role_in_its_restart_backoff_shows_as_restarting(
    tmp_path_factory: pytest.TempPathFactory, qwen_dir: Path
) -> None:
    """With a restart backoff longer than the test, the killed MM worker stays down: serve
    answers for it, so health (not 0), top and stats show it 'restarting', restart 1."""
    where = Path(tmp_path_factory.mktemp("backoff"))
    with serving(where, qwen_dir, "--restart-backoff", "3600") as served:
        os.kill(served.stats("mm-worker").pid, signal.SIGKILL)
        down = served.stats("mm-worker", lambda s: s.state == "restarting",
                            "the MM worker shown restarting")
        assert down.restarts == 1 and down.pid == served.process.pid
        tool = [sys.executable, "-m", "mmlane.cli"]
        where_args = ["--run-dir", str(served.run_dir)]
        health = subprocess.run([*tool, "health", *where_args], cwd=REPO, capture_output=True,
                                text=True, timeout=60)
        assert health.returncode == 1, health.stdout + health.stderr
        line = next(line for line in health.stdout.splitlines() if "mm-worker" in line)
        assert "restarting (restart 1)" in line and "no answer" not in line, health.stdout
        assert "mm-worker" in health.stderr and "restarting (restart 1)" in health.stderr
        top = subprocess.run([*tool, "top", "--once", "--timeout", "30", *where_args],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert top.returncode == 0, top.stdout + top.stderr
        assert "restarting (restart 1)" in top.stdout, top.stdout
        stats = subprocess.run([*tool, "stats", "--once", "--json", *where_args], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
        shown = {p["role"]: p for p in json.loads(stats.stdout)["processes"]}
        assert (shown["mm-worker"]["state"], shown["mm-worker"]["restarts"]) == ("restarting", 1)
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=60) == 0, served.log.read_text()


def test_a_role_that_cannot_start_stops_serve_after_the_limit(
    tmp_path_factory: pytest.TempPathFactory, qwen_dir: Path
) -> None:
    """The MM worker, killed, is restarted without its model: that start fails, its second exit
    within the window, and serve stops, quoting the failed start's log lines."""
    where = Path(tmp_path_factory.mktemp("crash-loop"))
    model = shutil.copytree(qwen_dir, where / "model")
    with serving(where, model, "--restart-backoff", "0.1",
                 "--crash-loop-limit", str(CRASH_LOOP_LIMIT),
                 "--crash-loop-window", str(CRASH_LOOP_WINDOW_S)) as served:
        pid = served.stats("mm-worker").pid
        shutil.rmtree(model)
        os.kill(pid, signal.SIGKILL)
        assert served.process.wait(timeout=120) == 1
    log = served.log.read_text()
    limit = f"mm-worker exited {CRASH_LOOP_LIMIT} times within {CRASH_LOOP_WINDOW_S:g} s"
    assert limit in log, log
    message = log[log.index("mmlane serve: mm-worker exited"):]
    assert "Its last log lines" in message and "failed to start" in message, message
