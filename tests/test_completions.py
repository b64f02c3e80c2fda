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
from test_http import SEEDED, Server, client, server, usage_and_reason

from protocol.errors import RequestError
from services.client import Client, user_message
from services.model import Preprocessor

__all__ = ["client", "server"]  # test_http's module fixtures, served here once more

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
