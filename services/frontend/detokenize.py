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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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
