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
empty one; the final chunk is emitted whatever it ends with. For a byte-level BPE tokenizer the
chunks then concatenate exactly to decoding the whole output at once: the window only moves past
ids whose bytes end on a complete character, where UTF-8 decoding restarts cleanly.

`OutputText` adds stop strings (vLLM's `stop`, without `include_stop_str_in_output`): the text
ends just before the first stop string to complete, also when it spans several tokens. While
streaming, `StopStrings` holds back only the tail that may still become a stop string, so no
text past one is ever sent; the scan looks only at the new text and that short tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

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
        with `final`, everything not yet emitted."""
        self._ids.extend(token_ids)
        context = self._decode(self._ids[: self._read_offset])
        text = self._decode(self._ids)
        if not final and (len(text) <= len(context) or text.endswith(_REPLACEMENT)):
            return ""
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        return text[len(context) :]


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
