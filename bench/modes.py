"""Each mode's processes: starting them, asking them things, stopping them.

Every mode runs mmlane's real engine, started as `mmlane serve` starts it; the modes differ in
where tokenization and image preprocessing run (see the package docstring). Each mode has its own
processes, started with the launcher's ready handshake, with their sockets in RUN_DIR/MODE and
their logs in RUN_DIR/MODE/logs/ROLE.log.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
from msgspec.structs import replace

from bench.config import BenchConfig
from bench.images import ImageSource
from bench.inproc import (
    ControlReply,
    ControlRequest,
    InProcessConfig,
    job_renderer,
    routed_message,
)
from mmlane.client import user_message
from mmlane.common.config import ipc
from mmlane.common.sockets import free_tcp_port, make_socket
from mmlane.launcher import SERVE_SETTINGS, Child, serve_config, start_roles
from mmlane.mm_worker.jobs import JobRenderer
from mmlane.model import Preprocessor
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import FatalError
from mmlane.protocol.messages import (
    ChatRequest,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    RequestFailed,
)

DESIGNS = {
    "shared": "1 process: one thread pool tokenizes and preprocesses images (+ mmlane engine)",
    "split": "1 process: tokenizer pool + one-thread MM executor (+ mmlane engine)",
    "mmlane": "3 processes: frontend (tokenizer pool), MM worker (FIFO), engine",
}
"""One line per mode: where tokenization and image preprocessing run."""

_PROCESS_NAMES = {"bench-server": "server"}

COMMANDS = {"bench-server": [sys.executable, "-m", "bench", "server"]}
"""The program of each process the bench starts that is not an mmlane role (`start_roles`):
bench/ is not installed, so the child imports it as the bench did, from the checkout it runs
in (the working folder or $PYTHONPATH, both inherited)."""


def serve_roles(
    config: BenchConfig, model_dir: Path, run_dir: Path, port: int
) -> dict[str, msgspec.Struct]:
    """Each role's config exactly as `mmlane serve` builds it (`serve_args` applied)."""
    values = SERVE_SETTINGS.parse([
        "--model", str(model_dir), "--port", str(port), "--run-dir", str(run_dir),
        "--engine-endpoint", ipc("bench-engine", run_dir),
        "--tokenizer-workers", str(config.tokenizer_workers),
        "--max-image-pixels", str(config.max_image_pixels), *config.serve_args,
    ])
    return serve_config(values).roles()


def server_config(
    mode: str, config: BenchConfig, model_dir: Path, run_dir: Path, port: int
) -> InProcessConfig:
    """The in-process server of `mode` (shared or split), in front of the bench's engine."""
    return InProcessConfig(
        mode=mode, model=str(model_dir),  # type: ignore[arg-type]  # checked by the bench config
        engine_endpoint=ipc("bench-engine", run_dir),
        client_endpoint=f"tcp://127.0.0.1:{port}",
        output_endpoint=ipc(f"bench-{mode}-output", run_dir),
        control_endpoint=ipc(f"bench-{mode}-control", run_dir),
        pool_size=config.pool_size, tokenizer_workers=config.tokenizer_workers,
        max_image_pixels=config.max_image_pixels,
    )


@dataclass
class Deployment:
    """One mode's processes (the engine included) and their addresses."""

    mode: str
    client_endpoint: str
    engine_endpoint: str | None
    """None when mmlane was given by address: the bench cannot reach its engine."""
    control_endpoint: str | None
    """The in-process server's control socket (shared, split)."""
    children: list[Child]

    def pids(self) -> dict[str, int]:
        pids = {"bench": os.getpid()}
        for child in self.children:
            pids[_PROCESS_NAMES.get(child.role, child.role)] = child.process.pid
        return pids


@dataclass
class _Group:
    """Processes started together: the engine, one in-process server, or mmlane's other roles."""

    roles: dict[str, msgspec.Struct]
    mode: str | None = None
    port: int = 0


def deploy_all(
    modes: list[str], config: BenchConfig, model_dir: Path, run_dir: Path, children: list[Child]
) -> dict[str, Deployment]:
    """Start every process of the run at once, before anything is measured; wait until each
    is ready. Returns each mode's deployment. Each process started is put on `children` (for
    the caller to stop, also when a failure or a signal ends this early).

    One engine serves every mode, so the model runs in the same process, in the same state, for
    each; a mode's processes idle (a poll every 50-100 ms) while the other modes run. If a
    process fails to start, the error names it, with its log.
    """
    groups = _groups(modes, config, model_dir, run_dir)
    stop = threading.Event()

    def start(name: str, group: _Group) -> list[Child]:  # on a start thread, which no signal ends
        started = start_roles(group.roles, run_dir, config.startup_timeout_s, stop,
                              log_dir=run_dir / "logs" / name, commands=COMMANDS)
        children.extend(started)
        return started

    with ThreadPoolExecutor(max(1, len(groups)), thread_name_prefix="bench-start") as pool:
        try:
            futures = {name: pool.submit(start, name, group) for name, group in groups.items()}
            wait(futures.values())
        finally:  # a signal: the starts give up waiting (the pool waits for them)
            stop.set()
    for name, future in futures.items():
        exc = future.exception()
        if exc is not None:
            logs = "".join(_tail(run_dir / "logs" / name / f"{role}.log")
                           for role in groups[name].roles)
            raise FatalError(f"{name}: {exc}\n{logs}") from exc
    engine = futures["engine"].result() if "engine" in futures else []
    deployments = {}
    for mode in modes:
        if mode == "mmlane" and config.mmlane_endpoint:
            deployments[mode] = Deployment(mode, config.mmlane_endpoint, None, None, [])
            continue
        group = groups[mode]
        control = None if mode == "mmlane" else ipc(f"bench-{mode}-control", run_dir)
        deployments[mode] = Deployment(
            mode, f"tcp://127.0.0.1:{group.port}", ipc("bench-engine", run_dir), control,
            [*engine, *futures[mode].result()],
        )
    return deployments


def _groups(
    modes: list[str], config: BenchConfig, model_dir: Path, run_dir: Path
) -> dict[str, _Group]:
    serve = serve_roles(config, model_dir, run_dir, free_tcp_port())
    groups = {}
    for mode in modes:
        port = free_tcp_port()
        if mode == "mmlane" and not config.mmlane_endpoint:
            roles = serve_roles(config, model_dir, run_dir, port)
            groups[mode] = _Group({"mm-worker": roles["mm-worker"],
                                   "frontend": roles["frontend"]}, mode, port)
        elif mode != "mmlane":
            server = server_config(mode, config, model_dir, run_dir, port)
            groups[mode] = _Group({"bench-server": server}, mode, port)
    if groups:
        groups["engine"] = _Group({"engine": serve["engine"]})
    return groups


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"--- {path.name}\n" + "\n".join(text) + "\n"


class Control:
    """The bench's end of an in-process server's control socket (REQ)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float = 30.0) -> None:
        self._sock = make_socket(ctx, zmq.REQ, endpoint, bind=False, linger_ms=0)
        self._timeout_ms = int(timeout_s * 1000)
        self._decoder = msgspec.msgpack.Decoder(ControlReply)

    def ask(self, request: ControlRequest) -> Any:
        self._sock.send(msgspec.msgpack.encode(request))
        if not self._sock.poll(self._timeout_ms):
            raise FatalError("the in-process server does not answer its control socket")
        return self._decoder.decode(self._sock.recv())

    def close(self) -> None:
        self._sock.close(linger=0)


class EngineCalibration:
    """The idle engine's time from receiving a preprocessed request to its first output.

    Requests of each class are preprocessed once, here, exactly as the servers do it; each mode's
    engine then gets them straight from the bench (no frontend, no MM worker) one at a time, and
    the median of a few sends is that class's service time.
    """

    def __init__(
        self, pre: Preprocessor, text_prompt: str, image_classes: dict[str, list[ImageSource]],
        max_image_pixels: int,
    ) -> None:
        self._codec: Codec[Any] = Codec(FrontendInput)
        renderer = job_renderer(pre, max_image_pixels)
        # Images first: the engine's vision lane runs in arrival order, so the first image's
        # warm-up send also waits out any work a previous mode left in the engine.
        self._requests = {
            name: self._preprocess(pre, renderer, "Describe the image.", sources)
            for name, sources in image_classes.items()
        }
        self._requests["text"] = self._preprocess(pre, renderer, text_prompt, [])

    @staticmethod
    def _preprocess(
        pre: Preprocessor, renderer: JobRenderer, prompt: str, sources: list[ImageSource]
    ) -> EngineRequest:
        """The engine's request for `user_message(prompt, images)`, as every design makes it
        (its request id and reply address are set at each send)."""
        chat = ChatRequest(request_id="", max_tokens=1,
                           messages=[user_message(prompt, [s.data_uri() for s in sources])])
        message = routed_message(pre, chat, "", "")
        return message if isinstance(message, EngineRequest) else renderer.render(message)

    def measure(
        self, ctx: zmq.Context, engine_endpoint: str, run_dir: Path, samples: int = 5
    ) -> dict[str, float]:
        """Milliseconds per class: the median of `samples` sends after one warm-up send."""
        reply_to = ipc("bench-calibration", run_dir)
        with make_socket(ctx, zmq.PULL, reply_to, bind=True, linger_ms=0) as replies, \
                make_socket(ctx, zmq.PUSH, engine_endpoint, bind=False, linger_ms=0) as engine:
            times = {}
            for name in self._requests:
                self._time_one(engine, replies, reply_to, name)  # warm-up
                runs = [self._time_one(engine, replies, reply_to, name) for _ in range(samples)]
                times[name] = statistics.median(runs) * 1000
            return times

    def _time_one(
        self, engine: zmq.Socket, replies: zmq.Socket, reply_to: str, name: str
    ) -> float:
        request_id = f"calibrate-{name}-{time.monotonic_ns()}"
        request = replace(self._requests[name], request_id=request_id, reply_to=reply_to)
        codec = self._codec
        frames = codec.encode(request)
        sent = time.monotonic()
        engine.send_multipart(frames, copy=False)
        while True:
            if not replies.poll(60_000):
                raise FatalError(f"the engine did not answer a calibration request ({name})")
            reply = codec.decode(replies.recv_multipart(copy=False))
            if reply.request_id != request_id:
                continue
            if isinstance(reply, RequestFailed):
                raise FatalError(f"the engine refused a calibration request: {reply.error.message}")
            assert isinstance(reply, EngineOutput)
            return time.monotonic() - sent
