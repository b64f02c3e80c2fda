"""The operator tools (`mmlane stats`, `top`, `health`, `exporter`) against three real roles.

One set of roles serves the whole module (started as `mmlane serve` starts them, but each a
child of this test, so one can be killed alone). The tools run through `mmlane.cli.main`,
in this process, except the exporter, which runs as its own process until SIGTERM.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group

from bench.config import ImageSpec
from bench.images import ImageSource, jpeg_uri
from conftest import REPO, free_port, role_log, start_role
from mmlane.cli import main
from mmlane.client import Client, user_message
from mmlane.common.config import ipc
from mmlane.common.lifecycle import RESTARTS_ENV
from mmlane.common.prometheus import metric_name
from mmlane.common.sockets import CURVE_REFUSED, free_tcp_port
from mmlane.common.stats import Metrics, count_full_collections
from mmlane.launcher import SERVE_SETTINGS, Child, serve_config, start_roles, stop_all
from mmlane.ops.discovery import Targets, endpoint_label
from mmlane.ops.feed import ProcessSnapshots, StatsFeed
from mmlane.ops.lanes import lanes
from mmlane.ops.stats_cli import snapshot_text
from mmlane.ops.text import errors_text, state_text
from mmlane.ops.top import plain_text, process_table
from mmlane.protocol.errors import FatalError
from mmlane.protocol.messages import HistogramSnapshot, Stats
from peers import wait_until

ROLES = ["frontend", "mm-worker", "engine"]
STATS_INTERVAL = "0.2"


@dataclass
class Deployment:
    run_dir: Path
    client_endpoint: str
    children: dict[str, Child]

    def stats_endpoint(self, name: str) -> str:
        return ipc(f"stats-{name}", self.run_dir)

    def control_endpoint(self, name: str) -> str:
        return ipc(f"control-{name}", self.run_dir)


@pytest.fixture(scope="module")
def deployment(module_run_dir: Path, qwen_dir: Path) -> Iterator[Deployment]:
    port = free_port()
    config = serve_config(SERVE_SETTINGS.parse(
        ["--model", str(qwen_dir), "--run-dir", str(module_run_dir), "--port", str(port),
         "--http-port", "0", "--stats-interval", STATS_INTERVAL]
    ))
    children = start_roles(config.roles(), module_run_dir, 180, log_dir=module_run_dir / "log")
    yield Deployment(module_run_dir, f"tcp://127.0.0.1:{port}", {c.role: c for c in children})
    stop_all(children)


def mmlane(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `mmlane ARGV` here; its exit status, stdout and stderr."""
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def send_mixed_requests(deployment: Deployment, count: int = 2) -> None:
    """`count` text and `count` small-image requests, each answered before this returns."""
    with Client(deployment.client_endpoint, timeout_s=120) as client:
        ids = [client.submit([user_message(f"hello {i}")], max_tokens=4) for i in range(count)]
        ids += [client.submit([user_message("what is it?", [jpeg_uri(96, 64, seed=i)])],
                              max_tokens=4) for i in range(count)]
        results = client.collect(ids)
    assert all(result.error is None for result in results.values())


# ---------------------------------------------------------------- mmlane stats


def test_stats_once_json_lists_every_process_with_its_histograms(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    send_mixed_requests(deployment)
    status, out, _ = mmlane(capsys, "stats", "--once", "--json",
                            "--run-dir", str(deployment.run_dir))
    assert status == 0
    report = json.loads(out)
    processes = report["processes"]
    assert report["silent"] == []
    assert [p["role"] for p in processes] == ROLES
    by_role = {p["role"]: p for p in processes}
    assert {p["pid"] for p in processes} == {c.process.pid for c in deployment.children.values()}
    assert {"tokenize", "end_to_end:text", "end_to_end:image"} <= set(
        by_role["frontend"]["histograms"])
    assert {"decode", "process", "mm_job"} <= set(by_role["mm-worker"]["histograms"])
    assert any(name.startswith("engine_step:") for name in by_role["engine"]["histograms"])
    # from the engine's receipt of a request to its first token, one per request that had one
    first_token = [by_role["engine"]["histograms"][f"first_token:{kind}"]
                   for kind in ("text", "image")]
    assert all(sum(histogram["counts"]) >= 1 for histogram in first_token)
    tokenize = by_role["frontend"]["histograms"]["tokenize"]
    assert sum(tokenize["counts"]) >= 4 and len(tokenize["counts"]) == len(tokenize["bounds"]) + 1
    assert by_role["frontend"]["counters"]["requests"] >= 4
    # Each role froze what it built out of garbage collection, and counts full collections.
    for process in processes:
        assert {"gc_full_collections", "gc_full_pause_us"} <= set(process["counters"])
    for child in deployment.children.values():
        frozen = re.search(r"(\d+) objects built at startup are left out of garbage collection",
                           role_log(child))
        assert frozen is not None and int(frozen[1]) > 10_000, child.role


def test_full_collections_are_counted_with_their_pause() -> None:
    counted = count_full_collections()
    before = dict(counted)
    gc.collect(1)  # not a full one
    gc.collect()
    assert counted["gc_full_collections"] == before["gc_full_collections"] + 1
    assert counted["gc_full_pause_us"] >= before["gc_full_pause_us"]


def test_counters_of_one_name_from_two_sources_add_up() -> None:
    """Each lane of an MM worker without a pool has a shared-memory writer of its own, both
    counting shm_*: published, their counts add up (the last one's used to replace the
    first's), unless a prefix tells them apart."""
    metrics = Metrics("mm-worker", "counting")
    metrics.counters["sent"] = 1
    metrics.add_counters(Counter(shm_tensors=2, shm_bytes=10))
    metrics.add_counters(Counter(shm_tensors=3, shm_reaped=1))
    metrics.add_counters(Counter(shm_tensors=4), prefix="video_")
    published = metrics.snapshot().counters
    assert {name: published[name] for name in ("sent", "shm_tensors", "shm_bytes", "shm_reaped",
                                               "video_shm_tensors")} == \
        {"sent": 1, "shm_tensors": 5, "shm_bytes": 10, "shm_reaped": 1, "video_shm_tensors": 4}


def test_stats_once_names_a_process_that_sends_nothing(
    deployment: Deployment, capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    nobody = ipc("stats-nobody-here", run_dir)
    status, out, err = mmlane(capsys, "stats", "--once", "--timeout", "1",
                              "--connect", deployment.stats_endpoint("engine"),
                              "--connect", nobody)
    assert status == 1
    assert "nobody-here" in err
    assert "engine engine" in out  # the one that answered is still printed


def test_stats_without_sockets_says_where_it_looked(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    status, _, err = mmlane(capsys, "stats", "--once", "--run-dir", str(run_dir))
    assert status == 1
    assert str(run_dir) in err and "--connect" in err


# ---------------------------------------------------------------- mmlane health


def test_health_passes_when_every_role_serves(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = mmlane(capsys, "health", "--timeout", "5",
                              "--run-dir", str(deployment.run_dir))
    assert status == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ROLES
    assert all(line.endswith("ok") and " serving " in line for line in lines)


def test_garbage_on_a_control_socket_is_logged_and_pings_still_answer(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoints = Targets("control", (), deployment.run_dir).require_endpoints()
    for endpoint in endpoints:
        with zmq.Context.instance().socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(endpoint)
            sock.send(b"not a ping")
    logged = "dropped an unreadable control message"
    wait_until(lambda: all(logged in role_log(child) for child in deployment.children.values()),
               "every role logging the unreadable message", timeout_s=30)
    status, _, err = mmlane(capsys, "health", "--timeout", "5",
                            "--run-dir", str(deployment.run_dir))
    assert status == 0, err  # every role still answers


def test_health_and_stats_answer_while_the_mm_worker_is_saturated(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    photo = ImageSource.generated(ImageSpec(4032, 3024))  # new bytes each use: no cache hits
    jobs = 8
    targets = Targets("stats", (deployment.stats_endpoint("mm-worker"),), deployment.run_dir)
    with StatsFeed(targets) as feed, Client(deployment.client_endpoint, timeout_s=300) as client:
        (worker,) = feed.processes.values()
        feed.wait_for(1, 30)
        sent_before = worker.latest.counters.get("sent", 0) if worker.latest else 0
        ids = [client.submit([user_message("describe", [photo.data_uri()])], max_tokens=2)
               for _ in range(jobs)]
        busy = _wait_for_snapshot(feed, lambda stats: stats.in_flight >= 2)
        status, out, err = mmlane(capsys, "health", "--timeout", "5",
                                  "--run-dir", str(deployment.run_dir))
        answered_at = time.time()
        after = _wait_for_snapshot(feed, lambda stats: stats.time > answered_at)
        results = client.collect(ids)
    assert busy.queues["jobs_queued"] >= 1  # in_flight counts the one job being processed
    assert status == 0, err
    assert "mm-worker" in out
    # Health answered before the MM worker was through the jobs queued ahead of it.
    assert after.counters.get("sent", 0) - sent_before < jobs
    assert all(result.error is None for result in results.values())


def _wait_for_snapshot(
    feed: StatsFeed, wanted: Callable[[Stats], bool], timeout_s: float = 60
) -> Stats:
    """The first snapshot that arrives and satisfies `wanted`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for stats in feed.receive(1.0):
            if wanted(stats):
                return stats
    pytest.fail(f"no such snapshot within {timeout_s} s")


def test_a_taken_stats_address_fails_the_start_naming_it(run_dir: Path, qwen_dir: Path) -> None:
    with zmq.Context.instance().socket(zmq.PUB) as squatter:
        port = squatter.bind_to_random_port("tcp://127.0.0.1")
        taken = f"tcp://127.0.0.1:{port}"
        with pytest.raises(FatalError, match=f"cannot bind {taken}"):
            start_role("mm-worker", [
                "--model", str(qwen_dir), "--engine-endpoint", ipc("engine", run_dir),
                "--mm-worker-endpoint", ipc("mm-worker", run_dir), "--stats-endpoint", taken,
            ], run_dir)


def test_health_names_a_killed_process(
    deployment: Deployment, capsys: pytest.CaptureFixture[str], run_dir: Path, qwen_dir: Path
) -> None:
    """A second frontend, with its sockets in a run dir of its own, is killed (SIGKILL: its
    socket files stay behind); health says which process is gone."""
    port = free_port()
    extra = start_role("frontend", [
        "--model", str(qwen_dir), "--port", str(port), "--http-port", "0",
        "--engine-endpoint", ipc("engine", deployment.run_dir),
        "--mm-worker-endpoint", ipc("mm-worker", deployment.run_dir),
        "--output-endpoint", ipc("frontend-extra", run_dir), "--stats-interval", STATS_INTERVAL,
    ], run_dir)
    endpoints = [deployment.control_endpoint(name)
                 for name in (_frontend_name(deployment), "mm-worker", "engine")]
    endpoints.append(ipc(f"control-frontend-{port}", run_dir))
    connect = [arg for endpoint in endpoints for arg in ("--connect", endpoint)]
    try:
        status, out, err = mmlane(capsys, "health", "--timeout", "5", *connect)
        assert status == 0, err
        assert out.count("frontend") >= 2
        extra.process.kill()
        extra.process.wait()
        status, out, err = mmlane(capsys, "health", "--timeout", "5", *connect)
        assert status == 1
        assert f"frontend-{port}: no answer within 5 s" in err
        assert out.count(" ok") == 3  # the others still serve
        status, _, err = mmlane(capsys, "health", "--timeout", "1", "--run-dir", str(run_dir))
        assert status == 1
        assert f"frontend-{port}" in err and "no mm-worker answered" in err
    finally:
        stop_all([extra])


# ---------------------------------------------------------------- mmlane exporter


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of /metrics, by name and labels."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def sample(samples: Samples, metric: str, /, **labels: str) -> float:
    """One sample's value (0 when absent); labels as keywords, `name` and `role` among them."""
    return samples.get((metric, frozenset(labels.items())), 0.0)


def test_exporter_serves_histograms_and_counters_that_grow(deployment: Deployment) -> None:
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "mmlane.cli", "exporter", "--port", str(port),
         "--run-dir", str(deployment.run_dir)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert f":{port}/metrics" in exporter.stdout.readline()  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/metrics"
        frontend = {"role": "frontend", "name": _frontend_name(deployment)}
        first = _scrape_until(url, lambda s: all(
            sample(s, "mmlane_up", role=role, name=name) == 1
            for role, name in [("frontend", frontend["name"]), ("mm-worker", "mm-worker"),
                               ("engine", "engine")]))
        send_mixed_requests(deployment)
        requests_before = sample(first, "mmlane_requests_total", **frontend)
        second = _scrape_until(url, lambda s: sample(
            s, "mmlane_requests_total", **frontend) >= requests_before + 4)
    finally:
        exporter.send_signal(signal.SIGTERM)
        assert exporter.wait(timeout=30) == 0
    text_lane = {**frontend, "kind": "text"}
    for name in ("mmlane_end_to_end_seconds_count", "mmlane_end_to_end_seconds_sum"):
        assert sample(second, name, **text_lane) > sample(first, name, **text_lane)
    assert (sample(second, "mmlane_end_to_end_seconds_bucket", **text_lane, le="+Inf")
            == sample(second, "mmlane_end_to_end_seconds_count", **text_lane))
    assert sample(second, "mmlane_tokenize_seconds_count", **frontend) > sample(
        first, "mmlane_tokenize_seconds_count", **frontend)
    assert sample(second, "mmlane_requests_total", role="engine", name="engine") > sample(
        first, "mmlane_requests_total", role="engine", name="engine")
    names = {name for name, _ in second}
    assert {"mmlane_decode_seconds_bucket", "mmlane_engine_step_seconds_count",
            "mmlane_in_flight", "mmlane_uptime_seconds", "mmlane_queue_depth"} <= names
    for role, name in [("frontend", frontend["name"]), ("mm-worker", "mm-worker"),
                       ("engine", "engine")]:  # each process's memory, glibc's heaps too
        memory = {kind: sample(second, "mmlane_memory_bytes", role=role, name=name, kind=kind)
                  for kind in ("resident", "anonymous", "heap_in_use")}
        assert 0 < memory["anonymous"] < memory["resident"] and memory["heap_in_use"] > 0
        assert ("mmlane_memory_bytes", frozenset(
            {"role": role, "name": name, "kind": "heap_free"}.items())) in second


def _frontend_name(deployment: Deployment) -> str:
    return "frontend-" + deployment.client_endpoint.rpartition(":")[2]


def _scrape_until(url: str, done: Callable[[Samples], bool], timeout_s: float = 60) -> Samples:
    """Scrape until `done(samples)` holds (the exporter follows the snapshots as they come)."""

    def scraped() -> Samples | None:
        samples = scrape(url)
        return samples if done(samples) else None

    return wait_until(scraped, f"{url} showing the awaited samples", timeout_s, every_s=0.2)


# ---------------------------------------------------------------- mmlane top


def test_top_once_shows_a_row_per_process_and_the_lanes(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    send_mixed_requests(deployment, count=1)
    status, out, _ = mmlane(capsys, "top", "--once", "--run-dir", str(deployment.run_dir))
    assert status == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for role, child in deployment.children.items():
        assert str(child.process.pid) in rows[role]
        assert "serving" in rows[role]
    assert rows["frontend"][1] == _frontend_name(deployment)
    for lane in ("tokenize", "decode", "process", "end_to_end:text", "end_to_end:image"):
        assert lane in rows


# ---------------------------------------------------------------- the pieces, without processes


@pytest.mark.parametrize(("endpoint", "label"), [
    ("ipc:///tmp/mmlane/serve-8765/stats-frontend-8765.sock", "frontend-8765"),
    ("ipc:///run/control-mm-worker.sock", "mm-worker"),
    ("tcp://10.0.0.7:5600", "tcp://10.0.0.7:5600"),
])
def test_endpoint_label(endpoint: str, label: str) -> None:
    assert endpoint_label(endpoint) == label


def test_a_free_port_is_never_given_twice() -> None:
    """Two servers started together each pick a port before either binds it: they must not
    get the same one (vLLM alone and mmlane once did, in test_vllm_families)."""
    ports = [free_tcp_port() for _ in range(200)]  # none bound: each one free again at once
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize(("name", "expected"), [
    ("end_to_end", "end_to_end"), ("cache-hits", "cache_hits"), ("a.b:c d", "a_b_c_d"),
])
def test_metric_names_keep_to_prometheus_characters(name: str, expected: str) -> None:
    assert metric_name(name) == expected


def _stats(pid: int, at: float, counts: list[int]) -> Stats:
    histogram = HistogramSnapshot(bounds=[0.1, 1.0], counts=counts, total=0.0, p50=0, p90=0,
                                  p99=0)
    return Stats(role="engine", name="engine", pid=pid, epoch=1, uptime_s=at, time=at,
                 state="serving", in_flight=0, queues={}, counters={}, errors={},
                 histograms={"engine_step:decode": histogram})


@pytest.mark.parametrize(("first_pid", "window"), [(7, [2, 1, 0]), (6, None)])
def test_the_last_window_is_the_difference_of_one_runs_two_snapshots(
    first_pid: int, window: list[int] | None
) -> None:
    process = ProcessSnapshots("ipc:///x/stats-engine.sock")
    process.add(_stats(first_pid, 10.0, [1, 0, 0]), now=0.0)
    process.add(_stats(7, 11.0, [3, 1, 0]), now=1.0)
    (lane,) = lanes([process], now=1.0)
    assert lane.since_start == [3, 1, 0]
    assert lane.last_window == window  # a new pid is a restarted process: no window


def test_top_shows_each_mm_workers_share_of_the_requests() -> None:
    def worker(name: str, requests: int) -> ProcessSnapshots:
        process = ProcessSnapshots(f"ipc:///x/stats-{name}.sock")
        for at, count in ((10.0, 0), (11.0, requests)):
            process.add(replace(_stats(7, at, [0, 0, 0]), role="mm-worker", name=name,
                                counters={"requests": count}), now=at - 10.0)
        return process

    processes = [worker("mm-worker-a", 3), worker("mm-worker-b", 1)]
    text = plain_text(Group(process_table(processes, now=1.0)))
    rows = {line.split()[1]: line for line in text.splitlines() if "mm-worker-" in line}
    assert "3.0 (75%)" in rows["mm-worker-a"] and "1.0 (25%)" in rows["mm-worker-b"]
    alone = plain_text(Group(process_table(processes[:1], now=1.0)))
    assert "3.0" in alone and "%" not in alone


def test_a_process_that_stops_publishing_goes_stale() -> None:
    process = ProcessSnapshots("ipc:///x/stats-engine.sock")
    process.add(_stats(7, 10.0, [1, 0, 0]), now=100.0)
    process.add(_stats(7, 20.0, [1, 0, 0]), now=110.0)  # publishes every 10 s
    assert process.fresh(now=130.0)
    assert not process.fresh(now=150.0)


@pytest.mark.parametrize(("errors", "refused", "curve", "text"), [
    ({}, {}, 0, "-"),
    ({"timeout": 1}, {}, 0, "timeout 1"),
    ({}, {"model_not_found": 2}, 0, "http refused model_not_found 2"),
    ({"timeout": 1}, {"invalid_request": 3, "invalid_api_key": 1}, 0,
     "timeout 1; http refused invalid_api_key 1, invalid_request 3"),
    ({}, {}, 5, "curve refused 5"),
    ({"timeout": 1}, {}, 2, "timeout 1; curve refused 2"),
])
def test_top_and_stats_show_the_refusals_after_the_errors(
    errors: dict[str, int], refused: dict[str, int], curve: int, text: str
) -> None:
    stats = replace(_stats(7, 10.0, [1, 0, 0]), role="frontend", errors=errors,
                    http_refused=refused, counters={CURVE_REFUSED: curve} if curve else {})
    assert errors_text(stats) == text
    assert f"  errors    {text}" in snapshot_text(stats).splitlines()


@pytest.mark.parametrize(("state", "restarts", "text"), [
    ("serving", 0, "serving"),
    ("serving", 2, "serving (restarted 2x)"),
    ("draining", 0, "draining"),
    ("restarting", 2, "restarting (restart 2)"),  # serve answers for a role it restarts
])
def test_the_tools_write_a_state_with_its_restarts(state: str, restarts: int, text: str) -> None:
    assert state_text(state, restarts) == text


SLOW_TO_BUILD = """
import sys, time
from pathlib import Path
from mmlane.common.config import OpsConfig
from mmlane.common.lifecycle import run_role
from mmlane.common.stats import Metrics

release = Path(sys.argv[1])


class Role:
    endpoint = "inproc://slow"

    def __init__(self):
        self.metrics = Metrics("engine", "slow")

    def serve(self, stop):
        stop.wait()

    def close(self):
        pass


def build():
    while not release.exists():  # a model that takes its time to load
        time.sleep(0.05)
    return Role()


sys.exit(run_role("engine", build, None, OpsConfig(stats_interval_s=0.1).named("slow")))
"""


def test_a_role_that_is_still_loading_answers_as_starting(
    capsys: pytest.CaptureFixture[str], run_dir: Path,
) -> None:
    """From before its build (a model load) to its end, health says 'starting', not silence;
    then 'serving'. The restart count shows in both."""
    release = run_dir / "release"
    env = {**os.environ, "MMLANE_RUN_DIR": str(run_dir), RESTARTS_ENV: "2"}
    role = subprocess.Popen([sys.executable, "-c", SLOW_TO_BUILD, str(release)], cwd=REPO,
                            env=env)
    try:
        wait_until(lambda: (run_dir / "control-slow.sock").exists(), "its control socket")
        status, out, err = mmlane(capsys, "health", "--timeout", "5", "--run-dir", str(run_dir))
        assert status == 1 and "state starting (restart 2)" in err, (out, err)
        release.touch()
        wait_until(lambda: mmlane(capsys, "health", "--timeout", "5", "--run-dir",
                                  str(run_dir))[1].count("serving (restarted 2x)") == 1,
                   "it serves")
    finally:
        role.send_signal(signal.SIGTERM)
        assert role.wait(timeout=30) == 0
