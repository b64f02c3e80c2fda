"""The mirrored feature cache end to end: engine, MM worker and frontend as real processes.

    test_cached_replies_equal_uncached_ones   200 requests, 20 images, a cache of a few images
    test_engine_killed_mid_flight             kill -9 the engine, start it again
    test_mm_worker_killed_mid_flight          kill -9 the MM worker, start it again
    test_reset_cache_while_requests_are_in_flight
    test_two_mm_workers_each_image_goes_where_it_is_cached   affinity routing, and a worker gone

Each test starts its own roles (their logs under RUN_DIR/logs) and stops them at its end: a role
logs its counters as JSON when it stops, and the tests read them there.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.images import jpeg_uri, noise_image, png_uri
from conftest import REPO, role_log, start_role
from mmlane.cli import config_from_argv
from mmlane.client import ChatResult, Client, user_message
from mmlane.frontend.service import affinity_key
from mmlane.launcher import Child, start_roles, stop_all
from mmlane.protocol.errors import RetryableError
from mmlane.protocol.messages import ImageUrl
from peers import wait_for_stats, wait_until

GIB = 1 << 30
PROMPT = "Describe the picture."
STATS_INTERVAL_S = "0.05"  # reset_soon waits on the frontend's stats


class Cluster:
    """The three roles on ipc sockets in `run_dir`, the frontend's client port on loopback."""

    def __init__(self, run_dir: Path, model: Path, *, cache_gb: float, timeout_s: float) -> None:
        self.run_dir = run_dir
        engine, mm_worker = f"ipc://{run_dir}/e.sock", f"ipc://{run_dir}/m.sock"
        common = ["--model", str(model), "--engine-endpoint", engine,
                  "--stats-interval", STATS_INTERVAL_S]
        self.argv = {
            "engine": [*common, "--mm-cache-gb", str(cache_gb)],
            "mm-worker": [*common, "--mm-worker-endpoint", mm_worker,
                          "--mm-cache-gb", str(cache_gb)],
            "frontend": [*common, "--mm-worker-endpoint", mm_worker,
                         "--output-endpoint", f"ipc://{run_dir}/f.sock",
                         "--port", "0", "--request-timeout", str(timeout_s)],
        }
        configs = {role: config_from_argv(role, args, run_dir) for role, args in self.argv.items()}
        children = start_roles(configs, run_dir, 180, log_dir=run_dir / "logs")
        self.roles: dict[str, Child] = {child.role: child for child in children}
        endpoint = self.roles["frontend"].endpoint  # the port it bound (never restarted here)
        assert endpoint is not None
        self.endpoint = endpoint
        self.stopped: list[Child] = []
        # Until the frontend has heard the engine's cache epoch, the MM worker caches nothing
        # (P0 has no receiver to mirror): a first request sent sooner would not count as cached.
        wait_for_stats(run_dir, lambda s: s.role == "frontend" and s.epoch != 0,
                       "the frontend knows the engine's cache epoch")

    def kill(self, role: str) -> None:
        """kill -9, then the same role again on the same addresses (logging elsewhere)."""
        child = self.roles[role]
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.wait()
        self.stopped.append(child)
        restarts = self.run_dir / f"logs-{len(self.stopped)}"
        self.roles[role] = start_role(role, self.argv[role], self.run_dir, log_dir=restarts)

    def stop(self) -> dict[str, dict]:
        """Stop every role; the counters each one logged as it stopped."""
        stop_all(list(self.roles.values()))
        return {role: counters(child) for role, child in self.roles.items()}


def counters(child: Child) -> dict:
    found = re.findall(r"counters (\{.*\})", role_log(child))
    assert found, f"{child.role} logged no counters:\n{role_log(child)[-3000:]}"
    return json.loads(found[-1])


@contextmanager
def cluster(run_dir: Path, model: Path, **settings: float) -> Iterator[Cluster]:
    roles = Cluster(run_dir, model, **settings)  # type: ignore[arg-type]
    try:
        yield roles
    finally:
        stop_all(list(roles.roles.values()))


def images(count: int) -> list[str]:
    """Lossless noise images, each with its own number of image tokens (2, 4, 6, ...): every
    one makes its own prompt, so a reply shows which image the engine used."""
    return [png_uri(noise_image(56 + 28 * i, 56, seed=i)) for i in range(count)]


def reply(result: ChatResult) -> tuple:
    prompt = tuple(result.prompt_token_ids or ())
    return (prompt, tuple(result.token_ids), result.text, result.finish_reason)


def run(client: Client, urls: list[str], order: list[int], in_flight: int = 8) -> list[ChatResult]:
    """Send `urls[i]` for each i of `order`, keeping `in_flight` requests outstanding."""
    results: dict[str, ChatResult] = {}
    ids: list[str] = []
    for index in order:
        if len(ids) - len(results) >= in_flight:
            finished = client.next_finished()
            results[finished.request_id] = finished
        ids.append(client.submit([user_message(PROMPT, [urls[index]])], max_tokens=6))
    results.update(client.collect([rid for rid in ids if rid not in results]))
    return [results[rid] for rid in ids]


def assert_nothing_more(client: Client) -> None:
    """No second reply for any request."""
    with pytest.raises(RetryableError, match="no reply"):
        client.next_finished(time.monotonic() + 1.0)


def test_cached_replies_equal_uncached_ones(run_dir: Path, qwen_dir: Path) -> None:
    urls = images(20)
    with cluster(run_dir / "off", qwen_dir, cache_gb=0, timeout_s=120) as off:
        with Client(off.endpoint, timeout_s=120) as client:
            uncached = [reply(result) for result in run(client, urls, list(range(20)))]
    assert len(set(uncached)) == 20, "the 20 images must make 20 different replies"

    # 0.75 MiB holds one to a few of these images (75 to 790 KB; the largest does not fit).
    order = random.Random(3).choices(range(20), k=200)
    with cluster(run_dir / "on", qwen_dir, cache_gb=0.75 / 1024, timeout_s=120) as on:
        with Client(on.endpoint, timeout_s=120) as client:
            results = run(client, urls, order)
            assert_nothing_more(client)
        count = on.stop()
    for index, result in zip(order, results, strict=True):
        assert result.error is None, result.error
        assert reply(result) == uncached[index]
    engine, worker, frontend = count["engine"], count["mm-worker"], count["frontend"]
    # Every hash the worker sent alone, the engine held: no dangling hash, no drift, no resend.
    assert engine.get("cache_misses", 0) == 0 and engine.get("cache_desyncs", 0) == 0
    assert frontend.get("cache_miss_resends", 0) == 0
    assert engine["cache_hits"] == worker["cache_hits"] > 0
    assert worker["cache_misses"] > 20  # the capacity forced evictions


def test_a_hit_expands_as_its_image_did(run_dir: Path, model_dirs: dict) -> None:
    """Idefics3's images expand into tiles among row/column tokens: an image sent as its hash
    alone expands as it did when processed (P0 keeps the expansion), and the engine puts the
    features it holds at the image tokens, so every reply is the first one for its image."""
    urls = [png_uri(noise_image(w, h, seed=i)) for i, (w, h) in
            enumerate([(56, 56), (500, 333), (90, 1200)])]  # grids of 4x4, 3x4 and 4x1 tiles
    order = [0, 1, 2, 0, 2, 1, 1]
    with cluster(run_dir, model_dirs["idefics3"], cache_gb=1, timeout_s=120) as roles:
        with Client(roles.endpoint, timeout_s=120) as client:
            results = run(client, urls, order, in_flight=1)  # one at a time: hits in order
        count = roles.stop()
    assert all(result.error is None for result in results), results
    first = {index: reply(result)
             for index, result in reversed(list(zip(order, results, strict=True)))}
    assert [reply(result) for result in results] == [first[index] for index in order]
    assert len(set(first.values())) == 3
    assert count["engine"]["cache_hits"] == count["mm-worker"]["cache_hits"] == 4


def warm_up(client: Client, urls: list[str]) -> dict[int, tuple]:
    """Each image twice, one at a time: the replies, and the images in both caches."""
    results = run(client, urls, list(range(len(urls))) * 2, in_flight=1)
    return {index: reply(result) for index, result in enumerate(results[: len(urls)])}


def check_answers(results: list[ChatResult], order: list[int], expected: dict) -> int:
    """Each request got a correct reply or a retryable error; how many errors."""
    errors = 0
    for index, result in zip(order, results, strict=True):
        if result.error is not None:
            assert isinstance(result.error, RetryableError), result.error
            errors += 1
        else:
            assert reply(result) == expected[index]
    return errors


def test_engine_killed_mid_flight(run_dir: Path, qwen_dir: Path) -> None:
    urls = images(4)
    order = [i % 4 for i in range(12)]
    with cluster(run_dir, qwen_dir, cache_gb=1, timeout_s=6) as roles:
        with Client(roles.endpoint, timeout_s=60) as client:
            expected = warm_up(client, urls)
            ids = [client.submit([user_message(PROMPT, [urls[i]])], max_tokens=6) for i in order]
            roles.kill("engine")
            # Held by the dead engine: peer_restarted (or a timeout); queued for it: answered.
            results = client.collect(ids)
            check_answers([results[rid] for rid in ids], order, expected)
            assert_nothing_more(client)
            # The new engine's epoch reaches the worker (in the engine's HelloReply, or with
            # the first cache miss, whichever comes first): the images are cached again.
            again = run(client, urls, order, in_flight=1)
            assert check_answers(again, order, expected) == 0
        count = roles.stop()
    engine, worker, frontend = count["engine"], count["mm-worker"], count["frontend"]
    assert frontend["engine_epochs"] == 2 and frontend.get("cache_miss_errors", 0) == 0
    assert engine.get("cache_desyncs", 0) == 0
    assert worker["cache_epochs"] == 2
    assert engine["cache_hits"] >= len(order) - len(urls)  # the repeated images hit again


def test_mm_worker_killed_mid_flight(run_dir: Path, qwen_dir: Path) -> None:
    urls = images(4)
    order = [i % 4 for i in range(12)]
    with cluster(run_dir, qwen_dir, cache_gb=1, timeout_s=6) as roles:
        with Client(roles.endpoint, timeout_s=60) as client:
            expected = warm_up(client, urls)
            # A big new image first, so repeated ones wait behind it in the worker's FIFO.
            big = client.submit([user_message(PROMPT, [jpeg_uri(2400, 1800)])], max_tokens=1)
            ids = [client.submit([user_message(PROMPT, [urls[i]])], max_tokens=6) for i in order]
            # A fixed pause, kept on purpose: the kill must come while the big image is still
            # being made (a few hundred ms), sooner than any stats snapshot can tell us it is.
            time.sleep(0.05)
            roles.kill("mm-worker")
            results = client.collect([big, *ids])
            errors = check_answers([results[rid] for rid in ids], order, expected)
            assert_nothing_more(client)
            again = run(client, urls, order, in_flight=1)
            assert check_answers(again, order, expected) == 0
        count = roles.stop()
    engine, worker, frontend = count["engine"], count["mm-worker"], count["frontend"]
    assert errors + (results[big].error is not None) >= 1, "some job must die with the worker"
    # The engine dropped the dead worker's receiver cache when the new one's epoch arrived;
    # the new worker started from nothing: no hash of the old one was ever sent again.
    assert engine["cache_sender_restarts"] == 1
    assert engine.get("cache_misses", 0) == 0 and engine.get("cache_desyncs", 0) == 0
    assert frontend.get("cache_miss_resends", 0) == 0
    assert worker["cache_hits"] >= len(order) - len(urls)  # the repeated images hit again


def test_reset_cache_while_requests_are_in_flight(run_dir: Path, qwen_dir: Path) -> None:
    urls = images(4)
    order = [i % 4 for i in range(24)]
    with cluster(run_dir, qwen_dir, cache_gb=1, timeout_s=60) as roles:
        with Client(roles.endpoint, timeout_s=60) as client:
            expected = warm_up(client, urls)
            resetter = threading.Thread(target=reset_soon, args=(roles,))
            resetter.start()
            results = run(client, urls, order, in_flight=6)
            resetter.join()
            assert check_answers(results, order, expected) == 0  # nobody sees the reset
            again = run(client, urls, order, in_flight=1)
            assert check_answers(again, order, expected) == 0
        cli = subprocess.run(
            [sys.executable, "-m", "mmlane.cli", "reset-cache", "--endpoint", roles.endpoint],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )
        assert (cli.returncode, cli.stdout.strip()) == (0, "feature caches reset"), cli.stderr
        count = roles.stop()
    engine, worker, frontend = count["engine"], count["mm-worker"], count["frontend"]
    assert engine["cache_resets"] == frontend["cache_resets"] == 2
    assert worker["cache_epochs"] == 3  # the first engine epoch, then one per reset
    assert frontend.get("cache_miss_errors", 0) == 0 and engine.get("cache_desyncs", 0) == 0
    assert worker["cache_hits"] > len(order)  # hits before and after the reset


def reset_soon(roles: Cluster) -> None:
    """Reset the caches as soon as the frontend holds requests."""
    wait_for_stats(roles.run_dir, lambda s: s.role == "frontend" and s.in_flight > 0,
                   "the frontend holding requests")
    with Client(roles.endpoint, timeout_s=60) as client:
        client.reset_cache()


def test_two_mm_workers_each_image_goes_where_it_is_cached(run_dir: Path, qwen_dir: Path) -> None:
    """Jobs go by their image's affinity key: a repeated image always meets the sender cache
    that holds it (each image misses once, in its worker; round robin over an odd number of
    images would not), and a worker that is gone hands its images to the other."""
    engine = f"ipc://{run_dir}/e.sock"
    workers = [f"ipc://{run_dir}/m{i}.sock" for i in range(2)]
    common = ["--model", str(qwen_dir), "--engine-endpoint", engine]
    roles = [start_role("engine", common, run_dir, log_dir=run_dir / "engine")]
    roles += [start_role("mm-worker", [*common, "--mm-worker-endpoint", worker], run_dir,
                         log_dir=run_dir / f"worker-{i}") for i, worker in enumerate(workers)]
    roles.append(start_role("frontend", [
        *common, "--mm-worker-endpoint", ",".join(workers), "--port", "0",
        "--output-endpoint", f"ipc://{run_dir}/f.sock", "--request-timeout", "60",
    ], run_dir, log_dir=run_dir / "frontend"))
    engine_role, first_worker, second_worker, frontend = roles
    urls = images(5)
    on_first = sum(affinity_key(ImageUrl(url=url)) % 2 == 0 for url in urls)
    assert 0 < on_first < len(urls)  # both workers have images
    try:
        assert frontend.endpoint is not None
        with Client(frontend.endpoint, timeout_s=60) as client:
            expected = warm_up(client, urls)  # each image twice
            order = list(range(5)) * 2
            assert check_answers(run(client, urls, order, in_flight=4), order, expected) == 0
            os.kill(first_worker.process.pid, signal.SIGKILL)
            first_worker.process.wait()
            wait_until(lambda: "mm-worker-0 at" in role_log(frontend)
                       and "disconnected" in role_log(frontend), "the frontend sees it gone")
            order = list(range(5))
            assert check_answers(run(client, urls, order, in_flight=1), order, expected) == 0
    finally:
        stop_all(roles)
    engine_counts, second = counters(engine_role), counters(second_worker)
    on_second = len(urls) - on_first
    # Before the kill: one miss per image, in its worker; every repeat hit.
    # After it: the first worker's images are misses in the second, the second's hit again.
    assert engine_counts["cache_hits"] == 3 * len(urls) + on_second
    assert second["requests"] == 4 * on_second + len(urls)
    assert (second["cache_misses"], second["cache_hits"]) == (len(urls), 4 * on_second)
