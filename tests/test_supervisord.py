"""deploy/: its files' command lines through the real CLI parser, and supervisord.conf under the
real supervisord: two frontends, one MM worker, one engine.

Each test under supervisord `kill -9`s one role under mixed load and checks what the others
say: supervisord starts it again, every request gets exactly one terminal reply (a result, or an
error such as the timeout for work that died with the process), and the lanes serve again
afterwards. Before them, the HTTP API that both frontends serve on one port answers from each.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from supervisor.options import ServerOptions

from bench.images import jpeg_uri
from conftest import REPO, free_port
from mmlane.cli import build_parser, config_from_argv
from mmlane.client import ChatResult, Client, user_message
from mmlane.engine.config import EngineConfig
from mmlane.frontend.config import FrontendConfig
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.protocol.errors import FatalError, RetryableError
from mmlane.protocol.messages import ChatMessage
from peers import wait_for_stats, wait_until

DEPLOY = REPO / "deploy"
FRONTENDS = 2
# Short, so that requests lost inside a killed process are answered (with a timeout) quickly.
REQUEST_TIMEOUT_S = 40.0
"""Longer than a role's restart on a busy machine (which can take 10 s): what the killed role
held ends with the restart's error, not with this timeout. Below PATIENCE_S."""
# The longest any wait in this file may take: a reply, a restart. A hang fails, never passes.
PATIENCE_S = 60.0
STATS_ARGS = "--stats-interval 0.1"


def _free_port_pair() -> int:
    """A port P such that P and P+1 are both free on loopback (frontend ports follow on)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports")


@dataclass
class Supervised:
    """A running supervisord with deploy/supervisord.conf, and how to reach its programs."""

    process: subprocess.Popen
    env: dict[str, str]
    ports: list[int]
    log_dir: Path

    def ctl(self, *args: str) -> str:
        out = subprocess.run(
            ["supervisorctl", "-s", f"unix://{self.env['MMLANE_RUN_DIR']}/supervisor.sock", *args],
            env=self.env, capture_output=True, text=True, timeout=30,
        )
        return out.stdout + out.stderr

    def status(self) -> dict[str, tuple[str, int | None]]:
        """Program name -> (state, pid) as `supervisorctl status` reports them."""
        programs: dict[str, tuple[str, int | None]] = {}
        for line in self.ctl("status").splitlines():
            parts = line.split()
            if len(parts) < 2:
                continue
            pid = int(parts[3].rstrip(",")) if len(parts) > 3 and parts[2] == "pid" else None
            programs[parts[0]] = (parts[1], pid)
        return programs

    def running_pid(self, program: str) -> int | None:
        state, pid = self.status().get(program, ("ABSENT", None))
        return pid if state == "RUNNING" else None

    def logs(self) -> str:
        return "\n".join(
            f"== {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.log_dir.glob("*.log"))
        )


@pytest.fixture(scope="module")
def supervised(module_run_dir: Path, qwen_dir: Path) -> Iterator[Supervised]:
    if shutil.which("supervisord") is None or shutil.which("supervisorctl") is None:
        pytest.skip("supervisord is not installed (pip install -e '.[test]' installs supervisor)")
    base_port = _free_port_pair()
    env = {
        **os.environ,
        "MMLANE_RUN_DIR": str(module_run_dir),
        "MMLANE_LOG_DIR": str(module_run_dir / "log"),
        "MMLANE_MODEL": str(qwen_dir),
        "MMLANE_BIN": f"{shlex.quote(sys.executable)} -m mmlane.cli",
        "MMLANE_FRONTENDS": str(FRONTENDS),
        "MMLANE_FRONTEND_PORT": str(base_port),
        "MMLANE_HTTP_PORT": str(free_port()),  # not 8000: a test run beside another
        "MMLANE_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S),
        "MMLANE_DEVICE": "cpu",
        # Frequent stats: the tests wait on them (`_wait_holding`).
        "MMLANE_ENGINE_ARGS": f"--torch-threads 1 {STATS_ARGS}",
        "MMLANE_MM_WORKER_ARGS": STATS_ARGS,
        "MMLANE_FRONTEND_ARGS": STATS_ARGS,
        "MMLANE_STARTSECS": "1",
    }
    process = subprocess.Popen(
        [str(DEPLOY / "run-supervisord")], env=env, cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    sup = Supervised(process, env, [base_port + i for i in range(FRONTENDS)],
                     module_run_dir / "log")
    try:
        _wait_until_serving(sup)
        yield sup
    finally:
        process.send_signal(signal.SIGTERM)  # supervisord stops every program with SIGTERM
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_serving(sup: Supervised) -> None:
    """Every program RUNNING and each frontend answering a text request end to end."""
    names = {"engine", "mm-worker", *(f"frontend:frontend-{p}" for p in sup.ports)}

    def running() -> bool:
        if sup.process.poll() is not None:
            pytest.fail(f"supervisord exited: {sup.status()}\n{sup.logs()}")
        return all(sup.running_pid(name) for name in names)

    wait_until(running, f"supervisord running {sorted(names)}", PATIENCE_S * 3, every_s=0.5)
    for port in sup.ports:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=PATIENCE_S) as client:
            client.chat([user_message("hello")], max_tokens=2)


# ---------------------------------------------------------------------------- the load


@dataclass
class Sent:
    kind: str  # "text" or "image"
    frontend: int
    order: int  # when it was sent, among all requests of this test
    replies: list[ChatResult] = field(default_factory=list)
    answered_at: int | None = None  # its place among all terminal replies, in arrival order


class Load:
    """Mixed requests through every frontend, each reply counted and placed in arrival order."""

    def __init__(self, ports: list[int]) -> None:
        self.clients = [Client(f"tcp://127.0.0.1:{p}", timeout_s=PATIENCE_S) for p in ports]
        self.sent: dict[str, Sent] = {}
        self._order = itertools.count()
        self._answered = itertools.count()
        self._seeds = itertools.count(1000)

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def text(self, frontend: int, max_tokens: int = 3) -> str:
        message = user_message("Tell me about lanes.")
        return self._submit("text", frontend, message, max_tokens)

    def image(
        self, frontend: int, seed: int | None = None, max_tokens: int = 3, uri: str = ""
    ) -> str:
        seed = next(self._seeds) if seed is None else seed  # new pixels: no cache hit
        message = user_message("What is in it?", [uri or jpeg_uri(320, 240, seed)])
        return self._submit("image", frontend, message, max_tokens)

    def _submit(self, kind: str, frontend: int, message: ChatMessage, max_tokens: int) -> str:
        request_id = self.clients[frontend].submit([message], max_tokens=max_tokens)
        self.sent[request_id] = Sent(kind, frontend, next(self._order))
        return request_id

    def poll(self, wait_s: float = 0.05) -> int:
        """Gather whatever replies arrived within about `wait_s`; returns how many."""
        gathered = 0
        for client in self.clients:
            while True:
                try:
                    result = client.next_finished(time.monotonic() + wait_s)
                except RetryableError:  # nothing more from this frontend for now
                    break
                sent = self.sent[result.request_id]
                sent.replies.append(result)
                if sent.answered_at is None:
                    sent.answered_at = next(self._answered)
                gathered += 1
        return gathered

    def wait_for(self, request_ids: list[str]) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while any(not self.sent[r].replies for r in request_ids):
            assert time.monotonic() < deadline, "requests without a reply: " + ", ".join(
                f"{self.sent[r].kind}" for r in request_ids if not self.sent[r].replies
            )
            self.poll()

    def settle(self) -> None:
        """Wait for every reply, then check that none came twice (nothing else may arrive)."""
        self.wait_for(list(self.sent))
        self.poll(wait_s=1.0)
        twice = [r for r, s in self.sent.items() if len(s.replies) != 1]
        assert not twice, f"{len(twice)} requests got more than one terminal reply"

    def outcome(self, request_id: str) -> str:
        error = self.sent[request_id].replies[0].error
        return "ok" if error is None else error.code

    def tally(self, request_ids: list[str] | None = None) -> Counter[str]:
        return Counter(
            f"{self.sent[r].kind}:{self.outcome(r)}" for r in (request_ids or list(self.sent))
        )


@pytest.fixture
def load(supervised: Supervised) -> Iterator[Load]:
    load = Load(supervised.ports)
    yield load
    load.close()


def _wait_until_gone(sup: Supervised, program: str, old_pid: int) -> None:
    """Until supervisord has seen `old_pid` exit (so its peers have seen its sockets close)."""
    wait_until(lambda: sup.running_pid(program) != old_pid,
               f"{program} {old_pid} gone after kill -9", every_s=0.05)


def _wait_for_restart(sup: Supervised, program: str, old_pid: int, load: Load) -> int:
    """Keep gathering replies until supervisord runs `program` under a new pid; returns it."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        pid = sup.running_pid(program)
        if pid is not None and pid != old_pid:
            return pid
        assert time.monotonic() < deadline, f"{program} not restarted: {sup.status()}"
        load.poll(wait_s=0.2)


def _wait_holding(sup: Supervised, role: str, name: str = "") -> None:
    """Until a process of `role` (called `name`, if given) says it holds requests."""
    wait_for_stats(Path(sup.env["MMLANE_RUN_DIR"]),
                   lambda s: s.role == role and s.name == (name or s.name) and s.in_flight > 0,
                   f"{name or role} holding requests")


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _both(make: object) -> list[str]:
    return [make(fe) for fe in range(FRONTENDS)]  # type: ignore[operator]


# ---------------------------------------------------------------------------- the deploy files


def _dockerfile() -> dict[str, list[str]]:
    """deploy/Dockerfile's instructions by name, each one's arguments in order (continued lines
    joined, comments left out)."""
    instructions: dict[str, list[str]] = {}
    for line in (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, arguments = line.partition(" ")
            instructions.setdefault(name, []).append(arguments.strip())
    return instructions


def _image_env() -> dict[str, str]:
    return dict(item.split("=", 1) for arguments in _dockerfile()["ENV"]
                for item in shlex.split(arguments))


def _image_ports() -> list[int]:
    return [int(port) for arguments in _dockerfile()["EXPOSE"] for port in arguments.split()]


def _image_command() -> Path:
    """The script the image's CMD runs, in this checkout (the image copies deploy/ into its
    WORKDIR)."""
    (workdir,), (command,) = _dockerfile()["WORKDIR"], _dockerfile()["CMD"]
    (script,) = json.loads(command)
    return REPO / Path(script).relative_to(workdir)


def _in_the_image(tmp: Path, **settings: str) -> dict[str, str]:
    """What `docker run -e ...` hands the image's CMD: its ENV with `settings`, the folders
    moved under `tmp` (not /run) and a model named (none is built)."""
    return {**_image_env(), "MMLANE_RUN_DIR": str(tmp / "run"), "MMLANE_LOG_DIR": str(tmp / "log"),
            "MMLANE_HOME": str(tmp), "MMLANE_MODEL": str(tmp / "model"), **settings}


def _run_supervisord(script: Path, env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess:
    """`script` (deploy/run-supervisord) with `env` alone, the supervisord it execs a stand-in
    that prints the environment supervisord would have handed its programs."""
    stand_in = tmp / "bin" / "supervisord"
    stand_in.parent.mkdir(exist_ok=True)
    stand_in.write_text("#!/bin/sh\nexec env -0\n")
    stand_in.chmod(0o755)
    return subprocess.run([str(script)], env={"PATH": f"{stand_in.parent}:{os.environ['PATH']}",
                                              "HOME": str(tmp), **env},
                          capture_output=True, text=True, timeout=60)


def _handed_to_supervisord(run: subprocess.CompletedProcess) -> dict[str, str]:
    """The environment `_run_supervisord`'s stand-in printed."""
    assert run.returncode == 0, run.stderr
    return dict(item.split("=", 1) for item in run.stdout.split("\0") if item)


def _as_environment(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process's MMLANE_* variables become `env`'s (the roles read them for flags not
    given), until the test ends."""
    for name in [name for name in os.environ if name.startswith("MMLANE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("MMLANE_"):
            monkeypatch.setenv(name, value)


def _frontends(env: dict[str, str], run_dir: Path,
               monkeypatch: pytest.MonkeyPatch) -> list[FrontendConfig]:
    """The config of each frontend program of supervisord.conf, its command line expanded in
    `env` (the environment run-supervisord handed supervisord) by supervisor's own config
    reader and built by the CLI in that environment; every other program's command line must
    build too."""
    options = ServerOptions()
    options.environ_expansions = {f"ENV_{name}": value for name, value in env.items()}
    options.configfile = str(DEPLOY / "supervisord.conf")
    options.process_config(do_usage=False)
    _as_environment(monkeypatch, env)
    configs = []
    for group in options.process_group_configs:
        for process in group.process_configs:
            program, role, *argv = shlex.split(process.command)  # as supervisord splits it
            assert program == env["MMLANE_BIN"]
            configs.append(config_from_argv(role, argv, run_dir))
    assert {type(config) for config in configs} == {EngineConfig, MMWorkerConfig, FrontendConfig}
    return [config for config in configs if isinstance(config, FrontendConfig)]


# ---------------------------------------------------------------------------- the tests


def test_the_images_frontends_all_serve_http_on_a_port_it_exposes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's CMD with a key and two frontends: both serve the HTTP API on 0.0.0.0 at the
    one port the image exposes for it, sharing it, with the key."""
    env = _handed_to_supervisord(_run_supervisord(
        _image_command(), _in_the_image(tmp_path, MMLANE_FRONTENDS="2", MMLANE_API_KEY="k1"),
        tmp_path))
    frontends = _frontends(env, tmp_path / "run", monkeypatch)
    assert len(frontends) == 2
    for frontend in frontends:
        assert (frontend.http_host, frontend.http_port) == ("0.0.0.0", 8000)
        assert frontend.http_reuse_port and frontend.api_keys() == ["k1"]
    assert 8000 in _image_ports()


def test_the_image_refuses_to_start_without_a_key_unless_told_insecure_http(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = _run_supervisord(_image_command(), _in_the_image(tmp_path), tmp_path)
    assert (refused.returncode, refused.stdout) == (1, "")  # supervisord never ran
    assert ("the HTTP API on 0.0.0.0:8000 needs API keys: set MMLANE_API_KEY (comma-separated) "
            "or MMLANE_API_KEY_FILE (one key a line), or MMLANE_INSECURE_HTTP=1") in refused.stderr

    env = _handed_to_supervisord(_run_supervisord(
        _image_command(), _in_the_image(tmp_path, MMLANE_INSECURE_HTTP="1"), tmp_path))
    (frontend,) = _frontends(env, tmp_path / "run", monkeypatch)
    assert frontend.insecure_http and frontend.api_keys() == []
    assert (frontend.http_host, frontend.http_port) == ("0.0.0.0", 8000)
    # The frontend judges for itself, whatever started it: without the opt-in, it refuses.
    with pytest.raises(FatalError, match="http_host '0.0.0.0' is not a loopback address"):
        _frontends(env | {"MMLANE_INSECURE_HTTP": ""}, tmp_path / "run", monkeypatch)


def test_run_supervisord_serves_http_on_loopback_from_every_frontend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the image: every frontend (not the first alone) serves the HTTP API, on
    127.0.0.1:8000, shared, with no key needed."""
    env = _handed_to_supervisord(_run_supervisord(DEPLOY / "run-supervisord", {
        "MMLANE_RUN_DIR": str(tmp_path / "run"), "MMLANE_MODEL": str(tmp_path / "model"),
        "MMLANE_FRONTENDS": "3"}, tmp_path))
    frontends = _frontends(env, tmp_path / "run", monkeypatch)
    assert [(f.http_host, f.http_port, f.http_reuse_port) for f in frontends] == [
        ("127.0.0.1", 8000, True)] * 3


def test_k8s_frontend_serves_http_on_its_service_port_with_the_secrets_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/k8s/base/pod.yaml's frontend, in the image's ENV and its own (the Secret's key given):
    the HTTP API on 0.0.0.0 at its `http` containerPort, which the image exposes, the readiness
    probe asks and service.yaml targets; without the Secret's key it refuses to start."""
    pod = yaml.safe_load((DEPLOY / "k8s" / "base" / "pod.yaml").read_text())
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "frontend"]
    secrets = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in container["env"]
               if "valueFrom" in v}
    assert secrets == {"MMLANE_API_KEY": {"name": "mmlane-api-key", "key": "api-key"}}
    values = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    _as_environment(monkeypatch, {**_image_env(), **values, "MMLANE_API_KEY": "k1"})
    frontend = config_from_argv("frontend", container["args"], tmp_path)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert (frontend.http_host, frontend.http_port) == ("0.0.0.0", ports["http"])
    assert frontend.api_keys() == ["k1"] and ports["http"] in _image_ports()
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}

    service = yaml.safe_load((DEPLOY / "k8s" / "base" / "service.yaml").read_text())
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["pod.yaml", "service.yaml"]

    monkeypatch.delenv("MMLANE_API_KEY")
    with pytest.raises(FatalError, match="http_host '0.0.0.0' is not a loopback address"):
        config_from_argv("frontend", container["args"], tmp_path)


def test_no_k8s_overlay_sits_inside_its_base() -> None:
    """Each kustomization's directory resources are outside it and it outside them: kustomize
    refuses an overlay inside its base ("cycle detected"); with kubectl at hand, each builds."""
    kustomizations = sorted((DEPLOY / "k8s").rglob("kustomization.yaml"))
    assert len(kustomizations) == 4
    for path in kustomizations:
        for resource in yaml.safe_load(path.read_text())["resources"]:
            target = (path.parent / resource).resolve()
            if target.is_dir():
                assert not path.parent.resolve().is_relative_to(target), (path, resource)
        if shutil.which("kubectl"):
            subprocess.run(["kubectl", "kustomize", str(path.parent)], check=True,
                           capture_output=True, timeout=60)


def test_k8s_pod_runs_each_role_with_flags_it_has() -> None:
    """Every container of deploy/k8s/base/pod.yaml is a role command line the CLI accepts."""
    pod = yaml.safe_load((DEPLOY / "k8s" / "base" / "pod.yaml").read_text())
    roles = {}
    for container in pod["spec"]["containers"]:
        program, role = container["command"]
        assert program == "mmlane"
        roles[role] = build_parser().parse_args([role, *container["args"]])
    assert set(roles) == {"engine", "mm-worker", "frontend"}
    engine = roles["engine"].engine_endpoint
    assert roles["mm-worker"].engine_endpoint == roles["frontend"].engine_endpoint == engine
    assert roles["frontend"].mm_worker_endpoint == [roles["mm-worker"].mm_worker_endpoint]


def test_k8s_vllm_patch_runs_the_engine_on_vllm_beside_the_same_roles() -> None:
    """deploy/k8s/vllm/ patches containers the base Pod has; its engine args are an engine
    command line the CLI accepts, on the vllm backend, at the base's endpoint."""
    base = yaml.safe_load((DEPLOY / "k8s" / "base" / "pod.yaml").read_text())["spec"]["containers"]
    patch = yaml.safe_load((DEPLOY / "k8s" / "vllm" / "engine.yaml").read_text())
    patched = {container["name"]: container for container in patch["spec"]["containers"]}
    assert set(patched) <= {container["name"] for container in base}
    engine = build_parser().parse_args(["engine", *patched["engine"]["args"]])
    (base_engine,) = [container for container in base if container["name"] == "engine"]
    assert engine.backend == "vllm"
    assert engine.engine_endpoint == build_parser().parse_args(
        ["engine", *base_engine["args"]]).engine_endpoint
    assert "nvidia.com/gpu" in patched["engine"]["resources"]["limits"]


def test_k8s_curve_patch_gives_each_role_its_keys_folder() -> None:
    """deploy/k8s/curve/ gives every container of the base Pod MMLANE_CURVE_KEYS naming a
    mounted folder of its own role's Secret and the public keys."""
    base = yaml.safe_load((DEPLOY / "k8s" / "base" / "pod.yaml").read_text())["spec"]["containers"]
    patch = yaml.safe_load((DEPLOY / "k8s" / "curve" / "keys.yaml").read_text())["spec"]
    volumes = {volume["name"]: volume["projected"]["sources"] for volume in patch["volumes"]}
    for container in patch["containers"]:
        role = container["name"]
        env = {variable["name"]: variable["value"] for variable in container["env"]}
        (mount,) = container["volumeMounts"]
        assert env["MMLANE_CURVE_KEYS"] == mount["mountPath"], role
        assert {"secret": {"name": f"mmlane-{role}-key"}} in volumes[mount["name"]], role
        assert {"configMap": {"name": "mmlane-public-keys"}} in volumes[mount["name"]], role
    assert {c["name"] for c in patch["containers"]} == {c["name"] for c in base}


def _requests_taken(run_dir: Path, name: str) -> int:
    """How many requests the frontend called `name` has taken, as its stats say now."""
    stats = wait_for_stats(run_dir, lambda s: s.name == name, f"{name}'s stats")
    return stats.counters.get("requests", 0)


def test_http_on_the_shared_port_is_answered_by_every_frontend(
    supervised: Supervised, qwen_dir: Path
) -> None:
    """Both frontends listen on MMLANE_HTTP_PORT (SO_REUSEPORT) and the kernel spreads new
    connections over them: requests, each on a connection of its own, reach both frontends,
    and each is answered in full."""
    run_dir = Path(supervised.env["MMLANE_RUN_DIR"])
    names = [f"frontend-{port}" for port in supervised.ports]
    before = {name: _requests_taken(run_dir, name) for name in names}
    chat = urllib.request.Request(
        f"http://127.0.0.1:{supervised.env['MMLANE_HTTP_PORT']}/v1/chat/completions",
        data=json.dumps({"model": qwen_dir.name, "max_tokens": 2, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Content-Type": "application/json"})
    sent = 0
    for _ in range(8):  # rounds of 8: one frontend getting them all is 1 in 128 a round
        for _ in range(8):
            with urllib.request.urlopen(chat, timeout=PATIENCE_S) as response:  # closes it
                reply = json.load(response)
            assert reply["model"] == qwen_dir.name and reply["usage"]["completion_tokens"] == 2
            assert reply["choices"][0]["finish_reason"] == "length", reply
            sent += 1
        taken = {name: _requests_taken(run_dir, name) - before[name] for name in names}
        if all(taken.values()):
            break
    assert all(taken.values()) and sum(taken.values()) == sent, taken


def _assert_ended(load: Load, doomed: list[str], racing: list[str]) -> None:
    """What the killed role held ended with its result or the restart's error, not the timeout;
    what was sent as it died, with either, or with the timeout."""
    for rid in doomed:
        assert load.outcome(rid) in ("ok", "peer_restarted"), load.sent[rid].replies[0].error
    for rid in racing:
        assert load.outcome(rid) in ("ok", "peer_restarted", "timeout"), (
            load.sent[rid].replies[0].error)


def test_mm_worker_killed_under_load(supervised: Supervised, load: Load) -> None:
    old_pid = supervised.running_pid("mm-worker")
    assert old_pid is not None
    # A backlog of large images in the MM worker (made first, then sent at once), text beside it.
    big = [jpeg_uri(2048, 1536, seed) for seed in range(100, 100 + 6 * FRONTENDS)]
    doomed = [load.image(i % FRONTENDS, uri=uri) for i, uri in enumerate(big)]
    doomed += _both(load.text)
    _wait_holding(supervised, "mm-worker")  # the backlog reached the MM worker
    _kill(old_pid)
    killed_at = time.monotonic()
    # Sent as it dies: a job handed to the dying connection is lost with it (ZMQ has no acks),
    # so each of these ends either way: with its result, with the restart's error once the
    # frontend hears from the new process, or (sent as the frontend saw the disconnection)
    # with the request timeout.
    racing = _both(load.image)
    _wait_until_gone(supervised, "mm-worker", old_pid)

    # While it is down: text is served regardless; image jobs wait in the frontends' queues.
    texts_while_down = [rid for _ in range(3) for rid in _both(load.text)]
    waiting = _both(load.image)
    load.wait_for(texts_while_down)
    new_pid = _wait_for_restart(supervised, "mm-worker", old_pid, load)
    load.wait_for(waiting)
    served_again_s = time.monotonic() - killed_at

    after = _both(load.image) + _both(load.text)
    load.settle()
    print(f"mm-worker {old_pid} -> {new_pid}: waiting jobs served {served_again_s:.1f} s after "
          f"the kill; backlog {dict(load.tally(doomed))}, racing {dict(load.tally(racing))}, "
          f"while down {dict(load.tally(texts_while_down + waiting))}, "
          f"after {dict(load.tally(after))}")

    assert all(load.outcome(r) == "ok" for r in texts_while_down), load.tally(texts_while_down)
    first_image_reply = min(load.sent[r].answered_at for r in waiting)  # type: ignore[type-var]
    assert any(load.sent[r].answered_at < first_image_reply for r in texts_while_down), (  # type: ignore[operator]
        "text requests sent while the MM worker was down waited for it"
    )
    assert all(load.outcome(r) == "ok" for r in waiting + after), load.tally(waiting + after)
    _assert_ended(load, doomed, racing)


def test_engine_killed_under_load(supervised: Supervised, load: Load) -> None:
    # Warm the caches with one image, so that after the restart the MM worker's sender cache
    # names an image the new engine never saw: the frontend must resend it (cache miss).
    warm = load.image(0, seed=7)
    load.wait_for([warm])
    assert load.outcome(warm) == "ok"

    old_pid = supervised.running_pid("engine")
    assert old_pid is not None
    doomed = []  # long replies keep the engine decoding when it dies
    for _ in range(3):
        doomed += _both(lambda fe: load.image(fe, max_tokens=48))
        doomed += _both(lambda fe: load.text(fe, max_tokens=48))
    _wait_holding(supervised, "engine")
    _kill(old_pid)
    killed_at = time.monotonic()
    racing = _both(load.text) + _both(load.image)  # lost with the connection, or served
    _wait_until_gone(supervised, "engine", old_pid)

    # While it is down, both lanes queue up in front of it (frontends' and MM worker's queues).
    waiting = _both(load.text) + _both(load.image) + [load.image(1, seed=7)]  # seed 7: cached
    new_pid = _wait_for_restart(supervised, "engine", old_pid, load)
    load.wait_for(waiting)
    served_again_s = time.monotonic() - killed_at

    after = _both(load.text) + _both(load.image)
    load.settle()
    print(f"engine {old_pid} -> {new_pid}: waiting requests served {served_again_s:.1f} s after "
          f"the kill; in flight {dict(load.tally(doomed))}, racing {dict(load.tally(racing))}, "
          f"while down {dict(load.tally(waiting))}, after {dict(load.tally(after))}")

    assert all(load.outcome(r) == "ok" for r in waiting + after), load.tally(waiting + after)
    _assert_ended(load, doomed, racing)
    assert supervised.running_pid("mm-worker") is not None


def test_frontend_killed_under_load(supervised: Supervised, load: Load) -> None:
    victim, other = 0, 1
    program = f"frontend:frontend-{supervised.ports[victim]}"
    old_pid = supervised.running_pid(program)
    assert old_pid is not None
    # Requests in flight in the victim die with it: their client gets no reply (its own timeout
    # ends them), and their late replies reach the restarted frontend, which ignores them.
    with Client(f"tcp://127.0.0.1:{supervised.ports[victim]}") as lost:
        for seed in range(3):
            lost.submit([user_message("What is in it?", [jpeg_uri(320, 240, seed)])],
                        max_tokens=48)
            lost.submit([user_message("Tell me about lanes.")], max_tokens=48)
        before = [load.image(other), load.text(other), load.image(other), load.text(other)]
        _wait_holding(supervised, "frontend", f"frontend-{supervised.ports[victim]}")
        _kill(old_pid)
    killed_at = time.monotonic()
    _wait_until_gone(supervised, program, old_pid)

    # While it is down, the other frontend serves both lanes.
    while_down: list[str] = []
    while (new_pid := supervised.running_pid(program)) in (None, old_pid):
        assert time.monotonic() - killed_at < PATIENCE_S, f"{program} not restarted"
        while_down += [load.text(other), load.image(other)]
        load.poll(wait_s=0.3)
    answered_while_down = [r for r in while_down if load.sent[r].replies]
    restarted_s = time.monotonic() - killed_at

    after = _both(load.text) + _both(load.image)  # the restarted one serves again
    load.settle()
    print(f"frontend {old_pid} -> {new_pid} after {restarted_s:.1f} s; through the other one "
          f"while it was down {dict(load.tally(while_down))} ({len(answered_while_down)} "
          f"answered before the restart), after {dict(load.tally(after))}")

    assert all(load.outcome(r) == "ok" for r in before + while_down + after), load.tally()
    assert answered_while_down, "the other frontend answered nothing while the victim was down"


def test_sigterm_stops_every_role_with_exit_0(supervised: Supervised) -> None:
    """`supervisorctl stop` sends SIGTERM: each role stops gracefully within stopwaitsecs."""
    programs = ["engine", "mm-worker", *(f"frontend:frontend-{p}" for p in supervised.ports)]
    supervised.ctl("stop", *programs)
    log = (supervised.log_dir / "supervisord.log").read_text()
    for program in programs:
        name = program.split(":")[-1]
        assert f"stopped: {name} (exit status 0)" in log, log[-2000:]
