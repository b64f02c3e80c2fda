"""Three hosts in network namespaces: frontend, MM worker and engine each in its own, CURVE on.

The test makes the namespaces itself (names unique per run): a switch namespace with a bridge,
one veth from each role's namespace to it (10.231.0.1-3/24: the roles' own addresses, so not
loopback, so CURVE is required), and one veth from here to the frontend's namespace
(10.232.0.1/30 here, .2 there) for the test's native client. Nothing else is routed. Each
role runs as `ip netns exec NS python -m mmlane.cli ROLE ...`, binding its namespace's
address; the stats and control sockets are ipc files in the run dir, which every namespace
shares, so the tools (and `wait_for_stats`) reach them. A chat with an image crosses the three;
an MM worker with a key nobody accepts is refused by the engine; the MM worker killed with -9
under load (and started again, as supervisord would) leaves every request with exactly one
reply, and its cache heals. Skipped, saying why, where namespaces cannot be made (not root, no
`ip`). The namespaces are deleted at the end, failed or not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO, ROLES, keys_folder, make_keys
from mmlane.client import Client
from mmlane.common.sockets import CURVE_REFUSED
from mmlane.protocol.errors import RetryableError
from mmlane.protocol.messages import Stats
from peers import (
    PATIENCE_S,
    all_ok,
    image_request,
    mixed_load,
    one_reply_each,
    serves_again_with_its_cache,
    wait_for_stats,
)

ADDRESS = {"frontend": "10.231.0.1", "mm-worker": "10.231.0.2", "engine": "10.231.0.3"}
"""Each role's address on the switch."""
CLIENT_HERE, CLIENT_THERE = "10.232.0.1", "10.232.0.2"
"""The test's end of its link to the frontend's namespace, and the frontend's."""
PORT = {"frontend": 5557, "mm-worker": 5556, "engine": 5555}
CLIENT_PORT = 8765


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """The namespaces and links of one run; `close` deletes them all (each step tolerated, so
    a half-made set goes too)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch = f"mml{tag}-sw"
        self.ns = {role: f"mml{tag}-{role[:2]}" for role in ROLES}
        self.client_link = f"mml{tag}c"  # ours, in this namespace
        self._made: list[str] = []

    def make(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for role, ns in self.ns.items():
            self._netns(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            port = f"p-{role[:2]}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{ADDRESS[role]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("link", "add", self.client_link, "type", "veth", "peer", "name", "eth1", "netns",
            self.ns["frontend"])
        self._made.append(self.client_link)
        _ip("addr", "add", f"{CLIENT_HERE}/30", "dev", self.client_link)
        _ip("link", "set", self.client_link, "up")
        _ip("-n", self.ns["frontend"], "addr", "add", f"{CLIENT_THERE}/30", "dev", "eth1")
        _ip("-n", self.ns["frontend"], "link", "set", "eth1", "up")

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        if self.client_link in self._made:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", self.client_link)
        for name in reversed(self._made):
            if name != self.client_link:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "del", name)


@dataclass
class Site:
    hosts: Hosts
    run_dir: Path
    pairs: Path
    model_dir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def args(self, role: str, keys: Path) -> list[str]:
        common = ["--model", str(self.model_dir), "--curve-keys", str(keys),
                  "--stats-interval", "0.2", "--drain-timeout", "1"]
        engine = f"tcp://{ADDRESS['engine']}:{PORT['engine']}"
        mm_worker = f"tcp://{ADDRESS['mm-worker']}:{PORT['mm-worker']}"
        return {
            "engine": [*common, "--device", "cpu", "--engine-endpoint", engine],
            "mm-worker": [*common, "--engine-endpoint", engine, "--mm-worker-endpoint",
                          mm_worker],
            "frontend": [*common, "--engine-endpoint", engine, "--mm-worker-endpoint",
                         mm_worker, "--host", CLIENT_THERE, "--port", str(CLIENT_PORT),
                         "--http-port", "0", "--request-timeout", "120", "--output-endpoint",
                         f"tcp://{ADDRESS['frontend']}:{PORT['frontend']}"],
        }[role]

    def start(self, role: str, keys: Path, *extra: str, name: str = "") -> subprocess.Popen:
        """`mmlane ROLE` in its role's namespace, once its stats say it is serving."""
        name = name or role
        log = (self.run_dir / f"{name}.log").open("ab")
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts.ns[role], sys.executable, "-m", "mmlane.cli",
             role, *self.args(role, keys), "--name", name, *extra],
            cwd=REPO, stderr=log, env={**os.environ, "MMLANE_RUN_DIR": str(self.run_dir)})
        self.processes[name] = process
        self.stats(name, lambda s: s.pid == process.pid and s.state == "serving",
                   f"{name} serving", timeout_s=180)
        return process

    def stats(self, name: str, done=lambda stats: True, what: str = "",
              timeout_s: float = PATIENCE_S) -> Stats:
        return wait_for_stats(self.run_dir, lambda s: s.name == name and done(s),
                              what or f"stats of {name}", timeout_s)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _namespaces_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces")
    probe = f"mml{uuid.uuid4().hex[:6]}-probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.strip()}")
    _ip("netns", "del", probe)


@pytest.fixture(scope="module")
def site(module_run_dir: Path, qwen_dir: Path) -> Iterator[Site]:
    _namespaces_or_skip()
    hosts = Hosts()
    site = Site(hosts, module_run_dir, module_run_dir / "pairs", qwen_dir)
    try:
        hosts.make()
        make_keys(site.pairs, *ROLES)
        for role in ROLES:
            site.start(role, keys_folder(site.pairs, role, module_run_dir / f"keys-{role}"))
        yield site
    finally:
        site.stop()
        hosts.close()


def keys_of(site: Site, role: str) -> Path:
    return site.run_dir / f"keys-{role}"


def test_a_chat_with_an_image_crosses_three_hosts(site: Site) -> None:
    with Client(f"tcp://{CLIENT_THERE}:{CLIENT_PORT}", timeout_s=60) as client:
        all_ok(client, image_request(client, 1))
    assert site.stats("engine").counters.get("requests", 0) >= 1


def test_an_mm_worker_with_a_wrong_key_is_refused(site: Site) -> None:
    before = site.stats("engine").counters.get(CURVE_REFUSED, 0)
    rogue_pair = site.run_dir / "rogue-pair"
    make_keys(rogue_pair, "mm-worker")
    keys = keys_folder(site.pairs, "mm-worker", site.run_dir / "keys-rogue", own=rogue_pair)
    # Beside the real one, on another port: it connects to the engine at its start.
    rogue = site.start("mm-worker", keys, "--mm-worker-endpoint",
                       f"tcp://{ADDRESS['mm-worker']}:{PORT['mm-worker'] + 100}", name="rogue")
    try:
        site.stats("engine", lambda s: s.counters.get(CURVE_REFUSED, 0) > before,
                   "the engine refusing the rogue MM worker's key")
    finally:
        rogue.send_signal(signal.SIGTERM)
        rogue.wait(timeout=20)


def test_the_mm_worker_killed_under_load_leaves_one_reply_each_and_heals(site: Site) -> None:
    with Client(f"tcp://{CLIENT_THERE}:{CLIENT_PORT}", timeout_s=60) as client:
        all_ok(client, image_request(client, 0))  # every role is up before the kill
        load = mixed_load(client, seed=100)
        site.processes["mm-worker"].kill()
        site.processes["mm-worker"].wait()
        site.start("mm-worker", keys_of(site, "mm-worker"))  # as supervisord would
        for rid, reply in one_reply_each(client, load, PATIENCE_S).items():
            error = reply if isinstance(reply, Exception) else reply.error
            assert error is None or (isinstance(error, RetryableError)
                                     and error.code == "peer_restarted"), f"{rid}: {reply!r}"
        serves_again_with_its_cache(client, site.run_dir)
