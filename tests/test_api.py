"""What vLLM-class clients expect beyond plain chat: the end-of-sequence options in the HF
runner (in process, the real tiny model), API keys on the HTTP API (a frontend with a stand-in
engine), and `mmlane top` and `stats` in a pipe."""

from __future__ import annotations

import functools
import json
import os
import pty
import select
import shlex
import subprocess
import sys
import termios
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch
from test_engine import load_runner, make_request
from test_http import (
    _answered,
    _assert_error,
    _status_error,
    first_new_token,
    frontend_count,
    frontend_with_silent_engine,
    own_metrics,
)

from conftest import REPO, free_port
from mmlane.cli import EXIT_BROKEN_PIPE, config_from_argv
from mmlane.common.stats import Metrics, StatsServer
from mmlane.engine.hf.runner import HFRunner
from mmlane.model import Preprocessor
from mmlane.protocol.errors import FatalError
from mmlane.protocol.messages import EngineOutput, EngineRequest

# ---------------------------------------------------------------- eos in the HF runner


def _run(runner: HFRunner, request: EngineRequest) -> tuple[list[int], str | None]:
    """The request's tokens and finish reason, run alone to its end."""
    runner.add(0, request)
    tokens, reason = [], None
    while runner.has_work():
        for output in runner.step():
            assert output.error is None, output.error
            tokens += output.token_ids
            reason = output.finish_reason or reason
    return tokens, reason


def test_eos_ends_the_output_unless_ignored_and_never_before_min_tokens(
    qwen_dir: Path, prep: Preprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model never picks its real eos, so the test makes a token it does pick the eos."""
    runner = load_runner(qwen_dir)
    sampled = {"temperature": 1.0, "seed": 11}  # varied tokens, the same on every run
    whole, reason = _run(runner, make_request(prep, "hi", max_tokens=12, **sampled))
    assert reason == "length"
    stop_at = first_new_token(whole)
    eos = whole[stop_at]
    monkeypatch.setattr(runner, "spec", replace(runner.spec, eos_token_ids=frozenset({eos})))

    assert _run(runner, make_request(prep, "hi", max_tokens=12, **sampled)) == (
        whole[:stop_at + 1], "stop")
    assert _run(runner, make_request(prep, "hi", max_tokens=12, ignore_eos=True, **sampled)) == (
        whole, "length")
    later, _ = _run(runner, make_request(prep, "hi", max_tokens=12, min_tokens=stop_at + 2,
                                         **sampled))
    assert len(later) >= stop_at + 2 and eos not in later[:stop_at + 2]


def test_logprobs_are_raw_not_tempered_nor_masked(qwen_dir: Path, prep: Preprocessor) -> None:
    """vLLM's default logprobs come from the model's logits before temperature, top_p and the
    min_tokens mask: so do the HF runner's, for the tokens it sampled."""
    runner = load_runner(qwen_dir)
    request = make_request(prep, "hi", max_tokens=6, temperature=1.7, top_p=0.9, seed=5,
                           min_tokens=6, logprobs=2)
    runner.add(0, request)
    tokens, positions = [], []
    while runner.has_work():
        for output in runner.step():
            tokens += output.token_ids
            positions += output.logprobs or []
    ids = torch.tensor([request.prompt_token_ids + tokens[:-1]], device=runner.model.device)
    with torch.inference_mode():  # the same tokens fed at once: each position's logits
        logits = runner.model(input_ids=ids).logits[0, len(request.prompt_token_ids) - 1:]
    expected = logits.float().log_softmax(-1).cpu()
    assert len(positions) == len(tokens) == 6
    for token, position, row in zip(tokens, positions, expected, strict=True):
        torch.testing.assert_close(torch.tensor(position.logprob), row[token])
        torch.testing.assert_close(torch.tensor(position.top_logprobs), row.topk(2).values)


# ---------------------------------------------------------------- API keys


def _answer(request: EngineRequest) -> EngineOutput:  # the stand-in engine's: one token
    return EngineOutput(request_id=request.request_id, token_ids=[42], finished=True,
                        finish_reason="length", prompt_token_ids=request.prompt_token_ids)


def test_api_keys_guard_every_v1_route_but_not_health_or_metrics(
    run_dir: Path, qwen_dir: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("\nfrom-the-file\n\n")
    hi = {"model": qwen_dir.name, "messages": [{"role": "user", "content": "hi"}]}
    with frontend_with_silent_engine(run_dir, qwen_dir, "--api-key", "k1,k2", "--api-key",
                                     "k3", "--api-key-file", str(key_file)) as (_, base_url,
                                                                                 engine):
        for key in ("k2", "k3", "from-the-file"):
            with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0,
                               timeout=60) as client:
                completion = _answered(
                    engine, functools.partial(client.chat.completions.create, **hi), _answer)
                assert completion.choices[0].finish_reason == "length"
                assert [m.id for m in client.models.list()] == [qwen_dir.name]
        with openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=60) as wrong:
            for stream in (False, True):
                _assert_error(_status_error(wrong, None, stream=stream, **hi), 401,
                              "invalid_api_key", "the API key is not valid")
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        for headers in ({}, {"Authorization": "Basic k1"}, {"Authorization": "Bearer "}):
            status, body = _get(f"{base_url}/models", headers)
            assert status == 401
            assert body["error"] == {
                "message": "no API key: send it as the header `Authorization: Bearer KEY`",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        assert _get(base_url.removesuffix("/v1") + "/health", {}) == (200, {"status": "ok"})
        # /metrics needs no key, as vLLM's: a scraper has none. It counts the 6 refusals above.
        assert frontend_count(own_metrics(base_url), "mmlane_http_refused", "invalid_api_key") == 6


def _get(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_api_keys_from_the_environment_and_a_file(
    run_dir: Path, qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "keys").write_text("f1\n  f2  \n")
    monkeypatch.setenv("MMLANE_API_KEY", "e1,e2")
    config = config_from_argv(
        "frontend", ["--model", str(qwen_dir), "--api-key-file", str(tmp_path / "keys")],
        run_dir)
    assert config.api_keys() == ["e1", "e2", "f1", "f2"]
    monkeypatch.delenv("MMLANE_API_KEY")
    assert config_from_argv("frontend", ["--model", str(qwen_dir)], run_dir).api_keys() == []


@pytest.mark.parametrize(("content", "problem"), [
    (" \n\n", "holds no key"),
    (None, "cannot read"),
])
def test_a_key_file_without_keys_is_refused_at_startup(
    run_dir: Path, qwen_dir: Path, tmp_path: Path, content: str | None, problem: str
) -> None:
    key_file = tmp_path / "keys"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(FatalError, match=f"api_key_file: .*{problem}"):
        config_from_argv("frontend", ["--model", str(qwen_dir), "--api-key-file",
                                      str(key_file)], run_dir)


# ---------------------------------------------------------------- mmlane top


def test_top_once_into_a_closed_pipe_ends_quietly(run_dir: Path) -> None:
    """`mmlane top --once | head`: the reader is gone before top writes (nobody publishes
    on the address, so top waits out --timeout first)."""
    top = subprocess.Popen(
        [sys.executable, "-m", "mmlane.cli", "top", "--once", "--timeout", "0.5",
         "--connect", f"tcp://127.0.0.1:{free_port()}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    top.stdout.close()  # the pipe's only reader
    stderr = top.stderr.read().decode()
    assert top.wait(timeout=60) == EXIT_BROKEN_PIPE, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_top_into_head_prints_plain_views_and_ends_with_the_status_of_a_broken_pipe(
    run_dir: Path,
) -> None:
    """`mmlane top | head -3`, in a real shell pipe: not a terminal, so top prints its view as
    plain text every interval, until a view finds the pipe closed."""
    server = StatsServer(Metrics("engine", "watched"), interval_s=0.05,
                         stats_endpoint=f"ipc://{run_dir}/stats-watched.sock",
                         control_endpoint=f"ipc://{run_dir}/control-watched.sock").start()
    top = [sys.executable, "-m", "mmlane.cli", "top", "--interval", "0.2",
           "--connect", server.stats_endpoint]
    try:
        piped = subprocess.run(["bash", "-o", "pipefail", "-c", f"{shlex.join(top)} | head -3"],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        server.close()
    assert piped.returncode == EXIT_BROKEN_PIPE, piped.stderr
    assert piped.stdout.count("\n") == 3 and "mmlane top" in piped.stdout, piped.stdout
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr


def test_q_quits_the_live_view_in_a_terminal(run_dir: Path) -> None:
    """`mmlane top` in a terminal (a pty): the live view, until the key `q` ends it with 0,
    leaving the terminal's mode as it found it."""
    server = StatsServer(Metrics("engine", "live"), interval_s=0.05,
                         stats_endpoint=f"ipc://{run_dir}/stats-live.sock",
                         control_endpoint=f"ipc://{run_dir}/control-live.sock").start()
    controller, terminal = pty.openpty()
    mode = termios.tcgetattr(terminal)
    top = subprocess.Popen(
        [sys.executable, "-m", "mmlane.cli", "top", "--interval", "0.2",
         "--connect", server.stats_endpoint],
        cwd=REPO, stdin=terminal, stdout=terminal, stderr=terminal)
    try:
        shown = b""
        while b"mmlane top" not in shown:  # the view is up (and the terminal in cbreak mode)
            assert select.select([controller], [], [], 60)[0], shown
            shown += os.read(controller, 65536)
        os.write(controller, b"q")
        assert top.wait(timeout=30) == 0
        assert termios.tcgetattr(terminal) == mode
    finally:
        top.kill()
        top.wait()
        server.close()
        os.close(controller)
        os.close(terminal)


def test_stats_into_head_ends_quietly_with_the_status_of_a_broken_pipe(run_dir: Path) -> None:
    """`mmlane stats | head -1`, in a real shell pipe: stats prints a line per snapshot until
    its next line finds the pipe closed (head is gone after the first)."""
    server = StatsServer(Metrics("engine", "piped"), interval_s=0.05,
                         stats_endpoint=f"ipc://{run_dir}/stats-piped.sock",
                         control_endpoint=f"ipc://{run_dir}/control-piped.sock").start()
    stats = [sys.executable, "-m", "mmlane.cli", "stats", "--connect", server.stats_endpoint]
    try:
        piped = subprocess.run(["bash", "-o", "pipefail", "-c", f"{shlex.join(stats)} | head -1"],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        server.close()
    assert piped.returncode == EXIT_BROKEN_PIPE, piped.stderr  # head's 0 would be the last
    assert " engine piped pid " in piped.stdout and piped.stdout.count("\n") == 1, piped.stdout
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr
