"""ZMQ CURVE between roles: real role processes on tcp://127.0.0.1, each with its keys folder.
(tests/test_netns.py runs them on three hosts.)

A chat with an image goes frontend -> MM worker -> engine -> frontend over CURVE; a frontend
whose key the others do not accept is refused at the handshake (nothing of it reaches the
engine, whose `curve_refused` counts it); plain tcp on a non-loopback address is refused unless
--insecure-tcp; `mmlane keys` writes a pair with a 0600 secret.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from test_serve_heals import serving

from bench.images import jpeg_uri
from conftest import REPO, ROLES, free_port, keys_folder, make_keys, start_role
from mmlane.client import Client, user_message
from mmlane.common.sockets import CURVE_REFUSED, make_socket
from mmlane.launcher import Child, stop_all
from mmlane.protocol.errors import FatalError, RetryableError
from mmlane.protocol.messages import EngineRequest, SamplingParams, Stats
from peers import StandInFrontend, wait_for_stats


@dataclass
class Site:
    """Three roles on loopback tcp with CURVE; their run dir and client endpoint."""

    run_dir: Path
    pairs: Path
    client_endpoint: str
    engine_endpoint: str
    mm_worker_endpoint: str
    model_dir: Path


def role_args(site: Site, keys: Path) -> dict[str, list[str]]:
    common = ["--model", str(site.model_dir), "--curve-keys", str(keys)]
    return {
        "engine": [*common, "--device", "cpu", "--engine-endpoint", site.engine_endpoint],
        "mm-worker": [*common, "--engine-endpoint", site.engine_endpoint,
                      "--mm-worker-endpoint", site.mm_worker_endpoint],
        "frontend": [*common, "--engine-endpoint", site.engine_endpoint,
                     "--mm-worker-endpoint", site.mm_worker_endpoint, "--http-port", "0"],
    }


@pytest.fixture(scope="module")
def site(module_run_dir: Path, qwen_dir: Path) -> Iterator[Site]:
    pairs = module_run_dir / "pairs"
    make_keys(pairs, *ROLES)
    port = free_port()
    site = Site(module_run_dir, pairs, f"tcp://127.0.0.1:{port}",
                f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", qwen_dir)
    children: list[Child] = []
    try:
        for role in ROLES:
            keys = keys_folder(pairs, role, module_run_dir / f"keys-{role}")
            args = role_args(site, keys)[role]
            if role == "frontend":
                args += ["--port", str(port), "--output-endpoint",
                         f"tcp://127.0.0.1:{free_port()}"]
            children.append(start_role(role, args, module_run_dir,
                                       log_dir=module_run_dir / "logs"))
        yield site
    finally:
        stop_all(children)


def engine_stats(run_dir: Path) -> Stats:
    return wait_for_stats(run_dir, lambda s: s.role == "engine", "the engine's stats")


def test_a_chat_with_an_image_crosses_every_role_over_curve(site: Site) -> None:
    with Client(site.client_endpoint, timeout_s=60) as client:
        result = client.chat([user_message("What is this?", [jpeg_uri(64, 48, seed=1)])],
                             max_tokens=4)
    assert result.finish_reason in ("length", "stop")
    assert engine_stats(site.run_dir).counters.get("requests", 0) >= 1


def test_a_peer_with_an_unaccepted_key_is_refused_at_the_handshake(
    site: Site, module_run_dir: Path
) -> None:
    rogue_pair = module_run_dir / "rogue-pair"
    make_keys(rogue_pair, "frontend")  # a frontend key pair nobody accepts
    keys = keys_folder(site.pairs, "frontend", module_run_dir / "keys-rogue", own=rogue_pair)
    before = engine_stats(site.run_dir)
    port = free_port()
    rogue = start_role(
        "frontend", [*role_args(site, keys)["frontend"], "--port", str(port),
                     "--name", "rogue",
                     "--output-endpoint", f"tcp://127.0.0.1:{free_port()}"],
        module_run_dir, log_dir=module_run_dir / "logs")
    try:
        # Refused, the frontend has no engine to send to: its client learns it at once.
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=30) as client, \
                pytest.raises(RetryableError, match="cannot send to the engine"):
            client.chat([user_message("let me in")], max_tokens=2)
        refused = wait_for_stats(
            site.run_dir, lambda s: s.role == "engine"
            and s.counters.get(CURVE_REFUSED, 0) > before.counters.get(CURVE_REFUSED, 0),
            "the engine counting the refused key")
    finally:
        stop_all([rogue])
    for counter in ("requests", "bytes_in"):  # nothing of the rogue's reached the engine
        assert refused.counters.get(counter, 0) == before.counters.get(counter, 0), counter
    log = (module_run_dir / "logs" / "engine.log").read_text()
    assert "refused a peer at the CURVE handshake" in log


def test_a_plain_peer_is_refused_and_counted_too(site: Site, module_run_dir: Path) -> None:
    before = engine_stats(site.run_dir)
    with zmq.Context() as ctx, StandInFrontend(ctx, site.engine_endpoint,
                                               f"ipc://{module_run_dir}/plain.sock") as plain:
        plain.send(EngineRequest(request_id="plain", reply_to=plain.reply_to,
                                 prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1)))
        refused = wait_for_stats(
            site.run_dir, lambda s: s.role == "engine"
            and s.counters.get(CURVE_REFUSED, 0) > before.counters.get(CURVE_REFUSED, 0),
            "the engine counting the plain peer")
        plain.replies.assert_quiet()
    for counter in ("requests", "bytes_in"):
        assert refused.counters.get(counter, 0) == before.counters.get(counter, 0), counter
    log = (module_run_dir / "logs" / "engine.log").read_text()
    assert "its handshake failed (a plain tcp peer" in log


@pytest.mark.parametrize("extra, refused", [([], True), (["--insecure-tcp"], False)])
def test_plain_tcp_on_a_non_loopback_address_needs_insecure_tcp(
    run_dir: Path, qwen_dir: Path, extra: list[str], refused: bool
) -> None:
    args = ["--model", str(qwen_dir), "--engine-endpoint", "tcp://127.0.0.1:1",
            "--mm-worker-endpoint", f"tcp://0.0.0.0:{free_port()}", *extra]
    if refused:
        with pytest.raises(FatalError, match="refusing to bind .*--insecure-tcp"):
            start_role("mm-worker", args, run_dir)
    else:
        stop_all([start_role("mm-worker", args, run_dir)])


def test_keys_writes_a_pair_with_a_0600_secret(run_dir: Path) -> None:
    make_keys(run_dir / "k", "engine")
    assert stat.S_IMODE((run_dir / "k" / "engine.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((run_dir / "k").stat().st_mode) == 0o700
    assert "public-key" in (run_dir / "k" / "engine.key").read_text()
    again = subprocess.run([sys.executable, "-m", "mmlane.cli", "keys", "--out",
                            str(run_dir / "k"), "--name", "engine"], cwd=REPO,
                           capture_output=True, text=True)
    assert again.returncode == 1 and "exists" in again.stderr


def test_serve_gives_its_children_throwaway_keys(run_dir: Path, qwen_dir: Path) -> None:
    with serving(run_dir, qwen_dir, "--throwaway-keys",
                 "--engine-endpoint", f"tcp://127.0.0.1:{free_port()}",
                 "--mm-worker-endpoint", f"tcp://127.0.0.1:{free_port()}") as served, \
            Client(served.endpoint, timeout_s=60) as client:
        result = client.chat([user_message("What is this?", [jpeg_uri(64, 48, seed=2)])],
                             max_tokens=4)
        assert result.finish_reason in ("length", "stop")
        keys = served.run_dir / "keys"
        for role in ROLES:
            assert stat.S_IMODE((keys / f"{role}.key_secret").stat().st_mode) == 0o600
    assert not keys.exists()  # removed when serve stopped


def test_an_ipc_socket_is_made_0600_in_a_new_0700_folder(run_dir: Path) -> None:
    path = run_dir / "new" / "engine.sock"
    with zmq.Context() as ctx, make_socket(ctx, zmq.PULL, f"ipc://{path}", bind=True,
                                           linger_ms=0):
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
