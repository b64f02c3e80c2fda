"""protocol/: every message round-trips through the codec, arrays travel as their own frames;
the error table agrees with its docstring and the tree, and foreign errors translate to it."""

from __future__ import annotations

import ast
import importlib
import io
import os
import re
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from conftest import REPO
from mmlane.protocol import errors, shm
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import (
    CODES,
    FOREIGN_ERRORS,
    CacheMissError,
    ErrorInfo,
    FatalError,
    InternalError,
    MMLaneError,
    RequestError,
    RetryableError,
    TensorsLost,
    TensorsRefused,
    from_info,
    http_status,
    translate,
    translated,
)
from mmlane.protocol.messages import (
    ChatError,
    ChatMessage,
    ChatOutput,
    ChatRequest,
    ClientReply,
    ClientRequest,
    CompletionRequest,
    EngineInput,
    EngineOutput,
    EngineRequest,
    FrontendInput,
    Hello,
    HelloReply,
    ImagePart,
    ImageUrl,
    LauncherInput,
    MMItem,
    MMJob,
    MMWorkerInput,
    Ready,
    RequestFailed,
    SamplingParams,
    StartupFailed,
    TextPart,
)
from mmlane.protocol.shm import ShmWriter

SAMPLING = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=3)
ERROR = ErrorInfo(kind="request", code="invalid_image", message="image 0: truncated")


def _item(offset: int, patches: int) -> MMItem:
    return MMItem(
        offset=offset, length=patches // 4,
        tensors={
            "pixel_values": np.arange(patches * 1176, dtype=np.float32).reshape(patches, 1176),
            "image_grid_thw": np.array([[1, 2, patches // 2]], dtype=np.int64),
        },
    )


CASES = [
    (ClientRequest, ChatRequest(
        request_id="r1", max_tokens=9, seed=1,
        messages=[ChatMessage(role="system", content="be brief"), ChatMessage(
            role="user", content=[TextPart(text="hi"),
                                  ImagePart(image_url=ImageUrl(url="data:x", uuid="u"))])],
    ), 1),
    (ClientRequest, CompletionRequest(request_id="r1", prompt="Once upon", max_tokens=9), 1),
    (ClientRequest, CompletionRequest(request_id="r1", prompt=[5, 6, 7], seed=1), 1),
    (ClientReply, ChatOutput(request_id="r1", token_ids=[1, 2], text="ab", finished=True,
                             finish_reason="stop", prompt_token_ids=[7, 8]), 1),
    (ClientReply, ChatError(request_id="r1", error=ERROR), 1),
    (MMWorkerInput, MMJob(request_id="r2", reply_to="ipc://x", prompt_token_ids=[1, 9],
                          images=[ImageUrl(url="data:x")], sampling=SAMPLING), 1),
    (EngineInput, EngineRequest(request_id="r3", reply_to="ipc://x", prompt_token_ids=[1] * 9,
                                sampling=SAMPLING), 1),
    (EngineInput, EngineRequest(request_id="r4", reply_to="ipc://x", prompt_token_ids=[1] * 9,
                                sampling=SAMPLING, mm_items=[_item(1, 8), _item(5, 4)]), 5),
    (FrontendInput, EngineOutput(request_id="r5", token_ids=[4], prompt_token_ids=[1]), 1),
    (FrontendInput, RequestFailed(request_id="r6", error=ERROR), 1),
    (MMWorkerInput, Hello(reply_to="ipc://x", peer="mm-worker-0"), 1),
    (EngineInput, Hello(reply_to="ipc://x", peer="engine"), 1),
    (FrontendInput, HelloReply(peer="engine", started=7, engine_epoch=3), 1),
    (LauncherInput, Ready(role="engine", pid=1, endpoint="ipc://e"), 1),
    (LauncherInput, StartupFailed(role="engine", pid=1, message="no model"), 1),
]


@pytest.mark.parametrize("union, message, frames", CASES, ids=[type(c[1]).__name__ for c in CASES])
def test_round_trip_keeps_the_message_and_counts_frames(union, message, frames) -> None:
    codec = Codec(union)
    encoded = codec.encode(message)
    assert len(encoded) == frames
    decoded = codec.decode(encoded)
    assert type(decoded) is type(message)
    if isinstance(message, EngineRequest) and message.mm_items:
        for got, sent in zip(decoded.mm_items, message.mm_items, strict=True):
            assert got.tensors.keys() == sent.tensors.keys()
            for name, array in sent.tensors.items():
                assert got.tensors[name].dtype == array.dtype
                assert np.array_equal(got.tensors[name], array)
    else:
        assert decoded == message


def test_arrays_cross_a_real_socket_without_copies() -> None:
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.PULL) as pull, ctx.socket(zmq.PUSH) as push:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        codec = Codec(EngineInput)
        sent = EngineRequest(request_id="r", reply_to="x", prompt_token_ids=[1],
                             sampling=SAMPLING, mm_items=[_item(0, 64)])
        push.send_multipart(codec.encode(sent), copy=False)
        frames = pull.recv_multipart(copy=False)
        got = codec.decode(frames).mm_items[0].tensors["pixel_values"]
    assert len(frames) == 3
    assert not got.flags.owndata  # a view over the received frame
    assert np.array_equal(got, sent.mm_items[0].tensors["pixel_values"])


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "empty message"),
        ([b"\xc1"], "undecodable"),
        ([msgspec.msgpack.encode({"type": "nope"})], "Invalid value 'nope'"),
        ([msgspec.msgpack.encode({"type": "chat", "request_id": "x", "messages": [
            {"role": "robot", "content": "hi"}]})], r"\$\.messages\[0\]\.role"),
        ([msgspec.msgpack.encode({"type": "chat", "request_id": "x", "messages": [
            {"role": "user", "content": [{"type": "audio"}]}]})], r"messages\[0\]\.content\[0\]"),
    ],
    ids=["empty", "garbage", "unknown_tag", "bad_role", "bad_part"],
)
def test_client_decode_errors_name_the_problem(frames, match) -> None:
    with pytest.raises(RequestError, match=match) as info:
        Codec(ClientRequest).decode(frames)
    assert info.value.code == "invalid_message"


def _tensor_request(header: list, frames: list[bytes]) -> list[bytes]:
    body = msgspec.msgpack.encode(["req", "r", "x", [1], [1, 0.0, 1.0, None],
                                   [[0, 1, {"pixel_values": header}]]])
    return [body, *frames]


@pytest.mark.parametrize(
    "header, frames, match",
    [
        (["<f4", [2, 2], 1], [], "frame 1 missing"),
        (["<f4", [2, 2], 1], [b"\0" * 15], "holds 15 bytes"),
        (["|O", [1], 1], [b"\0" * 8], "unsupported tensor dtype"),
        (["<f4", [-1, 4], 1], [b"\0" * 16], "negative dimension"),
        (["|u1", [2**32, 2**32], 1], [b""], r"needs 18446744073709551616\b"),  # no int64 wrap
        ("not a header", [], "Expected `array`"),
        (["|u1", [1], 1], [b"\0", b"\0"], "2 frames after the body, but its tensors use 1"),
        (["|u1", [0], 1], [], "frame 1 missing"),
        (msgspec.Raw(b"\x91" * 100_000 + b"\xc0"), [], "recursion depth"),  # not a crash
    ],
    ids=["missing_frame", "short_frame", "object_dtype", "negative_shape", "huge_shape",
         "bad_header", "extra_frame", "no_frame", "nested_deep"],
)
def test_bad_tensor_frames_are_refused(header, frames, match) -> None:
    with pytest.raises(RequestError, match=match):
        Codec(EngineInput).decode(_tensor_request(header, frames))


# ---------------------------------------------------------------- shared-memory tensors

SLOT = shm.HEADER + (1 << 20)
"""The size of a slot made for a tensor of up to 1 MiB."""


@pytest.fixture
def writer() -> Iterator[ShmWriter]:
    """A writer of its own tag, taking every array of 1 KiB or more, with room for two slots."""
    tag = shm.sender_tag(f"test-{time.time_ns()}")
    writer = ShmWriter(tag, threshold=1024, capacity=2 * SLOT, max_age_s=60)
    yield writer
    writer.close()
    for name in _slots(writer):  # full ones no receiver took
        (shm.SHM_DIR / name).unlink()


def _slots(writer: ShmWriter) -> dict[str, bool]:
    """Each of the writer's slot files, and whether it is full."""
    return {path.name: path.read_bytes()[0] == 1
            for path in sorted(shm.SHM_DIR.glob(f"mmlane-{writer.tag}-*"))}


def _image_request(patches: int, request_id: str = "r") -> EngineRequest:
    return EngineRequest(request_id=request_id, reply_to="x", prompt_token_ids=[1],
                         sampling=SAMPLING, mm_items=[_item(0, patches)])


def test_big_arrays_go_through_shared_memory_and_come_back_equal(writer) -> None:
    sent = _image_request(64)  # pixel_values 301 KB: a slot; image_grid_thw 24 B: a frame
    frames = Codec(EngineInput, shm_writer=writer).encode(sent)
    assert len(frames) == 2
    assert list(_slots(writer).values()) == [True]
    got = Codec(EngineInput, accept_shm=True).decode(frames).mm_items[0].tensors
    assert list(_slots(writer).values()) == [False]  # emptied by the receiver, kept for reuse
    for name, array in sent.mm_items[0].tensors.items():
        assert got[name].dtype == array.dtype and np.array_equal(got[name], array), name
    assert got["pixel_values"].flags.owndata  # a copy: the slot is the sender's again
    assert writer.counters["shm_tensors"] == 1
    assert writer.counters["shm_bytes"] == sent.mm_items[0].tensors["pixel_values"].nbytes


def test_a_decoder_that_does_not_accept_shared_memory_refuses_it(writer) -> None:
    frames = Codec(EngineInput, shm_writer=writer).encode(_image_request(64))
    with pytest.raises(RequestError, match="shared-memory tensors are refused"):
        Codec(EngineInput).decode(frames)
    assert list(_slots(writer).values()) == [True]  # not touched


def test_slots_are_reused_and_beyond_the_capacity_tensors_go_as_frames(writer) -> None:
    sender, receiver = Codec(EngineInput, shm_writer=writer), Codec(EngineInput, accept_shm=True)
    first = sender.encode(_image_request(128, "first"))
    second = sender.encode(_image_request(128, "second"))  # the first slot is full: a new one
    assert len(sender.encode(_image_request(128))) == 3  # both full, no room: a frame
    assert writer.counters["shm_fallbacks"] == 1
    assert receiver.decode(first).request_id == "first"
    third = sender.encode(_image_request(64, "third"))  # into the first's slot, emptied
    assert len(third) == 2 and len(_slots(writer)) == 2
    assert [receiver.decode(f).request_id for f in (second, third)] == ["second", "third"]
    assert list(_slots(writer).values()) == [False, False]


def test_a_slot_full_too_long_is_taken_back_and_its_old_message_is_lost(writer) -> None:
    writer.max_age_s = 0
    sender, receiver = Codec(EngineInput, shm_writer=writer), Codec(EngineInput, accept_shm=True)
    old = sender.encode(_image_request(64, "old"))
    new = sender.encode(_image_request(64, "new"))  # the slot, full too long, is reused
    assert writer.counters["shm_reaped"] == 1 and len(_slots(writer)) == 1
    with pytest.raises(TensorsLost):  # the slot holds a later use by now
        receiver.decode(old)
    assert receiver.decode(new).request_id == "new"


def test_a_relayed_slot_is_aged_only_from_when_its_relay_hands_it_on(writer) -> None:
    """A pool process's slot (its writer relayed) that the MM worker holds while its job waits
    for its turn is not taken back, however long it waits (a max age of 0 here); once the
    worker has handed it on, an engine that never empties it is taken to be gone."""
    writer.max_age_s, writer.relayed = 0, True
    pixels = np.arange(80_000, dtype=np.float32).reshape(100, 800)
    views = shm.ShmViews(keep_from=1024)
    held = views.adopt(str(writer.put(pixels)), pixels.dtype, pixels.shape)
    later = views.adopt(str(writer.put(pixels + 1)), pixels.dtype, pixels.shape)
    assert held is not None and later is not None
    assert writer.counters["shm_reaped"] == 0 and len(_slots(writer)) == 2  # a second slot
    engine = shm.ShmReader()
    sent = str(views.put(held))  # its job's turn: to the engine, which takes it
    assert np.array_equal(engine.take(sent, pixels.dtype, pixels.shape), pixels)
    unread = str(views.put(later))  # to an engine that is gone
    writer.put(pixels)
    assert writer.counters["shm_reaped"] == 1
    assert engine.take(unread, pixels.dtype, pixels.shape) is None


def test_a_successor_unlinks_its_predecessors_slots_and_a_message_of_them_is_lost(
    writer
) -> None:
    frames = Codec(EngineInput, shm_writer=writer).encode(_image_request(64))
    successor = ShmWriter(writer.tag, threshold=1024, capacity=SLOT, max_age_s=60)
    assert shm.reap(successor.tag, keep=successor.stem) == 1
    assert _slots(writer) == {}
    with pytest.raises(TensorsLost, match="gone on arrival") as lost:
        Codec(EngineInput, accept_shm=True).decode(frames)
    assert lost.value.code == "tensors_lost" and lost.value.kind == "retryable"
    assert lost.value.decoded.request_id == "r" and lost.value.decoded.reply_to == "x"


def test_a_closed_writer_unlinks_its_empty_slots_and_its_receiver_the_others(writer) -> None:
    sender, receiver = Codec(EngineInput, shm_writer=writer), Codec(EngineInput, accept_shm=True)
    taken = sender.encode(_image_request(64, "taken"))
    pending = sender.encode(_image_request(64, "pending"))  # the first slot is full: a second
    receiver.decode(taken)
    writer.close()  # the sender stops with "pending" still on its way
    assert list(_slots(writer).values()) == [True]  # the empty slot is gone, the full one kept
    assert receiver.decode(pending).request_id == "pending"  # ... until its receiver takes it
    assert _slots(writer) == {}


@pytest.mark.parametrize(
    "ref",
    ["../../etc/passwd", "mmlane-000000000000-1-0/x.1", "mmlane-000000000000-1-0", "psm_1234"],
)
def test_shared_memory_references_are_checked_before_any_file_is_opened(ref) -> None:
    header = ["<f4", [2, 2], 0, ref]
    with pytest.raises(RequestError, match="not a shared-memory tensor reference"):
        Codec(EngineInput, accept_shm=True).decode(_tensor_request(header, []))


def test_a_slot_holding_another_size_is_refused(writer) -> None:
    Codec(EngineInput, shm_writer=writer).encode(_image_request(64))
    [name] = _slots(writer)
    header = ["<f4", [2, 2], 0, f"{name}.1"]  # 16 bytes, where the slot holds 301 KB
    with pytest.raises(RequestError, match="needs 16"):
        Codec(EngineInput, accept_shm=True).decode(_tensor_request(header, []))


def test_a_pool_processs_slot_goes_on_as_it_is_and_a_dropped_view_frees_it(writer) -> None:
    """The MM worker's side of its pool processes' slots (ShmViews): a view goes to the engine
    as its slot, with no copy; a view dropped unsent frees its slot; a small tensor, or any
    without a shared-memory engine, is copied out and its slot freed at once."""
    pixels = np.arange(80_000, dtype=np.float32).reshape(100, 800)  # 320 KB
    views = shm.ShmViews(keep_from=1024)
    view = views.adopt(str(writer.put(pixels)), pixels.dtype, pixels.shape)
    assert view is not None and np.array_equal(view, pixels)
    request = EngineRequest(request_id="r", reply_to="x", prompt_token_ids=[1],
                            sampling=SAMPLING, mm_items=[MMItem(
                                offset=0, length=1, tensors={"pixel_values": view})])
    frames = Codec(EngineInput, shm_writer=views).encode(request)
    assert len(frames) == 1 and views.counters["shm_tensors"] == 1  # handed on: no frame
    del view, request
    assert list(_slots(writer).values()) == [True]  # the engine's to empty now
    got = Codec(EngineInput, accept_shm=True).decode(frames)
    assert np.array_equal(got.mm_items[0].tensors["pixel_values"], pixels)
    assert list(_slots(writer).values()) == [False]

    dropped = views.adopt(str(writer.put(pixels)), pixels.dtype, pixels.shape)
    assert list(_slots(writer).values()) == [True]
    del dropped  # its job failed: nobody sends it
    assert list(_slots(writer).values()) == [False]

    for copying in (shm.ShmViews(keep_from=None), shm.ShmViews(keep_from=1 << 20)):
        copy = copying.adopt(str(writer.put(pixels)), pixels.dtype, pixels.shape)
        assert copy is not None and np.array_equal(copy, pixels)
        assert list(_slots(writer).values()) == [False]  # copied out, freed at once
        assert copying.put(copy) is None  # not a slot's: it would go as a frame


def test_the_worker_checks_a_pool_slot_as_the_engine_does(writer) -> None:
    """A pool process's result is checked against its slot before the worker takes it as a
    view: a use of another size or a negative shape is refused, a use taken back since (the
    slot holds a later one) reads as gone; the slot is left as it was."""
    views = shm.ShmViews(keep_from=1024)
    pixels = np.ones((100, 800), np.float32)
    ref = str(writer.put(pixels))
    name, use = ref.rsplit(".", 1)
    with pytest.raises(shm.SlotRefused, match="needs 16"):
        views.adopt(ref, np.dtype(np.float32), (2, 2))
    with pytest.raises(shm.SlotRefused, match="negative shape"):
        views.adopt(ref, np.dtype(np.float32), (-1, -80_000))
    assert views.adopt(f"{name}.{int(use) + 1}", pixels.dtype, pixels.shape) is None
    assert list(_slots(writer).values()) == [True]
    assert np.array_equal(views.adopt(ref, pixels.dtype, pixels.shape), pixels)


def test_a_dead_writers_slots_are_released_as_its_close_would(writer) -> None:
    full = writer.put(np.ones(1 << 18, np.float32))  # 1 MiB: a slot of its own, left full
    empty_ref = writer.put(np.ones(1 << 10, np.float32))
    assert full and empty_ref
    shm.ShmReader().take(empty_ref, np.dtype(np.float32), (1 << 10,))  # emptied
    shm.abandon("")  # a process that died before it said its stem names nothing
    shm.abandon("mmlane-../")
    assert len(_slots(writer)) == 2
    shm.abandon(writer.stem)  # as if it were killed
    assert list(_slots(writer).values()) == [True]  # the empty one unlinked
    shm.ShmReader().take(full, np.dtype(np.float32), (1 << 18,))  # the receiver unlinks it
    assert _slots(writer) == {}


def test_a_slot_cut_short_after_its_receiver_read_it_is_refused_not_a_sigbus(writer) -> None:
    """Found by the fuzzing (tests/test_fuzz.py): a receiver that kept its slots mapped died of
    SIGBUS reading a slot truncated since; it checks the file against the mapping first now,
    and its writer lets go of a slot cut short without touching its pages."""
    sender, receiver = Codec(EngineInput, shm_writer=writer), Codec(EngineInput, accept_shm=True)
    receiver.decode(sender.encode(_image_request(64, "first")))  # read once: the slot known
    frames = sender.encode(_image_request(64, "cut"))
    [name] = _slots(writer)
    for size in (shm.HEADER + 100, 0):
        os.truncate(shm.SHM_DIR / name, size)
        with pytest.raises(TensorsRefused, match="refused: shared-memory") as refused:
            receiver.decode(frames)
        assert refused.value.kind == "request" and refused.value.code == "invalid_message"
        assert refused.value.decoded.request_id == "cut"
    assert len(sender.encode(_image_request(64))) == 2  # a new slot, the cut one dropped
    assert name not in _slots(writer)


@pytest.mark.parametrize("replacement", ["symlink", "fifo"])
def test_a_slot_replaced_by_a_symlink_or_a_fifo_is_refused_and_never_followed(
    writer, tmp_path, replacement
) -> None:
    target = tmp_path / "target"
    target.write_bytes(bytes(SLOT))
    frames = Codec(EngineInput, shm_writer=writer).encode(_image_request(64))
    [name] = _slots(writer)
    path = shm.SHM_DIR / name
    with path.open("rb") as slot:  # the target looks like the slot, full
        target.write_bytes(slot.read(SLOT))
    path.unlink()
    path.symlink_to(target) if replacement == "symlink" else os.mkfifo(path)
    with pytest.raises(TensorsRefused, match="cannot be opened|is no regular file"):
        Codec(EngineInput, accept_shm=True).decode(frames)
    assert target.read_bytes()[0] == 1  # not freed through the link
    path.unlink()


@given(st.one_of(st.text(max_size=120), st.from_regex(
    r"(/dev/shm/|\.\./)?mmlane-[0-9a-f]{12}-[0-9]{1,3}-[0-9./]{1,4}\.[0-9]{1,3}\n?",
    fullmatch=True)))
def test_a_reference_names_a_slot_inside_the_shared_memory_folder_or_none(ref: str) -> None:
    """Whatever a peer writes as a reference, it names one file directly in /dev/shm of the
    slot pattern, or is refused before any file is opened."""
    try:
        name, generation, nbytes = shm._parse(ref, np.dtype("<f4"), (2, 3))
    except shm.SlotRefused:
        return
    assert (shm.SHM_DIR / name).parent == shm.SHM_DIR and shm._SLOT.fullmatch(name)
    assert ref.startswith(f"{name}.") and int(ref[len(name) + 1:]) == generation
    assert nbytes == 24


KINDS = [RequestError, RetryableError, InternalError, FatalError]


@pytest.mark.parametrize("cls", KINDS)
def test_errors_cross_as_data_and_come_back_as_the_same_kind(cls: type[MMLaneError]) -> None:
    error = cls("it broke", code="some_code")
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(error.to_info()), type=ErrorInfo)
    back = from_info(info)
    assert type(back) is cls and back.code == "some_code" and str(back) == "it broke"


def test_unknown_error_kind_is_internal() -> None:
    assert type(from_info(ErrorInfo(kind="???", code="c", message="m"))) is InternalError


def test_an_unclassified_error_is_internal_not_fatal() -> None:
    info = MMLaneError("a bug while serving one request").to_info()
    assert (info.kind, info.code) == ("internal", "internal")
    assert type(from_info(info)) is InternalError


# ---------------------------------------------------------------- the code table


def test_every_code_has_a_kind_and_each_kind_class_a_code_of_its_kind() -> None:
    assert {code.kind for code in CODES.values()} == {cls.kind for cls in KINDS}
    for cls in [*KINDS, CacheMissError]:
        assert CODES[cls.default_code].kind == cls.kind, cls


def _docstring_codes() -> dict[str, set[str]]:
    """kind -> the codes the module docstring's tree lists under that kind's class."""
    tree = errors.__doc__.split("\n\n")[1]
    listed: dict[str, set[str]] = {}
    kind = ""
    for line in tree.splitlines():
        if found := re.search(r"── (\w+)", line):
            kind = getattr(errors, found[1]).kind
        words = line.strip(" │").removeprefix("│ ").removeprefix("codes:")
        if "codes:" in line or re.fullmatch(r"\s*[a-z_]+(, [a-z_]+)*,?", words):
            listed.setdefault(kind, set()).update(re.findall(r"[a-z_]+", words))
    return listed


def test_the_docstring_lists_every_code_under_its_kind() -> None:
    by_kind: dict[str, set[str]] = {}
    for name, code in CODES.items():
        by_kind.setdefault(code.kind, set()).add(name)
    assert _docstring_codes() == by_kind


def _module_strings(trees: list[ast.Module]) -> dict[str, str]:
    """Module-level NAME = "string" constants, for codes given by name (DRAINING_CODE)."""
    return {
        target.id: node.value.value
        for tree in trees for node in tree.body if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets if isinstance(target, ast.Name)
    }


def _code(value: ast.expr, constants: dict[str, str]) -> str | None:
    """The code a `code=` argument names; None for one passed through (`code=exc.code`)."""
    if isinstance(value, ast.Constant):
        return str(value.value)
    return constants.get(value.id) if isinstance(value, ast.Name) else None


def _raised_codes() -> list[tuple[str, str, str]]:
    """(where, class name, code) of every `X(..., code=...)` and `default_code = ...` in the
    tree."""
    files = [*(REPO / "services").rglob("*.py"), *(REPO / "protocol").rglob("*.py"),
             *(REPO / "bench").rglob("*.py")]
    trees = [ast.parse(path.read_text(), str(path)) for path in files]
    constants = _module_strings(trees)
    found = []
    for path, tree in zip(files, trees, strict=True):
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                codes = [_code(k.value, constants) for k in node.keywords if k.arg == "code"]
                found += [(where, name, code) for code in codes if code is not None]
            elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "default_code":
                found.append((where, "", ast.literal_eval(node.value)))
    return found


def test_every_code_raised_in_the_tree_is_in_the_table_with_its_class_kind() -> None:
    raised = _raised_codes()
    assert len(raised) > 40  # the scan sees the tree
    for where, name, code in raised:
        assert code in CODES, f"{where}: code {code!r} is not in mmlane.protocol.errors.CODES"
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, MMLaneError):
            assert CODES[code].kind == cls.kind, f"{where}: {name} raised with {code!r}"


@pytest.mark.parametrize(
    "info, status",
    [
        (ErrorInfo(kind="request", code="model_error", message="m"), 400),
        (ErrorInfo(kind="request", code="image_too_large", message="m"), 413),
        (ErrorInfo(kind="retryable", code="timeout", message="m"), 504),
        (ErrorInfo(kind="internal", code="internal", message="m"), 500),
        (ErrorInfo(kind="request", code="from_a_newer_peer", message="m"), 400),
        (ErrorInfo(kind="retryable", code="from_a_newer_peer", message="m"), 503),
        (ErrorInfo(kind="???", code="???", message="m"), 500),
    ],
    ids=["code", "code_413", "code_504", "internal", "new_request_code", "new_retryable_code",
         "unknown"],
)
def test_http_status_is_the_codes_or_else_its_kinds(info: ErrorInfo, status: int) -> None:
    assert http_status(info) == status


# ---------------------------------------------------------------- translating foreign errors


def test_every_foreign_error_names_a_real_type_and_a_known_code() -> None:
    for name, foreign in FOREIGN_ERRORS.items():
        module, _, qualname = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), qualname), type), name
        assert foreign.code in CODES, name


def _pil_error(data: bytes) -> Exception:
    with pytest.raises(Exception) as caught:
        Image.open(io.BytesIO(data))
    return caught.value


@pytest.mark.parametrize(
    "make, kind, code, message",
    [
        (lambda: _pil_error(b"not an image"), RequestError, "invalid_image",
         "where: not an image in a format we can read"),
        (lambda: Image.DecompressionBombError("too big"), RequestError, "image_too_large",
         r"where: more pixels than max_image_pixels allows \(too big\)"),
        (lambda: msgspec.ValidationError("Expected `int`"), RequestError, "invalid_message",
         "where: Expected `int`"),
        (lambda: torch.OutOfMemoryError("CUDA out of memory"), RetryableError, "overloaded",
         "where: out of device memory: CUDA out of memory"),
        (lambda: MemoryError(), RetryableError, "overloaded", "where: out of memory"),
        (lambda: zmq.Again(), RetryableError, "overloaded", "where: its socket's queue is full"),
        (lambda: KeyError("x"), InternalError, "internal", "where: 'x'"),
    ],
    ids=["pil_unidentified", "pil_bomb", "msgspec", "torch_oom", "memory", "zmq_again",
         "unmapped"],
)
def test_translate_maps_foreign_types_to_our_codes(make, kind, code, message) -> None:
    error = translate(make(), "where")
    assert (type(error), error.code) == (kind, code)
    assert re.fullmatch(message, error.message), error.message


def test_translate_keeps_ours_and_falls_back_to_the_boundarys_default() -> None:
    ours = RetryableError("busy")
    assert translate(ours, "where", default="invalid_image") is ours
    error = translate(ValueError("tile cannot extend outside image"), "image 0",
                      default="invalid_image")
    assert (type(error), error.code) == (RequestError, "invalid_image")
    assert error.message == "image 0: tile cannot extend outside image"


def test_translated_raises_ours_from_the_foreign_error() -> None:
    with pytest.raises(RetryableError, match="^decoding: out of memory$") as caught:
        with translated("decoding", default="invalid_image"):
            raise MemoryError
    assert isinstance(caught.value.__cause__, MemoryError)
    ours = RequestError("bad")
    with pytest.raises(RequestError) as caught_ours, translated("decoding"):
        raise ours
    assert caught_ours.value is ours and ours.__cause__ is None
