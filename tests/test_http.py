"""The OpenAI-compatible HTTP API, end to end through `mmlane serve`, with the `openai` client.

Images by URL come from a loopback server, allowed here by --allow-http-media and
--allow-internal-media; nothing connects anywhere but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import http.client
import itertools
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import openai
import pytest
import zmq
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from test_detokenize import split_stop

from bench.images import make_image, png_uri
from conftest import REPO, free_port, role_log, start_role, stop_role
from image_server import ImageServer
from mmlane.client import ChatResult, Client, user_message
from mmlane.frontend.http_api import Choice, Choices, parallel_requests
from mmlane.launcher import Child
from mmlane.model import Preprocessor
from mmlane.protocol.errors import ErrorInfo, FatalError
from mmlane.protocol.messages import (
    AbortRequests,
    ChatError,
    ChatOutput,
    ChatRequest,
    EngineOutput,
    EngineRequest,
    RequestFailed,
    TokenLogprobs,
)
from peers import StandInEngine, wait_for_stats, wait_until

FETCH_TIMEOUT_S = 3.0
MAX_BODY_BYTES = 4_000_000


@dataclass
class Server:
    base_url: str
    model: str
    log_path: Path
    process: subprocess.Popen
    client_endpoint: str
    """The native client API, which answers with token ids."""
    run_dir: Path
    """Where its processes' stats and control sockets are."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def serve_http(run_dir: Path, model_dir: Path, *args: str) -> Iterator[Server]:
    """`mmlane serve` with its HTTP API (ARGS added), answering /health; stopped with SIGTERM."""
    http_port, port = free_port(), free_port()
    log_path = run_dir / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "mmlane.cli", "serve", "--model", str(model_dir),
             "--port", str(port), "--http-port", str(http_port),
             "--run-dir", str(run_dir / "run"), *args],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        )
    served = Server(f"http://127.0.0.1:{http_port}/v1", model_dir.name, log_path, process,
                    f"tcp://127.0.0.1:{port}", run_dir / "run")

    def healthy() -> bool:
        assert process.poll() is None, f"serve exited: {served.log()}"
        return _healthy(http_port)

    try:
        wait_until(healthy, "serve answering /health", timeout_s=180)
        yield served
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, served.log()


@pytest.fixture(scope="module")
def server(module_run_dir: Path, qwen_dir: Path) -> Iterator[Server]:
    with serve_http(
        module_run_dir, qwen_dir, "--max-images-per-request", "2", "--allow-http-media",
        "--allow-internal-media", "--max-image-bytes", "1000000",
        "--media-fetch-timeout", str(FETCH_TIMEOUT_S), "--media-fetch-retries", "0",
        "--http-max-body-bytes", str(MAX_BODY_BYTES),
    ) as served:
        yield served


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def user(text: str, *image_urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}
                                   for url in image_urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def chat(client: openai.OpenAI, server: Server, messages: list[dict[str, Any]],
         **kw: Any) -> Any:
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=server.model, messages=messages, **kw)


def streamed(client: openai.OpenAI, server: Server, messages: list[dict[str, Any]],
             **kw: Any) -> tuple[str, list[Any]]:
    chunks = list(chat(client, server, messages, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def usage_and_reason(chunks: list[Any]) -> tuple[Any, str]:
    """A streamed answer's usage (its last chunk, with stream_options.include_usage) and the
    finish reason of its one choice."""
    reason = next(c.choices[0].finish_reason for c in chunks
                  if c.choices and c.choices[0].finish_reason)
    return chunks[-1].usage, reason


# ---------------------------------------------------------------- answers


class TestAnswers:
    def test_models_lists_the_served_model(self, client: openai.OpenAI, server: Server) -> None:
        assert [m.id for m in client.models.list()] == [server.model]

    def test_text_chat(self, client: openai.OpenAI, server: Server) -> None:
        completion = chat(client, server, [{"role": "user", "content": "Hello there"}])
        [choice] = completion.choices
        assert completion.object == "chat.completion"
        assert completion.model == server.model
        assert choice.message.role == "assistant"
        assert isinstance(choice.message.content, str) and choice.message.content
        assert choice.finish_reason in ("stop", "length")
        assert completion.usage is not None
        assert completion.usage.completion_tokens <= 6
        assert completion.usage.total_tokens == (
            completion.usage.prompt_tokens + completion.usage.completion_tokens
        )

    def test_streaming_gives_the_same_text_in_chunks(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Tell me about lanes."}]
        whole = chat(client, server, messages).choices[0].message.content
        text, chunks = streamed(client, server, messages,
                                stream_options={"include_usage": True})
        assert text == whole
        assert chunks[0].choices[0].delta.role == "assistant"
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6
        assert len({c.id for c in chunks}) == 1

    def test_stream_ends_with_done(self, server: Server) -> None:
        body = {"model": server.model, "stream": True, "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}
        events = _post(server, body)[1].decode().strip().split("\n\n")
        assert events[-1] == "data: [DONE]"
        assert all(e.startswith("data: {") for e in events[:-1])

    def test_image_by_data_uri(self, client: openai.OpenAI, server: Server) -> None:
        image = png_uri(make_image(64, 48, seed=3))
        completion = chat(client, server, user("What is in it?", image))
        assert completion.choices[0].message.content
        text_only = chat(client, server, user("What is in it?"))
        assert completion.usage.prompt_tokens > text_only.usage.prompt_tokens  # image tokens

    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_image_by_url(self, client: openai.OpenAI, server: Server,
                          image_server: ImageServer, stream: bool) -> None:
        url = image_server.url("/image.png")
        if stream:
            text, _ = streamed(client, server, user("Describe it.", url))
        else:
            text = chat(client, server, user("Describe it.", url)).choices[0].message.content
        assert text

    def test_health(self, server: Server) -> None:
        with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/health") as r:
            assert (r.status, json.load(r)) == (200, {"status": "ok"})


# ---------------------------------------------------------------- vLLM's sampling fields


SEEDED = {"temperature": 1.0, "seed": 11}
"""Seeded sampling: the same tokens on every run, and not one token over and over, as the tiny
model's greedy replies can be."""


def seeded_ids(server: Server, text: str, **sampling: Any) -> ChatResult:
    """The seeded reply to `text`, by the native client (which answers with token ids)."""
    with Client(server.client_endpoint, timeout_s=120) as native:
        return native.chat([user_message(text)], **SEEDED, **sampling)


def greedy_ids(server: Server, text: str, **sampling: Any) -> ChatResult:
    """The greedy reply to `text`, by the native client."""
    with Client(server.client_endpoint, timeout_s=120) as native:
        return native.chat([user_message(text)], temperature=0.0, **sampling)


def first_new_token(token_ids: list[int]) -> int:
    """The index of the first token (after the first) not seen before it in `token_ids`."""
    return next(i for i in range(1, len(token_ids)) if token_ids[i] not in token_ids[:i])


class TestSampling:
    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_ignore_eos_gives_exactly_max_tokens(
        self, client: openai.OpenAI, server: Server, stream: bool
    ) -> None:
        messages = [{"role": "user", "content": "Say nothing."}]
        kw = {"max_tokens": 40, "extra_body": {"ignore_eos": True}}
        if stream:
            _, chunks = streamed(client, server, messages, stream_options={"include_usage": True},
                                 **kw)
            usage, reason = usage_and_reason(chunks)
        else:
            completion = chat(client, server, messages, **kw)
            usage, reason = completion.usage, completion.choices[0].finish_reason
        assert (usage.completion_tokens, reason) == (40, "length")

    def test_ignore_eos_over_raw_http(self, server: Server) -> None:
        body = {"model": server.model, "max_tokens": 25, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}]}
        status, raw = _post(server, body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 25

    def test_a_stop_token_ends_the_reply_and_is_included(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        whole = seeded_ids(server, "Count the lanes.", max_tokens=12, ignore_eos=True).token_ids
        stop_at = first_new_token(whole)
        stopped = seeded_ids(server, "Count the lanes.", max_tokens=12,
                             stop_token_ids=[whole[stop_at]])
        assert (stopped.token_ids, stopped.finish_reason) == (whole[:stop_at + 1], "stop")
        before_stop = seeded_ids(server, "Count the lanes.", max_tokens=stop_at, ignore_eos=True)
        assert stopped.text == before_stop.text  # the stop token adds no text, as in vLLM

        completion = chat(client, server, user("Count the lanes."), max_tokens=12, **SEEDED,
                          extra_body={"stop_token_ids": [whole[stop_at]]})
        assert completion.usage.completion_tokens == stop_at + 1
        assert completion.choices[0].finish_reason == "stop"
        assert completion.choices[0].message.content == before_stop.text

    def test_no_stop_token_before_min_tokens(self, server: Server) -> None:
        first = seeded_ids(server, "Count the lanes.", max_tokens=1).token_ids[0]
        reply = seeded_ids(server, "Count the lanes.", max_tokens=8, min_tokens=4,
                           stop_token_ids=[first])
        assert len(reply.token_ids) >= 4
        assert first not in reply.token_ids[:4]
        assert reply.token_ids[-1] == first or len(reply.token_ids) == 8

    def test_a_logit_bias_forces_its_token(self, client: openai.OpenAI, server: Server) -> None:
        seeded = seeded_ids(server, "Count the lanes.", max_tokens=12, ignore_eos=True).token_ids
        token = seeded[first_new_token(seeded)]  # a token greedy would not pick
        forced = greedy_ids(server, "Count the lanes.", max_tokens=4, ignore_eos=True,
                            logit_bias={token: 100.0})
        assert forced.token_ids == [token] * 4
        completion = chat(client, server, user("Count the lanes."), max_tokens=4,
                          logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
        assert completion.choices[0].message.content == forced.text

    def test_a_repetition_penalty_breaks_greedy_repeats(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        plain = greedy_ids(server, "Count the lanes.", max_tokens=8, ignore_eos=True)
        assert len(set(plain.token_ids)) == 1  # the tiny model repeats its greedy token
        penalised = greedy_ids(server, "Count the lanes.", max_tokens=8, ignore_eos=True,
                               repetition_penalty=2.0)
        assert len(set(penalised.token_ids)) > 1
        completion = chat(client, server, user("Count the lanes."), max_tokens=8,
                          extra_body={"ignore_eos": True, "repetition_penalty": 2.0})
        assert completion.choices[0].message.content == penalised.text

    def test_presence_and_frequency_penalties_pass_through(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        penalised = greedy_ids(server, "Count the lanes.", max_tokens=8, ignore_eos=True,
                               frequency_penalty=2.0, presence_penalty=1.0)
        assert len(set(penalised.token_ids)) > 1
        completion = chat(client, server, user("Count the lanes."), max_tokens=8,
                          frequency_penalty=2.0, presence_penalty=1.0,
                          extra_body={"ignore_eos": True})
        assert completion.choices[0].message.content == penalised.text


SCHEMAS = {
    "object": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 10},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "enum": {"enum": ["red", "green", "blue"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 1, "maxItems": 4},
}
"""Schemas whose every value is bounded: the tiny model's random text fills what a grammar
leaves open (an unbounded string) until max_tokens."""


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema,
                                                   "strict": True}}


class TestStructuredOutput:
    @pytest.mark.parametrize("name", list(SCHEMAS))
    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_the_reply_parses_and_matches_the_schema(
        self, client: openai.OpenAI, server: Server, name: str, stream: bool
    ) -> None:
        fields = {"max_tokens": 60, "response_format": json_schema(SCHEMAS[name])}
        if stream:
            text, chunks = streamed(client, server, user("Describe a lane."), **fields)
            _, reason = usage_and_reason(chunks)
        else:
            choice = chat(client, server, user("Describe a lane."), **fields).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        assert reason == "stop"  # the grammar ended the reply, not max_tokens
        jsonschema.validate(json.loads(text), SCHEMAS[name])

    def test_json_object_gives_a_json_object(self, client: openai.OpenAI, server: Server,
                                             prep: Preprocessor) -> None:
        # Within a string the tiny model's random text goes on to max_tokens: a bias on the
        # quote and the closing brace lets its objects end (the grammar still decides).
        ends = {str(prep.tokenizer.convert_tokens_to_ids(t)): 10 for t in ('"', "}")}
        completion = chat(client, server, user("Describe a lane."), max_tokens=60,
                          response_format={"type": "json_object"}, logit_bias=ends)
        assert isinstance(json.loads(completion.choices[0].message.content), dict)

    @pytest.mark.parametrize(("response_format", "pattern"), [
        (json_schema({"type": "strin"}), "response_format: the JSON schema cannot be used: "
                                         "Invalid type: strin"),
        (json_schema({"properties": {"a": {"minimum": "x"}}}), "response_format: the JSON "
                                                               "schema cannot be used"),
        ({"type": "json_schema", "json_schema": {"name": "reply"}},
         "response_format: json_schema.schema must be a JSON schema object"),
        ({"type": "yaml"}, "response_format: type must be 'text', 'json_object' or "
                           "'json_schema', got 'yaml'"),
    ], ids=["bad-type", "bad-minimum", "no-schema", "unknown-type"])
    def test_a_bad_response_format_is_a_400_naming_it(
        self, client: openai.OpenAI, server: Server, response_format: dict[str, Any],
        pattern: str,
    ) -> None:
        error = _status_error(client, server, response_format=response_format)
        _assert_error(error, 400, "invalid_request", pattern)
        assert error.response.json()["error"]["param"] == "response_format"
        assert chat(client, server, user("hi")).choices[0].finish_reason  # it serves on

    def test_text_is_the_default(self, client: openai.OpenAI, server: Server) -> None:
        plain = chat(client, server, user("hi"))
        as_text = chat(client, server, user("hi"), response_format={"type": "text"})
        assert as_text.choices[0].message.content == plain.choices[0].message.content

    @pytest.mark.parametrize(("fields", "matches"), [
        ({"structured_outputs": {"regex": "(lane|road)-[0-9]{2}"}},
         lambda text: re.fullmatch("(lane|road)-[0-9]{2}", text)),
        ({"guided_regex": "[ab]{3}"}, lambda text: re.fullmatch("[ab]{3}", text)),
        ({"structured_outputs": {"choice": ["north", "south", "east"]}},
         lambda text: text in ("north", "south", "east")),
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'start: "go " DIR\nDIR: "left" | "right"'}},
         lambda text: text in ("go left", "go right")),
        ({"guided_grammar": 'root ::= "a" ("b" | "c") "d"'},
         lambda text: text in ("abd", "acd")),
        ({"guided_json": {"type": "boolean"}}, lambda text: text in ("true", "false")),
    ], ids=["regex", "guided-regex", "choice", "guided-choice", "lark", "gbnf", "guided-json"])
    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_vllm_constraints_shape_the_reply(
        self, client: openai.OpenAI, server: Server, fields: dict[str, Any],
        matches: Callable[[str], Any], stream: bool,
    ) -> None:
        """vLLM's structured_outputs (regex, choice, a Lark or GBNF grammar) and its older
        guided_* fields, as the openai client sends them (extra_body)."""
        if stream:
            text, chunks = streamed(client, server, user("Where to?"), max_tokens=40,
                                    extra_body=fields)
            _, reason = usage_and_reason(chunks)
        else:
            choice = chat(client, server, user("Where to?"), max_tokens=40,
                          extra_body=fields).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        assert matches(text), text
        assert reason == "stop"  # each form is finite: the grammar ended the reply

    @pytest.mark.parametrize(("fields", "param", "pattern"), [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs",
         "structured_outputs: the regex cannot be used: .*invalid regex"),
        ({"guided_regex": "("}, "guided_regex", "guided_regex: the regex cannot be used"),
        ({"guided_grammar": "start: ???"}, "guided_grammar", "guided_grammar: the grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs",
         "choice must hold at least one text"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "set exactly one of .* got regex, choice"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs",
         "structural_tag not supported by this server"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "only one of response_format, guided_regex may be set"),
        ({"structured_outputs": "a"}, "structured_outputs", "must be an object"),
    ], ids=["bad-regex", "bad-guided-regex", "bad-grammar", "no-choice", "two-kinds",
            "structural-tag", "two-fields", "not-an-object"])
    def test_a_bad_constraint_is_a_400_naming_the_field_sent(
        self, client: openai.OpenAI, server: Server, fields: dict[str, Any], param: str,
        pattern: str,
    ) -> None:
        error = _status_error(client, server, extra_body=fields)
        _assert_error(error, 400, "invalid_request", pattern)
        assert error.response.json()["error"]["param"] == param


# ---------------------------------------------------------------- /tokenize and /detokenize


def _post_json(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _root(base_url: str) -> str:
    return base_url.removesuffix("/v1")


class TestTokenize:
    def test_a_chat_tokenizes_to_the_prompt_the_model_gets(
        self, client: openai.OpenAI, server: Server, prep: Preprocessor
    ) -> None:
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Tell me about lanes."}]
        status, body = _post_json(f"{_root(server.base_url)}/tokenize",
                                  {"model": server.model, "messages": messages})
        assert status == 200, body
        assert body["tokens"] == prep.tokenize_batch([prep.render_prompt(messages)])[0]
        assert body["count"] == len(body["tokens"]) == \
            chat(client, server, messages).usage.prompt_tokens
        assert (body["max_model_len"], body["token_strs"]) == (prep.max_context, None)
        _, bare = _post_json(f"{_root(server.base_url)}/tokenize",
                             {"messages": messages, "add_generation_prompt": False})
        assert bare["tokens"] == body["tokens"][:bare["count"]] and bare["count"] < body["count"]

    def test_a_text_and_back(self, server: Server, prep: Preprocessor) -> None:
        text = "Lanes, wide and narrow: 12 of them."
        root = _root(server.base_url)
        assert _post_json(f"{root}/tokenize", {"prompt": text})[1]["tokens"] == \
            prep.tokenizer(text)["input_ids"]
        _, plain = _post_json(f"{root}/tokenize", {"prompt": text, "add_special_tokens": False,
                                                   "return_token_strs": True})
        assert plain["token_strs"] == prep.tokenizer.convert_ids_to_tokens(plain["tokens"])
        assert _post_json(f"{root}/detokenize", {"tokens": plain["tokens"]}) == \
            (200, {"prompt": text})

    @pytest.mark.parametrize(("path", "body", "status", "param", "pattern"), [
        ("/tokenize", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         400, "messages", "images cannot be tokenized here"),
        ("/tokenize", {"prompt": [99999999]}, 400, "prompt", "outside the vocabulary"),
        ("/tokenize", {}, 400, "prompt", "prompt: a text or a list of token ids is required"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens",
         "must be a boolean"),
        ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model", "'gpt-9' does not exist"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens", "a list of token ids is required"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "tokens: token id -1 is outside"),
    ], ids=["image", "bad-id", "no-prompt", "bad-flag", "unknown-model", "not-ids", "bad-id-back"])
    def test_bad_bodies_are_openai_errors(self, server: Server, path: str, body: Any,
                                          status: int, param: str, pattern: str) -> None:
        answer, reply = _post_json(_root(server.base_url) + path, body)
        assert answer == status, reply
        assert re.search(pattern, reply["error"]["message"]), reply
        assert reply["error"]["param"] == param


# ---------------------------------------------------------------- the render API


class TestRender:
    def test_a_chat_renders_to_the_prompt_and_sampling_the_model_would_get(
        self, server: Server, prep: Preprocessor
    ) -> None:
        messages = [{"role": "user", "content": "Tell me about lanes."}]
        status, rendered = _post_json(f"{server.base_url}/chat/completions/render",
                                      {"messages": messages, "max_tokens": 7,
                                       "temperature": 0.5, "seed": 3})
        assert status == 200, rendered
        assert rendered["token_ids"] == prep.tokenize_batch([prep.render_prompt(messages)])[0]
        sampling = rendered["sampling_params"]
        assert (sampling["max_tokens"], sampling["temperature"], sampling["seed"]) == (7, 0.5, 3)
        assert "features" not in rendered
        status, completions = _post_json(f"{server.base_url}/completions/render",
                                         {"prompt": "Lanes", "max_tokens": 2})
        assert status == 200 and len(completions) == 1, completions
        assert completions[0]["token_ids"] == prep.tokenize_text("Lanes")

    def test_an_image_renders_with_its_features_whole_also_from_the_cache(
        self, server: Server, prep: Preprocessor
    ) -> None:
        """The image's hash, its placeholder range over its tokens, and its item (uint8 pixels
        in the model's layout), the same when the MM worker sent it as a cached hash."""
        messages = user("What is in it?", png_uri(make_image(64, 48, seed=21)))
        renders = [_post_json(f"{server.base_url}/chat/completions/render",
                              {"messages": messages})[1] for _ in range(2)]
        first, again = renders
        assert first["features"] == again["features"] and first["token_ids"] == again[
            "token_ids"]
        features = first["features"]
        [placeholder] = features["mm_placeholders"]["image"]
        span = first["token_ids"][placeholder["offset"]:][:placeholder["length"]]
        assert span == [prep.image_token_id] * placeholder["length"]
        [item] = features["kwargs_data"]["image"]
        decoded = msgspec.msgpack.decode(base64.b64decode(item))
        assert set(decoded) == {"pixel_values", "image_grid_thw"}
        dtype, shape, _ = decoded["pixel_values"]["data"]
        assert dtype == "uint8" and shape[0] == placeholder["length"] * 4  # 2x2 merged patches
        assert len(features["mm_hashes"]["image"][0]) > 8

    @pytest.mark.parametrize("route", ["chat/completions", "completions"])
    def test_n_choices_render_as_one_request_for_n(self, server: Server, route: str) -> None:
        """As vLLM's render: one GenerateRequest whose sampling asks for the choices (vLLM
        samples them, each with seed + its index), the same as the render of one otherwise."""
        prompt = ({"messages": [{"role": "user", "content": "Tell me about lanes."}]}
                  if route == "chat/completions" else {"prompt": "Lanes"})
        renders = [_post_json(f"{server.base_url}/{route}/render",
                              {**prompt, "max_tokens": 3, "seed": 5, **n})
                   for n in ({}, {"n": 3})]
        assert all(status == 200 for status, _ in renders), renders
        one, three = (render if route == "chat/completions" else render[0]
                      for _, render in renders)
        assert "n" not in one["sampling_params"] and three["sampling_params"]["n"] == 3
        del three["sampling_params"]["n"], three["request_id"], one["request_id"]
        assert three == one

    @pytest.mark.parametrize(("body", "status", "pattern"), [
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n: must be an int"),
        ({"messages": []}, 400, "messages: a non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ], ids=["no-choices", "no-messages", "bad-sampling"])
    def test_bad_renders_are_openai_errors(self, server: Server, body: dict[str, Any],
                                           status: int, pattern: str) -> None:
        answer, reply = _post_json(f"{server.base_url}/chat/completions/render", body)
        assert answer == status and re.search(pattern, reply["error"]["message"]), reply


# ---------------------------------------------------------------- logprobs


def logprobs_content(choice: Any) -> list[dict[str, Any]]:
    """A choice's (or a chunk's choice's) logprobs content as plain dicts."""
    return [entry.model_dump() for entry in choice.logprobs.content]


class TestLogprobs:
    @pytest.mark.parametrize("images", [0, 1], ids=["text", "image"])
    def test_logprobs_in_openai_shape(self, client: openai.OpenAI, server: Server,
                                      images: int) -> None:
        messages = user("Hello there", *[png_uri(make_image(40, 30, seed=5))] * images)
        completion = chat(client, server, messages, max_tokens=8, logprobs=True, top_logprobs=3)
        [choice] = completion.choices
        content = logprobs_content(choice)
        assert len(content) == completion.usage.completion_tokens
        for entry in content:
            assert entry["bytes"] == list(entry["token"].encode())
            assert entry["logprob"] <= 0
            top = entry["top_logprobs"]
            assert len(top) == 3
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top),
                                                         reverse=True)
            assert top[0] == {k: entry[k] for k in ("token", "logprob", "bytes")}  # greedy

    def test_no_logprobs_unless_asked_and_none_on_top_without_top_logprobs(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        assert chat(client, server, user("Hello there")).choices[0].logprobs is None
        content = logprobs_content(chat(client, server, user("Hello there"),
                                        logprobs=True).choices[0])
        assert content and all(entry["top_logprobs"] == [] for entry in content)

    def test_streamed_logprobs_are_the_complete_ones(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        kw = {"max_tokens": 8, "logprobs": True, "top_logprobs": 2}
        whole = logprobs_content(chat(client, server, user("Tell me about lanes."),
                                      **kw).choices[0])
        _, chunks = streamed(client, server, user("Tell me about lanes."), **kw)
        pieces = [logprobs_content(c.choices[0]) for c in chunks
                  if c.choices and c.choices[0].logprobs is not None]
        assert [entry for piece in pieces for entry in piece] == whole
        assert all(len(piece) == 1 for piece in pieces)  # one token per chunk, text or not

    def test_raw_http_shape(self, server: Server) -> None:
        body = {"model": server.model, "max_tokens": 3, "ignore_eos": True, "logprobs": True,
                "top_logprobs": 2, "messages": [{"role": "user", "content": "hi"}]}
        status, raw = _post(server, body)
        assert status == 200, raw
        logprobs = json.loads(raw)["choices"][0]["logprobs"]
        assert set(logprobs) == {"content"} and len(logprobs["content"]) == 3
        for entry in logprobs["content"]:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert all(set(top) == {"token", "logprob", "bytes"} for top in entry["top_logprobs"])

    def test_sampled_tokens_come_first_as_in_vllm_and_texts_are_decoded_alone(
        self, client: openai.OpenAI, server: Server, prep: Preprocessor
    ) -> None:
        native = seeded_ids(server, "Count the lanes.", max_tokens=10, logprobs=3)
        assert native.logprobs is not None and len(native.logprobs) == len(native.token_ids)
        completion = chat(client, server, user("Count the lanes."), max_tokens=10, **SEEDED,
                          logprobs=True, top_logprobs=3)
        content = logprobs_content(completion.choices[0])
        for token_id, position, entry in zip(native.token_ids, native.logprobs, content,
                                             strict=True):
            assert position.sampled.token_id == token_id
            alone = prep.tokenizer.decode([token_id])
            if not alone.endswith("\ufffd"):
                assert position.sampled.token == entry["token"] == alone
            assert position.top == sorted(position.top, key=lambda t: -t.logprob)
            others = [t for t in position.top if t.token_id != token_id]
            assert [t["token"] for t in entry["top_logprobs"]] == [
                t.token for t in [position.sampled, *others][:3]]


# ---------------------------------------------------------------- stop strings


STOP_PROMPT = "Count the lanes."


def inner_stop(prep: Preprocessor, token_ids: list[int]) -> tuple[str, int]:
    """A stop string inside one token of this output (its text without the first and last
    character), and the number of tokens through that one: the first such token whose string
    does not occur earlier in the output's text."""
    texts = [prep.decode([token]) for token in token_ids]
    for index, text in enumerate(texts):
        inner, before = text[1:-1], "".join(texts[:index]) + text[0]
        if inner.strip() and "\ufffd" not in text and (before + inner).find(inner) == len(before):
            return inner, index + 1
    raise AssertionError(f"no token of three characters or more in {texts}")


@pytest.fixture(scope="module")
def stops(server: Server, prep: Preprocessor) -> dict[str, tuple[str, int, str]]:
    """For a seeded reply: a stop string inside one token and one split across two, each with
    the number of tokens through the one that completes it and the text before it."""
    whole = seeded_ids(server, STOP_PROMPT, max_tokens=16, ignore_eos=True)
    found = {"inside": inner_stop(prep, whole.token_ids),
             "split": split_stop(prep, whole.token_ids)}
    return {kind: (stop, through, whole.text[:whole.text.index(stop)])
            for kind, (stop, through) in found.items()}


class TestStop:
    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    @pytest.mark.parametrize("kind", ["inside", "split"])
    def test_the_text_ends_before_the_stop_string(
        self, client: openai.OpenAI, server: Server, stops: dict, kind: str, stream: bool
    ) -> None:
        stop, through, before = stops[kind]
        kw = {"max_tokens": 16, "stop": [stop, "never said"], "extra_body": {"ignore_eos": True},
              **SEEDED}
        if stream:
            text, chunks = streamed(client, server, user(STOP_PROMPT),
                                    stream_options={"include_usage": True}, **kw)
            usage = chunks[-1].usage
            [reason] = [c.choices[0].finish_reason for c in chunks
                        if c.choices and c.choices[0].finish_reason]
        else:
            completion = chat(client, server, user(STOP_PROMPT), **kw)
            text, usage = completion.choices[0].message.content, completion.usage
            reason = completion.choices[0].finish_reason
        assert (text, reason, usage.completion_tokens) == (before, "stop", through)

    def test_over_raw_http_and_the_native_api(
        self, server: Server, stops: dict
    ) -> None:
        stop, through, before = stops["split"]
        body = {"model": server.model, "stream": True, "max_tokens": 16, "ignore_eos": True,
                "stop": stop, "messages": user(STOP_PROMPT), **SEEDED}
        status, raw = _post(server, body)
        assert status == 200, raw
        events = [json.loads(e.removeprefix("data: "))
                  for e in raw.decode().strip().split("\n\n")[:-1]]
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == before
        assert events[-1]["choices"][0]["finish_reason"] == "stop"

        native = seeded_ids(server, STOP_PROMPT, max_tokens=16, ignore_eos=True, stop=[stop])
        whole = seeded_ids(server, STOP_PROMPT, max_tokens=16, ignore_eos=True)
        assert (native.text, native.finish_reason) == (before, "stop")
        assert native.token_ids == whole.token_ids[:through]


# ---------------------------------------------------------------- n choices


class TestChoices:
    def test_n_seeded_choices_are_the_replies_to_seed_plus_index(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        """As vLLM's parallel sampling: choice i samples with seed + i."""
        singles = [chat(client, server, user(STOP_PROMPT), max_tokens=8, temperature=1.0,
                        seed=11 + index) for index in range(3)]
        completion = chat(client, server, user(STOP_PROMPT), max_tokens=8, n=3, **SEEDED)
        assert [c.index for c in completion.choices] == [0, 1, 2]
        assert [c.message.content for c in completion.choices] == [
            single.choices[0].message.content for single in singles]
        assert len({c.message.content for c in completion.choices}) > 1
        assert completion.usage.prompt_tokens == singles[0].usage.prompt_tokens
        assert completion.usage.completion_tokens == sum(
            single.usage.completion_tokens for single in singles)

    def test_n_streamed_choices_carry_their_index(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        whole = chat(client, server, user(STOP_PROMPT), max_tokens=8, n=3, **SEEDED)
        chunks = list(chat(client, server, user(STOP_PROMPT), max_tokens=8, n=3, stream=True,
                           stream_options={"include_usage": True}, **SEEDED))
        texts, reasons = ["", "", ""], [[], [], []]
        for chunk in chunks[:-1]:
            [choice] = chunk.choices
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index].append(choice.finish_reason)
        assert texts == [c.message.content for c in whole.choices]
        assert reasons == [[c.finish_reason] for c in whole.choices]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    def test_n_greedy_choices_are_the_same(self, client: openai.OpenAI, server: Server) -> None:
        completion = chat(client, server, user(STOP_PROMPT), max_tokens=4, n=2)
        first, second = completion.choices
        assert first.message.content == second.message.content

    def test_n_choices_of_an_image_process_it_once(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        """The MM worker's feature cache answers the other choices' image (it is on here)."""
        def mm_counts() -> tuple[int, int]:
            stats = wait_for_stats(server.run_dir, lambda s: s.role == "mm-worker",
                                   "the MM worker's stats")
            return stats.counters.get("cache_hits", 0), stats.counters.get("cache_misses", 0)

        hits, misses = mm_counts()
        image = png_uri(make_image(40, 40, seed=1234))  # seen by no other test
        completion = chat(client, server, user("What is in it?", image), n=3)
        assert [c.index for c in completion.choices] == [0, 1, 2]
        wait_for_stats(server.run_dir, lambda s: s.role == "mm-worker"
                       and s.counters.get("cache_hits", 0) >= hits + 2, "two cache hits")
        assert mm_counts() == (hits + 2, misses + 1)


def test_choices_keep_what_came_while_waiting_for_every_first_reply() -> None:
    """Choice 0 has ended before choice 1's first reply comes: nothing of choice 0 is lost."""
    requests = parallel_requests(
        ChatRequest(request_id="r", messages=[user_message("hi")], seed=5), 2)
    assert [(r.request_id, r.seed) for r in requests] == [("r-0", 5), ("r-1", 6)]

    def output(request_id: str, text: str, finished: bool) -> ChatOutput:
        return ChatOutput(request_id=request_id, token_ids=[1], text=text, finished=finished,
                          finish_reason="length" if finished else None)

    async def gather() -> list[Choice] | ChatError:
        choices = Choices(requests)
        for reply in (output("r-0", "a", False), output("r-0", "b", True),
                      output("r-1", "c", True)):
            choices.queue.put_nowait(reply)
        firsts = await choices.firsts()
        assert not isinstance(firsts, ChatError)
        return await choices.gathered(firsts)

    assert asyncio.run(gather()) == [Choice("ab", 2, "length"), Choice("c", 1, "length")]


# ---------------------------------------------------------------- errors


def _post(server: Server, body: Any, raw: bytes | None = None) -> tuple[int, bytes]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(f"{server.base_url}/chat/completions", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


ERROR_CASES = [
    # id, request fields, status, error code, message pattern
    ("unknown-model", {"model": "gpt-9"}, 404, "model_not_found", "the model 'gpt-9' does not"),
    ("no-messages", {"messages": []}, 400, "invalid_request", "messages: a non-empty list"),
    ("bad-role", {"messages": [{"role": "function", "content": "x"}]}, 400, "invalid_request",
     r"messages\[0\]"),
    ("n-too-large", {"n": 17}, 400, "invalid_request",
     r"n: must be an integer in 1\.\.16, got 17"),
    ("n-0", {"n": 0}, 400, "invalid_request", r"n: must be an integer in 1\.\.16, got 0"),
    ("n-not-int", {"n": "2"}, 400, "invalid_request", "n: must be an integer .* got '2'"),
    ("stop-too-many", {"stop": ["x"] * 17}, 400, "invalid_request",
     "stop: at most 16 stop strings, got 17"),
    ("stop-empty", {"stop": ""}, 400, "invalid_request", r"stop: stop\[0\] is empty"),
    ("stop-empty-in-list", {"stop": ["a", ""]}, 400, "invalid_request",
     r"stop: stop\[1\] is empty"),
    ("stop-too-long", {"stop": "x" * 257}, 400, "invalid_request",
     r"stop: stop\[0\] has 257 characters, at most 256"),
    ("stop-not-text", {"stop": 5}, 400, "invalid_request",
     "Expected `array`, got `int` - at `stop`"),
    ("stop-not-texts", {"stop": ["a", 5]}, 400, "invalid_request",
     r"Expected `str`, got `int` - at `stop\[1\]`"),
    ("functions", {"functions": [{"name": "f"}]}, 400, "invalid_request",
     "functions: not supported"),  # OpenAI's older name of tools
    ("max-tokens-0", {"max_tokens": 0}, 400, "invalid_request", "max_tokens must be at least 1"),
    ("min-tokens-above-max", {"max_tokens": 2, "extra_body": {"min_tokens": 3}}, 400,
     "invalid_request", r"min_tokens must be in 0\.\.max_tokens \(2\), got 3"),
    ("stop-token-negative", {"extra_body": {"stop_token_ids": [5, -1]}}, 400,
     "invalid_request", r"stop_token_ids: -1 is not a token id"),
    ("stop-token-outside-vocab", {"extra_body": {"stop_token_ids": [10**9]}}, 400,
     "invalid_request", "stop_token_ids: 1000000000 is outside the vocabulary"),
    ("ignore-eos-not-bool", {"extra_body": {"ignore_eos": "yes"}}, 400, "invalid_request",
     "Expected `bool`, got `str` - at `ignore_eos`"),
    ("presence-penalty-high", {"presence_penalty": 3}, 400, "invalid_request",
     r"presence_penalty must be in \[-2, 2\], got 3"),
    ("frequency-penalty-low", {"frequency_penalty": -2.5}, 400, "invalid_request",
     r"frequency_penalty must be in \[-2, 2\], got -2.5"),
    ("repetition-penalty-0", {"extra_body": {"repetition_penalty": 0}}, 400, "invalid_request",
     "repetition_penalty must be above 0 and finite, got 0"),
    ("logit-bias-key", {"logit_bias": {"a": 1}}, 400, "invalid_request",
     "logit_bias: its keys must be token ids"),
    ("logit-bias-value", {"logit_bias": {"5": 200}}, 400, "invalid_request",
     r"logit_bias: the bias of 5 must be in \[-100, 100\], got 200"),
    ("logit-bias-outside-vocab", {"logit_bias": {str(10**9): 1}}, 400, "invalid_request",
     "logit_bias: 1000000000 is outside the vocabulary"),
    ("top-logprobs-without-logprobs", {"top_logprobs": 2}, 400, "invalid_request",
     "top_logprobs needs logprobs set to true"),
    ("top-logprobs-above-20", {"logprobs": True, "top_logprobs": 21}, 400, "invalid_request",
     r"top_logprobs must be an integer in 0\.\.20, got 21"),
    ("top-logprobs-negative", {"logprobs": True, "top_logprobs": -1}, 400, "invalid_request",
     r"top_logprobs must be an integer in 0\.\.20, got -1"),
    ("logprobs-not-bool", {"logprobs": "yes"}, 400, "invalid_request",
     "logprobs must be a boolean, got 'yes'"),
    ("bad-base64", {"messages": user("x", "data:image/png;base64,@@@")}, 400, "invalid_image",
     "image 0: data URI is not valid base64"),
    ("too-many-images", {"messages": user("x", *[png_uri(make_image(8, 8))] * 3)}, 400,
     "too_many_images", "too many images: 3 in the request, at most 2"),
    ("ftp-url", {"messages": user("x", "ftp://example.com/a.png")}, 400, "media_not_allowed",
     "image 0: 'ftp' URLs are not supported"),
]
URL_ERROR_CASES = [
    ("redirect-to-link-local", "/to-metadata", 400, "media_not_allowed",
     "image 0: 169.254.169.254 resolves to link-local address"),
    ("body-over-cap-chunked", "/huge-chunked", 413, "image_too_large",
     "larger than the 1000000-byte fetch limit"),
    ("over-cap-declared", "/huge-declared", 413, "image_too_large",
     "larger than the 1000000-byte fetch limit"),
    ("never-answers", "/never-answers", 400, "fetch_failed",
     f"took longer than {FETCH_TIMEOUT_S} s"),
    ("not-found", "/missing", 400, "fetch_failed", "HTTP 404"),
]


def _status_error(client: openai.OpenAI, server: Server | None,
                  **fields: Any) -> openai.APIStatusError:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    if server is not None:
        fields.setdefault("model", server.model)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**fields)
    return caught.value


def _assert_error(error: openai.APIStatusError, status: int, code: str, pattern: str) -> None:
    assert error.status_code == status, error.body
    body = error.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["code"] == code
    assert re.search(pattern, body["message"]), body["message"]
    assert body["type"] == ("invalid_request_error" if status < 500 else "overloaded_error")


class TestErrors:
    @pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_bad_requests(self, client: openai.OpenAI, server: Server, case: tuple,
                          stream: bool) -> None:
        _, fields, status, code, pattern = case
        error = _status_error(client, server, stream=stream, **fields)
        _assert_error(error, status, code, pattern)

    @pytest.mark.parametrize(("fields", "param"), [
        ({"max_tokens": 2, "extra_body": {"min_tokens": 3}}, "min_tokens"),  # the frontend's
        ({"extra_body": {"stop_token_ids": [10**9]}}, "stop_token_ids"),  # the engine's check
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {str(10**9): 1}}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"stop": [""]}, "stop"),  # the frontend's
        ({"stop": 5}, "stop"),  # the HTTP API's: the wrong type
        ({"n": 17}, "n"),
    ], ids=["min_tokens", "stop_token_ids", "presence_penalty", "logit_bias-vocab",
            "logit_bias-key", "top_logprobs-alone", "top_logprobs-range", "stop", "stop-type",
            "n"])
    def test_a_bad_sampling_field_is_the_errors_param(
        self, client: openai.OpenAI, server: Server, fields: dict[str, Any], param: str
    ) -> None:
        error = _status_error(client, server, **fields)
        assert error.response.json()["error"]["param"] == param

    @pytest.mark.parametrize("case", URL_ERROR_CASES, ids=[c[0] for c in URL_ERROR_CASES])
    def test_refused_or_failed_image_urls(self, client: openai.OpenAI, server: Server,
                                          image_server: ImageServer, case: tuple) -> None:
        _, path, status, code, pattern = case
        started = time.monotonic()
        error = _status_error(client, server, messages=user("x", image_server.url(path)))
        _assert_error(error, status, code, pattern)
        assert time.monotonic() - started < FETCH_TIMEOUT_S + 10

    @pytest.mark.parametrize("raw", [
        b"{not json", b"[" * 5000 + b"]" * 5000, b'{"max_tokens": NaN}', b'{"a": 1e400}',
        b'{"a": "\\ud800"}', b'{"a": "\xff"}', b'{"a": 1} trailing',
    ], ids=["garbage", "nested-too-deep", "nan", "out-of-range", "lone-surrogate",
            "invalid-utf8", "trailing"])
    def test_invalid_json(self, server: Server, raw: bytes) -> None:
        status, body = _post(server, None, raw=raw)
        assert status == 400
        assert "not valid JSON" in json.loads(body)["error"]["message"]
        assert _post(server, {"model": server.model, "max_tokens": 1,  # and it still serves
                              "messages": [{"role": "user", "content": "hi"}]})[0] == 200

    def test_body_over_the_limit(self, server: Server) -> None:
        status, body = _post(server, None, raw=b" " * (MAX_BODY_BYTES + 1))
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"


# ---------------------------------------------------------------- /metrics


def own_metrics(base_url: str) -> dict[str, Metric]:
    """The frontend's GET /metrics, parsed as Prometheus text, by family name (no API key)."""
    with urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version="), r.headers
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def frontend_count(families: dict[str, Metric], family: str, code: str) -> float:
    """The frontend's sample of `family` (mmlane_errors, mmlane_http_refused) for `code`."""
    return sum(sample.value for sample in families[family].samples
               if sample.labels["role"] == "frontend" and sample.labels["code"] == code)


def _frontend_families(families: Iterable[Metric]) -> frozenset[str]:
    return frozenset(family.name for family in families
                     if any(sample.labels.get("role") == "frontend" for sample in family.samples))


def test_metrics_has_the_families_the_exporter_gives_this_frontend(server: Server) -> None:
    assert _post(server, {"model": server.model, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "hi"}]})[0] == 200
    assert _post(server, {"model": "gpt-9"})[0] == 404  # a refusal: mmlane_http_refused
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "mmlane.cli", "exporter", "--port", str(port),
         "--run-dir", str(server.run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert f":{port}/metrics" in exporter.stdout.readline()  # type: ignore[union-attr]

        def the_same() -> frozenset[str] | None:  # the exporter's lag: one stats interval
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                exported = _frontend_families(text_string_to_metric_families(r.read().decode()))
            own = _frontend_families(own_metrics(server.base_url).values())
            return own if own == exported else None

        names = wait_until(the_same, "/metrics and the exporter giving the same families",
                           timeout_s=60, every_s=0.2)
    finally:
        exporter.send_signal(signal.SIGTERM)
        assert exporter.wait(timeout=30) == 0
    assert {"mmlane_up", "mmlane_in_flight", "mmlane_uptime_seconds", "mmlane_queue_depth",
            "mmlane_requests", "mmlane_tokenize_seconds", "mmlane_end_to_end_seconds",
            "mmlane_http_refused"} <= names


REFUSED_OVER_HTTP = [
    # what is sent, the code it is refused with
    ({"raw": b"{not json"}, "invalid_request"),
    ({"body": {"model": "gpt-9"}}, "model_not_found"),
    ({"body": {"n": 10**6}}, "invalid_request"),
    ({"raw": b" " * (MAX_BODY_BYTES + 1)}, "request_too_large"),
]


@pytest.mark.parametrize(("method", "path", "status", "message"), [
    ("GET", "/v1/nothing-here", 404, "no route /v1/nothing-here"),
    ("GET", "/v1/chat/completions", 405, "GET is not allowed on /v1/chat/completions"),
])
def test_unknown_routes_and_methods_answer_openai_error_json(
    server: Server, method: str, path: str, status: int, message: str,
) -> None:
    """As every other error: an OpenAI error body (not aiohttp's plain text), a 405 with
    `Allow`."""
    url = server.base_url.removesuffix("/v1") + path
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=60)
    assert answer.value.code == status
    error = json.loads(answer.value.read())["error"]
    assert message in error["message"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    if status == 405:
        assert "POST" in answer.value.headers["Allow"]


def test_a_request_refused_over_http_is_counted_by_its_code(server: Server) -> None:
    before = own_metrics(server.base_url)
    for sent, _ in REFUSED_OVER_HTTP:
        body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}],
                **sent.get("body", {})}
        assert _post(server, body, raw=sent.get("raw"))[0] >= 400
    # min_tokens > max_tokens is the I/O thread's refusal: an error, not an HTTP refusal
    assert _post(server, {"model": server.model, "max_tokens": 2, "min_tokens": 3,
                          "messages": [{"role": "user", "content": "hi"}]})[0] == 400
    after = own_metrics(server.base_url)  # the live snapshot: no wait
    codes = [code for _, code in REFUSED_OVER_HTTP]
    for code in set(codes):
        assert (frontend_count(after, "mmlane_http_refused", code)
                - frontend_count(before, "mmlane_http_refused", code)) == codes.count(code), code
        assert frontend_count(after, "mmlane_errors", code) == frontend_count(
            before, "mmlane_errors", code) + (code == "invalid_request"), code
    expected = {code: int(frontend_count(after, "mmlane_http_refused", code)) for code in codes}
    stats = wait_for_stats(server.run_dir, lambda s: s.role == "frontend" and all(
        s.http_refused.get(code, 0) >= count for code, count in expected.items()),
        "the frontend's stats counting the refusals")
    assert {code: stats.http_refused[code] for code in expected} == expected


# ---------------------------------------------------------------- lanes and disconnects


def test_a_hanging_image_fetch_does_not_delay_text(
    client: openai.OpenAI, server: Server, image_server: ImageServer
) -> None:
    done: list[str] = []

    def hanging() -> None:
        with pytest.raises(openai.BadRequestError):
            chat(client, server, user("x", image_server.url("/never-answers")))
        done.append("image")

    thread = threading.Thread(target=hanging, name="hanging-image")
    thread.start()
    # The image request is in the MM worker, waiting on its fetch:
    wait_until(lambda: image_server.hits.get("never-answers"), "the hanging image fetched")
    chat(client, server, [{"role": "user", "content": "quick"}], max_tokens=2)
    done.append("text")
    thread.join(FETCH_TIMEOUT_S + 30)
    assert done == ["text", "image"]


def test_a_client_disconnect_cancels_the_request(
    server: Server, image_server: ImageServer
) -> None:
    body = {"model": server.model, "messages": user("x", image_server.url("/slow.png")),
            "max_tokens": 2}
    request = urllib.request.Request(f"{server.base_url}/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(OSError):  # TimeoutError, or URLError wrapping it
        urllib.request.urlopen(request, timeout=0.3)
    wait_until(lambda: "went away, or another choice failed): cancelling" in server.log(),
               f"the frontend logging the cancel: {server.log()[-3000:]}", timeout_s=10)


def test_a_streaming_client_that_goes_away_is_no_error(server: Server) -> None:
    """A client reads the first chunk of a long stream and closes its connection: the request
    is cancelled, and the log says so without an error or a traceback."""
    before = len(server.log())
    host, port = server.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": server.model, "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 3000, "stream": True, "ignore_eos": True,
    }), headers={"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: ")
    connection.sock.close()  # type: ignore[union-attr]  # gone, mid-stream
    connection.close()
    wait_until(lambda: "went away, or another choice failed): cancelling"
               in server.log()[before:], "the frontend cancelling the request", timeout_s=30)
    time.sleep(0.5)  # the write that finds the connection gone
    logged = server.log()[before:]
    assert "Traceback" not in logged and "Error handling request" not in logged, logged


# ---------------------------------------------------------------- a frontend with a silent engine


@contextmanager
def frontend_with_silent_engine(
    run_dir: Path, qwen_dir: Path, *args: str, greet: bool = True
) -> Iterator[tuple[Child, str, StandInEngine]]:
    """A frontend (HTTP API on, ARGS added) whose engine is this test's socket: it receives and
    answers only when the test does (its Hello at once, unless not `greet`). Yields the
    frontend, its HTTP base URL and that socket."""
    engine = StandInEngine.at(zmq.Context.instance(), f"ipc://{run_dir}/engine.sock")
    http_port = free_port()  # not port 0: an HTTP port 0 turns the API off
    frontend = start_role("frontend", [
        "--model", str(qwen_dir), "--engine-endpoint", engine.endpoint,
        "--mm-worker-endpoint", f"ipc://{run_dir}/mm.sock", "--port", "0",
        "--output-endpoint", f"ipc://{run_dir}/out.sock", "--http-port", str(http_port), *args,
    ], run_dir, log_dir=run_dir / "logs")
    if greet:
        engine.greet()
    try:
        yield frontend, f"http://127.0.0.1:{http_port}/v1", engine
    finally:
        assert stop_role(frontend) == 0, role_log(frontend)
        engine.close()


@pytest.mark.parametrize("reuse_port", [[], ["--http-reuse-port"]])
def test_an_http_port_another_program_holds_refuses_the_frontend_at_startup(
    run_dir: Path, qwen_dir: Path, reuse_port: list[str]
) -> None:
    """A frontend fails to start, saying why, on an HTTP port already taken: with
    --http-reuse-port too, which shares the port only with the frontends that ask for it, not
    with a listener without SO_REUSEPORT (another program)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(FatalError, match=f"cannot serve HTTP on 127.0.0.1:{port}: .*in use"):
            start_role("frontend", ["--model", str(qwen_dir), "--port", "0",
                                    "--http-port", str(port), *reuse_port], run_dir)


def test_a_draining_frontend_leaves_its_shared_port_to_the_others(
    run_dir: Path, qwen_dir: Path
) -> None:
    """Two frontends on one HTTP port (--http-reuse-port): once one drains (SIGTERM, a request
    held), every new connection is the other's to answer, none gets the drainer's 503."""
    engine = StandInEngine.at(zmq.Context.instance(), f"ipc://{run_dir}/engine.sock")
    port = free_port()
    frontends = [start_role("frontend", [
        "--model", str(qwen_dir), "--engine-endpoint", engine.endpoint,
        "--mm-worker-endpoint", f"ipc://{run_dir}/mm.sock", "--port", "0",
        "--output-endpoint", f"ipc://{run_dir}/out-{name}.sock", "--http-port", str(port),
        "--http-reuse-port", "--name", name,
    ], run_dir, log_dir=run_dir / name) for name in ("first", "second")]
    for _ in frontends:
        engine.greet()
    body = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            # new connections until one request reaches the engine from `first`
            held: list[Any] = []
            while not held:
                pool.submit(_chat_on_a_new_connection, port, body)
                request = _engine_message(engine)
                if request.reply_to.endswith("out-first.sock"):
                    held.append(request)
                else:
                    engine.reply(request.reply_to, EngineOutput(
                        request_id=request.request_id, token_ids=[42], finished=True,
                        finish_reason="length", prompt_token_ids=request.prompt_token_ids))
            frontends[0].process.send_signal(signal.SIGTERM)
            wait_until(lambda: "draining 1 requests" in role_log(frontends[0]),
                       "the first frontend draining")
            statuses = [_health_on_a_new_connection(port) for _ in range(12)]
            assert statuses == [200] * 12  # the second's, every one
            engine.reply(held[0].reply_to, EngineOutput(
                request_id=held[0].request_id, token_ids=[42], finished=True,
                finish_reason="length", prompt_token_ids=held[0].prompt_token_ids))
            assert frontends[0].process.wait(timeout=30) == 0, role_log(frontends[0])
    finally:
        for frontend in frontends:
            stop_role(frontend)
        engine.close()


def _chat_on_a_new_connection(port: int, body: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/chat/completions", body,
                           {"Content-Type": "application/json"})
        return connection.getresponse().status
    finally:
        connection.close()


def _health_on_a_new_connection(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.fixture
def silent_engine(run_dir: Path, qwen_dir: Path) -> Iterator[tuple[str, StandInEngine]]:
    """A frontend (HTTP API on, at most one request in flight, 2 s timeout) whose engine is this
    test's socket: it receives and never answers."""
    with frontend_with_silent_engine(run_dir, qwen_dir, "--request-timeout", "2",
                                     "--max-inflight-requests", "1") as (_, base_url, engine):
        yield base_url, engine


def _engine_message(engine: StandInEngine) -> Any:
    return engine.take(timeout_s=20)


def test_overload_timeout_and_disconnect_reach_the_engine(
    silent_engine: tuple[str, StandInEngine], qwen_dir: Path
) -> None:
    base_url, engine = silent_engine
    hi = {"model": qwen_dir.name, "messages": [{"role": "user", "content": "hi"}]}
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
        outcome: list[openai.APIStatusError] = []
        first = threading.Thread(
            target=lambda: outcome.append(_status_error(client, None, **hi)), name="first")
        first.start()
        request = _engine_message(engine)  # the first is in flight: the second is refused
        assert isinstance(request, EngineRequest)
        refused = _status_error(client, None, **hi)
        _assert_error(refused, 503, "overloaded", "frontend overloaded: 1 requests in flight")
        assert refused.response.headers["Retry-After"] == "1"
        first.join(30)
        _assert_error(outcome[0], 504, "timeout", "no reply within request_timeout_s=2")
        assert isinstance(_engine_message(engine), AbortRequests)

    post = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(hi).encode(),
                                  headers={"Content-Type": "application/json"})
    with pytest.raises(OSError):  # the client gives up before the (silent) engine answers
        urllib.request.urlopen(post, timeout=0.5)
    request = _engine_message(engine)
    abort = _engine_message(engine)  # well before the 2 s deadline would have sent it
    assert isinstance(abort, AbortRequests) and abort.request_ids == [request.request_id]


def test_a_stream_its_client_stops_reading_is_cut_off_and_cancelled(
    run_dir: Path, qwen_dir: Path
) -> None:
    with frontend_with_silent_engine(run_dir, qwen_dir, "--http-stream-write-timeout", "1") as (
        frontend, base_url, engine
    ):
        port = int(base_url.split(":")[2].split("/")[0])
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, then
        reader.connect(("127.0.0.1", port))  # it reads nothing past the headers
        body = json.dumps({"model": qwen_dir.name, "stream": True, "max_tokens": 4000, "n": 2,
                           "logprobs": True, "top_logprobs": 20,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        reader.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        requests = [_engine_message(engine) for _ in range(2)]  # one per choice
        # 2 x 4000 tokens, each with its 20 alternatives: about 10 MB of events, more than the
        # kernel and aiohttp buffer for a client that reads nothing
        ids = list(range(1000, 1100))
        logprobs = [TokenLogprobs(logprob=-1.0, top_token_ids=list(range(1000, 1020)),
                                  top_logprobs=[-1.0] * 20)] * len(ids)
        for _ in range(40):
            for request in requests:
                engine.reply(request.reply_to, EngineOutput(
                    request_id=request.request_id, token_ids=ids, logprobs=logprobs))
        aborted: set[str] = set()
        while aborted != {r.request_id for r in requests}:  # both choices cancelled
            abort = _engine_message(engine)
            assert isinstance(abort, AbortRequests), abort
            aborted |= set(abort.request_ids)
        wait_until(lambda: "the client read nothing for 1 s; closed" in role_log(frontend),
                   "the frontend's log of the cut-off stream")
        reader.close()
        answered = _answered(engine, lambda: urllib.request.urlopen(urllib.request.Request(
            f"{base_url}/chat/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": qwen_dir.name, "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}]}).encode()), timeout=30).status,
            lambda r: EngineOutput(request_id=r.request_id, token_ids=[1000], finished=True,
                                   finish_reason="length", prompt_token_ids=r.prompt_token_ids))
        assert answered == 200  # serving on


def _raw_answer(sock: socket.socket, timeout_s: float = 20.0) -> bytes:
    """Everything the server sends on `sock` until it closes the connection."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _raw_error(answer: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A raw HTTP answer's status, headers (lower-cased names) and JSON error body."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in
               (line.partition(":") for line in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)["error"]


def test_slow_heads_slow_bodies_idle_and_surplus_connections_are_bounded(
    run_dir: Path, qwen_dir: Path
) -> None:
    """Slowloris heads and bodies get a 408 and are closed, a connection over the bound a 503
    with Retry-After, an idle keep-alive connection is closed; none of it reaches the engine,
    and the frontend serves on."""
    with frontend_with_silent_engine(
        run_dir, qwen_dir, "--http-header-timeout", "1", "--http-body-timeout", "1",
        "--http-keepalive-timeout", "1", "--http-max-connections", "3",
    ) as (_, base_url, engine):
        port = int(base_url.split(":")[2].split("/")[0])
        trickler = socket.create_connection(("127.0.0.1", port))
        trickler.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        trickler.settimeout(0.25)
        cut_off = False
        for byte in b"X-Slow: " + b"a" * 200:  # one byte every 0.25 s: 50 s for the whole head
            try:
                trickler.sendall(bytes([byte]))
                if trickler.recv(65536, socket.MSG_PEEK):
                    cut_off = True
                    break
            except TimeoutError:
                continue
            except OSError:  # closed under the write
                cut_off = True
                break
        assert cut_off, "a trickled request head was never cut off"
        status, _, error = _raw_error(_raw_answer(trickler))
        assert (status, error["code"]) == (408, "request_timeout"), error
        assert "no whole request head within 1 s" in error["message"]

        silent = socket.create_connection(("127.0.0.1", port))  # connects and sends nothing
        silent.settimeout(20)
        assert silent.recv(65536, socket.MSG_PEEK)  # the 408 is here: the server is closing
        silent.sendall(b"late bytes")  # a socket closed at once would answer these with a reset
        time.sleep(0.2)
        assert _raw_error(_raw_answer(silent))[0] == 408  # and then an orderly end, no reset

        body = socket.create_connection(("127.0.0.1", port))
        body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        status, _, error = _raw_error(_raw_answer(body))  # then closed: the body is half read
        assert (status, error["code"]) == (408, "request_timeout"), error
        assert "the request body stalled: nothing for 1 s" in error["message"]

        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.2)  # all three accepted
        surplus = socket.create_connection(("127.0.0.1", port))
        status, headers, error = _raw_error(_raw_answer(surplus))
        assert (status, error["code"], headers["retry-after"]) == (503, "overloaded", "1")
        assert "holds the most connections it takes (3)" in error["message"]
        for sock in held:
            sock.close()

        keepalive = socket.create_connection(("127.0.0.1", port))
        keepalive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        keepalive.settimeout(20)
        assert keepalive.recv(65536).startswith(b"HTTP/1.1 200")
        assert _raw_answer(keepalive) == b""  # idle for its keep-alive timeout: closed

        counters = wait_for_stats(
            run_dir, lambda s: s.role == "frontend" and s.counters.get("http_slow_bodies", 0)
            and s.counters.get("http_connections_refused", 0), "the frontend's stats").counters
        assert counters["http_slow_heads"] >= 2  # the trickler and the silent one (held ones too)
        assert counters["http_slow_bodies"] == 1 and counters["http_connections_refused"] == 1
        engine.assert_quiet(500)  # nothing reached the engine
        with urllib.request.urlopen(f"{base_url}/models", timeout=30) as reply:
            assert reply.status == 200  # serving on
        for sock in (trickler, silent, body, surplus, keepalive):
            sock.close()


def test_the_rate_limit_answers_429_with_retry_after_per_key(
    run_dir: Path, qwen_dir: Path
) -> None:
    with frontend_with_silent_engine(
        run_dir, qwen_dir, "--http-rate-limit", "0.5", "--http-rate-burst", "2",
        "--api-key", "alpha", "--api-key", "beta",
    ) as (_, base_url, _engine):
        def models(key: str) -> tuple[int, dict[str, str], dict[str, Any]]:
            request = urllib.request.Request(f"{base_url}/models",
                                             headers={"Authorization": f"Bearer {key}"})
            try:
                with urllib.request.urlopen(request, timeout=30) as reply:
                    return reply.status, dict(reply.headers), json.load(reply)
            except urllib.error.HTTPError as error:
                return error.code, dict(error.headers), json.load(error)

        assert [models("alpha")[0] for _ in range(2)] == [200, 200]  # the burst
        status, headers, body = models("alpha")
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
        assert body["error"]["type"] == "requests"  # as OpenAI's
        assert int(headers["Retry-After"]) in (1, 2)  # a token every 2 s
        assert "over the rate limit of 0.5 requests a second (bursts of 2)" in \
            body["error"]["message"]
        assert models("beta")[0] == 200  # another key has its own bucket
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health",
                                    timeout=30) as reply:
            assert reply.status == 200  # outside /v1: no limit
        refused = wait_for_stats(
            run_dir, lambda s: s.role == "frontend" and "rate_limit_exceeded" in s.http_refused,
            "the frontend's count of the 429").http_refused
        assert refused["rate_limit_exceeded"] == 1


def test_served_names_and_a_chat_template_file(
    run_dir: Path, qwen_dir: Path, prep: Preprocessor, tmp_path: Path
) -> None:
    """--served-model-name: every name is listed and taken, replies report the first;
    --chat-template: the file's template renders the chats; /tokenize needs the API key as /v1
    does."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    with frontend_with_silent_engine(
        run_dir, qwen_dir, "--served-model-name", "lanes,lanes-alias",
        "--chat-template", str(template), "--api-key", "k",
    ) as (_, base_url, engine), openai.OpenAI(base_url=base_url, api_key="k", max_retries=0,
                                              timeout=60) as client:
        hi = [{"role": "user", "content": "hi"}]
        assert _post_json(f"{_root(base_url)}/tokenize", {"messages": hi})[0] == 401
        status, body = _post_json(f"{_root(base_url)}/tokenize",
                                  {"model": "lanes-alias", "messages": hi},
                                  {"Authorization": "Bearer k"})
        assert status == 200, body
        assert body["tokens"] == prep.tokenize_batch(["<<user>>hi\n<<assistant>>"])[0]
        models = client.models.list().data
        assert [model.id for model in models] == ["lanes", "lanes-alias"]
        assert {model.model_extra["root"] for model in models} == {qwen_dir.name}
        completion = _answered(
            engine, functools.partial(client.chat.completions.create, model="lanes-alias",
                                      messages=hi, max_tokens=1),
            lambda request: EngineOutput(request_id=request.request_id, token_ids=[42],
                                         finished=True, finish_reason="length",
                                         prompt_token_ids=request.prompt_token_ids))
        assert completion.model == "lanes"
        assert completion.usage.prompt_tokens == body["count"]
        error = _status_error(client, None, model=qwen_dir.name)  # the directory is no name now
        _assert_error(error, 404, "model_not_found", "serves 'lanes' and 'lanes-alias'")


@pytest.mark.parametrize(("setting", "pattern"), [
    ("/no/such/template.jinja", "chat_template: cannot read the file /no/such/template.jinja"),
    ("{% for m in messages %}", "chat_template: not a Jinja template"),
], ids=["missing-file", "bad-syntax"])
def test_a_chat_template_that_cannot_be_used_stops_the_frontend_at_start(
    run_dir: Path, qwen_dir: Path, setting: str, pattern: str
) -> None:
    args = ["--model", str(qwen_dir), "--port", "0", "--http-port", "0",
            "--chat-template", setting]
    with pytest.raises(FatalError, match=pattern):
        start_role("frontend", args, run_dir)


# ---------------------------------------------------------------- each kind of error, over HTTP


def _answered(engine: StandInEngine, call: Callable[[], Any],
              answer: Callable[[EngineRequest], EngineOutput | RequestFailed]) -> Any:
    """What `call` (a client request) returns while this test's engine answers the request that
    reaches it with `answer(request)`."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="http-client") as pool:
        result = pool.submit(call)
        request = _engine_message(engine)
        engine.reply(request.reply_to, answer(request))
        return result.result(timeout=60)


ENGINE_ERRORS = [
    # the engine's error: kind, code, message; the HTTP status and OpenAI error type it gets
    ("request", "model_error", "the model failed on this request: NaN probabilities", 400,
     "invalid_request_error"),
    ("request", "prompt_too_long", "prompt is 9000 tokens", 400, "invalid_request_error"),
    ("retryable", "overloaded", "engine overloaded", 503, "overloaded_error"),
    ("retryable", "timeout", "passed its deadline", 504, "overloaded_error"),
    ("internal", "internal", "internal error in the receiver cache: KeyError", 500,
     "server_error"),
    ("fatal", "cannot_serve", "the engine cannot serve", 500, "server_error"),
    ("retryable", "from_a_newer_peer", "a code this frontend does not know", 503,
     "overloaded_error"),
]


def test_each_kind_of_engine_error_gets_its_status_and_the_frontend_serves_on(
    run_dir: Path, qwen_dir: Path
) -> None:
    hi = {"model": qwen_dir.name, "messages": [{"role": "user", "content": "hi"}]}
    with frontend_with_silent_engine(run_dir, qwen_dir) as (frontend, base_url, engine), (
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    ) as client:
        for (kind, code, message, status, error_type), stream in itertools.product(
                ENGINE_ERRORS, [False, True]):
            info = ErrorInfo(kind=kind, code=code, message=message)
            error = _answered(
                engine, functools.partial(_status_error, client, None, stream=stream, **hi),
                lambda request, info=info: RequestFailed(request_id=request.request_id,
                                                         error=info))
            body = error.response.json()["error"]
            assert (error.status_code, body["type"], body["code"], body["message"]) == (
                status, error_type, code, message), (kind, code, stream)

        # after every kind (an internal error among them) the frontend serves on
        completion = _answered(
            engine, functools.partial(client.chat.completions.create, **hi),
            lambda request: EngineOutput(request_id=request.request_id, token_ids=[42],
                                         finished=True, finish_reason="length",
                                         prompt_token_ids=request.prompt_token_ids))
        assert completion.choices[0].finish_reason == "length"
        assert frontend.process.poll() is None


# ---------------------------------------------------------------- a frontend that drains


def _health(base_url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/health", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_health_answers_503_until_the_engine_has_answered(run_dir: Path, qwen_dir: Path) -> None:
    """A readiness probe on /health sends nothing to a frontend whose engine has not answered
    yet (a vLLM engine loads its model first), as `vllm serve` is not up before its engine."""
    with frontend_with_silent_engine(run_dir, qwen_dir, greet=False) as (_, base_url, engine):
        status, body = _health(base_url)
        assert status == 503 and body["error"]["code"] == "peer_restarted", body
        assert body["error"]["message"] == "the engine has not answered yet (it is starting)"
        engine.greet()
        assert wait_until(lambda: _health_if(base_url, 200), "/health answering 200") == (
            200, {"status": "ok"})


def _health_if(base_url: str, status: int) -> tuple[int, dict[str, Any]] | None:
    """`_health`, if its status is `status`."""
    health = _health(base_url)
    return health if health[0] == status else None


def test_a_draining_frontend_refuses_new_requests_and_answers_held_ones(
    run_dir: Path, qwen_dir: Path
) -> None:
    with frontend_with_silent_engine(run_dir, qwen_dir, "--drain-timeout", "60") as (
        frontend, base_url, engine
    ), openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
        hi = {"model": qwen_dir.name, "messages": [{"role": "user", "content": "hi"}]}
        held: list[Any] = []
        thread = threading.Thread(
            target=lambda: held.append(client.chat.completions.create(**hi)), name="held")
        thread.start()
        request = _engine_message(engine)  # in flight: the engine holds it
        frontend.process.send_signal(signal.SIGTERM)
        health = wait_until(lambda: _health_if(base_url, 503),
                            "/health saying the frontend is draining")
        assert health[1]["error"]["code"] == "peer_restarted"

        refused = _status_error(client, None, **hi)
        _assert_error(refused, 503, "peer_restarted",
                      "the frontend is stopping and takes no new requests")
        assert refused.response.headers["Retry-After"] == "1"
        engine.answer(request.reply_to, request.request_id,
                      prompt_token_ids=request.prompt_token_ids)
        thread.join(60)
        assert held[0].choices[0].finish_reason == "length"
        assert frontend.process.wait(timeout=60) == 0, role_log(frontend)


# ---------------------------------------------------------------- stop strings and n, downstream


def test_a_stop_string_stops_the_engine_and_the_reply_ends_once(
    run_dir: Path, qwen_dir: Path, prep: Preprocessor
) -> None:
    """The engine streams a whole output, one token at a time: the reply ends before the stop
    string (it spans two tokens), the engine is told to stop, and what it sends after the stop
    string (its own end among it) reaches nobody."""
    ids = prep.tokenize_batch(["Lanes keep text requests moving, whatever the images do."])[0]
    stop, through = split_stop(prep, ids)
    whole = prep.decode(ids)
    with frontend_with_silent_engine(run_dir, qwen_dir) as (_, base_url, engine), (
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    ) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        chunks = pool.submit(lambda: list(client.chat.completions.create(
            model=qwen_dir.name, messages=user("hi"), stream=True, stop=stop,
            stream_options={"include_usage": True})))
        request = _engine_message(engine)
        for number, token in enumerate(ids, 1):
            engine.reply(request.reply_to, EngineOutput(
                request_id=request.request_id, token_ids=[token], finished=number == len(ids),
                finish_reason="length" if number == len(ids) else None,
                prompt_token_ids=request.prompt_token_ids if number == 1 else None))
        abort = _engine_message(engine)
        assert isinstance(abort, AbortRequests) and abort.request_ids == [request.request_id]
        received = chunks.result(timeout=60)
    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert text == whole[:whole.index(stop)]
    assert [c.choices[0].finish_reason for c in received
            if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert received[-1].usage.completion_tokens == through


def test_a_client_disconnect_cancels_every_choice(run_dir: Path, qwen_dir: Path) -> None:
    with frontend_with_silent_engine(run_dir, qwen_dir) as (_, base_url, engine):
        body = {"model": qwen_dir.name, "messages": user("hi"), "n": 3}
        post = urllib.request.Request(f"{base_url}/chat/completions",
                                      data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})
        with pytest.raises(OSError):  # the client gives up before the (silent) engine answers
            urllib.request.urlopen(post, timeout=0.5)
        requested = {_engine_message(engine).request_id for _ in range(3)}
        aborted: set[str] = set()
        while aborted != requested:
            abort = _engine_message(engine)
            assert isinstance(abort, AbortRequests), abort
            aborted.update(abort.request_ids)
