"""`mmlane serve` heals: a role killed with -9 is restarted, and serve ends only on a crash loop.

One real `mmlane serve` on a copy of the tiny model for the whole module; each test kills one
role under a little mixed load. The last test removes the model and kills the MM worker, whose
restarts then fail until serve gives up: it ends the module's serve, so it runs last.
"""

from __future__ import annotations

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

from conftest import REPO, free_port
from peers import one_reply_each, wait_for_stats, wait_until
from protocol.errors import RetryableError
from protocol.messages import Stats
from services.bench.images import jpeg_uri
from services.client import Client, user_message
from services.launcher import ServeConfig

REQUEST_TIMEOUT_S = 8.0
"""The frontend's request timeout: what a dead role held is answered 'timeout' this soon."""
CRASH_LOOP_LIMIT = 3


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


@pytest.fixture(scope="module")
def served(module_run_dir: Path, qwen_dir: Path) -> Iterator[Served]:
    model = shutil.copytree(qwen_dir, module_run_dir / "model")
    run_dir, log = module_run_dir / "run", module_run_dir / "serve.log"
    port = free_port()
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--model", str(model),
             "--port", str(port), "--http-port", "0", "--run-dir", str(run_dir),
             "--request-timeout", str(REQUEST_TIMEOUT_S), "--stats-interval", "0.2",
             "--drain-timeout", "1", "--restart-backoff", "0.1",
             "--crash-loop-limit", str(CRASH_LOOP_LIMIT)],
            cwd=REPO, stderr=stderr,
        )
    served = Served(process, f"tcp://127.0.0.1:{port}", run_dir, model, log)
    wait_until(lambda: "ready" in log.read_text() or process.poll() is not None,
               "serve ready", timeout_s=180)
    assert process.poll() is None, log.read_text()
    yield served
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def _image_request(client: Client, seed: int) -> str:
    return client.submit([user_message("what is it?", [jpeg_uri(800, 600, seed)])],
                         max_tokens=4)


def _mixed_load(client: Client, seed: int) -> list[str]:
    """Four text and four image requests, in flight at once."""
    text = [client.submit([user_message(f"hello {i}")], max_tokens=8) for i in range(4)]
    return text + [_image_request(client, seed + i) for i in range(4)]


def _ok(client: Client, *request_ids: str) -> None:
    for rid, result in client.collect(list(request_ids)).items():
        assert result.error is None and result.finish_reason, f"{rid}: {result}"


@pytest.mark.parametrize(("setting", "value"), [
    ("crash_loop_limit", 0), ("crash_loop_window_s", 0.0), ("restart_backoff_s", -1.0),
])
def test_restart_settings_are_validated(setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=setting):
        ServeConfig(**{setting: value})


@pytest.mark.parametrize("role", ["mm-worker", "engine", "frontend"])
def test_a_role_killed_under_load_is_restarted_and_serves_again(served: Served, role: str) -> None:
    with Client(served.endpoint, timeout_s=60) as client:
        _ok(client, _image_request(client, 0))  # every role is up before the kill
        pid = served.stats(role).pid
        load = _mixed_load(client, seed=100)
        os.kill(pid, signal.SIGKILL)
        replies = one_reply_each(client, load, REQUEST_TIMEOUT_S + 3, frontend_may_die=True)
        for rid, reply in replies.items():
            error = reply if isinstance(reply, Exception) else reply.error
            assert error is None or isinstance(error, RetryableError), f"{rid}: {reply!r}"
            if error is not None and role != "frontend":
                assert error.code == "timeout", f"{rid}: {error!r}"

        restarted = served.stats(role, lambda s: s.restarts == 1, f"the {role} restarted once")
        assert restarted.pid != pid
        _ok(client, *_mixed_load(client, seed=200))
        _ok(client, _image_request(client, 7))
        since = time.time()
        before = served.stats("mm-worker", lambda s: s.time > since).counters.get("cache_hits", 0)
        _ok(client, _image_request(client, 7))  # the same image: a hit on both sides again
        served.stats("mm-worker", lambda s: s.counters.get("cache_hits", 0) > before,
                     "the repeated image hit the cache")
    assert served.process.poll() is None, served.log.read_text()


def test_health_shows_the_restarts(served: Served) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "health", "--run-dir", str(served.run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "serving (restarted 1x)" in out.stdout, out.stdout


def test_a_role_that_cannot_start_stops_serve_after_the_limit(served: Served) -> None:
    """Runs last: it ends the module's serve."""
    pid = served.stats("mm-worker").pid
    shutil.rmtree(served.model)
    os.kill(pid, signal.SIGKILL)
    assert served.process.wait(timeout=120) == 1
    log = served.log.read_text()
    assert f"mm-worker exited {CRASH_LOOP_LIMIT} times within 60 s" in log, log
    message = log[log.index("mmlane serve: mm-worker exited"):]
    assert "Its last log lines" in message and "failed to start" in message, message
