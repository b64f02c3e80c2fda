"""Structured output with llguidance: the grammar of a request's `structured_outputs` (a JSON
schema, any JSON object, a regex, a choice of texts, or a Lark or GBNF grammar), checked
by the frontend before it admits the request, compiled once per constraint by the HF engine,
which masks each step's logits to the tokens the grammar allows.

    check_grammar(structured)        raise RequestError naming the field if it cannot compile
    Grammars(tokenizer, ...)         compiled grammars, an LRU bounded by count (the engine's)
    Grammar                          one request's matcher: mask the logits, accept a token

llguidance, not xgrammar: it is one 3 MB wheel with no dependencies (xgrammar brings triton and
a TVM runtime into a CPU install), it computes each mask lazily in Rust with no ahead-of-time
pass over the vocabulary, and vLLM uses it too (its "guidance" backend, and the fallback of
"auto" for schemas xgrammar cannot take; vLLM 0.32 pins llguidance 1.7, as pyproject.toml does,
so one environment serves both backends). JSON is compact (no whitespace between tokens), and
the vllm backend asks vLLM for the same.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np

from mmlane.protocol.errors import RequestError
from mmlane.protocol.sampling import StructuredOutputs

if TYPE_CHECKING:
    import torch

FIELD = "structured_outputs"
_ANY_OBJECT = '{"type": "object"}'
_NAMES = {"json": "the JSON schema", "json_object": "the JSON schema", "regex": "the regex",
          "choice": "the choice", "grammar": "the grammar",
          "structural_tag": "the tool calls' structural tag"}
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def check_grammar(structured: StructuredOutputs) -> None:
    """Raise RequestError naming the field when the constraint does not make a valid grammar."""
    problem = llguidance.LLMatcher.validate_grammar(_grammar_text(structured))
    if problem:
        raise RequestError(f"{FIELD}: {_NAMES[structured.kind()]} cannot be used: {problem}")


def hf_tokenizer(tokenizer: Any, *, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer, for `vocab_size` logits (the model's
    embedding rows, which may be more than the tokenizer's tokens)."""
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                        eos_token=eos_token_ids)


class Grammars:
    """The compiled grammar of each recent constraint, at most `capacity` of them: a repeated
    schema is compiled once, and each request gets its own copy of the compiled matcher."""

    def __init__(self, tokenizer: Any, capacity: int) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._compiled: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, structured: StructuredOutputs) -> Grammar:
        """A new request's matcher for `structured`; RequestError if it does not compile."""
        compiled = self._compiled.get(structured)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._tokenizer, _grammar_text(structured),
                                            log_level=0)
            if compiled.is_error():
                raise RequestError(f"{FIELD}: {_NAMES[structured.kind()]} cannot be used: "
                                   f"{compiled.get_error()}")
            self._compiled[structured] = compiled
            if len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(structured)
        return Grammar(compiled.deep_copy())


class Grammar:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (vocab,) with every token the grammar forbids next set to -inf."""
        import torch  # here: the frontend checks grammars without torch (services/cli.py)

        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[0]].astype(bool)
        forbidden = torch.from_numpy(~allowed).to(logits.device)
        return logits.masked_fill(forbidden, float("-inf"))

    def accept(self, token: int) -> None:
        """Move past `token`, which `mask` allowed."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the output is complete: the grammar takes nothing more (but end of text)."""
        return self._matcher.is_stopped()


def _grammar_text(structured: StructuredOutputs) -> str:
    """llguidance's grammar for the constraint; RequestError when its text cannot be read."""
    kind = structured.kind()
    try:
        if structured.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(structured.regex)
        if structured.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(structured.choice))
        if structured.grammar is not None:  # Lark, or GBNF turned into Lark
            return llguidance.grammar_from("grammar", structured.grammar)
        if structured.structural_tag is not None:
            return llguidance.LLMatcher.grammar_from_lark(
                _tag_lark(json.loads(structured.structural_tag)["format"]))
        schema = structured.json if structured.json is not None else _ANY_OBJECT
        # compact JSON: a small model may otherwise emit whitespace until max_tokens
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        problem = "is not a JSON object" if kind in ("json", "json_object") else "cannot be read"
        raise RequestError(f"{FIELD}: {_NAMES[kind]} {problem}: {exc}") from exc


def _tag_lark(form: dict[str, Any]) -> str:
    """Lark for the structural tags tools.py builds (vLLM's, for xgrammar): calls each written
    as one of its tags, `begin`, JSON, `end`; one or more of them (`tags_with_separator`, no
    separator), or text with a call wherever a trigger opens one (`triggered_tags`: llguidance's
    lazy lexeme ends the text at the trigger, as its StructTag does). Its JSON is compact, as
    elsewhere here."""
    if form["type"] == "tags_with_separator":
        calls = _tags(form["tags"])
        return f"start: call{'' if form['stop_after_first'] else '+'}\ncall: {calls}\n"
    [trigger] = form["triggers"]
    rests = _tags(form["tags"], opened=trigger)
    start = "call | TEXT" if form["stop_after_first"] else "call* TEXT"
    return (f"start: {start}\ncall: opened ({rests})\n"
            f"opened[lazy]: TEXT {json.dumps(trigger)}\nTEXT: /(.|\\n)*/\n")


def _tags(tags: list[dict[str, Any]], opened: str = "") -> str:
    """The tags as Lark alternatives, each `begin` (less the `opened` text before it), JSON,
    `end`."""
    return " | ".join(f"{json.dumps(tag['begin'].removeprefix(opened))} "
                      f"{_tag_json(tag['content'])} {json.dumps(tag['end'])}" for tag in tags)


def _tag_json(content: dict[str, Any]) -> str:
    schema = content["json_schema"]
    return "%json " + json.dumps({**(schema if isinstance(schema, dict) else {}), **_COMPACT})
