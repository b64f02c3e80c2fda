"""Tool calling on the OpenAI API, as vLLM 0.32 serves it (`vllm serve
--enable-auto-tool-choice --tool-call-parser hermes|mistral`): a request's `tools`, `tool_choice`
and `parallel_tool_calls` checked, and each choice's text turned into `tool_calls`, whole or
streamed.

    tool_format(parser, ...)    the format replies are read in (--tool-call-parser)
    tool_use(body, format)      the request's ToolUse (None: no tools asked about), or a
                                RequestError naming the field
    ToolUse.constraint()        the native structured_outputs that constrains the reply, as
                                vLLM's server builds it (so a greedy reply is vLLM's); None: free
    ToolUse.keeps_special_tokens    the reply's text keeps special tokens (a Mistral call's
                                [TOOL_CALLS] is one)
    ToolUse.answer(text, reason)    a whole reply's message and finish reason
    ToolUse.stream()            a ToolStream: feed(text) and finish(reason) give the deltas

The tools reach the model through the chat template (the native ChatRequest's `tools`); what
the model answers stays text until here, so the native API gives the text itself.

With the model's tool-call format known (`hermes`, Qwen's: a `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` per call, content before the first), every reply is read in it,
and the constraint is vLLM's structural tag for it (`VLLM_ENFORCE_STRICT_TOOL_CALLING`, on by
default): 'required' is one or more calls of the tools, a named function one call of it,
'auto' is free text unless a tool is `strict` or `parallel_tool_calls` is false, then each call
it opens is constrained. A call's arguments follow its parameters' schema only for a `strict`
tool (else any JSON, as vLLM's default strict level has it). Text that does not read as calls
stays content, as in vLLM.

With `mistral` (Mistral 3's before its v11 tokenizer, read as vLLM's parser reads a Hugging Face
tokenizer without `[ARGS]`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, content
before it), the reply's text keeps special tokens (vLLM sets skip_special_tokens false) so that
the [TOOL_CALLS] token shows; 'auto' is free text, 'required' and a named function are
constrained to that array without its marker (a named one holds one call), whatever `strict`.

Without a format ('none'), 'auto' is refused and 'required' and a named function take vLLM's
JSON forms (an array of {"name", "parameters"}; the arguments).

With `parallel_tool_calls` false, a reply's first call is its only one (vLLM drops the others).

A streamed reply sends its content as it comes, holding back only what may be the start of a
call's marker; the calls follow when the reply ends, each whole in one delta (vLLM streams
their arguments in pieces; a client that joins the pieces, as OpenAI's clients do, gets the
same calls).
"""

from __future__ import annotations

import json
import logging
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from mmlane.protocol.errors import RequestError

log = logging.getLogger(__name__)
Choice = Literal["none", "auto", "required", "named"]
_OPENERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
"""What a call begins with, in each format read (vLLM's --tool-call-parser names)."""
_HERMES_OPEN = _OPENERS["hermes"]
_HERMES_ENVELOPES = (("<tool_call>\n{\"name\": \"", "}\n</tool_call>"),
                     ("<tool_call>{\"name\": \"", "}</tool_call>"))
"""The two ways a hermes call may be written, begin (before the name) and end, as vLLM's
structural tag takes them."""
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Call:
    """One tool call read out of a reply."""

    name: str
    arguments: str
    """JSON text."""
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI writes it in a message (or, with its `index`, in a delta)."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Function:
    """A tool's function, as its calls are constrained."""

    parameters: dict[str, Any] | None
    """Its arguments' JSON schema (None: none given)."""
    strict: bool
    """Its arguments must follow the schema (OpenAI's `strict`)."""


def tool_format(parser: str, family_format: str | None, vocab: dict[str, int]) -> str | None:
    """The format to read tool calls in: --tool-call-parser `parser` ('auto': the family's
    `family_format`; 'none': None). Mistral's v11 format (`[TOOL_CALLS]name[ARGS]{...}`, a
    tokenizer with `[ARGS]`, Mistral Small 3.2 on) is not read: None, and a warning says so."""
    format = family_format if parser == "auto" else None if parser == "none" else parser
    if format == "mistral" and "[ARGS]" in vocab:
        log.warning("tool calls: this tokenizer writes Mistral's v11 calls ([TOOL_CALLS]name"
                    "[ARGS]{...}), which are not read; tool_choice 'auto' is refused")
        return None
    return format


def tool_use(body: dict[str, Any], format: str | None) -> ToolUse | None:
    """The tool use a chat body asks for; None when it has neither tools nor a tool_choice.
    `format`: the model's tool-call format, 'hermes' or 'mistral' (None: none known, 'auto'
    is refused)."""
    tools: Any = body.get("tools")
    choice = body.get("tool_choice")
    if not tools and choice in (None, "none"):
        return None
    functions = _functions(tools)
    kind: Choice
    name = None
    if choice is None or choice in ("none", "auto", "required"):
        kind = choice or "auto"
    elif isinstance(choice, dict):
        kind, name = "named", _named(choice, functions)
    else:
        raise RequestError(f"tool_choice: must be 'none', 'auto', 'required' or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
    if kind == "auto" and format is None:
        raise RequestError("tool_choice: 'auto' needs the model's tool-call format, and none is "
                           "known for this model (--tool-call-parser); 'required' or a named "
                           "function work with every model")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls: must be a boolean, got {parallel!r}")
    return ToolUse([_as_vllm_renders(tool["function"]) for tool in tools], functions, kind,
                   name, parallel, format)


def _as_vllm_renders(function: dict[str, Any]) -> dict[str, Any]:
    """A checked tool as vLLM hands it to the chat template (its request model's dump): the
    function's name, description and parameters (null where absent), its `strict` where given,
    nothing else."""
    rendered = {key: function.get(key) for key in ("name", "description", "parameters")}
    if "strict" in function:
        rendered["strict"] = function["strict"]
    return {"type": "function", "function": rendered}


def _functions(tools: Any) -> dict[str, Function]:
    """Each tool's function, by name."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools: a non-empty list of tools is required for tool_choice")
    functions: dict[str, Function] = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict):
            raise RequestError(f"tools[{index}]: must be {{'type': 'function', 'function': "
                               f"{{'name': ..., 'parameters': {{...}}}}}}")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{index}].function.name: a name is required")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"tools[{index}].function.parameters: must be a JSON schema "
                               "object")
        functions[name] = Function(parameters, function.get("strict") is True)
    return functions


def _named(choice: dict[str, Any], functions: dict[str, Function]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice: a named choice is {'type': 'function', 'function': "
                           "{'name': ...}}")
    if name not in functions:
        raise RequestError(f"tool_choice: the function {name!r} is not among the tools "
                           f"({', '.join(functions)})")
    return name


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and how its replies use them."""

    tools: list[dict[str, Any]]
    """As the chat template gets them (vLLM's form of the client's)."""
    functions: dict[str, Function]
    choice: Choice
    name: str | None
    """The function a named choice calls."""
    parallel: bool
    format: str | None
    """The model's tool-call format ('hermes' or 'mistral'; None: none known)."""

    @property
    def keeps_special_tokens(self) -> bool:
        """The reply's text is to keep special tokens: a Mistral call's marker is one."""
        return self.format == "mistral" and self.choice != "none"

    def constraint(self) -> dict[str, Any] | None:
        """The native structured_outputs vLLM's server puts on the reply (module docstring);
        None: the reply is free."""
        if self.choice == "none":
            return None
        if self.format == "hermes":
            return self._hermes_tag()
        if self.format == "mistral":
            return self._mistral_array()
        if self.choice == "named":
            assert self.name is not None
            return {"json": json.dumps(self.functions[self.name].parameters or _EMPTY_OBJECT)}
        if self.choice != "required":
            return None
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {
            "type": "object", "anyOf": [_call_schema(name, function.parameters)
                                        for name, function in self.functions.items()]}}
        if not self.parallel:
            schema["maxItems"] = 1
        definitions = _definitions(self.functions)
        if definitions:
            schema["$defs"] = definitions
        return {"json": json.dumps(schema)}

    def _hermes_tag(self) -> dict[str, Any] | None:
        """vLLM's structural tag for hermes calls (its `_hermes_style_structural_tag`, at the
        default strict level): None for 'auto' with no strict tool and parallel calls."""
        if self.choice == "auto" and self.parallel and \
                not any(function.strict for function in self.functions.values()):
            return None
        # parallel_tool_calls false raises the strict level to the calls' envelope
        names = [self.name] if self.name is not None else list(self.functions)
        tags = [{"type": "tag", "begin": begin + name + '", "arguments": ',
                 "content": _json_content(self.functions[name]), "end": end}
                for name in names for begin, end in _HERMES_ENVELOPES]
        single = self.choice == "named" or not self.parallel
        if self.choice == "auto":
            form = {"type": "triggered_tags", "triggers": [_HERMES_OPEN], "tags": tags,
                    "at_least_one": False, "stop_after_first": single, "excludes": []}
        else:
            form = {"type": "tags_with_separator", "tags": tags, "separator": "",
                    "at_least_one": True, "stop_after_first": single}
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": form})}

    def _mistral_array(self) -> dict[str, Any] | None:
        """vLLM's schema for Mistral's calls without their marker (its
        `_build_guided_schema_pre_v11`): None for 'auto'."""
        if self.choice == "auto":
            return None
        names = [self.name] if self.name is not None else list(self.functions)
        schema: dict[str, Any] = {"type": "array", "minItems": 1}
        if self.choice == "named":
            schema["maxItems"] = 1
        schema["items"] = {"type": "object", "anyOf": [
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": [name]},
                            "arguments": self.functions[name].parameters or {"type": "object"}},
             "required": ["name", "arguments"]} for name in names]}
        return {"json": json.dumps(schema)}

    def calls(self, text: str) -> tuple[str | None, list[Call]]:
        """A whole reply's content and its tool calls (vLLM's parser's reading)."""
        if self.choice == "none":
            return text, []
        if self.format is not None:
            content, calls = _hermes_calls(text) if self.format == "hermes" else \
                _mistral_calls(text, marked=self.choice == "auto")
            if self.choice != "auto":  # vLLM's message: "" rather than null
                content = content or ""
            return content, calls if self.parallel else calls[:1]
        if self.choice == "named":
            assert self.name is not None
            return "", ([Call(self.name, text)] if text.strip() else [])
        return "", _required_calls(text)

    def answer(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """A whole reply's message and its finish reason: 'tool_calls' when 'auto' found calls
        or 'required' ended its array ('stop'), as in vLLM; a named call keeps its reason."""
        content, calls = self.calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.choice != "none":
            message["tool_calls"] = [call.openai() for call in calls]
        return message, self.finish_reason(calls, reason)

    def finish_reason(self, calls: list[Call], reason: str) -> str:
        if (self.choice == "auto" and calls) or (self.choice == "required" and reason == "stop"):
            return "tool_calls"
        return reason

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice's deltas: content as it comes, the calls when the reply ends (a
    named call's arguments as they come)."""

    def __init__(self, use: ToolUse) -> None:
        self._use = use
        self._held = ""
        """Text not sent yet: all of it for 'required', from a call's marker on for 'auto'."""
        self._calling = False
        """'auto': the reply has opened a call, so the rest is held for the calls."""
        self._named = Call(use.name, "") if use.name is not None and use.format is None \
            else None
        """A named call without a format: its arguments are the reply, streamed as they come."""
        self._named_opened = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas for the reply's next text."""
        if not text:
            return []
        if self._use.choice == "none":
            return [{"content": text}]
        if self._named is not None:
            deltas = [] if self._named_opened else [{"tool_calls": [self._named.openai(0)]}]
            self._named_opened = True
            return [*deltas, {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        self._held += text
        if self._use.choice != "auto" or self._calling:  # calls' JSON: held to the end
            return []
        assert self._use.format is not None  # 'auto' is refused without one (tool_use)
        opener = _OPENERS[self._use.format]
        start = self._held.find(opener)
        if start >= 0:
            self._calling = True
            content, self._held = self._held[:start], self._held[start:]
        else:
            keep = _open_prefix(self._held, opener)
            content, self._held = self._held[:len(self._held) - keep], self._held[
                len(self._held) - keep:]
        return [{"content": content}] if content else []

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The deltas left when the reply ends, and its finish reason."""
        if self._named is not None:
            calls = [self._named] if self._named_opened else []
            return [], self._use.finish_reason(calls, reason)
        held, self._held = self._held, ""
        content, calls = self._use.calls(held)  # before a call's marker: all content, no call
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        deltas += [{"tool_calls": [call.openai(index)]} for index, call in enumerate(calls)]
        return deltas, self._use.finish_reason(calls, reason)


def _open_prefix(text: str, opener: str) -> int:
    """The length of the longest end of `text` that may begin `opener`."""
    for length in range(min(len(text), len(opener) - 1), 0, -1):
        if opener.startswith(text[-length:]):
            return length
    return 0


def _hermes_calls(text: str) -> tuple[str | None, list[Call]]:
    """vLLM's hermes reading: the JSON of each `<tool_call>` (the last may be left open);
    content is the text before the first (None when empty). Text whose calls do not parse
    is all content, with no calls."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    try:
        raw = [json.loads(closed or left_open) for closed, left_open in _HERMES.findall(text)]
        calls = [Call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))
                 for call in raw]
    except (ValueError, KeyError, TypeError):
        return text, []
    return text[:start] or None, calls


def _mistral_calls(text: str, *, marked: bool) -> tuple[str | None, list[Call]]:
    """vLLM's reading of Mistral calls (its parser's pre-v11 path): the first JSON value after
    a `[TOOL_CALLS]` (or, not `marked`, the whole text when it has none), an object being one
    call; content is the text before the marker (None when blank). Text with no call in it is
    the content: what follows the marker, or the whole reply when there is none."""
    opener = _OPENERS["mistral"]
    if opener in text:
        content, *segments = text.split(opener)
        raw = next((segment.strip() for segment in segments if segment.strip()), "")
    elif not marked:
        content, raw = None, text.strip()
    else:
        return text, []
    try:
        parsed: Any = json.JSONDecoder().raw_decode(raw)[0]
    except ValueError:
        found = re.findall(r"\[{.*}\]", raw, re.DOTALL)
        try:
            parsed = json.loads(found[0]) if found else None
        except ValueError:
            parsed = None
    calls = [Call(call["name"] if isinstance(call.get("name"), str) else "",
                  _arguments_text(call.get("arguments")), _mistral_id())
             for call in (parsed if isinstance(parsed, list) else [parsed])
             if isinstance(call, dict) and ("name" in call or "arguments" in call)]
    if not calls:
        return raw, []
    return (content if content and content.strip() else None), calls


def _mistral_id() -> str:
    """A call's id as Mistral writes them (vLLM's too): nine letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _arguments_text(arguments: Any) -> str:
    """A Mistral call's arguments as JSON text ("{}" when absent; a string is kept)."""
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _required_calls(text: str) -> list[Call]:
    """The calls of a 'required' reply, a JSON array of {"name", "parameters"} (none when it
    is not one: the reply was cut short)."""
    try:
        raw = json.loads(text)
        return [Call(call["name"], json.dumps(call.get("parameters"), ensure_ascii=False))
                for call in raw]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    parameters = {key: value for key, value in (parameters or _EMPTY_OBJECT).items()
                  if key != "$defs"}
    return {"properties": {"name": {"type": "string", "enum": [name]},
                           "parameters": parameters or _EMPTY_OBJECT},
            "required": ["name", "parameters"]}


def _json_content(function: Function) -> dict[str, Any]:
    """A call's arguments in vLLM's structural tag: its schema if it is strict, else any JSON."""
    schema: Any = (function.parameters or _EMPTY_OBJECT) if function.strict else True
    return {"type": "json_schema", "json_schema": schema, "style": "json", "any_order": False,
            "max_whitespace_cnt": None, "excludes": []}


def _definitions(functions: dict[str, Function]) -> dict[str, Any]:
    """The tools' `$defs`, merged into the array's (vLLM's); one name with two schemas is
    refused."""
    merged: dict[str, Any] = {}
    for name, function in functions.items():
        definitions = (function.parameters or {}).get("$defs", {})
        if not isinstance(definitions, dict):
            raise RequestError(f"tools: the $defs of the parameters of {name!r} must be an "
                               "object")
        for key, schema in definitions.items():
            if merged.setdefault(key, schema) != schema:
                raise RequestError(f"tools: the definition {key!r} has two schemas")
    return merged
