"""Incremental detokenization: streamed chunks concatenate to decoding the whole output at once.

The tokenizer is the embedded tiny Qwen2-VL's, a byte-level BPE: a multi-byte character (emoji,
CJK, accents) often spans several token ids, some of which decode to an incomplete UTF-8
sequence on their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import free_port, role_log, start_role, stop_role
from mmlane.client import user_message
from mmlane.frontend.detokenize import (
    IncrementalDetokenizer,
    OutputText,
    StopStrings,
    TokenTexts,
    space_marker,
)
from mmlane.model import Preprocessor
from mmlane.protocol.codec import Codec
from mmlane.protocol.messages import (
    ChatOutput,
    ChatRequest,
    ClientReply,
    EngineOutput,
    EngineRequest,
)
from peers import StandInEngine

TRICKY_TEXT = "naïve 😀 中文 👩‍👩‍👧 ok"
"""Accents, a 4-byte emoji, CJK and a ZWJ sequence: characters that span token ids."""


def stream(prep: Preprocessor, chunks: list[list[int]]) -> list[str]:
    """The text each chunk adds, the last one flushed; checks on the way that the text so far
    never runs ahead of decoding the ids so far (nothing a later id could still change)."""
    detokenizer = IncrementalDetokenizer(prep.decode)
    texts: list[str] = []
    seen: list[int] = []
    for number, chunk in enumerate(chunks, 1):
        seen.extend(chunk)
        texts.append(detokenizer.step(chunk, final=number == len(chunks)))
        assert prep.decode(seen).startswith("".join(texts))
    return texts


def whole_text(prep: Preprocessor, ids: list[int]) -> str:
    """The output's text as vLLM shows it: decoded up to the last id after which it is whole
    (ids that end inside a character at the end are never shown)."""
    end = len(ids)
    while end and prep.decode(ids[:end]).endswith("\ufffd"):
        end -= 1
    return prep.decode(ids[:end])


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *sorted({cut % (len(ids) + 1) for cut in cuts}), len(ids)]
    return [ids[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


@st.composite
def outputs(draw: st.DrawFn, vocab_size: int, text_ids: list[int]) -> list[list[int]]:
    """Token ids in chunks: random ids of the whole vocabulary (special and byte tokens too),
    mixed with runs of a tricky text's ids, cut at random places."""
    pieces = draw(st.lists(st.one_of(
        st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=8),
        st.integers(0, len(text_ids) - 1).map(lambda start: text_ids[start:start + 6]),
    ), max_size=12))
    ids = [token for piece in pieces for token in piece]
    return split(ids, draw(st.lists(st.integers(0, 1000), max_size=len(ids))))


@pytest.fixture(scope="module")
def tricky_ids(prep: Preprocessor) -> list[int]:
    return prep.tokenize_batch([TRICKY_TEXT])[0]


def test_random_outputs_stream_their_whole_text(prep: Preprocessor, tricky_ids: list[int]) -> None:
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(outputs(len(prep.tokenizer), tricky_ids))
    def check(chunks: list[list[int]]) -> None:
        ids = [token for chunk in chunks for token in chunk]
        assert "".join(stream(prep, chunks)) == whole_text(prep, ids)

    check()


def test_a_character_spanning_ids_comes_once_complete(prep: Preprocessor) -> None:
    ids = prep.tokenize_batch(["😀"])[0]
    assert len(ids) > 1  # the emoji's four bytes are several byte tokens
    assert stream(prep, [[token] for token in ids]) == [""] * (len(ids) - 1) + ["😀"]


def test_special_tokens_are_skipped(prep: Preprocessor, tricky_ids: list[int]) -> None:
    special = prep.tokenizer.all_special_ids
    chunks = [[special[0]], tricky_ids[:3], [special[-1]], tricky_ids[3:], [special[0]]]
    assert "".join(stream(prep, chunks)) == TRICKY_TEXT


def test_an_incomplete_character_at_the_end_is_never_shown(prep: Preprocessor) -> None:
    """As vLLM: the output's text is "a", not "a" and replacement characters."""
    ids = prep.tokenize_batch(["a😀"])[0][:-1]  # the emoji's last byte never comes
    assert prep.decode(ids).endswith("\ufffd")
    assert stream(prep, [[token] for token in ids]) == ["a"] + [""] * (len(ids) - 1)
    assert stream(prep, [ids]) == ["a"]


def test_the_window_stays_short(prep: Preprocessor) -> None:
    """The work per chunk does not grow with the output: only a window of ids is kept."""
    detokenizer = IncrementalDetokenizer(prep.decode)
    for token in prep.tokenize_batch([TRICKY_TEXT * 20])[0]:
        detokenizer.step([token])
    assert len(detokenizer._ids) < 16


# ---------------------------------------------------------------- through a real frontend


# ---------------------------------------------------------------- the texts in logprobs


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """The logprobs texts of `ids` as an output's tokens, one position each."""
    texts = TokenTexts(tokenizer, space_marker(tokenizer))
    out = []
    for token_id in ids:
        out += texts.position([token_id])
        texts.advance(token_id)
    return out


def test_logprobs_texts_complete_a_character_at_its_last_id(prep: Preprocessor,
                                                             tricky_ids: list[int]) -> None:
    texts = token_texts(prep.tokenizer, tricky_ids)
    assert "".join(texts) == TRICKY_TEXT  # a character spanning ids: "" until it is complete
    assert "😀" in texts and "\ufffd" not in "".join(texts)


def test_logprobs_texts_keep_special_tokens_and_candidates_share_the_context(
    prep: Preprocessor, tricky_ids: list[int]
) -> None:
    eos = prep.eos_token_ids[0]
    assert token_texts(prep.tokenizer, [eos]) == [prep.tokenizer.decode([eos])]
    emoji = prep.tokenizer.encode("😀", add_special_tokens=False)
    texts = TokenTexts(prep.tokenizer, space_marker(prep.tokenizer))
    for token_id in emoji[:-1]:
        texts.advance(token_id)
    # The output's own last id completes the emoji; another candidate there does not.
    assert texts.position([emoji[-1], tricky_ids[0]]) == ["😀", "n"]


def test_logprobs_texts_of_sentencepiece_pieces_keep_their_leading_space() -> None:
    """A Metaspace tokenizer (Llama-style) decodes a lone word-start piece without its space;
    vLLM's logprobs put it back."""
    model = models.WordLevel({"[UNK]": 0, "\u2581hello": 1, "\u2581world": 2, "world": 3},
                             unk_token="[UNK]")
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert space_marker(tokenizer) == "\u2581"
    assert tokenizer.decode([2]) == "world"
    assert token_texts(tokenizer, [1, 2, 3]) == [" hello", " world", "world"]


@pytest.fixture
def frontend(run_dir: Path, qwen_dir: Path) -> Iterator[tuple[zmq.Socket, StandInEngine]]:
    """A real frontend whose engine this test stands in for; yields (client, engine)."""
    ctx: zmq.Context = zmq.Context.instance()
    engine = StandInEngine.at(ctx, f"ipc://{run_dir}/engine.sock")
    port = free_port()
    child = start_role("frontend", [
        "--model", str(qwen_dir), "--engine-endpoint", f"ipc://{run_dir}/engine.sock",
        "--mm-worker-endpoint", f"ipc://{run_dir}/mm.sock", "--port", str(port),
        "--output-endpoint", f"ipc://{run_dir}/out.sock",
    ], run_dir, log_dir=run_dir / "logs")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield client, engine
    finally:
        client.close(linger=0)
        engine.close()
        assert stop_role(child) == 0, role_log(child)


def test_a_streamed_reply_carries_the_whole_text(
    frontend: tuple[zmq.Socket, StandInEngine], prep: Preprocessor, tricky_ids: list[int]
) -> None:
    """The engine streams one id per output, a special token among them: the client's chunks
    concatenate to the decoded output, and none holds a replacement character."""
    client, engine = frontend
    codec: Codec[EngineRequest] = Codec(EngineRequest)  # encodes any message
    client.send_multipart(codec.encode(ChatRequest(request_id="r", messages=[user_message("hi")])))
    request = engine.take()
    output_ids = [*tricky_ids[:4], prep.tokenizer.all_special_ids[0], *tricky_ids[4:]]
    for number, token in enumerate(output_ids, 1):
        done = number == len(output_ids)
        engine.reply(request.reply_to, EngineOutput(
            request_id=request.request_id, token_ids=[token], finished=done,
            finish_reason="stop" if done else None,
        ))
    replies = [_reply(client) for _ in output_ids]
    assert [r.token_ids for r in replies] == [[token] for token in output_ids]
    assert "".join(r.text for r in replies) == prep.decode(output_ids) == TRICKY_TEXT
    assert not any("\ufffd" in r.text for r in replies)
    assert "" in [r.text for r in replies]  # held: the first bytes of a multi-byte character
    assert replies[-1].finished


def _reply(client: zmq.Socket) -> ChatOutput:
    assert client.poll(20_000), "no reply reached the client"
    reply: ClientReply = Codec(ClientReply).decode(client.recv_multipart())
    assert isinstance(reply, ChatOutput), reply
    return reply


# ---------------------------------------------------------------- stop strings


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` cut before the stop string that completes first in it (the longest of those that
    complete together): what a reply with these stop strings says."""
    ends = [(text.find(stop) + len(stop), text.find(stop)) for stop in stops if stop in text]
    return text[:min(ends)[1]] if ends else text


def could_start(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is the start of a stop string (and not a whole one)."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])),
               default=0)


def stream_with_stops(prep: Preprocessor, chunks: list[list[int]],
                      stops: list[str]) -> tuple[list[str], int | None]:
    """The text each chunk adds with these stop strings, and how many ids the stop took (None:
    no stop string came). Checks on the way that only the tail that may still become a stop
    string is held back."""
    output = OutputText(prep.decode, stop=stops)
    plain = IncrementalDetokenizer(prep.decode)  # the text so far, one id at a time
    texts: list[str] = []
    seen, used = "", 0
    for number, chunk in enumerate(chunks, 1):
        final = number == len(chunks)
        text, stopped_after = output.step(chunk, final=final)
        texts.append(text)
        if stopped_after is not None:
            return texts, used + stopped_after
        used += len(chunk)
        seen += "".join(plain.step([token], final=final and index == len(chunk) - 1)
                        for index, token in enumerate(chunk))
        if not final:
            assert "".join(texts) == seen[:len(seen) - could_start(seen, stops)]
    return texts, None


def test_random_outputs_stream_their_text_cut_at_the_stop_string(
    prep: Preprocessor, tricky_ids: list[int]
) -> None:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(outputs(len(prep.tokenizer), tricky_ids), st.data())
    def check(chunks: list[list[int]], data: st.DataObject) -> None:
        whole = whole_text(prep, [token for chunk in chunks for token in chunk])
        inside = st.integers(0, max(len(whole) - 1, 0)).flatmap(
            lambda start: st.integers(1, 6).map(lambda size: whole[start:start + size]))
        stops = data.draw(st.lists(
            st.one_of(inside, st.text("ab😀 中", min_size=1, max_size=4)).filter(bool),
            min_size=1, max_size=3))
        texts, _ = stream_with_stops(prep, chunks, stops)
        assert "".join(texts) == cut_at_stop(whole, stops)

    check()


@pytest.mark.parametrize(("pieces", "stops", "sent", "stopped"), [
    (["hello", " wor", "ld!"], ["world"], ["hello", " ", ""], True),  # across pieces
    (["ab", "c"], ["bc", "abcd"], ["", "a"], True),  # held "ab" for both; "bc" completes
    (["abcd"], ["cd", "abcd"], [""], True),  # both complete at "d": the longer one counts
    (["xx", "a", "b"], ["abc", "bx"], ["xx", "", "ab"], False),  # held "ab", flushed at the end
    (["a\ufffd", "b"], ["\ufffdb"], ["a", ""], True),
], ids=["across", "first-to-complete", "longest", "flushed", "replacement-char"])
def test_the_stop_scanner_holds_back_only_a_possible_start(
    pieces: list[str], stops: list[str], sent: list[str], stopped: bool
) -> None:
    scanner = StopStrings(stops)
    results = [scanner.step(piece, final=number == len(pieces))
               for number, piece in enumerate(pieces, 1)]
    assert [text for text, _ in results] == sent
    assert [stop for _, stop in results] == [False] * (len(pieces) - 1) + [stopped]


def test_a_stop_string_must_complete_after_min_tokens(prep: Preprocessor) -> None:
    """As vLLM: a stop string that completes within the first min_tokens tokens does not count,
    even when it is the tail of a longer one; one that starts there and completes after does."""
    scanner = StopStrings(["abc", "b"])
    assert scanner.step("ab", search=False) == ("", False)  # "ab" may start "abc"
    assert scanner.step("x", final=True) == ("abx", False)

    ids = prep.tokenize_batch(["one two three"])[0]
    texts = [prep.decode([token]) for token in ids]
    first_char_of_second = texts[1][0]
    stop = texts[0] + first_char_of_second
    for min_tokens, stopped_after in ((0, 2), (1, 2), (2, None)):
        output = OutputText(prep.decode, stop=[stop], min_tokens=min_tokens)
        text, used = output.step(ids, final=True)
        assert used == stopped_after, min_tokens
        assert text == ("" if used else "one two three")


def split_stop(prep: Preprocessor, token_ids: list[int]) -> tuple[str, int]:
    """A stop string that spans two tokens of this output (the end of one and the start of the
    next), and the number of tokens through the second: the first such pair whose string does
    not occur earlier in the output's text."""
    texts = [prep.decode([token]) for token in token_ids]
    for second in range(1, len(token_ids)):
        before, after = texts[second - 1], texts[second]
        if not before.strip() or not after.strip() or "\ufffd" in before + after:
            continue
        stop, earlier = before[-1] + after[0], "".join(texts[:second])
        if (earlier + after).find(stop) == len(earlier) - 1:
            return stop, second + 1
    raise AssertionError(f"no two tokens with text in {texts}")


def test_a_stop_string_split_across_two_tokens(prep: Preprocessor) -> None:
    ids = prep.tokenize_batch(["Lanes keep text requests moving, whatever the images do."])[0]
    stop, through = split_stop(prep, ids)
    whole = prep.decode(ids)
    for chunks in ([[token] for token in ids], [ids]):  # streamed one by one, or all at once
        texts, used = stream_with_stops(prep, chunks, [stop])
        assert "".join(texts) == whole[:whole.index(stop)]
        assert used == through
