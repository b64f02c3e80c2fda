"""Incremental detokenization: an output's text chunk by chunk, in work that does not grow with it.

Re-decoding the whole output for every streamed chunk costs time quadratic in its length. An
`IncrementalDetokenizer` decodes only a short window instead (the prefix/read offsets of vLLM's
`detokenize_incrementally`, also the algorithm of tokenizers' `DecodeStream`):

    ids:    ... | prefix_offset ... read_offset | new ids ...
                  └─ already emitted, decoded ─┘
                     again as context

The window starts a little before the new ids so that a decoder which treats the start of a
text specially (a SentencePiece leading space) decodes the new ids as it would mid-text; the
text beyond the context's own decoding is the new chunk. A chunk that ends in U+FFFD is held back
(the new ids may end inside a multi-byte character that the next id completes), and so is an
empty one. The final chunk ends at the last id after which the text is whole: ids that end
inside a character at the output's end are never shown, as vLLM never shows them (its
detokenizer holds them back token by token, and nothing flushes them). For a byte-level BPE
tokenizer the chunks then concatenate exactly to decoding the output's ids up to that last
whole id at once: the window only moves past ids whose bytes end on a complete character,
where UTF-8 decoding restarts cleanly.

`TokenTexts` gives the texts of the tokens in an output's logprobs, one token at a time, as
vLLM's logprobs show them.
`OutputText` adds stop strings (vLLM's `stop`, without `include_stop_str_in_output`): the text
ends just before the first stop string to complete, also when it spans several tokens. While
streaming, `StopStrings` holds back only the tail that may still become a stop string, so no
text past one is ever sent; the scan looks only at the new text and that short tail.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of one output as its token ids arrive; `decode` is the tokenizer's (the same
    options as whole decoding, e.g. skipping special tokens)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        """The window: the ids from the prefix offset on (older ones are dropped)."""
        self._read_offset = 0
        """Where in the window the ids not yet emitted start."""

    def step(self, token_ids: Iterable[int], *, final: bool = False) -> str:
        """The text the new ids add, or "" while it may still change (see the module docstring);
        with `final`, all that is not yet emitted up to the last id after which it is whole."""
        self._ids.extend(token_ids)
        context = self._decode(self._ids[: self._read_offset])
        text = self._decode(self._ids)
        if final:
            end = len(self._ids)
            while text.endswith(_REPLACEMENT) and end > self._read_offset:
                end -= 1
                text = self._decode(self._ids[:end])
        elif len(text) <= len(context) or text.endswith(_REPLACEMENT):
            return ""
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        return text[len(context) :]



class TokenTexts:
    """The text of each token in one output's logprobs, as vLLM's logprobs show it
    (vllm/v1/engine/logprobs.py, `convert_ids_list_to_tokens`): a token decoded alone, special
    tokens included, with the leading spaces of a SentencePiece piece kept; one that ends inside
    a multi-byte character (its text ends in U+FFFD) is what it completes after up to `CONTEXT`
    preceding output tokens, or "" while still incomplete."""

    CONTEXT = 4
    """Preceding output tokens looked at: enough for any UTF-8 character (vLLM's bound)."""

    def __init__(self, tokenizer: Any, space_marker: str | None) -> None:
        self._tokenizer = tokenizer  # a transformers tokenizer
        self._space_marker = space_marker
        """The tokenizer's `space_marker`, computed once per tokenizer."""
        self._context: list[int] = []
        """The latest output tokens, oldest first."""

    def position(self, token_ids: list[int]) -> list[str]:
        """The texts of `token_ids`, candidates at the output's next position."""
        texts = [self._alone(token_id) for token_id in token_ids]
        return [self._completed(token_id) if text.endswith(_REPLACEMENT) else text
                for token_id, text in zip(token_ids, texts, strict=True)]

    def advance(self, token_id: int) -> None:
        """The output's next token is `token_id`: context for the positions after it."""
        self._context = [*self._context, token_id][-self.CONTEXT :]

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids) or "")

    def _alone(self, token_id: int) -> str:
        text = self._decode([token_id])
        if self._space_marker is None:
            return text
        # decode() drops the markers a piece starts with: give their spaces back.
        piece = str(self._tokenizer.convert_ids_to_tokens(token_id))
        missing = (len(piece) - len(piece.lstrip(self._space_marker))
                   - (len(text) - len(text.lstrip(" "))))
        return " " * missing + text if missing > 0 else text

    def _completed(self, token_id: int) -> str:
        for count in range(1, len(self._context) + 1):
            context = self._context[-count:]
            text = self._decode([*context, token_id])
            if text.endswith(_REPLACEMENT):
                continue
            # Context tokens that were incomplete themselves give their bytes to this token.
            clean = count
            while clean and self._decode([context[clean - 1]]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = self._decode(context[:clean]) if clean else ""
            if not text.startswith(prefix):  # normalisation changed it: keep what differs
                prefix = prefix[: _common_prefix(prefix, text)]
            return text[len(prefix) :]
        return ""


def space_marker(tokenizer: Any) -> str | None:
    """The word-start marker of a SentencePiece-style tokenizer (its pre-tokenizer is Metaspace,
    e.g. Llama's "\u2581"), whose leading instances decode() drops; None for others (byte-level
    BPE such as Qwen's decodes a token alone faithfully)."""
    try:
        pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    except (AttributeError, ValueError):
        return None
    for part in [pre, *pre.get("pretokenizers", [])]:
        if part.get("type") == "Metaspace":
            return str(part.get("replacement", "\u2581"))
    return None


def _common_prefix(first: str, second: str) -> int:
    """How many characters two strings share at their start."""
    count = 0
    while count < min(len(first), len(second)) and first[count] == second[count]:
        count += 1
    return count
class StopStrings:
    """A streamed text cut just before the first stop string to complete in it (of those that
    complete at the same character, the longest): what of it may be sent so far."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = stop
        self._held = ""
        """Text not sent yet: the longest tail that is the start of a stop string."""

    def step(self, text: str, *, final: bool = False, search: bool = True) -> tuple[str, bool]:
        """The text that may be sent now, and whether a stop string ended it (then nothing more
        comes). With `final` nothing is held back; without `search` no stop string may complete
        in `text` (vLLM's min_tokens), but one may start there."""
        buffer = self._held + text
        cut = self._first_stop(buffer, len(self._held)) if search else None
        if cut is not None:
            self._held = ""
            return buffer[:cut], True
        keep = len(buffer) - (0 if final else self._could_start(buffer))
        self._held = buffer[keep:]
        return buffer[:keep], False

    def _first_stop(self, buffer: str, new_from: int) -> int | None:
        """Where the stop string that completes first in `buffer` starts; only matches that end
        in its new text (from `new_from`) count: the held text never holds a whole one."""
        found = []
        for stop in self._stop:
            start = buffer.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0:
                found.append((start + len(stop), start))
        return min(found)[1] if found else None

    def _could_start(self, buffer: str) -> int:
        """The length of the longest tail of `buffer` that is the start of a stop string."""
        longest = 0
        for stop in self._stop:
            start = max(0, len(buffer) - len(stop) + 1)
            while (start := buffer.find(stop[0], start)) >= 0:
                if stop.startswith(buffer[start:]):
                    longest = max(longest, len(buffer) - start)
                    break
                start += 1
        return longest


class OutputText:
    """The text of one output as its token ids arrive (`IncrementalDetokenizer`), cut just
    before its first stop string (`StopStrings`); as in vLLM, a stop string must complete after
    the first `min_tokens` tokens."""

    def __init__(self, decode: Callable[[list[int]], str], *, stop: Sequence[str] = (),
                 min_tokens: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(decode)
        self._stop = StopStrings(stop) if stop else None
        self._min_tokens = min_tokens
        self._tokens = 0

    def step(self, token_ids: list[int], *, final: bool = False) -> tuple[str, int | None]:
        """The text the new ids add that may be sent now; and, once a stop string ends the
        text, how many of these ids it took (through the one that completed it), else None."""
        if self._stop is None:
            return self._detokenizer.step(token_ids, final=final), None
        sent = []
        for number, token in enumerate(token_ids, 1):
            last = final and number == len(token_ids)
            self._tokens += 1
            text, stopped = self._stop.step(self._detokenizer.step([token], final=last),
                                            final=last, search=self._tokens > self._min_tokens)
            sent.append(text)
            if stopped:
                return "".join(sent), number
        if final and not token_ids:  # flush what is held
            sent.append(self._stop.step(self._detokenizer.step([], final=True), final=True)[0])
        return "".join(sent), None
