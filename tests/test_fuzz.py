"""Structured fuzzing of every socket a role binds (issue 14, part 3): hypothesis against the real
role processes, over real sockets, with the real codec.

    role       socket it binds       what a hostile peer sends it here
    engine     input (PULL)          EngineInput: requests, aborts, cache resets, hellos
    mm worker  job socket (PULL)     MMWorkerInput: jobs, engine epochs, cancels, hellos
    frontend   client (ROUTER)       ClientRequest: chats, completions, resets, cancels
    frontend   output (PULL)         FrontendInput: outputs, failures, resets, hello replies
    every role control (ROUTER)      ControlRequest (Ping), in any envelope
    every role stats (PUB)           subscriptions and anything else an XSUB peer can send

(The frontend's wake socket is inproc, inside its process; its HTTP API is test_http.py's.)
Each example starts from a message of the socket's union, with hostile field values (negative
and huge numbers, NaN, empty, huge and odd strings, unknown hashes, epochs from the future, token
ids outside the vocabulary, prompts over the context, images that are not images, tensors whose
dtype and shape disagree), then maybe breaks its frames: one node of its msgpack replaced (a
wrong type, non-UTF-8 text, nesting 100 000 deep, a truncated array), the body truncated,
frames dropped, added or emptied, or plain random bytes.

The properties, for every example: the role process lives; a message the test's own codec
decodes and that names the test as its reply address gets its one terminal reply (an error must
be of the request or retryable kind, naming the problem, never an internal one); one it cannot
decode is counted in the role's stats (`invalid_messages`, `invalid_control_messages`) and
dropped, or, on the client socket, answered with an `invalid_message` error; and a valid
request sent after it gets its normal reply (the engine: the same greedy tokens as before any
fuzzing; the MM worker: the same rendered prompt; the frontend: the stand-in engine's token).
On the frontend's output socket the fuzzer is the engine, while the stand-in engine holds a
chat: that chat gets exactly one terminal reply, whatever came (the engine's errors pass to the
client as the engine said them). After the fuzzing, no role holds a request.

One process per role serves the whole module, fuzzed with many examples. The runs are seeded
(`derandomize`) and bounded: FUZZ_EXAMPLES per socket (about a minute for the file on two
shared cores). A longer run raises it:

    MMLANE_FUZZ_EXAMPLES=1000 scripts/test tests/test_fuzz.py --hypothesis-show-statistics

(BENCHMARKS.md, "Fuzzing every socket", has the cases run, times and what they found; each
fix has a targeted test here beside the fuzzing that found it.)
"""

from __future__ import annotations

import base64
import itertools
import math
import os
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from bench.images import encode, make_image, png_uri
from conftest import role_log, start_role, stop_role
from mmlane.common.feature_cache import MAX_EPOCH
from mmlane.launcher import Child
from mmlane.model import Preprocessor
from mmlane.protocol import shm
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import CODES, ErrorInfo
from mmlane.protocol.messages import (
    AbortRequests,
    CancelChat,
    CancelJobs,
    ChatError,
    ChatMessage,
    ChatOutput,
    ChatRequest,
    ClientReply,
    ClientRequest,
    CompletionRequest,
    ControlRequest,
    EngineCacheReset,
    EngineEpoch,
    EngineInput,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    Hello,
    HelloReply,
    ImagePart,
    ImageUrl,
    MMCacheHeader,
    MMItem,
    MMJob,
    MMWorkerInput,
    Ping,
    Pong,
    RequestFailed,
    ResetCache,
    ResetEngineCache,
    SamplingParams,
    Stats,
    TextPart,
    TokenLogprobs,
)
from mmlane.protocol.sampling import StructuredOutputs
from mmlane.protocol.shm import ShmWriter
from peers import PATIENCE_S, Inbox, StandInEngine, counter, push, wait_for_stats

FUZZ_EXAMPLES = int(os.environ.get("MMLANE_FUZZ_EXAMPLES", "60"))
"""Examples per fuzzed socket; raise it for a longer run (see the module docstring)."""
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
ROLE_ARGS = ["--stats-interval", "0.2"]
_ids = itertools.count()

# ---------------------------------------------------------------- hostile values

INT_EDGES = [-1, -(2**31), -(2**63), 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**64 - 1]
"""Integers at the edges of what msgpack carries (-2**63 .. 2**64-1) and of C types."""
hostile_ints = st.one_of(st.integers(-3, 3000), st.sampled_from(INT_EDGES))
hostile_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-1.0, 0.0, -0.0, 1e308, -1e308, math.nan, math.inf, -math.inf]),
)
utf8_text = st.text(st.characters(codec="utf-8"), max_size=24)
hostile_text = st.one_of(
    utf8_text, st.just(""), st.just("x" * 100_000), st.just("\x00" * 8), st.just("é" * 5000),
)
NESTED_DEEP = msgspec.Raw(b"\x91" * 100_000 + b"\xc0")
"""A list in a list ... 100 000 deep: where a field is typed only by the codec's hook (a
tensor's header), msgspec recurses into it until Python's recursion limit stops it."""
raw_oddities = st.sampled_from([
    msgspec.Raw(b"\xa3\xff\xfe\xfd"),  # a str whose bytes are not UTF-8
    msgspec.Raw(b"\xa3\xed\xa0\x80"),  # a str holding a UTF-16 surrogate
    NESTED_DEEP,
    msgspec.Raw(b"\xdd\xff\xff\xff\xff"),  # an array that claims 4 G elements
    msgspec.Raw(b"\xdb\xff\xff\xff\xff"),  # a str that claims 4 GB
    msgspec.Raw(b"\xc1"),  # the one byte msgpack never uses
    msgspec.Raw(b"\xd4\x01\x00"),  # an ext type
])
hostile_values = st.one_of(
    hostile_ints, hostile_floats, hostile_text, st.binary(max_size=16), st.none(),
    st.booleans(), raw_oddities, st.lists(hostile_ints, max_size=3),
    st.dictionaries(utf8_text, hostile_ints, max_size=2),
)


def often(valid: Any, hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` three times in four, else a hostile value: most fields of a message stay sane,
    so the hostile one is what the role meets."""
    return st.one_of(st.just(valid), st.just(valid), st.just(valid), hostile)


# ---------------------------------------------------------------- frames, then broken frames


def frames_of(message: msgspec.Struct) -> list[bytes]:
    return [bytes(frame) for frame in Codec(Any).encode(message)]


def _nodes(tree: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into a decoded msgpack tree, the root included."""
    yield path
    if isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _nodes(value, (*path, index))
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _nodes(value, (*path, key))


def _replaced(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = tree
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return tree


BREAKS = ["as is"] * 4 + ["node"] * 2 + ["truncated", "frames dropped", "frames added",
                                         "empty frames", "random bytes"]
"""How an example's frames are broken, each as likely as its count here."""


@st.composite
def broken(draw: st.DrawFn, messages: st.SearchStrategy[msgspec.Struct]) -> list[bytes]:
    """A message of the socket's union, as its frames, then maybe broken (module docstring)."""
    frames = frames_of(draw(messages))
    body, tensors = frames[0], frames[1:]
    how = draw(st.sampled_from(BREAKS))
    if how == "node":
        tree = msgspec.msgpack.decode(body)
        path = draw(st.sampled_from(list(_nodes(tree))))
        return [msgspec.msgpack.encode(_replaced(tree, path, draw(hostile_values))), *tensors]
    if how == "truncated":
        return [body[: draw(st.integers(0, max(0, len(body) - 1)))], *tensors]
    if how == "frames dropped":
        return [body, *draw(st.lists(st.sampled_from(tensors), max_size=len(tensors)))] \
            if tensors else [body, b""]
    if how == "frames added":
        return [body, *tensors, *draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))]
    if how == "empty frames":
        return draw(st.sampled_from([[b""], [body, b""], [b"", body]]))
    if how == "random bytes":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    return frames


def decoded(codec: Codec[Any], frames: list[bytes]) -> Any | None:
    """What the role's own codec makes of `frames`; None when it cannot decode them."""
    try:
        return codec.decode(frames)
    except Exception:  # the role's codec raises RequestError; the test's oracle needs no more
        return None


# ---------------------------------------------------------------- message strategies

def sampling_params() -> st.SearchStrategy[SamplingParams]:
    return st.builds(
        SamplingParams,
        max_tokens=often(2, hostile_ints), temperature=often(0.0, hostile_floats),
        top_p=often(1.0, hostile_floats), seed=often(None, hostile_ints),
        min_tokens=often(0, hostile_ints), stop_token_ids=often([], st.lists(hostile_ints)),
        presence_penalty=often(0.0, hostile_floats),
        repetition_penalty=often(1.0, hostile_floats),
        logit_bias=often(None, st.dictionaries(hostile_ints, hostile_floats, max_size=3)),
        logprobs=often(None, hostile_ints),
    )


def arrays() -> st.SearchStrategy[np.ndarray]:
    shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
    return st.builds(np.zeros, shapes, st.sampled_from(["u1", "i8", "f4", "f2", "bool"]))


def hashes() -> st.SearchStrategy[str]:
    """Hashes the caches never saw, and odd ones."""
    return st.one_of(st.text("0123456789abcdef", min_size=1, max_size=64), hostile_text)


def mm_items(valid: MMItem) -> st.SearchStrategy[MMItem]:
    tensors = st.one_of(
        st.just(valid.tensors), st.just({}),
        st.dictionaries(st.sampled_from([*valid.tensors, "other"]), arrays(), max_size=3),
    )
    return st.builds(
        MMItem, offset=often(valid.offset, hostile_ints), length=often(valid.length, hostile_ints),
        tensors=tensors, mm_hash=often("", hashes()), nbytes=often(0, hostile_ints),
    )


def cache_headers() -> st.SearchStrategy[MMCacheHeader]:
    """Headers naming senders, epochs and seqs the engine never saw (from the future)."""
    return st.builds(
        MMCacheHeader, sender=often("fuzz-sender", hostile_text),
        sender_epoch=hostile_ints, engine_epoch=hostile_ints, seq=hostile_ints,
        capacity=hostile_ints, invalidate=st.lists(hashes(), max_size=3),
    )


def long_prompt(prep: Preprocessor) -> list[int]:
    return [prep.tokenize_text("hi")[0]] * (prep.max_context + 1)


# ---------------------------------------------------------------- the oracle's side


def key(message: Any) -> str:
    """What a reply answers: a request id, or the peer a Hello named."""
    return f"hello:{message.peer}" if isinstance(message, HelloReply) else message.request_id


def terminal(message: Any) -> bool:
    if isinstance(message, EngineOutput | ChatOutput):
        return message.finished
    return True


def assert_clear_error(error: ErrorInfo, what: Any) -> None:
    """A hostile message's error names a problem of the request, or a retryable one: an
    internal error would be a bug of ours that the message found."""
    assert error.kind in ("request", "retryable"), (error, what)
    assert error.code in CODES and error.message, (error, what)


class Replies:
    """The Inboxes where a role sends to the test, read until the replies the test waits for
    have come."""

    def __init__(self, *inboxes: Inbox, answer: Callable[[Any], bool] | None = None) -> None:
        self.inboxes = inboxes
        self.answer = answer
        """Called with each message (a stand-in peer's chance to play its part): True when it
        took the message, which then answers nothing the test waits for."""

    def until(self, keys: set[str], role: Child) -> dict[str, list[Any]]:
        """Every message until each of `keys` has had its terminal reply; none gets two."""
        got: dict[str, list[Any]] = {}
        done: set[str] = set()
        deadline = time.monotonic() + PATIENCE_S
        while not keys <= done:
            assert role.process.poll() is None, f"the {role.role} died:\n{_log_tail(role)}"
            assert time.monotonic() < deadline, \
                f"no reply for {keys - done} from the {role.role}:\n{_log_tail(role)}"
            message = self._next()
            if message is None:
                continue
            if self.answer is not None and self.answer(message):
                continue
            if not hasattr(message, "request_id") and not isinstance(message, HelloReply):
                continue
            got.setdefault(key(message), []).append(message)
            if terminal(message):
                assert key(message) not in done, f"a second terminal reply: {message}"
                done.add(key(message))
        return got


    def _next(self) -> Any | None:
        """The next message at any of the inboxes (a Hello answered there), or None after 1 s."""
        poller = zmq.Poller()
        for inbox in self.inboxes:
            poller.register(inbox.sock, zmq.POLLIN)
        ready = dict(poller.poll(1000))
        for inbox in self.inboxes:
            if inbox.sock in ready and (taken := inbox._next(0)) is not None:
                return taken[0]
        return None


def _log_tail(role: Child) -> str:
    return role_log(role)[-4000:] if role.log_path else ""


# ================================================================ the engine's input


@pytest.fixture(scope="module")
def engine(module_run_dir: Path) -> Iterator[Child]:
    child = start_role("engine", ["--device", "cpu", "--engine-endpoint",
                                  f"ipc://{module_run_dir}/engine.sock", *ROLE_ARGS],
                       module_run_dir, log_dir=module_run_dir / "logs")
    yield child
    assert stop_role(child) == 0, _log_tail(child)


class EngineFuzz:
    """The test as the engine's frontend: a PUSH to its input, a reply inbox, the probe."""

    def __init__(self, engine: Child, run_dir: Path, prep: Preprocessor) -> None:
        assert engine.endpoint is not None
        self.role = engine
        self.ctx = zmq.Context()
        self.push = push(self.ctx, engine.endpoint)
        self.inbox = Inbox.bound(self.ctx, f"ipc://{run_dir}/engine-replies.sock", FrontendInput)
        self.reply_to = self.inbox.endpoint
        self.replies = Replies(self.inbox)
        self.codec: Codec[Any] = Codec(EngineInput)
        self.prompt = prep.tokenize_batch(["Hello, how are you?"])[0]
        self.messages = engine_inputs(prep, self.inbox.endpoint)
        self.dropped = 0
        """Messages sent that the engine cannot decode: it must count at least these."""
        self.baseline = self.probe()

    def probe(self) -> list[int]:
        """A valid greedy request's output tokens."""
        request_id = f"probe-{next(_ids)}"
        self.push.send_multipart(frames_of(EngineRequest(
            request_id=request_id, reply_to=self.inbox.endpoint, prompt_token_ids=self.prompt,
            sampling=SamplingParams(max_tokens=3))))
        replies = self.replies.until({request_id}, self.role)[request_id]
        assert all(isinstance(r, EngineOutput) for r in replies), replies
        return [token for reply in replies for token in reply.token_ids]

    def close(self) -> None:
        self.push.close(linger=0)
        self.inbox.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def engine_fuzz(engine: Child, module_run_dir: Path, prep: Preprocessor) -> Iterator[EngineFuzz]:
    fuzz = EngineFuzz(engine, module_run_dir, prep)
    yield fuzz
    fuzz.close()


def engine_inputs(prep: Preprocessor, reply_to: str) -> st.SearchStrategy[msgspec.Struct]:
    image = prep.process_image(make_image(32, 32))
    prompt = prep.tokenize_batch(["Describe"])[0]
    ids = [*prompt, *[prep.image_token_id] * image.num_tokens]
    item = MMItem(offset=len(prompt), length=image.num_tokens, tensors=image.tensors)
    prompts: st.SearchStrategy[list[int]] = st.one_of(
        st.just(ids), st.just([]), st.just(long_prompt(prep)), st.lists(hostile_ints, max_size=8),
    )
    requests = st.builds(
        EngineRequest, request_id=st.one_of(hostile_text, st.just(f"fuzz-{next(_ids)}")),
        reply_to=st.just(reply_to), prompt_token_ids=prompts, sampling=sampling_params(),
        mm_items=often([item], st.lists(mm_items(item), max_size=2)),
        deadline=often(0.0, hostile_floats), mm_cache=often(None, cache_headers()),
    )
    others = st.one_of(
        st.builds(AbortRequests, request_ids=st.lists(hostile_text, max_size=3)),
        st.builds(ResetEngineCache, request_id=hostile_text, reply_to=st.just(reply_to)),
        st.builds(Hello, reply_to=often(reply_to, hostile_text), peer=hostile_text),
    )
    return st.one_of(requests, requests, others)


def owed(message: Any, reply_to: str) -> set[str]:
    """The keys of the replies a role owes the test for a message it could decode: one for
    each message (a request, a job, a cache reset, a hello) that names the test's reply_to."""
    if getattr(message, "reply_to", None) != reply_to:
        return set()
    return {f"hello:{message.peer}"} if isinstance(message, Hello) else {message.request_id}


def outcome(message: Any, replies: dict[str, list[Any]]) -> str:
    """What became of a fuzzed message, for hypothesis' statistics
    (pytest --hypothesis-show-statistics)."""
    if message is None:
        return "undecodable: dropped and counted"
    codes = sorted({r.error.code[:24] for rs in replies.values() for r in rs  # a peer's, odd
                    if isinstance(r, RequestFailed | ChatError)})
    return f"{type(message).__name__}: " + (f"error {', '.join(codes)}" if codes else "served")


def fuzz_example(fuzz: EngineFuzz | WorkerFuzz, data: st.DataObject) -> None:
    """One example against a role that replies to `reply_to` addresses (module docstring)."""
    frames = data.draw(broken(fuzz.messages))
    message = decoded(fuzz.codec, frames)
    fuzz.dropped += message is None
    fuzz.push.send_multipart(frames)
    replies = fuzz.replies.until(set() if message is None else owed(message, fuzz.reply_to),
                                 fuzz.role)
    for failed in (r for rs in replies.values() for r in rs if isinstance(r, RequestFailed)):
        assert_clear_error(failed.error, message)
    event(outcome(message, replies))
    assert fuzz.probe() == fuzz.baseline


@given(data=st.data())
@FUZZ
def test_engine_input(engine_fuzz: EngineFuzz, data: st.DataObject) -> None:
    fuzz_example(engine_fuzz, data)


def test_engine_refuses_a_nan_deadline(engine_fuzz: EngineFuzz) -> None:
    """A NaN deadline is never passed, and at the top of the engine's heap of deadlines it
    would stop every other request from expiring: refused, naming it."""
    fuzz = engine_fuzz
    request = EngineRequest(request_id=f"nan-{next(_ids)}", reply_to=fuzz.inbox.endpoint,
                            prompt_token_ids=fuzz.prompt, sampling=SamplingParams(max_tokens=2),
                            deadline=math.nan)
    fuzz.push.send_multipart(frames_of(request))
    [failed] = fuzz.replies.until({request.request_id}, fuzz.role)[request.request_id]
    assert isinstance(failed, RequestFailed) and "deadline" in failed.error.message, failed
    assert fuzz.probe() == fuzz.baseline


@pytest.mark.parametrize("epochs", [[2**64 - 1], [2**63 - 1, 2**64 - 1]],
                         ids=["past_uint64", "past_int64_then_uint64"])
def test_engine_follows_no_epoch_past_any_clock(
    engine_fuzz: EngineFuzz, module_run_dir: Path, epochs: list[int]
) -> None:
    """Found by the fuzzing: a cache header naming engine epoch 2**64 - 1 made the engine
    follow it to 2**64, which msgpack cannot carry: its output thread died on the next reply
    (the engine went deaf) and its stats stopped. Such an epoch is not followed now: the
    request is served without the cache, and the engine's epoch stays one a clock makes."""
    fuzz = engine_fuzz
    for epoch in epochs:
        header = MMCacheHeader(sender="far-future", sender_epoch=1, engine_epoch=epoch, seq=0,
                               capacity=1 << 20)
        request = EngineRequest(request_id=f"epoch-{next(_ids)}", reply_to=fuzz.inbox.endpoint,
                                prompt_token_ids=fuzz.prompt,
                                sampling=SamplingParams(max_tokens=1), mm_cache=header)
        fuzz.push.send_multipart(frames_of(request))
        replies = fuzz.replies.until({request.request_id}, fuzz.role)[request.request_id]
        assert all(isinstance(r, EngineOutput) for r in replies), replies
        assert replies[0].engine_epoch <= MAX_EPOCH
    assert fuzz.probe() == fuzz.baseline
    stats = wait_for_stats(module_run_dir, lambda s: s.role == "engine", "the engine's stats")
    assert 0 < stats.epoch <= MAX_EPOCH


def holds_nothing(run_dir: Path, role: str) -> None:
    """Every request the role took has had its terminal reply: it holds none."""
    wait_for_stats(run_dir, lambda s: s.role == role and s.in_flight == 0,
                   f"the {role} holding no request", timeout_s=5)


def test_engine_counted_what_it_dropped(engine_fuzz: EngineFuzz, module_run_dir: Path) -> None:
    """After the fuzzing (this test runs after it): every undecodable message was counted,
    and nothing is held."""
    assert engine_fuzz.dropped > 0
    counter(module_run_dir, "engine", "invalid_messages", engine_fuzz.dropped)
    holds_nothing(module_run_dir, "engine")


# ========================================================= the engine's shared-memory tensors

NOBODY = 65534
"""The uid and gid a slot is handed to in the 'owned by nobody' case (root alone can)."""
SHM_CASES = {
    # what the example does to the request's reference or to its slot: what the engine answers
    "as sent": "served",
    "name: no slot's": "invalid_message",  # a drawn name, or one that escapes /dev/shm
    "name: a slot never made": "tensors_lost",
    "generation: another": "tensors_lost",
    "dtype and shape: another byte count": "invalid_message",
    "shape: more dimensions than numpy takes": "invalid_message",
    "header: full flag garbage": "tensors_lost",
    "header: closed flag set": "served",  # the engine unlinks it after reading it
    "header: generation scribbled": "tensors_lost",
    "header: byte count scribbled": "invalid_message",
    "file: truncated": "invalid_message",
    "file: replaced by a symlink": "invalid_message",
    "file: replaced by a FIFO": "invalid_message",
    "file: replaced by a folder": "invalid_message",
    "file: replaced by one of another size": "invalid_message",
    "file: replaced by an empty slot": "tensors_lost",
    **({"file: owned by nobody": "invalid_message"} if os.geteuid() == 0 else {}),
}
"""Each hostile case of a shared-memory tensor, and the engine's one reply to its request:
served, or an error of that code (`expected_reply`)."""
_REF_KEY = 3  # a TensorHeader's field, as msgpack carries it: [dtype, shape, frame, shm]
PIXEL_BYTES = 4 * 588
"""The uint8 pixel_values of a 32x32 image for the tiny Qwen2-VL: 4 patches of 588 bytes (one
frame of 3 x 14 x 14)."""


class ShmFuzz:
    """The test as an MM worker on the engine's host: requests whose pixels are in slots of
    its own (a `ShmWriter` per example), sent beside the engine fuzz's socket and inbox, and a
    canary outside /dev/shm that a symlink points to, made to look like a full slot."""

    def __init__(self, fuzz: EngineFuzz, run_dir: Path, prep: Preprocessor) -> None:
        self.fuzz = fuzz
        self.tag = shm.sender_tag(f"{run_dir}/shm-fuzz")
        image = prep.process_image(make_image(32, 32))
        prompt = prep.tokenize_batch(["Describe"])[0]
        self.request = EngineRequest(
            request_id="", reply_to=fuzz.reply_to,
            prompt_token_ids=[*prompt, *[prep.image_token_id] * image.num_tokens],
            mm_items=[MMItem(offset=len(prompt), length=image.num_tokens, tensors=image.tensors)],
            sampling=SamplingParams(max_tokens=3))
        self.canary = run_dir / "canary"
        self.canary.write_bytes(bytes([1]) + bytes(shm.HEADER + (1 << 20) - 1))
        self.decoys = [shm.SHM_DIR / f"mmlane-{self.tag}-decoy", shm.SHM_DIR / f"{self.tag}-1-0"]
        """Files beside the slots, outside the slot pattern: never to be opened or unlinked."""
        for decoy in self.decoys:
            decoy.write_bytes(b"decoy")
        self.counts: Counter[str] = Counter()
        """The replies the engine owes its counters: tensors_lost, tensors_refused."""
        self.baseline = self.send(ShmWriter(self.tag, threshold=1024, capacity=4 << 20,
                                            max_age_s=60), lambda frames, writer: frames)

    def send(self, writer: ShmWriter, hostile: Callable[[list[bytes], ShmWriter], list[bytes]],
             ) -> list[int] | RequestFailed:
        """Send the image request through `writer`'s slot, made hostile; the one reply: the
        output tokens, or the error. The writer is closed after it, its slots unlinked."""
        request = replace(self.request, request_id=f"shm-{next(_ids)}")
        try:
            frames = [bytes(f) for f in Codec(EngineInput, shm_writer=writer).encode(request)]
            self.fuzz.push.send_multipart(hostile(frames, writer))
            replies = self.fuzz.replies.until({request.request_id},
                                              self.fuzz.role)[request.request_id]
        finally:
            writer.close()
            _unlink_slots(self.tag)
        if isinstance(replies[-1], RequestFailed):
            return replies[-1]
        assert all(isinstance(r, EngineOutput) for r in replies), replies
        return [token for reply in replies for token in reply.token_ids]

    def probe(self) -> None:
        """A valid request through a slot is served as before any fuzzing."""
        writer = ShmWriter(self.tag, threshold=1024, capacity=4 << 20, max_age_s=60)
        assert self.send(writer, lambda frames, writer: frames) == self.baseline

    def close(self) -> None:
        for decoy in self.decoys:
            decoy.unlink()


def _unlink_slots(tag: str) -> None:
    """Whatever an example left under the tag's slot names (files, links, FIFOs, folders)."""
    for path in shm.SHM_DIR.glob(f"mmlane-{tag}-[0-9]*"):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()


@pytest.fixture(scope="module")
def shm_fuzz(engine_fuzz: EngineFuzz, module_run_dir: Path,
             prep: Preprocessor) -> Iterator[ShmFuzz]:
    fuzz = ShmFuzz(engine_fuzz, module_run_dir, prep)
    yield fuzz
    fuzz.close()


def _with_ref(frames: list[bytes], ref: str | None = None, *, dtype: str | None = None,
              shape: list[int] | None = None) -> list[bytes]:
    """The frames with the shared-memory header's reference, dtype or shape replaced."""
    body = msgspec.msgpack.decode(frames[0])
    for header in _shm_headers(body):
        header[_REF_KEY] = header[_REF_KEY] if ref is None else ref
        header[0] = header[0] if dtype is None else dtype
        header[1] = header[1] if shape is None else shape
    return [msgspec.msgpack.encode(body), *frames[1:]]


def _shm_headers(tree: Any) -> Iterator[list[Any]]:
    """The TensorHeaders in a decoded msgpack tree that name a slot."""
    if isinstance(tree, list):
        if len(tree) == 4 and isinstance(tree[_REF_KEY], str) and tree[_REF_KEY].startswith(
                "mmlane-"):
            yield tree
            return
        for value in tree:
            yield from _shm_headers(value)
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _shm_headers(value)


def _the_slot(frames: list[bytes]) -> tuple[Path, str]:
    [header] = _shm_headers(msgspec.msgpack.decode(frames[0]))
    name, _, generation = header[_REF_KEY].rpartition(".")
    return shm.SHM_DIR / name, generation


def _scribble(offset: int, data: bytes) -> Callable[[list[bytes], ShmWriter], list[bytes]]:
    def hostile(frames: list[bytes], writer: ShmWriter) -> list[bytes]:
        path, _ = _the_slot(frames)
        with path.open("r+b") as slot:
            slot.seek(offset)
            slot.write(data)
        return frames
    return hostile


def _replace_file(make: Callable[[Path], object]) -> Callable[[list[bytes], ShmWriter],
                                                                list[bytes]]:
    def hostile(frames: list[bytes], writer: ShmWriter) -> list[bytes]:
        path, _ = _the_slot(frames)
        path.unlink()
        make(path)
        return frames
    return hostile


def _full_header(frames: list[bytes]) -> bytes:
    """The header of a slot holding the use the frames name, as its writer wrote it."""
    generation = int(_the_slot(frames)[1])
    return (bytes([1]) + bytes(7) + struct.pack("<QQ", generation, PIXEL_BYTES)).ljust(
        shm.HEADER, b"\0")


def _resized(size: int) -> Callable[[list[bytes], ShmWriter], list[bytes]]:
    """The slot replaced by a file of `size` bytes that starts as the slot did."""
    def hostile(frames: list[bytes], writer: ShmWriter) -> list[bytes]:
        data = _full_header(frames).ljust(size, b"\0")[:size]
        return _replace_file(lambda path: path.write_bytes(data))(frames, writer)
    return hostile


def _link_to(canary: Path) -> Callable[[list[bytes], ShmWriter], list[bytes]]:
    """The slot replaced by a symlink to the canary, made to hold the use the frames name:
    followed, the engine would serve the request and clear the canary's full flag."""
    def hostile(frames: list[bytes], writer: ShmWriter) -> list[bytes]:
        with canary.open("r+b") as file:
            file.write(_full_header(frames))
        return _replace_file(lambda path: path.symlink_to(canary))(frames, writer)
    return hostile


def _scribble_generation(value: int) -> Callable[[list[bytes], ShmWriter], list[bytes]]:
    def hostile(frames: list[bytes], writer: ShmWriter) -> list[bytes]:
        generation = int(_the_slot(frames)[1])
        scribbled = value if value != generation else (value + 1) % 2**64
        return _scribble(8, scribbled.to_bytes(8, "little"))(frames, writer)
    return hostile


@st.composite
def shm_hostility(draw: st.DrawFn, canary: Path
                  ) -> tuple[str, Callable[[list[bytes], ShmWriter], list[bytes]]]:
    """A case of SHM_CASES and what it does to the frames or the slot they name."""
    case = draw(st.sampled_from(sorted(SHM_CASES)))
    u64 = st.integers(0, 2**64 - 1)
    if case == "name: no slot's":
        name = draw(st.one_of(hostile_text.map(lambda text: text or "?"), st.sampled_from([
            "../../etc/passwd", "mmlane-000000000000-1-0/../../x.1", "mmlane-0-1-0.1",
            "mmlane-000000000000-1-0.1\n", "/dev/shm/mmlane-000000000000-1-0.1"])))
        return case, lambda frames, writer: _with_ref(frames, name)
    if case == "name: a slot never made":
        return case, lambda frames, writer: _with_ref(
            frames, f"mmlane-{writer.tag}-1-{draw(st.integers(100, 10**9 - 1))}.1")
    if case == "generation: another":
        delta = draw(st.sampled_from([-1, 1, 2**40]))
        return case, lambda frames, writer: _with_ref(
            frames, f"{_the_slot(frames)[0].name}.{max(0, int(_the_slot(frames)[1]) + delta)}")
    if case == "dtype and shape: another byte count":
        dtype, shape = draw(st.sampled_from([
            ("<f4", None), ("|u1", [PIXEL_BYTES + 1]), ("|u1", [0, 2**63]), ("|u1", [2**63, 2**63]),
            ("<f8", [2**62, 4]), ("|u1", [])]))
        return case, lambda frames, writer: _with_ref(frames, dtype=dtype, shape=shape)
    if case == "shape: more dimensions than numpy takes":
        return case, lambda frames, writer: _with_ref(frames, shape=[1] * 64 + [PIXEL_BYTES])
    if case == "header: full flag garbage":
        return case, _scribble(0, bytes([draw(st.sampled_from([0, 2, 255]))]))
    if case == "header: closed flag set":
        return case, _scribble(1, b"\x01")
    if case == "header: generation scribbled":
        return case, _scribble_generation(draw(u64))
    if case == "header: byte count scribbled":
        return case, _scribble(16, draw(u64.filter(lambda n: n != PIXEL_BYTES)).to_bytes(
            8, "little"))
    if case == "file: truncated":
        size = draw(st.sampled_from([0, 1, 8, 24, shm.HEADER, shm.HEADER + 100]))
        return case, _truncate(size)
    if case == "file: replaced by a symlink":
        return case, _link_to(canary)
    if case == "file: replaced by a FIFO":
        return case, _replace_file(os.mkfifo)
    if case == "file: replaced by a folder":
        return case, _replace_file(os.mkdir)
    if case == "file: replaced by one of another size":
        return case, _resized(draw(st.sampled_from([1, 10, shm.HEADER - 2, shm.HEADER + 10,
                                                    shm.HEADER + 4703])))
    if case == "file: replaced by an empty slot":
        return case, _replace_file(lambda path: path.write_bytes(bytes(shm.HEADER + (1 << 20))))
    if case == "file: owned by nobody":
        return case, _chown(NOBODY)
    return case, lambda frames, writer: frames


def _truncate(size: int) -> Callable[[list[bytes], ShmWriter], list[bytes]]:
    def hostile(frames: list[bytes], writer: ShmWriter) -> list[bytes]:
        os.truncate(_the_slot(frames)[0], size)
        return frames
    return hostile


def _chown(uid: int) -> Callable[[list[bytes], ShmWriter], list[bytes]]:
    def hostile(frames: list[bytes], writer: ShmWriter) -> list[bytes]:
        os.chown(_the_slot(frames)[0], uid, uid)
        return frames
    return hostile


def expected_reply(case: str, reused: bool) -> str:
    """SHM_CASES' reply; but a slot whose file was replaced or handed over after the engine had
    mapped it is served: the engine reads the slot it mapped, which its writer wrote to, and
    never opens what stands at the name now."""
    if reused and case.startswith(("file: replaced", "file: owned")):
        return "served"
    return SHM_CASES[case]


@given(data=st.data())
@FUZZ
def test_engine_shared_memory_tensors(shm_fuzz: ShmFuzz, data: st.DataObject) -> None:
    """A request whose pixels are in a slot gets its one reply whatever became of the slot or
    of its reference: served, or the error of SHM_CASES naming the problem; the canary the
    symlinks point to and the decoys beside the slots are never touched; a valid request
    through a slot is served after it. With `reused`, the engine has read the slot once before
    (a receiver that kept its slots mapped died of SIGBUS reading a truncated one)."""
    fuzz = shm_fuzz
    case, hostile = data.draw(shm_hostility(fuzz.canary))
    writer = ShmWriter(fuzz.tag, threshold=1024, capacity=4 << 20, max_age_s=60)
    reused = data.draw(st.booleans(), label="reused")
    if reused:
        first = replace(fuzz.request, request_id=f"shm-{next(_ids)}")
        fuzz.fuzz.push.send_multipart(Codec(EngineInput, shm_writer=writer).encode(first))
        fuzz.fuzz.replies.until({first.request_id}, fuzz.fuzz.role)
    got = fuzz.send(writer, hostile)
    expected = expected_reply(case, reused)
    if expected == "served":
        assert got == fuzz.baseline, (case, got)
    else:
        assert isinstance(got, RequestFailed), (case, got)
        assert_clear_error(got.error, case)
        assert got.error.code == expected and "shared-memory" in got.error.message, (case, got)
        fuzz.counts["tensors_lost" if expected == "tensors_lost" else "tensors_refused"] += 1
    assert fuzz.canary.read_bytes()[0] == 1, f"{case}: the canary was written through a link"
    assert all(decoy.read_bytes() == b"decoy" for decoy in fuzz.decoys), case
    event(f"{case}{', reused' if reused else ''}: {expected}")
    fuzz.probe()


def test_engine_counted_the_shared_memory_it_refused(shm_fuzz: ShmFuzz,
                                                     module_run_dir: Path) -> None:
    """After the fuzzing: each refused or lost slot counted, nothing held, no slot left."""
    for name, count in shm_fuzz.counts.items():
        assert count > 0
        counter(module_run_dir, "engine", name, count)
    holds_nothing(module_run_dir, "engine")
    assert not list(shm.SHM_DIR.glob(f"mmlane-{shm_fuzz.tag}-[0-9]*"))


# ================================================================ the MM worker's job socket


class WorkerFuzz:
    """The test as the MM worker's frontend and engine: a PUSH to its job socket, a reply inbox,
    a stand-in engine, the probe."""

    def __init__(self, run_dir: Path, prep: Preprocessor, media_dir: Path) -> None:
        self.ctx = zmq.Context()
        self.engine = StandInEngine.at(self.ctx, f"ipc://{run_dir}/mm-engine.sock")
        self.inbox = Inbox.bound(self.ctx, f"ipc://{run_dir}/mm-replies.sock", FrontendInput)
        self.reply_to = self.inbox.endpoint
        self.role = start_role("mm-worker", [
            "--mm-worker-endpoint", f"ipc://{run_dir}/mm.sock",
            "--engine-endpoint", self.engine.endpoint, "--allowed-media-dir", str(media_dir),
            *ROLE_ARGS], run_dir, log_dir=run_dir / "logs")
        assert self.role.endpoint is not None
        self.push = push(self.ctx, self.role.endpoint)
        self.replies = Replies(self.inbox, self.engine)
        self.codec: Codec[Any] = Codec(MMWorkerInput)
        self.prompt = prep.tokenize_batch([prep.render_prompt([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "What is it?"}]}])])[0]
        self.image = png_uri(make_image(32, 32))
        self.messages = worker_inputs(prep, self.prompt, self.image, self.inbox.endpoint,
                                      media_dir)
        self.dropped = 0
        self.baseline = self.probe()

    def probe(self) -> list[int]:
        """A valid job's rendered prompt, as the engine receives it."""
        request_id = f"probe-{next(_ids)}"
        self.push.send_multipart(frames_of(MMJob(
            request_id=request_id, reply_to=self.inbox.endpoint, prompt_token_ids=self.prompt,
            images=[ImageUrl(url=self.image)], sampling=SamplingParams(max_tokens=2))))
        [request] = self.replies.until({request_id}, self.role)[request_id]
        assert isinstance(request, EngineRequest), request
        assert len(request.mm_items) == 1, request
        return request.prompt_token_ids

    def close(self) -> None:
        self.push.close(linger=0)
        assert stop_role(self.role) == 0, _log_tail(self.role)
        self.engine.close()
        self.inbox.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def worker_fuzz(module_run_dir: Path, prep: Preprocessor) -> Iterator[WorkerFuzz]:
    media_dir = module_run_dir / "media"
    media_dir.mkdir()
    (media_dir / "photo.png").write_bytes(encode(make_image(16, 16), "PNG"))
    (media_dir / "not-an-image.png").write_bytes(b"GIF89a but not really")
    fuzz = WorkerFuzz(module_run_dir, prep, media_dir)
    yield fuzz
    fuzz.close()


def image_urls(valid: str, media_dir: Path) -> st.SearchStrategy[str]:
    """Image sources: the valid one, and images that are not images, or not allowed."""
    png = encode(make_image(8, 8), "PNG")
    return st.one_of(
        st.just(valid), st.just(valid),
        st.binary(max_size=64).map(lambda data: "data:image/png;base64," + _b64(data)),
        st.just("data:image/png;base64," + _b64(png[: len(png) // 2])),  # truncated
        st.just("data:image/png;base64,!!not base64!!"), st.just("data:,"),
        st.just(f"file://{media_dir}/photo.png"), st.just(f"file://{media_dir}/not-an-image.png"),
        st.just(f"file://{media_dir}/../../etc/passwd"), st.just(f"file://{media_dir}"),
        st.just("https://127.0.0.1:1/image.png"), st.just("http://example.invalid/a.png"),
        st.just("gopher://x"), hostile_text,
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def worker_inputs(prep: Preprocessor, prompt: list[int], image: str, reply_to: str,
                  media_dir: Path) -> st.SearchStrategy[msgspec.Struct]:
    prompts = st.one_of(
        st.just(prompt), st.just(prompt), st.just([*prompt, prep.image_token_id]), st.just([]),
        st.just([*long_prompt(prep), prep.image_token_id]), st.lists(hostile_ints, max_size=8),
    )
    images = st.lists(st.builds(ImageUrl, url=image_urls(image, media_dir),
                                uuid=often(None, hashes())), min_size=1, max_size=2)
    jobs = st.builds(
        MMJob, request_id=hostile_text, reply_to=st.just(reply_to), prompt_token_ids=prompts,
        images=often([ImageUrl(url=image)], images), sampling=sampling_params(),
        deadline=often(0.0, hostile_floats), engine_epoch=often(0, hostile_ints),
        mm_cache_invalidate=often([], st.lists(hashes(), max_size=3)),
    )
    others = st.one_of(
        st.builds(EngineEpoch, engine_epoch=hostile_ints),
        st.builds(CancelJobs, request_ids=st.lists(hostile_text, max_size=3)),
        st.builds(Hello, reply_to=often(reply_to, hostile_text), peer=hostile_text),
    )
    return st.one_of(jobs, jobs, others)


@given(data=st.data())
@FUZZ
def test_mm_worker_job_socket(worker_fuzz: WorkerFuzz, data: st.DataObject) -> None:
    fuzz_example(worker_fuzz, data)


def test_mm_worker_counted_what_it_dropped(worker_fuzz: WorkerFuzz, module_run_dir: Path) -> None:
    """As the engine's."""
    assert worker_fuzz.dropped > 0
    counter(module_run_dir, "mm-worker", "invalid_messages", worker_fuzz.dropped)
    holds_nothing(module_run_dir, "mm-worker")


# ================================================================ the frontend's sockets


class FrontendFuzz:
    """The test as the frontend's client, engine and MM worker: a DEALER to its client socket,
    a PUSH to its output socket, a stand-in engine and MM worker that answer what reaches them
    with one token (42), the probe."""

    def __init__(self, run_dir: Path, prep: Preprocessor) -> None:
        self.ctx = zmq.Context()
        self.engine = StandInEngine.at(self.ctx, f"ipc://{run_dir}/fe-engine.sock")
        self.mm_worker = StandInEngine.bound(self.ctx, f"ipc://{run_dir}/fe-mm.sock",
                                             MMWorkerInput)
        self.output_endpoint = f"ipc://{run_dir}/fe-out.sock"
        self.role = start_role("frontend", [
            "--engine-endpoint", self.engine.endpoint,
            "--mm-worker-endpoint", self.mm_worker.endpoint, "--port", "0",
            "--output-endpoint", self.output_endpoint, "--request-timeout", "30", *ROLE_ARGS,
        ], run_dir, log_dir=run_dir / "logs")
        assert self.role.endpoint is not None
        self.client = Inbox.client(self.ctx, self.role.endpoint)
        self.output = push(self.ctx, self.output_endpoint)
        self.replies = Replies(self.client, self.engine, self.mm_worker, answer=self.play_peers)
        self.codec: Codec[Any] = Codec(ClientRequest)
        self.output_codec: Codec[Any] = Codec(FrontendInput)
        self.answer_text = prep.decode([42])
        self.prep = prep
        self.messages = client_requests(prep, png_uri(make_image(32, 32)))
        self.outputs = frontend_inputs()
        self.dropped = 0
        """Messages sent to the output socket that the frontend cannot decode."""
        self.aborts: list[AbortRequests] = []
        """The engine's aborts that `replies` read: one sent after a reply may come first."""
        self.probe()

    def play_peers(self, message: Any) -> bool:
        """The stand-in engine's and MM worker's part: finish each request (a job too) with
        token 42, answer a cache reset; True when `message` was theirs, not a client reply."""
        if isinstance(message, EngineRequest | MMJob):
            self.engine.answer(message.reply_to, message.request_id)
        elif isinstance(message, ResetEngineCache):
            self.engine.reply(message.reply_to, EngineCacheReset(
                request_id=message.request_id, engine_epoch=1))
        elif isinstance(message, AbortRequests):
            self.aborts.append(message)
        return not isinstance(message, ClientReply)

    def send(self, *messages: msgspec.Struct) -> None:
        for message in messages:
            self.client.sock.send_multipart(frames_of(message))

    def probe(self) -> None:
        """A valid chat gets the stand-in engine's token, as text."""
        request_id = f"probe-{next(_ids)}"
        self.send(ChatRequest(request_id=request_id, messages=[ChatMessage("user", "hi")],
                              max_tokens=1))
        [reply] = self.replies.until({request_id}, self.role)[request_id]
        assert isinstance(reply, ChatOutput), reply
        assert (reply.token_ids, reply.text, reply.finished) == ([42], self.answer_text, True)

    def hold(self) -> tuple[str, EngineRequest]:
        """A chat that the stand-in engine holds, unanswered: its client id and the request."""
        request_id = f"held-{next(_ids)}"
        self.send(ChatRequest(request_id=request_id, messages=[ChatMessage("user", "hi")],
                              max_tokens=4, logprobs=2))
        while not isinstance(request := self.engine.take(), EngineRequest):
            assert isinstance(request, AbortRequests), request  # of an earlier request
        self.aborts.clear()  # of earlier requests too
        return request_id, request

    def close(self) -> None:
        self.client.close()
        self.output.close(linger=0)
        assert stop_role(self.role) == 0, _log_tail(self.role)
        self.engine.close()
        self.mm_worker.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def frontend_fuzz(module_run_dir: Path, prep: Preprocessor) -> Iterator[FrontendFuzz]:
    fuzz = FrontendFuzz(module_run_dir, prep)
    yield fuzz
    fuzz.close()


def client_requests(prep: Preprocessor, image: str) -> st.SearchStrategy[msgspec.Struct]:
    parts = st.lists(st.one_of(
        st.builds(TextPart, hostile_text),
        st.builds(ImagePart, st.builds(ImageUrl, url=often(image, hostile_text),
                                       uuid=often(None, hashes()))),
    ), max_size=3)
    messages = st.lists(st.builds(
        ChatMessage, st.sampled_from(["system", "user", "assistant"]),
        st.one_of(hostile_text, parts, st.just("hi " * 5000)),  # the last: over the context
    ), max_size=3)
    structured = st.builds(StructuredOutputs, json=often(None, st.one_of(
        hostile_text, st.just('{"type": "object"}'), st.just("[" * 10_000))),
        json_object=often(None, st.booleans()))
    fields = dict(
        max_tokens=often(1, hostile_ints), temperature=often(0.0, hostile_floats),
        top_p=often(1.0, hostile_floats), seed=often(None, hostile_ints),
        min_tokens=often(0, hostile_ints), stop_token_ids=often([], st.lists(hostile_ints)),
        logit_bias=often(None, st.dictionaries(hostile_ints, hostile_floats, max_size=3)),
        structured_outputs=often(None, structured), logprobs=often(None, hostile_ints),
        stop=often([], st.lists(hostile_text, max_size=3)),
    )
    prompts = st.one_of(hostile_text, st.lists(hostile_ints, max_size=8),
                        st.just(long_prompt(prep)), st.just([prep.image_token_id]))
    return st.one_of(
        st.builds(ChatRequest, request_id=hostile_text, messages=messages, **fields),
        st.builds(CompletionRequest, request_id=hostile_text, prompt=prompts, **fields),
        st.builds(ResetCache, request_id=hostile_text),
        st.builds(CancelChat, request_id=hostile_text),
    )


@given(data=st.data())
@FUZZ
def test_frontend_client_socket(frontend_fuzz: FrontendFuzz, data: st.DataObject) -> None:
    fuzz = frontend_fuzz
    frames = data.draw(broken(fuzz.messages))
    message = decoded(fuzz.codec, frames)
    owed = {""} if message is None else set() if isinstance(message, CancelChat) \
        else {message.request_id}
    fuzz.client.sock.send_multipart(frames)
    replies = fuzz.replies.until(owed, fuzz.role)
    for reply in (r for rs in replies.values() for r in rs if isinstance(r, ChatError)):
        assert_clear_error(reply.error, message)
        assert message is not None or reply.error.code == "invalid_message", reply
    event(outcome(message, replies))
    fuzz.probe()


HELD = msgspec.msgpack.encode("<the held request>")
"""Stands in the drawn frames for the id of the request the engine holds (known only later)."""


def frontend_inputs() -> st.SearchStrategy[msgspec.Struct]:
    """What an engine or MM worker could send: mostly about the request the engine holds."""
    ids = st.one_of(st.just(msgspec.msgpack.decode(HELD)), st.just(msgspec.msgpack.decode(HELD)),
                    hostile_text)
    token_ids = st.lists(hostile_ints, min_size=1, max_size=4)
    logprobs = st.lists(st.builds(
        TokenLogprobs, logprob=hostile_floats, top_token_ids=st.lists(hostile_ints, max_size=3),
        top_logprobs=st.lists(hostile_floats, max_size=3)), max_size=3)
    errors = st.builds(
        ErrorInfo, kind=often("request", hostile_text),
        code=st.one_of(st.sampled_from(sorted(CODES)), hostile_text), message=hostile_text,
        mm_hashes=st.lists(hashes(), max_size=2))
    outputs = st.builds(
        EngineOutput, request_id=ids, token_ids=st.one_of(st.just([42]), token_ids),
        finished=st.booleans(), finish_reason=often(None, hostile_text),
        prompt_token_ids=often(None, st.lists(hostile_ints, max_size=4)),
        engine_epoch=often(0, hostile_ints), logprobs=often(None, logprobs))
    return st.one_of(
        outputs, outputs,
        st.builds(RequestFailed, request_id=ids, error=errors,
                  engine_epoch=often(0, hostile_ints)),
        st.builds(EngineCacheReset, request_id=ids, engine_epoch=hostile_ints),
        st.builds(HelloReply, peer=st.one_of(st.sampled_from(["engine", "mm-worker-0"]),
                                             hostile_text),
                  started=hostile_ints, engine_epoch=often(0, hostile_ints)),
    )


@given(data=st.data())
@FUZZ
def test_frontend_output_socket(frontend_fuzz: FrontendFuzz, data: st.DataObject) -> None:
    """While the stand-in engine holds a chat, a hostile peer sends to the frontend's output
    socket (often about that chat); then the engine finishes it. The chat gets exactly one
    terminal reply, whatever came first."""
    fuzz = frontend_fuzz
    frames = data.draw(broken(fuzz.outputs))  # first: a draw may end the example
    held, request = fuzz.hold()
    frames = [frame.replace(HELD, msgspec.msgpack.encode(request.request_id)) for frame in frames]
    message = decoded(fuzz.output_codec, frames)
    fuzz.dropped += message is None
    fuzz.output.send_multipart(frames)
    fuzz.engine.answer(request.reply_to, request.request_id)
    replies = fuzz.replies.until({held}, fuzz.role)
    event(outcome(message, replies))
    fuzz.probe()


def test_frontend_counted_what_it_dropped(frontend_fuzz: FrontendFuzz,
                                          module_run_dir: Path) -> None:
    """As the engine's: every unreadable reply was counted, and no request waits for its
    timeout."""
    assert frontend_fuzz.dropped > 0
    counter(module_run_dir, "frontend", "invalid_messages", frontend_fuzz.dropped)
    holds_nothing(module_run_dir, "frontend")


@pytest.mark.parametrize("output, bad_id", [
    ({"token_ids": [-1]}, -1), ({"token_ids": [2**63]}, 2**63),
    ({"token_ids": [2**64 - 1], "finished": True}, 2**64 - 1),
    ({"token_ids": [42], "logprobs": [TokenLogprobs(0.0, [-5], [0.0])]}, -5),
], ids=["negative_id", "id_over_int64", "id_max_uint64", "negative_logprob_id"])
def test_frontend_output_with_ids_no_tokenizer_takes(
    frontend_fuzz: FrontendFuzz, output: dict[str, Any], bad_id: int
) -> None:
    """Found by the fuzzing (the frontend's I/O loop died of the tokenizer's OverflowError):
    the chat fails naming the id, is stopped in the engine, and the frontend serves on."""
    fuzz = frontend_fuzz
    held, request = fuzz.hold()
    fuzz.output.send_multipart(frames_of(EngineOutput(request_id=request.request_id, **output)))
    [reply] = fuzz.replies.until({held}, fuzz.role)[held]
    assert isinstance(reply, ChatError), reply
    assert reply.error.code == "internal" and f"token id {bad_id}," in reply.error.message
    abort = fuzz.aborts.pop() if fuzz.aborts else fuzz.engine.take()
    assert isinstance(abort, AbortRequests) and abort.request_ids == [request.request_id]
    fuzz.probe()


# ================================================================ every role's stats and control


ROLES = {"engine": "engine_fuzz", "mm-worker": "worker_fuzz", "frontend": "frontend_fuzz"}
"""Each role's name in its stats, and the fixture that started it."""


def role_child(request: pytest.FixtureRequest, role: str) -> Child:
    child: Child = request.getfixturevalue(ROLES[role]).role
    return child


class ControlFuzz:
    """A DEALER to a role's control socket, its stats socket subscribed, and what it dropped."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.ctx = zmq.Context()
        ops = child.config.ops  # type: ignore[attr-defined]
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.connect(ops.control_endpoint)
        self.stats = self.ctx.socket(zmq.SUB)
        self.stats.subscribe(b"")
        self.stats.connect(ops.stats_endpoint)
        self.xsub = self.ctx.socket(zmq.XSUB)  # a PUB takes only what an XSUB peer sends
        self.xsub.connect(ops.stats_endpoint)
        self.dropped = 0

    def pong(self) -> list[bytes]:
        assert self.control.poll(int(PATIENCE_S * 1000)), f"no Pong from the {self.child.role}"
        return self.control.recv_multipart()

    def close(self) -> None:
        for sock in (self.control, self.stats, self.xsub):
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def control_fuzz(request: pytest.FixtureRequest) -> Iterator[dict[str, ControlFuzz]]:
    fuzzes = {role: ControlFuzz(role_child(request, role)) for role in ROLES}
    yield fuzzes
    for fuzz in fuzzes.values():
        fuzz.close()


control_frames = st.one_of(
    st.lists(st.binary(max_size=32), min_size=1, max_size=3),  # random frames, envelopes
    st.builds(lambda envelope, body: [*envelope, body],
              st.lists(st.sampled_from([b"", b"x"]), max_size=2),
              st.sampled_from([frames_of(Ping())[0], b"", b"\x81\xa4type\xa4pong",
                               b"\x81\xa4type\xa4ping\xc1", frames_of(Pong(
                                   role="x", name="y", pid=-1, state="", model=""))[0]])),
)


@pytest.mark.parametrize("role", list(ROLES))
@given(frames=control_frames)
@FUZZ
def test_control_socket(control_fuzz: dict[str, ControlFuzz], role: str,
                        frames: list[bytes]) -> None:
    """A role answers each readable Ping in its envelope, drops (and counts) the rest, and
    answers the next plain Ping."""
    fuzz = control_fuzz[role]
    readable = decoded(Codec(ControlRequest), frames[-1:]) is not None
    fuzz.dropped += not readable
    fuzz.control.send_multipart(frames)
    if readable:
        *envelope, pong = fuzz.pong()
        assert envelope == frames[:-1]
        assert msgspec.msgpack.decode(pong, type=Pong).role == role
    fuzz.control.send_multipart(frames_of(Ping()))
    [pong] = fuzz.pong()
    assert msgspec.msgpack.decode(pong, type=Pong).role == role
    event("a Ping: answered" if readable else "unreadable: dropped and counted")


@pytest.mark.parametrize("role", list(ROLES))
@given(frames=st.lists(st.binary(max_size=32), min_size=1, max_size=3))
@settings(FUZZ, max_examples=max(10, FUZZ_EXAMPLES // 5))  # each waits for a snapshot
def test_stats_socket(control_fuzz: dict[str, ControlFuzz], role: str,
                      frames: list[bytes]) -> None:
    """Whatever an XSUB peer sends a role's stats socket (subscriptions, unsubscriptions,
    anything), the role publishes on: a snapshot taken after it comes."""
    fuzz = control_fuzz[role]
    fuzz.xsub.send_multipart(frames)
    sent = time.time()
    while True:
        assert fuzz.stats.poll(int(PATIENCE_S * 1000)), f"no Stats from the {role}"
        stats = msgspec.msgpack.decode(fuzz.stats.recv(), type=Stats)
        if stats.time > sent:
            break
    assert stats.role == role and fuzz.child.process.poll() is None


@pytest.mark.parametrize("role", list(ROLES))
def test_control_counted_what_it_dropped(control_fuzz: dict[str, ControlFuzz], role: str,
                                         module_run_dir: Path) -> None:
    assert control_fuzz[role].dropped > 0
    counter(module_run_dir, role, "invalid_control_messages", control_fuzz[role].dropped)
