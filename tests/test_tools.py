"""Tool calling on the HTTP API: the request's tools checked and rendered by the chat template,
'required' and named choices constrained to valid calls (even from the tiny random model),
'auto' replies read in the hermes and mistral formats, whole and streamed, as vLLM's parsers
read them.

The reading itself is tested on texts (fast); the rest over `mmlane serve` and over a frontend
whose engine is the test's socket, answering with the tokens of a chosen reply."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from test_http import (
    Server,
    _answered,
    _assert_error,
    _post_json,
    _root,
    _status_error,
    frontend_with_silent_engine,
    serve_http,
)

from mmlane.frontend.tools import ToolStream, ToolUse, tool_format, tool_use
from mmlane.model import Preprocessor, load_preprocessor
from mmlane.model.grammar import Grammars, hf_tokenizer
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import EngineOutput
from mmlane.protocol.sampling import StructuredOutputs

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["c", "f"]}}}}}
FORECAST = {"type": "function", "function": {
    "name": "forecast", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["days"],
                   "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
NO_PARAMETERS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, FORECAST, NO_PARAMETERS]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"}
           for tool in TOOLS}

# Qwen2.5's tool section (its chat template's), over Qwen2-VL's content parts: the tools in the
# system turn, an assistant's calls as <tool_call> JSON, a tool's result in <tool_response>.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> tags."
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content }}{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{%- if message.content is string %}"
    "{{ message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

HERMES_REPLY = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "forecast", "arguments": {"days": 3}}\n</tool_call>')
COMPACT_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}'
                 '\n</tool_call><tool_call>{"name": "forecast", "arguments": {"days":3}}'
                 '</tool_call>')
HERMES_CALLS = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("forecast", '{"days": 3}')]
MISTRAL_REPLY = ('Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": '
                 '{"city": "Paris", "unit": "c"}}, {"name": "forecast", "arguments": {"days": 3}}]')
NAMED_NOW = {"type": "function", "function": {"name": "now"}}


def use(format: str | None = "hermes", **body: Any) -> ToolUse:
    found = tool_use({"tools": TOOLS, **body}, format)
    assert found is not None
    return found


def calls_of(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"])
            for call in message["tool_calls"]]


def streamed(stream: ToolStream, text: str, piece: int, reason: str = "stop") -> tuple[
        str, list[tuple[str, str]], str]:
    """The content, the calls and the finish reason of `text` fed `piece` characters at a
    time."""
    deltas = [delta for start in range(0, len(text), piece)
              for delta in stream.feed(text[start:start + piece])]
    last, reason = stream.finish(reason)
    deltas += last
    content = "".join(delta.get("content", "") for delta in deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            name, arguments = calls.get(call["index"], ["", ""])
            function = call["function"]
            calls[call["index"]] = [name + function.get("name", ""),
                                    arguments + function["arguments"]]
    return content, [(name, arguments) for name, arguments in calls.values()], reason


# ---------------------------------------------------------------- reading replies (fast)


class TestReading:
    def test_auto_reads_hermes_calls_and_the_content_before_them(self) -> None:
        message, reason = use().answer(HERMES_REPLY, "stop")
        assert (message["content"], calls_of(message), reason) == (
            "Let me look.", HERMES_CALLS, "tool_calls")
        assert all(call["id"].startswith("chatcmpl-tool-") for call in message["tool_calls"])

    @pytest.mark.parametrize("text", [
        "No tools needed.", "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ], ids=["plain", "not-json", "no-name"])
    def test_text_that_does_not_read_as_calls_is_content(self, text: str) -> None:
        message, reason = use().answer(text, "length")
        assert (message["content"], message["tool_calls"], reason) == (text, [], "length")

    def test_a_call_left_open_is_read_as_vllm_reads_it(self) -> None:
        message, _ = use().answer('<tool_call>{"name": "now", "arguments": {}}', "length")
        assert (message["content"], calls_of(message)) == (None, [("now", "{}")])

    def test_without_parallel_calls_auto_keeps_the_first(self) -> None:
        message, _ = use(parallel_tool_calls=False).answer(HERMES_REPLY, "stop")
        assert calls_of(message) == HERMES_CALLS[:1]

    def test_required_and_named_read_hermes_calls(self) -> None:
        text = '<tool_call>\n{"name": "forecast", "arguments": {"days": 2}}\n</tool_call>' \
               '<tool_call>{"name": "now", "arguments": null}</tool_call>'
        message, reason = use(tool_choice="required").answer(text, "stop")
        assert (message["content"], calls_of(message), reason) == (
            "", [("forecast", '{"days": 2}'), ("now", "null")], "tool_calls")
        named = use(tool_choice={"type": "function", "function": {"name": "now"}})
        message, reason = named.answer(text.split("</tool_call>")[1] + "</tool_call>", "stop")
        assert (message["content"], calls_of(message), reason) == ("", [("now", "null")], "stop")
        message, reason = use(tool_choice="required").answer(text[:30], "length")  # cut short
        assert (message["content"], message["tool_calls"], reason) == (text[:30], [], "length")

    def test_without_a_format_required_reads_the_array_and_named_the_arguments(self) -> None:
        text = '[{"name": "forecast", "parameters": {"days": 2}}, {"name": "now", ' \
               '"parameters": {}}]'
        message, reason = use(None, tool_choice="required").answer(text, "stop")
        assert (message["content"], calls_of(message), reason) == (
            "", [("forecast", '{"days": 2}'), ("now", "{}")], "tool_calls")
        named = use(None, tool_choice={"type": "function", "function": {"name": "forecast"}})
        message, reason = named.answer('{"days": 5}', "stop")
        assert (calls_of(message), reason) == ([("forecast", '{"days": 5}')], "stop")

    def test_auto_reads_mistral_calls_and_the_content_before_them(self) -> None:
        message, reason = use("mistral").answer(MISTRAL_REPLY, "stop")
        assert (message["content"], calls_of(message), reason) == (
            "Let me look.", HERMES_CALLS, "tool_calls")
        assert all(len(call["id"]) == 9 and call["id"].isalnum()  # Mistral's ids, as vLLM's
                   for call in message["tool_calls"])
        message, _ = use("mistral").answer('[TOOL_CALLS] {"name": "now"}', "stop")
        assert (message["content"], calls_of(message)) == (None, [("now", "{}")])
        message, _ = use("mistral", parallel_tool_calls=False).answer(MISTRAL_REPLY, "stop")
        assert calls_of(message) == HERMES_CALLS[:1]

    @pytest.mark.parametrize(("text", "content"), [
        ("No tools needed.", "No tools needed."),
        ('[{"name": "now", "arguments": {}}]', '[{"name": "now", "arguments": {}}]'),
        ("Look: [TOOL_CALLS] {not json}", "{not json}"),
        ('[TOOL_CALLS] [{"days": 3}]', '[{"days": 3}]'),
    ], ids=["plain", "unmarked", "not-json", "no-call"])
    def test_mistral_text_that_does_not_read_as_calls_is_content(self, text: str,
                                                                 content: str) -> None:
        """As vLLM's parser: after a marker, what follows it is the content."""
        message, reason = use("mistral").answer(text, "length")
        assert (message["content"], message["tool_calls"], reason) == (content, [], "length")

    def test_mistral_required_and_named_read_the_array_without_its_marker(self) -> None:
        text = '[{"name": "forecast", "arguments": {"days": 2}}, {"name": "now", ' \
               '"arguments": {}}]'
        message, reason = use("mistral", tool_choice="required").answer(text, "stop")
        assert (message["content"], calls_of(message), reason) == (
            "", [("forecast", '{"days": 2}'), ("now", "{}")], "tool_calls")
        message, reason = use("mistral", tool_choice=NAMED_NOW).answer(
            '[{"name": "now", "arguments": {}}]', "stop")
        assert (message["content"], calls_of(message), reason) == ("", [("now", "{}")], "stop")
        message, reason = use("mistral", tool_choice="required").answer(text[:20], "length")
        assert (message["content"], message["tool_calls"], reason) == (text[:20], [], "length")

    def test_mistral_choices_keep_special_tokens_and_constrain_as_vllm(self) -> None:
        """vLLM's parser for a Hugging Face tokenizer before v11: the [TOOL_CALLS] token kept
        in the text unless the choice is 'none'; 'required' and a named function constrained
        to the array of {"name", "arguments"} (its `_build_guided_schema_pre_v11`)."""
        assert use("mistral").keeps_special_tokens and use("mistral").constraint() is None
        assert not use("mistral", tool_choice="none").keeps_special_tokens
        assert not use("hermes", tool_choice="required").keeps_special_tokens

        def schema(**body: Any) -> Any:
            constraint = use("mistral", **body).constraint()
            assert constraint is not None
            return json.loads(constraint["json"])

        def item(name: str) -> dict[str, Any]:
            return {"type": "object", "properties": {
                "name": {"type": "string", "enum": [name]},
                "arguments": SCHEMAS[name]}, "required": ["name", "arguments"]}

        assert schema(tool_choice="required", parallel_tool_calls=False) == {
            "type": "array", "minItems": 1,
            "items": {"type": "object", "anyOf": [item(name) for name in SCHEMAS]}}
        assert schema(tool_choice=NAMED_NOW) == {
            "type": "array", "minItems": 1, "maxItems": 1,
            "items": {"type": "object", "anyOf": [item("now")]}}

    def test_mistrals_v11_calls_are_not_read(self) -> None:
        """A tokenizer with [ARGS] writes `[TOOL_CALLS]name[ARGS]{...}`: no format is read, so
        'auto' is refused rather than misread."""
        assert tool_format("auto", "mistral", {"[TOOL_CALLS]": 9}) == "mistral"
        assert tool_format("auto", "mistral", {"[TOOL_CALLS]": 9, "[ARGS]": 32}) is None
        assert tool_format("mistral", None, {"[ARGS]": 32}) is None
        assert tool_format("none", "hermes", {}) is None
        assert tool_format("hermes", None, {}) == "hermes"

    def test_the_template_gets_the_tools_as_vllm_hands_them(self) -> None:
        """vLLM's dump of its request model: description and parameters null where absent,
        strict where given, other keys dropped (a tool's JSON in the prompt is vLLM's)."""
        extra = {"type": "function", "cache": True,
                 "function": {"name": "later", "strict": False, "examples": [1]}}
        assert use(tools=[NO_PARAMETERS, extra]).tools == [
            {"type": "function", "function": {"name": "now", "description": None,
                                              "parameters": None}},
            {"type": "function", "function": {"name": "later", "description": None,
                                              "parameters": None, "strict": False}}]

    def test_none_reads_nothing(self) -> None:
        message, reason = use(tool_choice="none").answer(HERMES_REPLY, "stop")
        assert (message, reason) == ({"role": "assistant", "content": HERMES_REPLY}, "stop")

    @pytest.mark.parametrize("piece", [1, 2, 5, 1000])
    def test_a_stream_gives_the_whole_replys_content_and_calls(self, piece: int) -> None:
        named = {"type": "function", "function": {"name": "now"}}
        for body, text in [({}, HERMES_REPLY), ({}, "Text that ends in <tool"),
                           ({}, "<tool_call>{broken"),
                           ({"tool_choice": "required"}, HERMES_REPLY),
                           ({"tool_choice": named},
                            '<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
                           ({"format": None, "tool_choice": "required"},
                            '[{"name": "now", "parameters": {}}]'),
                           ({"format": None, "tool_choice": named}, "{}"),
                           ({"format": "mistral"}, MISTRAL_REPLY),
                           ({"format": "mistral"}, "Text that ends in [TOOL"),
                           ({"format": "mistral", "tool_choice": "required"},
                            '[{"name": "now", "arguments": {}}]'),
                           ({"format": "mistral", "tool_choice": named},
                            '[{"name": "now", "arguments": {}}]')]:
            whole, reason = use(**body).answer(text, "stop")
            content, calls, streamed_reason = streamed(use(**body).stream(), text, piece)
            assert content == (whole["content"] or ""), (body, text)
            assert (calls, streamed_reason) == (calls_of(whole), reason), (body, text)

    @pytest.mark.parametrize(("body", "text", "takes"), [
        ({"tool_choice": "required"}, COMPACT_CALLS, True),
        ({"tool_choice": "required"}, "Let me look.", False),
        ({"tool_choice": "required"}, '<tool_call>{"name": "fly", "arguments": 1}</tool_call>',
         False),
        ({"tool_choice": "required"}, '<tool_call>{"name": "forecast", "arguments": '
                                      '{"days":9}}</tool_call>', False),  # strict: 1..7
        ({"tool_choice": "required"}, '<tool_call>{"name": "now", "arguments": [1,'
                                      '"x"]}</tool_call>', True),  # not strict: any JSON
        ({"tool_choice": {"type": "function", "function": {"name": "now"}}},
         '<tool_call>{"name": "forecast", "arguments": {"days":2}}</tool_call>', False),
        ({"parallel_tool_calls": False}, "Look: " + COMPACT_CALLS, False),  # a second call
        ({"parallel_tool_calls": False}, "Look: " + COMPACT_CALLS.split("</tool_call>")[0]
         + "</tool_call>", True),
        ({"parallel_tool_calls": False}, "Just text, no calls.", True),
    ], ids=["required", "required-text", "unknown-name", "strict-arguments", "loose-arguments",
            "named-other", "one-call-only", "one-call", "text"])
    def test_the_engines_constraint_takes_what_vllms_does(
        self, prep: Preprocessor, body: dict[str, Any], text: str, takes: bool
    ) -> None:
        """The hf backend's grammar for vLLM's structural tag (grammar.py's Lark; its JSON
        compact)."""
        constraint = use(**body).constraint()
        assert constraint is not None
        matcher = Grammars(hf_tokenizer(prep.tokenizer, vocab_size=len(prep.tokenizer),
                                        eos_token_ids=prep.eos_token_ids), capacity=1).matcher(
            StructuredOutputs(**constraint))
        ids = prep.tokenizer.encode(text, add_special_tokens=False)
        try:
            for token in ids:
                matcher.accept(token)
            ending = matcher.mask(torch.zeros(len(prep.tokenizer)))[prep.eos_token_ids[0]]
            taken = bool(ending == 0)  # the grammar lets the reply end here
        except RuntimeError:  # a token the grammar refuses
            taken = False
        assert taken == takes

    def test_a_stream_holds_back_only_what_may_open_a_call(self) -> None:
        stream = use().stream()
        assert stream.feed("Hello <to") == [{"content": "Hello "}]
        assert stream.feed("day") == [{"content": "<today"}]

    def test_the_structural_tags_are_vllms(self) -> None:
        """As vLLM 0.32 builds them (printed from its get_model_structural_tag): a strict
        tool's arguments follow its schema, another's are any JSON."""
        def tags(names: list[str]) -> list[dict[str, Any]]:
            return [{"type": "tag", "begin": begin + name + '", "arguments": ',
                     "content": {"type": "json_schema", "json_schema": SCHEMAS[name]
                                 if name != "now" else True, "style": "json",
                                 "any_order": False, "max_whitespace_cnt": None,
                                 "excludes": []}, "end": end}
                    for name in names for begin, end in [
                        ('<tool_call>\n{"name": "', '}\n</tool_call>'),
                        ('<tool_call>{"name": "', '}</tool_call>')]]

        def tag(**body: Any) -> Any:
            constraint = use(**body).constraint()
            return constraint and json.loads(constraint["structural_tag"])["format"]

        names = ["get_weather", "forecast", "now"]
        assert tag(tool_choice="required") == {
            "type": "tags_with_separator", "tags": tags(names), "separator": "",
            "at_least_one": True, "stop_after_first": False}
        assert tag(tool_choice={"type": "function", "function": {"name": "now"}}) == {
            "type": "tags_with_separator", "tags": tags(["now"]), "separator": "",
            "at_least_one": True, "stop_after_first": True}
        assert tag(parallel_tool_calls=False) == {
            "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags(names),
            "at_least_one": False, "stop_after_first": True, "excludes": []}
        assert tag() == {  # a strict tool: its calls are constrained where they open
            "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags(names),
            "at_least_one": False, "stop_after_first": False, "excludes": []}
        loose = tool_use({"tools": [NO_PARAMETERS]}, "hermes")
        assert loose is not None and loose.constraint() is None  # 'auto', nothing strict
        assert use(tool_choice="none").constraint() is None

    def test_without_a_format_the_required_schema_is_vllms(self) -> None:
        constraint = use(None, tool_choice="required", parallel_tool_calls=False).constraint()
        assert constraint is not None
        schema = json.loads(constraint["json"])
        assert schema == {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [name]},
                                "parameters": tool["function"].get("parameters") or {
                                    "type": "object", "properties": {}}},
                 "required": ["name", "parameters"]} for tool in TOOLS
                for name in [tool["function"]["name"]]]}}

    @pytest.mark.parametrize(("body", "pattern"), [
        ({"tools": [{"type": "function"}]}, r"tools\[0\]: must be"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]},
         r"tools\[0\].function.name: a name is required"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]},
         r"tools\[0\].function.parameters: must be a JSON schema object"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
         "tool_choice: the function 'fly' is not among the tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice: must be 'none'"),
        ({"tool_choice": "required"}, "tools: a non-empty list of tools is required"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls: must be a"),
    ], ids=["no-function", "no-name", "bad-parameters", "unknown-function", "unknown-choice",
            "no-tools", "bad-parallel"])
    def test_bad_tools_are_refused_by_name(self, body: dict[str, Any], pattern: str) -> None:
        with pytest.raises(RequestError, match=pattern):
            tool_use(body, "hermes")

    def test_auto_needs_a_format_and_the_others_do_not(self) -> None:
        with pytest.raises(RequestError, match="'auto' needs the model's tool-call format"):
            tool_use({"tools": TOOLS}, None)
        assert tool_use({"tools": TOOLS, "tool_choice": "required"}, None) is not None
        assert tool_use({}, None) is None and tool_use({"tool_choice": "none"}, None) is None


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module", params=["qwen2_vl", "mistral3"])
def family(request: pytest.FixtureRequest) -> str:
    """The tiny model served: Qwen2-VL reads hermes calls, Mistral 3 mistral ones."""
    return str(request.param)


@pytest.fixture(scope="module")
def server(module_run_dir: Path, model_dirs: dict[str, Path], family: str) -> Iterator[Server]:
    """`mmlane serve` with a chat template that renders tools (its `client`: conftest's): the
    tiny Qwen2-VL with Qwen2.5's tool section, the tiny Mistral 3 with its own."""
    args: list[str] = []
    if family == "qwen2_vl":
        template = module_run_dir / "tool-template.jinja"
        template.write_text(TOOL_TEMPLATE)
        args = ["--chat-template", str(template)]
    run_dir = module_run_dir / family
    run_dir.mkdir()
    with serve_http(run_dir, model_dirs[family], *args) as served:
        yield served


@pytest.fixture(scope="module")
def served_prep(model_dirs: dict[str, Path], family: str) -> Preprocessor:
    return load_preprocessor(model_dirs[family])


@pytest.fixture(scope="module")
def bias(served_prep: Preprocessor, family: str) -> dict[str, int]:
    """The served model's `ends`."""
    return ends(served_prep, array=family == "mistral3")


CLOSED_TOOLS = [WEATHER, FORECAST]
"""Strict tools whose arguments the tiny model cannot write on forever (NO_PARAMETERS takes any
JSON)."""


def ends(prep: Preprocessor, *, array: bool = False) -> dict[str, int]:
    """A bias on the end of text: without it the tiny model would go on calling to max_tokens
    wherever the grammar lets it (another call, or text after one). With `array` (Mistral's
    calls are one JSON array), on the array's end too."""
    bias = {str(prep.eos_token_ids[0]): 10}
    if array:
        bias[str(prep.tokenizer.convert_tokens_to_ids("]"))] = 10
    return bias


def ask(client: openai.OpenAI, server: Server, **fields: Any) -> Any:
    fields = {"model": server.model, "max_tokens": 100, "temperature": 0, "tools": CLOSED_TOOLS,
              "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return client.chat.completions.create(**fields)


def joined_stream(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed choice's content, calls (their pieces joined) and finish reason."""
    content, calls, reason = "", {}, ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""),
                                 arguments + (call.function.arguments or ""))
        reason = chunk.choices[0].finish_reason or reason
    return content, list(calls.values()), reason


class TestOverHttp:
    @pytest.mark.parametrize("parallel", [True, False])
    def test_required_gives_valid_calls_whole_and_streamed(
        self, client: openai.OpenAI, server: Server, bias: dict[str, int], parallel: bool
    ) -> None:
        fields = {"tool_choice": "required", "parallel_tool_calls": parallel,
                  "logit_bias": bias}
        choice = ask(client, server, **fields).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls and (parallel or len(calls) == 1)
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        streamed_calls = joined_stream(list(ask(client, server, stream=True, **fields)))
        assert streamed_calls == ("", calls, "tool_calls")

    def test_a_named_function_gets_its_arguments(self, client: openai.OpenAI, server: Server,
                                                 bias: dict[str, int]) -> None:
        named = {"type": "function", "function": {"name": "get_weather"}}
        choice = ask(client, server, tool_choice=named, logit_bias=bias).choices[0]
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert joined_stream(list(ask(client, server, tool_choice=named, stream=True,
                                      logit_bias=bias))) == (
            "", [("get_weather", call.function.arguments)], "stop")

    def test_the_template_renders_the_tools_and_the_calls_history(
        self, server: Server, served_prep: Preprocessor, family: str
    ) -> None:
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call-1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call-1", "content": "21 degrees"},
        ]
        status, body = _post_json(f"{_root(server.base_url)}/tokenize",
                                  {"messages": messages, "tools": TOOLS})
        assert status == 200, body
        prompt = served_prep.tokenizer.decode(body["tokens"])
        as_vllm = {"type": "function", "function": {
            key: WEATHER["function"][key] for key in ("name", "description", "parameters",
                                                      "strict")}}
        assert json.dumps(as_vllm) in prompt  # the tools, as vLLM hands them to the template
        call, result = {
            "qwen2_vl": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                         '"unit": "c"}}\n</tool_call>',
                         "<tool_response>\n21 degrees\n</tool_response>"),
            "mistral3": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                         '"unit": "c"}, "id": "call-1"}]</s>',
                         '[TOOL_RESULTS] {"content": 21 degrees, "call_id": "call-1"}'
                         '[/TOOL_RESULTS]')}[family]
        assert call in prompt and result in prompt

    @pytest.mark.parametrize(("fields", "param", "pattern"), [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined with tool_choice 'required'"),
        ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice",
         "the function 'fly' is not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools",
         "a name is required"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "now",
                                                         "arguments": "{oops"}}]}]},
         None, r"messages\[0\].tool_calls\[0\].function.arguments: not JSON"),
    ], ids=["with-response-format", "unknown-function", "nameless", "bad-history"])
    def test_bad_tool_requests_are_400s(self, client: openai.OpenAI, server: Server,
                                        fields: dict[str, Any], param: str | None,
                                        pattern: str) -> None:
        error = _status_error(client, server, **{"tools": TOOLS, **fields})
        _assert_error(error, 400, "invalid_request", pattern)
        if param is not None:
            assert error.response.json()["error"]["param"] == param

    def test_completions_take_no_tools(self, client: openai.OpenAI, server: Server) -> None:
        with pytest.raises(openai.BadRequestError, match="tools: not supported"):
            client.completions.create(model=server.model, prompt="hi", max_tokens=2,
                                      extra_body={"tools": TOOLS})


@pytest.mark.parametrize(("family", "reply"), [("qwen2_vl", HERMES_REPLY),
                                               ("mistral3", MISTRAL_REPLY)],
                         ids=["hermes", "mistral"])
def test_auto_reads_the_models_calls_whole_and_streamed(
    run_dir: Path, model_dirs: dict[str, Path], family: str, reply: str
) -> None:
    """The engine is this test's socket, answering with the tokens of a reply in the family's
    format (the tiny model writes none of its own): 'auto' reads its calls, a token at a time
    when streamed. Mistral's [TOOL_CALLS] is a special token: the text keeps it for 'auto', and
    for a client that asks (`skip_special_tokens` false), not for 'none'; the end of sequence
    that ends the reply never shows."""
    model_dir = model_dirs[family]
    prep = load_preprocessor(model_dir)  # the reply ends as the model's do: its text does not
    ids = [*prep.tokenizer.encode(reply, add_special_tokens=False), prep.eos_token_ids[0]]

    def whole(request: Any) -> EngineOutput:
        return EngineOutput(request_id=request.request_id, token_ids=ids, finished=True,
                            finish_reason="stop", prompt_token_ids=request.prompt_token_ids)

    with frontend_with_silent_engine(run_dir, model_dir) as (_, base_url, engine), \
            openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                          timeout=60) as client:
        create = functools.partial(client.chat.completions.create, model=model_dir.name,
                                   messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
        choice = _answered(engine, create, whole).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
        assert [(c.function.name, c.function.arguments)
                for c in choice.message.tool_calls] == HERMES_CALLS

        def one_token_at_a_time(request: Any) -> EngineOutput:
            for token in ids[:-1]:
                engine.reply(request.reply_to, EngineOutput(
                    request_id=request.request_id, token_ids=[token],
                    prompt_token_ids=request.prompt_token_ids if token == ids[0] else None))
            return EngineOutput(request_id=request.request_id, token_ids=ids[-1:],
                                finished=True, finish_reason="stop")

        chunks = _answered(engine, lambda: list(create(stream=True)), one_token_at_a_time)
        assert joined_stream(chunks) == ("Let me look.", HERMES_CALLS, "tool_calls")
        if family == "mistral3":
            unmarked = reply.replace("[TOOL_CALLS]", "")
            none = _answered(engine, functools.partial(create, tool_choice="none"), whole)
            assert none.choices[0].message.content == unmarked
            asked = _answered(engine, functools.partial(
                create, tools=None, extra_body={"skip_special_tokens": False}), whole)
            assert asked.choices[0].message.content == reply
