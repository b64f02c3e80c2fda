"""POST /v1/completions end to end through `mmlane serve` (the `server` of test_http), with the
`openai` client and raw HTTP, and the native client's completion requests: a text prompt or
token ids, no chat template, the same sampling, answers and errors as chat."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from test_detokenize import split_stop
from test_http import SEEDED, Server, server, usage_and_reason

from mmlane.client import Client, user_message
from mmlane.model import Preprocessor
from mmlane.protocol.errors import RequestError

__all__ = ["server"]  # test_http's module fixture, served here once more (its `client`: conftest's)

PROMPT = "Tell me about lanes."


def complete(client: openai.OpenAI, server: Server, prompt: Any, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=server.model, prompt=prompt, **kw)


def streamed(client: openai.OpenAI, server: Server, prompt: Any,
             **kw: Any) -> tuple[str, list[Any]]:
    chunks = list(complete(client, server, prompt, stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def _post(server: Server, body: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{server.base_url}/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---------------------------------------------------------------- answers


class TestAnswers:
    def test_a_text_prompt_is_tokenized_as_it_is(
        self, client: openai.OpenAI, server: Server, prep: Preprocessor
    ) -> None:
        completion = complete(client, server, PROMPT)
        [choice] = completion.choices
        assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
        assert completion.model == server.model
        assert isinstance(choice.text, str) and choice.text
        assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
        # no chat template; the tokenizer's special tokens added, as `tokenizer(text)` does
        assert completion.usage.prompt_tokens == len(prep.tokenizer(PROMPT)["input_ids"])
        assert completion.usage.total_tokens == (
            completion.usage.prompt_tokens + completion.usage.completion_tokens)

    def test_streaming_gives_the_same_text_in_chunks(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        whole = complete(client, server, PROMPT)
        text, chunks = streamed(client, server, PROMPT, stream_options={"include_usage": True})
        assert text == whole.choices[0].text
        assert {c.object for c in chunks} == {"text_completion"}
        assert len({c.id for c in chunks}) == 1
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1
        assert finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    def test_stream_ends_with_done(self, server: Server) -> None:
        status, raw = _post(server, {"model": server.model, "prompt": "hi", "max_tokens": 3,
                                     "stream": True})
        assert status == 200
        events = raw.decode().strip().split("\n\n")
        assert events[-1] == "data: [DONE]"
        assert all(e.startswith("data: {") for e in events[:-1])

    def test_token_ids_and_one_element_lists_are_the_same_prompt(
        self, client: openai.OpenAI, server: Server, prep: Preprocessor
    ) -> None:
        ids = prep.tokenizer(PROMPT)["input_ids"]
        answers = [complete(client, server, prompt, max_tokens=8, **SEEDED)
                   for prompt in (PROMPT, [PROMPT], ids, [ids])]
        assert len({a.choices[0].text for a in answers}) == 1
        assert {a.usage.prompt_tokens for a in answers} == {len(ids)}

    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_ignore_eos_gives_exactly_max_tokens(
        self, client: openai.OpenAI, server: Server, stream: bool
    ) -> None:
        kw = {"max_tokens": 30, "extra_body": {"ignore_eos": True}}
        if stream:
            _, chunks = streamed(client, server, PROMPT, stream_options={"include_usage": True},
                                 **kw)
            usage, reason = usage_and_reason(chunks)
        else:
            completion = complete(client, server, PROMPT, **kw)
            usage, reason = completion.usage, completion.choices[0].finish_reason
        assert (usage.completion_tokens, reason) == (30, "length")

    def test_max_tokens_defaults_to_16_as_openai_and_vllm(self, server: Server) -> None:
        status, raw = _post(server, {"model": server.model, "prompt": "hi", "ignore_eos": True})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 16

    def test_seeded_sampling_is_reproducible(self, client: openai.OpenAI,
                                             server: Server) -> None:
        first, again = (complete(client, server, PROMPT, max_tokens=12, **SEEDED)
                        for _ in range(2))
        assert first.choices[0].text == again.choices[0].text

    def test_a_chat_and_a_completion_of_its_token_ids_give_the_same_tokens(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        sampling = {"max_tokens": 10, "ignore_eos": True, **SEEDED}
        with Client(server.client_endpoint, timeout_s=120) as native:
            chat = native.chat([user_message(PROMPT)], **sampling)
            assert chat.prompt_token_ids
            completion = native.complete(chat.prompt_token_ids, **sampling)
        assert (completion.token_ids, completion.text) == (chat.token_ids, chat.text)
        assert completion.prompt_token_ids == chat.prompt_token_ids

        over_http = complete(client, server, chat.prompt_token_ids, max_tokens=10, **SEEDED,
                             extra_body={"ignore_eos": True})
        assert over_http.choices[0].text == chat.text

    def test_the_native_client_completes_a_text(self, server: Server,
                                                prep: Preprocessor) -> None:
        with Client(server.client_endpoint, timeout_s=120) as native:
            result = native.complete(PROMPT, max_tokens=5, ignore_eos=True)
            assert result.prompt_token_ids == prep.tokenizer(PROMPT)["input_ids"]
            assert (len(result.token_ids), result.finish_reason) == (5, "length")
            with pytest.raises(RequestError, match="prompt: must not be empty"):
                native.complete([])


# ---------------------------------------------------------------- logprobs


LEGACY_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
"""The lists of a completion choice's logprobs, one entry per output token each."""
EIGHT_SEEDED = {"max_tokens": 8, "extra_body": {"ignore_eos": True}, **SEEDED}


def choice_logprobs(client: openai.OpenAI, server: Server, *, stream: bool, prompt: Any = PROMPT,
                    **kw: Any) -> list[tuple[str, dict[str, list[Any]]]]:
    """Each choice's text and logprobs, in index order; a stream's chunks joined."""
    if not stream:
        completion = complete(client, server, prompt, **kw)
        return [(c.text, c.logprobs.model_dump()) for c in completion.choices]
    joined: dict[int, tuple[list[str], dict[str, list[Any]]]] = {}
    for chunk in complete(client, server, prompt, stream=True, **kw):
        for choice in chunk.choices:
            texts, logprobs = joined.setdefault(
                choice.index, ([], {key: [] for key in LEGACY_LOGPROBS}))
            texts.append(choice.text)
            if choice.logprobs is not None:  # the chunk with the finish reason has none
                for key, values in choice.logprobs.model_dump().items():
                    logprobs[key] += values
    return [("".join(texts), logprobs) for _, (texts, logprobs) in sorted(joined.items())]


class TestLogprobs:
    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    @pytest.mark.parametrize("logprobs", [0, 3])
    def test_each_choice_has_the_legacy_lists_with_the_sampled_token_first(
        self, client: openai.OpenAI, server: Server, logprobs: int, stream: bool
    ) -> None:
        choices = choice_logprobs(client, server, stream=stream, n=2, logprobs=logprobs,
                                  **EIGHT_SEEDED)
        assert len(choices) == 2
        for _, lists in choices:
            assert [len(lists[key]) for key in LEGACY_LOGPROBS] == [8] * 4
            for token, logprob, top in zip(lists["tokens"], lists["token_logprobs"],
                                           lists["top_logprobs"], strict=True):
                assert logprob <= 0
                assert next(iter(top)) == token  # the sampled token first, as vLLM's
                assert 1 <= len(top) <= logprobs + 1
                others = list(top.values())[1:]
                assert others == sorted(others, reverse=True)
                if logprobs == 0:  # the sampled token alone
                    assert top == {token: logprob}

    def test_raw_http_shape_and_none_unless_asked(self, server: Server) -> None:
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
        status, raw = _post(server, {**body, "logprobs": 2})
        assert status == 200, raw
        [choice] = json.loads(raw)["choices"]
        assert set(choice["logprobs"]) == set(LEGACY_LOGPROBS)
        assert [len(choice["logprobs"][key]) for key in LEGACY_LOGPROBS] == [3] * 4
        for asked in ({}, {"logprobs": None}):
            status, raw = _post(server, {**body, **asked})
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["logprobs"] is None

    def test_streamed_logprobs_are_the_complete_ones(self, client: openai.OpenAI,
                                                     server: Server) -> None:
        """Also their text offsets: a chunk's go on from the previous chunk's tokens."""
        kw = {"n": 2, "logprobs": 2, **EIGHT_SEEDED}
        assert (choice_logprobs(client, server, stream=True, **kw)
                == choice_logprobs(client, server, stream=False, **kw))

    def test_they_are_the_engines_with_the_sampled_token_first_as_in_vllm(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        """As vLLM's: the sampled token, then the 3 most likely others."""
        with Client(server.client_endpoint, timeout_s=120) as native:
            result = native.complete(PROMPT, max_tokens=8, ignore_eos=True, logprobs=3,
                                     **SEEDED)
        [(text, lists)] = choice_logprobs(client, server, stream=False, logprobs=3,
                                          **EIGHT_SEEDED)
        positions = result.logprobs or []
        assert text == result.text and len(positions) == 8
        assert lists["tokens"] == [position.sampled.token for position in positions]
        assert lists["token_logprobs"] == [position.sampled.logprob for position in positions]
        assert [list(top.items()) for top in lists["top_logprobs"]] == [
            [(entry.token, entry.logprob) for entry in [position.sampled, *[
                other for other in position.top if other.token_id != position.sampled.token_id]]]
            for position in positions]

    def test_greedy_token_logprobs_are_the_chat_routes_for_its_prompt_ids(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        with Client(server.client_endpoint, timeout_s=120) as native:
            prompt_ids = native.chat([user_message(PROMPT)], max_tokens=1).prompt_token_ids
        greedy = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
        chat = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": PROMPT}], logprobs=True,
            top_logprobs=3, **greedy)
        [(text, lists)] = choice_logprobs(client, server, stream=False, prompt=prompt_ids,
                                          logprobs=3, **greedy)
        content = chat.choices[0].logprobs.content
        assert text == chat.choices[0].message.content
        assert lists["tokens"] == [entry.token for entry in content]
        assert lists["token_logprobs"] == [entry.logprob for entry in content]
        # greedy: the sampled token is the most likely, so both list the 3 most likely
        assert lists["top_logprobs"] == [{top.token: top.logprob for top in entry.top_logprobs}
                                         for entry in content]

    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_text_offsets_point_at_each_tokens_text(
        self, client: openai.OpenAI, server: Server, stream: bool
    ) -> None:
        """The prompt is not echoed: the first token is at 0."""
        [(text, lists)] = choice_logprobs(client, server, stream=stream, logprobs=0,
                                          **{**EIGHT_SEEDED, "max_tokens": 16})
        offsets, tokens = lists["text_offset"], lists["tokens"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        for offset, token in zip(offsets, tokens, strict=True):
            assert text[offset:].startswith(token), (offset, token, text)
        # the texts cover the text, but for a last character its tokens leave incomplete
        # (the text decodes it as U+FFFD; its token's text is "" as vLLM's)
        assert text[offsets[-1] + len(tokens[-1]):].strip("\ufffd") == ""

    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_a_stop_string_ends_the_text_not_the_tokens_through_it(
        self, client: openai.OpenAI, server: Server, prep: Preprocessor, stream: bool
    ) -> None:
        """As vLLM's: the tokens go on through the one that completed the stop string."""
        with Client(server.client_endpoint, timeout_s=120) as native:
            whole = native.complete(PROMPT, max_tokens=16, ignore_eos=True, **SEEDED)
        stop, through = split_stop(prep, whole.token_ids)
        [(text, lists)] = choice_logprobs(client, server, stream=stream, logprobs=1,
                                          stop=[stop], **{**EIGHT_SEEDED, "max_tokens": 16})
        assert text == whole.text[:whole.text.index(stop)]
        assert len(lists["tokens"]) == through
        assert "".join(lists["tokens"]).startswith(text + stop)


# ---------------------------------------------------------------- errors


ERROR_CASES = [
    # id, request fields, error code, message pattern, param
    ("empty-text", {"prompt": ""}, "invalid_request", "prompt: must not be empty", "prompt"),
    ("empty-ids", {"prompt": []}, "invalid_request", "prompt: must not be empty", "prompt"),
    ("no-prompt", {"prompt": None}, "invalid_request",
     "prompt: a text or a list of token ids is required", "prompt"),
    ("not-a-prompt", {"prompt": 7}, "invalid_request", "Expected `str | array`.* at `prompt`",
     "prompt"),
    ("id-outside-vocab", {"prompt": [5, 10**6]}, "invalid_request",
     r"prompt: token id 1000000 is outside the vocabulary \(0\.\.\d+\)", "prompt"),
    ("negative-id", {"prompt": [-1]}, "invalid_request",
     r"prompt: token id -1 is outside the vocabulary", "prompt"),
    ("image-placeholder-id", {"prompt": "IMAGE_IDS"}, "invalid_request",
     "prompt: contains the reserved image token '<|image_pad|>'", "prompt"),
    ("image-placeholder-text", {"prompt": "a <|image_pad|> b"}, "invalid_request",
     "prompt: contains the reserved image token '<|image_pad|>'", "prompt"),
    ("batch-of-texts", {"prompt": ["a", "b"]}, "invalid_request",
     "prompt: a batch of 2 prompts is not supported", "prompt"),
    ("batch-of-ids", {"prompt": [[1, 2], [3]]}, "invalid_request",
     "prompt: a batch of 2 prompts is not supported", "prompt"),
    ("echo", {"echo": True}, "invalid_request", "echo: not supported", "echo"),
    ("suffix", {"suffix": "end"}, "invalid_request", "suffix: not supported", "suffix"),
    ("best-of-2", {"best_of": 2}, "invalid_request", "best_of: not supported", "best_of"),
    ("logprobs-negative", {"logprobs": -1}, "invalid_request",
     r"logprobs must be an integer in 0\.\.20, got -1", "logprobs"),
    ("logprobs-above-20", {"logprobs": 21}, "invalid_request",
     r"logprobs must be an integer in 0\.\.20, got 21", "logprobs"),
    ("logprobs-not-integer", {"logprobs": 1.5}, "invalid_request",
     r"logprobs must be an integer in 0\.\.20, got 1\.5", "logprobs"),
    ("logprobs-boolean", {"logprobs": True}, "invalid_request",
     r"logprobs must be an integer in 0\.\.20, got True", "logprobs"),
    ("max-tokens-0", {"max_tokens": 0}, "invalid_request", "max_tokens must be at least 1",
     "max_tokens"),
    ("too-long", {"prompt": [1] * 4096}, "prompt_too_long",
     "prompt too long: 4096 prompt tokens \\+ max_tokens 6 exceed the model's context of 4096",
     None),
    ("unknown-model", {"model": "gpt-9"}, "model_not_found", "the model 'gpt-9' does not",
     "model"),
]


class TestErrors:
    @pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
    @pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
    def test_bad_requests_name_the_field(self, client: openai.OpenAI, server: Server,
                                         prep: Preprocessor, case: tuple, stream: bool) -> None:
        _, fields, code, pattern, param = case
        fields = {"prompt": "hi", "max_tokens": 6, "model": server.model, **fields}
        if fields["prompt"] == "IMAGE_IDS":
            fields["prompt"] = [5, prep.image_token_id, 6]
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(stream=stream, **fields)
        error = caught.value
        body = error.response.json()["error"]
        assert (error.status_code, body["code"], body["param"]) == (
            404 if code == "model_not_found" else 400, code, param), body
        assert re.search(pattern, body["message"]), body["message"]

    def test_the_frontend_serves_on_after_bad_requests(
        self, client: openai.OpenAI, server: Server
    ) -> None:
        for prompt in ("", [10**6], ["a", "b"]):
            with pytest.raises(openai.BadRequestError):
                complete(client, server, prompt)
        assert complete(client, server, PROMPT).choices[0].text
        assert server.process.poll() is None
