"""protocol/: every message round-trips through the codec, arrays travel as their own frames."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from protocol.codec import Codec
from protocol.errors import (
    ErrorInfo,
    FatalError,
    MMLaneError,
    RequestError,
    RetryableError,
    from_info,
)
from protocol.messages import (
    ChatError,
    ChatMessage,
    ChatOutput,
    ChatRequest,
    ClientReply,
    ClientRequest,
    EngineInput,
    EngineOutput,
    EngineRequest,
    FrontendInput,
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
        (["<f4", [-1, 4], 1], [b"\0" * 16], "needs"),
        ("not a header", [], "Expected `array`"),
    ],
    ids=["missing_frame", "short_frame", "object_dtype", "negative_shape", "bad_header"],
)
def test_bad_tensor_frames_are_refused(header, frames, match) -> None:
    with pytest.raises(RequestError, match=match):
        Codec(EngineInput).decode(_tensor_request(header, frames))


@pytest.mark.parametrize("cls", [RequestError, RetryableError, FatalError])
def test_errors_cross_as_data_and_come_back_as_the_same_kind(cls: type[MMLaneError]) -> None:
    error = cls("it broke", code="some_code")
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(error.to_info()), type=ErrorInfo)
    back = from_info(info)
    assert type(back) is cls and back.code == "some_code" and str(back) == "it broke"


def test_unknown_error_kind_is_fatal() -> None:
    assert type(from_info(ErrorInfo(kind="???", code="c", message="m"))) is FatalError
