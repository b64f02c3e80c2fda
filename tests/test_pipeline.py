"""The whole request path through `mmlane serve`: three real processes, real sockets, tiny model."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from bench.images import data_uri, encode, jpeg_uri, make_image, png_uri
from conftest import REPO, free_port, processes
from mmlane.client import Client, user_message
from mmlane.model import Preprocessor
from mmlane.model.video import Qwen2VLVideo
from mmlane.protocol.messages import ChatMessage, ImagePart, ImageUrl, TextPart
from peers import SERVE_READY


@dataclass
class Served:
    endpoint: str
    media_dir: Path
    process: subprocess.Popen
    lines: list[str]


def start_serve(extra: list[str], run_dir: Path, port: int) -> tuple[subprocess.Popen, list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "mmlane.cli", "serve", "--port", str(port),
         "--run-dir", str(run_dir), *extra],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if SERVE_READY in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, name="serve-stdout", daemon=True).start()
    ready.wait(180)
    return process, lines


@pytest.fixture(scope="module")
def served(module_run_dir: Path, qwen_dir: Path) -> Iterator[Served]:
    media = module_run_dir / "media"
    media.mkdir()
    port = free_port()
    process, lines = start_serve(
        ["--allowed-media-dir", str(media), "--max-images-per-request", "4"],
        module_run_dir / "run", port,
    )
    assert any(SERVE_READY in line for line in lines), f"serve did not start: {lines}"
    yield Served(f"tcp://127.0.0.1:{port}", media, process, lines)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


@pytest.fixture
def client(served: Served) -> Iterator[Client]:
    with Client(served.endpoint, timeout_s=120) as c:
        yield c


def ask(client: Client, text: str, images: list[str] = (), **kw: object):  # type: ignore[assignment]
    return client.chat([user_message(text, list(images))], max_tokens=kw.pop("max_tokens", 8), **kw)


# ---------------------------------------------------------------- happy paths


def test_only_the_roles_that_run_tensors_load_torch(served: Served) -> None:
    """`mmlane serve` and its frontend never load torch (about 280 MB each): serve imports no
    model code, and the frontend runs transformers with torch hidden (services/cli.py). The MM
    worker (its image processors) and the engine load it."""
    def loads_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    roles = {role: child.pid for child in processes() if child.parent == served.process.pid
             for role in ("frontend", "mm-worker", "engine")
             if f"mmlane.cli\0{role}\0".encode() in child.cmdline}
    assert set(roles) == {"frontend", "mm-worker", "engine"}, roles
    assert not loads_torch(served.process.pid)
    assert not loads_torch(roles["frontend"])
    assert loads_torch(roles["mm-worker"]) and loads_torch(roles["engine"])



def test_text_chat_streams_a_full_reply(client: Client) -> None:
    result = ask(client, "Hello there, how are you?")
    assert result.finish_reason in ("stop", "length")
    assert 1 <= len(result.token_ids) <= 8
    assert result.prompt_token_ids and len(result.prompt_token_ids) > 5


def test_image_chat_by_data_uri_expands_placeholders(client: Client, qwen_dir: Path) -> None:
    from mmlane.model import load_preprocessor

    pre = load_preprocessor(qwen_dir)
    result = ask(client, "What is in the picture?", [jpeg_uri(224, 168)])
    # 224x168 -> a 16x12 patch grid -> 48 merged tokens for Qwen2-VL.
    assert result.prompt_token_ids.count(pre.image_token_id) == 48
    assert result.token_ids


def test_image_by_file_url_under_the_allowed_folder(client: Client, served: Served) -> None:
    path = served.media_dir / "cat.png"
    make_image(64, 64, seed=3).save(path)
    result = ask(client, "Describe it.", [f"file://{path}"])
    assert result.token_ids


def test_same_request_same_greedy_reply(client: Client) -> None:
    image = jpeg_uri(300, 200, seed=5)
    first = ask(client, "Twice?", [image])
    second = ask(client, "Twice?", [image])
    assert first.token_ids == second.token_ids and first.text == second.text


def test_a_reply_streams_in_pieces_that_add_up_to_the_whole(client: Client) -> None:
    messages = [user_message("Count to eight, please.", [])]
    whole = client.chat(messages, max_tokens=8, ignore_eos=True)
    request_id = client.submit(messages, max_tokens=8, ignore_eos=True)
    pieces, ended = [], False
    while not ended:
        result, ended = client.receive()
        assert result.request_id == request_id
        pieces.append(len(result.token_ids))
    assert len(pieces) > 1 and pieces == sorted(pieces)
    assert result.token_ids == whole.token_ids and result.finish_reason == "length"


def test_text_is_answered_before_an_earlier_large_image(served: Served) -> None:
    big = jpeg_uri(4032, 3024, seed=1)
    with Client(served.endpoint, timeout_s=120) as c:
        image_id = c.submit([user_message("Big picture", [big])], max_tokens=4)
        text_id = c.submit([user_message("Quick question")], max_tokens=4)
        finished = [c.next_finished().request_id for _ in range(2)]
    assert finished == [text_id, image_id]


def test_64_concurrent_mixed_requests_each_get_one_correct_reply(served: Served) -> None:
    kinds = {
        "text": user_message("Tell me a story"),
        "one": user_message("One image", [jpeg_uri(128, 96, seed=7)]),
        "three": user_message(
            "Three images", [jpeg_uri(64, 64, seed=8), jpeg_uri(96, 64, seed=9),
                             jpeg_uri(200, 120, seed=10)]
        ),
    }
    with Client(served.endpoint, timeout_s=300) as c:
        expected = {k: c.chat([m], max_tokens=6).token_ids for k, m in kinds.items()}
        order = [random.Random(0).choice(list(kinds)) for _ in range(64)]
        ids = {c.submit([kinds[k]], max_tokens=6): k for k in order}
        results = c.collect(list(ids))
    assert len(results) == 64
    for request_id, kind in ids.items():
        assert results[request_id].error is None
        assert results[request_id].token_ids == expected[kind]


# ---------------------------------------------------------------- bad input


def _bad_cases(media_dir: Path) -> dict[str, tuple[list[str], str]]:
    jpeg = encode(make_image(200, 200))
    outside = media_dir.parent / "secret.png"
    make_image(8, 8).save(outside)
    return {
        "undecodable": ([data_uri(b"\x00\x01 definitely not an image" * 10)], "not an image"),
        "truncated_jpeg": ([data_uri(jpeg[: len(jpeg) // 2])], "truncated"),
        "unreadable_format": ([data_uri(b"<svg xmlns='http://www.w3.org/2000/svg'/>",
                                        "image/svg+xml")], "not an image"),
        "not_base64": (["data:image/png;base64,***not-base64***"], "base64"),
        "outside_allowed": ([f"file://{outside}"], "outside"),
        "missing_file": ([f"file://{media_dir}/nope.png"], "no such file"),
        "bomb": ([data_uri(encode(Image.new("L", (10000, 10000)), "PNG"), "image/png")],
                 "pixels"),
        "too_many_images": ([jpeg_uri(8, 8)] * 5, "too many images"),
    }


@pytest.mark.parametrize(
    "case", ["undecodable", "truncated_jpeg", "unreadable_format", "not_base64",
             "outside_allowed", "missing_file", "bomb", "too_many_images"],
)
def test_bad_image_gets_a_clear_error_and_serving_goes_on(
    client: Client, served: Served, case: str
) -> None:
    images, expected = _bad_cases(served.media_dir)[case]
    with pytest.raises(Exception) as info:
        ask(client, "look", images)
    assert expected in str(info.value).lower()
    assert getattr(info.value, "kind", None) == "request"
    assert ask(client, "still there?", [jpeg_uri(32, 32)]).token_ids


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([], "at least one message"),
        ([{"role": "wizard", "content": "hi"}], "role"),
        ([{"role": "user", "content": [{"type": "input_audio",
                                         "input_audio": {"data": "", "format": "wav"}}]}],
         "type"),
        ([{"role": "user", "content": "word " * 5000}], "prompt too long"),
        ([{"role": "user", "content": "sneaky <|image_pad|> token"}], "reserved image token"),
    ],
    ids=["no_messages", "unknown_role", "unknown_content_type", "prompt_too_long",
         "forged_placeholder"],
)
def test_bad_request_gets_a_clear_error(client: Client, messages: list, expected: str) -> None:
    import msgspec

    body = msgspec.msgpack.encode(
        {"type": "chat", "request_id": "bad", "messages": messages, "max_tokens": 4}
    )
    client.send_raw([body])
    result = client.next_finished()
    assert result.error is not None and expected in result.error.message.lower()
    assert ask(client, "fine?").token_ids


@pytest.mark.parametrize(
    "frames", [[b"\xff\xfe garbage"], [b""], [b"\x93\x01\x02\x03"]],
    ids=["garbage", "empty", "wrong_schema"],
)
def test_unreadable_client_message_is_answered_and_survived(client: Client, frames: list) -> None:
    client.send_raw(frames)
    result = client.next_finished()
    assert result.error is not None and result.error.code == "invalid_message"
    assert ask(client, "fine?").token_ids


def test_messages_with_text_parts_and_system_prompt(client: Client) -> None:
    messages = [
        ChatMessage(role="system", content="You are terse."),
        ChatMessage(role="user", content=[
            TextPart(text="Compare"), ImagePart(image_url=ImageUrl(url=jpeg_uri(64, 48))),
            TextPart(text="with"), ImagePart(image_url=ImageUrl(url=jpeg_uri(48, 64))),
        ]),
    ]
    assert client.chat(messages, max_tokens=4).token_ids


# ---------------------------------------------------------------- the launcher and the CLI


def test_chat_command_prints_one_json_object(served: Served) -> None:
    import json

    out = subprocess.run(
        [sys.executable, "-m", "mmlane.cli", "chat", "--endpoint", served.endpoint, "--json",
         "--max-tokens", "4", "Hi!"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    reply = json.loads(out.stdout)
    assert out.returncode == 0
    assert set(reply) == {"text", "token_ids", "finish_reason", "prompt_token_ids"}


def test_chat_command_sends_a_video_through_the_whole_pipeline(
    served: Served, client: Client, prep: Preprocessor,
) -> None:
    """`mmlane chat --video`: decoded and processed in the MM worker's video lane, run through
    the engine's vision tower; the same video with an image, from the native client."""
    import json

    from test_video import BY_NAME

    clip = served.media_dir / "clip.mp4"
    clip.write_bytes(BY_NAME["h264"].data)  # 2 s of 96x64: 8 frames at 4 fps, 24 tokens
    out = subprocess.run(
        [sys.executable, "-m", "mmlane.cli", "chat", "--endpoint", served.endpoint, "--json",
         "--max-tokens", "4", "--video", str(clip), "--video-fps", "4", "What happens?"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    video_token = prep.tokenizer.convert_tokens_to_ids(Qwen2VLVideo.token)
    assert reply["prompt_token_ids"].count(video_token) == 24
    assert len(reply["token_ids"]) == 4
    mixed = client.chat([user_message("And now?", [jpeg_uri(64, 48)], [clip.as_uri()])],
                        max_tokens=4)
    assert mixed.prompt_token_ids is not None
    assert mixed.prompt_token_ids.count(video_token) == 12  # 2 fps by default
    assert mixed.prompt_token_ids.count(prep.image_token_id) > 0


def test_chat_command_reports_errors_as_json_and_exit_1(served: Served, tmp_path: Path) -> None:
    import json

    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    out = subprocess.run(
        [sys.executable, "-m", "mmlane.cli", "chat", "--endpoint", served.endpoint, "--json",
         "--image", str(bad), "Hi!"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1
    reply = json.loads(out.stdout)
    assert set(reply) == {"error"} and reply["error"]["code"] == "invalid_image"


def test_serve_exits_nonzero_with_the_childs_error(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bert"}')
    out = subprocess.run(
        [sys.executable, "-m", "mmlane.cli", "serve", "--model", str(model),
         "--port", "0", "--run-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode != 0
    assert "bert" in out.stderr


def test_serve_stops_all_children_on_sigterm(qwen_dir: Path, run_dir: Path) -> None:
    process, lines = start_serve(["--model", str(qwen_dir)], run_dir, free_port())
    assert any(SERVE_READY in line for line in lines)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.parametrize("family", ["mistral3", "internvl"])
def test_a_model_dir_whose_images_have_spans_serves_as_hf_generates(
    family: str, model_dirs: dict[str, Path], run_dir: Path
) -> None:
    """`mmlane serve --model DIR` of a family whose images become structured spans (rows and
    breaks, start and end tokens): the prompt is the processor's and the greedy reply HF
    generate's; the same image again (a cache hit, its span placed from P0) gets the same."""
    from test_engine import generate_greedy, make_request

    from mmlane.model import load_model, load_preprocessor

    model_dir = model_dirs[family]
    port = free_port()
    process, lines = start_serve(["--model", str(model_dir)], run_dir, port)
    assert any(SERVE_READY in line for line in lines), f"serve did not start: {lines}"
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=120) as client:
            image = png_uri(make_image(100, 60, seed=0))
            first, second = (ask(client, "What is it?", [image], max_tokens=6) for _ in range(2))
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    prep = load_preprocessor(model_dir)
    request = make_request(prep, "What is it?", ((100, 60),), max_tokens=6)
    assert first.prompt_token_ids == second.prompt_token_ids == request.prompt_token_ids
    expected = generate_greedy(load_model(model_dir, "cpu"), prep, request)
    assert first.token_ids == second.token_ids == expected
