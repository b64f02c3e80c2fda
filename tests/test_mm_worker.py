"""The MM worker, as real processes on real ipc sockets with the real image processor.

The worker runs as `python -m mmlane.cli mm-worker`; the test plays both of its peers: it binds
a stand-in engine socket (decoding with the real codec) and a frontend reply socket, and pushes
`MMJob`s whose prompt ids come from the real chat template and tokenizer. What arrives is compared
with the same preprocessing run in this process.

    TestRendering      an image job arrives rendered: expanded prompt, placed items, same tensors
    TestBadInput       every bad job gets a RequestFailed naming the problem; the next job passes
    TestJobSocket      garbage on the job socket is dropped; the worker serves on
    TestFilesDisabled  a worker started without --allowed-media-dir refuses file:// URLs
    TestInputThread    cancels and new jobs' fetches are taken in while a big job is processed
    TestJpegDraft      --jpeg-draft: a big JPEG arrives decoded reduced, with the exact decode's
                       grid and pixels close to its; other images exactly; the pool does it too
    TestMedia, TestRender  the loading/decoding boundary and the placeholder arithmetic, in-process
"""

from __future__ import annotations

import io
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from msgspec.structs import replace
from PIL import Image, ImageOps

from bench.images import data_uri, encode, make_image, noise_image, png_uri
from conftest import role_log, start_role, stop_role
from image_server import PNG, ImageServer
from mmlane.common.sockets import free_tcp_port
from mmlane.launcher import Child
from mmlane.mm_worker.media import (
    MediaPolicy,
    decode_image,
    jpeg_draft_scale,
    load_bytes,
    to_rgb,
)
from mmlane.mm_worker.render import placeholder_offsets
from mmlane.ops.discovery import Targets
from mmlane.ops.feed import StatsFeed
from mmlane.protocol import shm
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import (
    CancelJobs,
    EngineRequest,
    FrontendInput,
    ImageUrl,
    MMJob,
    RequestFailed,
    SamplingParams,
    Stats,
)
from peers import Inbox, StandInEngine, frames_for, push, send

MAX_IMAGE_PIXELS = 4_000_000  # small, so an over-limit image is cheap to make
RECV_TIMEOUT_S = 30


# ---------------------------------------------------------------- images


def rgb_from(data: bytes) -> Image.Image:
    """Decode encoded bytes the plain way, for images that need no orientation or alpha."""
    return Image.open(io.BytesIO(data)).convert("RGB")


# ---------------------------------------------------------------- processes and sockets


@pytest.fixture(scope="module")
def preprocessor(qwen_dir: Path) -> Any:
    """The tiny model's preprocessor, in this process (conftest builds the model once)."""
    from mmlane.model import load_preprocessor

    return load_preprocessor(qwen_dir)


@pytest.fixture(scope="module")
def media_dir(module_run_dir: Path) -> Path:
    folder = module_run_dir / "media"
    folder.mkdir()
    return folder


def start_worker(
    name: str, run_dir: Path, model_dir: Path, engine_endpoint: str, *extra: str
) -> Child:
    """`mmlane mm-worker` serving ipc://RUN_DIR/NAME.sock, logging under RUN_DIR/NAME/."""
    argv = [
        "--mm-worker-endpoint", f"ipc://{run_dir}/{name}.sock", "--engine-endpoint",
        engine_endpoint, "--model", str(model_dir), *extra,
    ]
    return start_role("mm-worker", argv, run_dir, log_dir=run_dir / name)


class Peers:
    """The worker's peers, played by the test: a stand-in engine, a frontend, a job sender."""

    def __init__(self, run_dir: Path) -> None:
        self.ctx: zmq.Context = zmq.Context.instance()
        self.engine = StandInEngine.at(self.ctx, f"ipc://{run_dir}/engine.sock")
        self.engine_endpoint = self.engine.endpoint
        self.replies = Inbox.bound(self.ctx, f"ipc://{run_dir}/frontend.sock", FrontendInput)
        self.reply_to = self.replies.endpoint
        self.senders: dict[str, zmq.Socket] = {}

    def send(self, worker: Child, *messages: MMJob | bytes | list[bytes]) -> None:
        assert worker.endpoint is not None
        sock = self.senders.get(worker.endpoint)
        if sock is None:
            sock = self.senders[worker.endpoint] = push(self.ctx, worker.endpoint)
        for message in messages:
            if isinstance(message, MMJob):
                send(sock, message)
            else:
                sock.send_multipart(message if isinstance(message, list) else [message])

    def next_request(self) -> tuple[EngineRequest, int]:
        """The next message at the engine socket, and how many frames it came in."""
        return self.engine.take_frames(RECV_TIMEOUT_S)

    def next_failure(self) -> RequestFailed:
        reply = self.replies.take(RECV_TIMEOUT_S)
        assert isinstance(reply, RequestFailed), reply
        return reply

    def assert_quiet(self, wait_ms: int = 200) -> None:
        self.engine.assert_quiet(wait_ms)
        self.replies.assert_quiet(0)

    def close(self) -> None:
        self.engine.close()
        self.replies.close()
        for sock in self.senders.values():
            sock.close(linger=0)


@pytest.fixture(scope="module")
def peers(module_run_dir: Path) -> Iterator[Peers]:
    peers = Peers(module_run_dir)
    yield peers
    peers.close()


@pytest.fixture(scope="module")
def worker(
    module_run_dir: Path, qwen_dir: Path, media_dir: Path, peers: Peers
) -> Iterator[Child]:
    worker = start_worker(
        "mm-worker", module_run_dir, qwen_dir, peers.engine_endpoint,
        "--allowed-media-dir", str(media_dir), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
    )
    yield worker
    assert stop_role(worker) == 0, role_log(worker)


@pytest.fixture(scope="module")
def worker_without_files(
    module_run_dir: Path, qwen_dir: Path, peers: Peers
) -> Iterator[Child]:
    worker = start_worker("mm-worker-no-files", module_run_dir, qwen_dir, peers.engine_endpoint)
    yield worker
    assert stop_role(worker) == 0, role_log(worker)


# ---------------------------------------------------------------- jobs


class Jobs:
    """Builds `MMJob`s the way the frontend does: chat template, then the tokenizer."""

    def __init__(self, preprocessor: Any, reply_to: str) -> None:
        self.preprocessor = preprocessor
        self.reply_to = reply_to
        self.count = 0

    def prompt_ids(self, images: int, text: str = "What is in the picture?") -> list[int]:
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": "unused"}} for _ in range(images)
        ]
        parts.append({"type": "text", "text": text})
        prompt = self.preprocessor.render_prompt([{"role": "user", "content": parts}])
        [ids] = self.preprocessor.tokenize_batch([prompt])
        return list(ids)

    def job(self, *urls: str, prompt_ids: list[int] | None = None, **fields: Any) -> MMJob:
        self.count += 1
        return MMJob(
            request_id=fields.pop("request_id", f"req-{self.count}"),
            reply_to=fields.pop("reply_to", self.reply_to),
            prompt_token_ids=prompt_ids if prompt_ids is not None else self.prompt_ids(len(urls)),
            images=[ImageUrl(url=url) for url in urls],
            sampling=SamplingParams(max_tokens=4),
        )


@pytest.fixture(scope="module")
def jobs(preprocessor: Any, peers: Peers) -> Jobs:
    return Jobs(preprocessor, peers.reply_to)


def expected_request(preprocessor: Any, job: MMJob, images: list[Image.Image]) -> Any:
    """What the worker should send, computed in this process."""
    items = [preprocessor.process_image(image) for image in images]
    prompt = preprocessor.expand_placeholders(job.prompt_token_ids, items)
    return prompt, items


def assert_rendered(
    preprocessor: Any, job: MMJob, images: list[Image.Image], got: EngineRequest, frames: int,
    via_shm: bool = True,
) -> None:
    prompt, items = expected_request(preprocessor, job, images)
    assert got.request_id == job.request_id
    assert got.reply_to == job.reply_to
    assert got.sampling == job.sampling
    assert got.prompt_token_ids == prompt
    assert len(got.mm_items) == len(items)
    expected_offset = -1
    for got_item, item in zip(got.mm_items, items, strict=True):
        expected_offset = prompt.index(preprocessor.image_token_id, expected_offset + 1)
        assert (got_item.offset, got_item.length) == (expected_offset, item.num_tokens)
        assert prompt[got_item.offset : got_item.offset + got_item.length] == (
            [preprocessor.image_token_id] * item.num_tokens
        )
        assert got_item.tensors.keys() == item.tensors.keys()
        for name, tensor in item.tensors.items():
            assert got_item.tensors[name].dtype == tensor.dtype, name
            np.testing.assert_array_equal(got_item.tensors[name], tensor, err_msg=name)
        expected_offset += item.num_tokens - 1
    assert frames == frames_for((t for item in items for t in item.tensors.values()), via_shm)


# ---------------------------------------------------------------- end to end: rendering


class TestRendering:
    def test_image_job_arrives_rendered_with_in_process_tensors(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        png = encode(noise_image(96, 64), "PNG")
        job = jobs.job(data_uri(png, "image/png"))
        peers.send(worker, job)
        got, frames = peers.next_request()
        assert_rendered(preprocessor, job, [rgb_from(png)], got, frames)
        assert frames == 3  # msgpack body + pixel_values + image_grid_thw

    def test_three_images_from_data_uris_and_files(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any, media_dir: Path
    ) -> None:
        first = encode(noise_image(120, 90, seed=1), "JPEG", quality=90)
        second = encode(noise_image(64, 200, seed=2), "PNG")
        third = encode(noise_image(300, 80, seed=3), "WEBP", lossless=True)
        (media_dir / "second.png").write_bytes(second)
        (media_dir / "sub dir").mkdir(exist_ok=True)
        (media_dir / "sub dir" / "third.webp").write_bytes(third)
        job = jobs.job(
            data_uri(first, "image/jpeg"),
            (media_dir / "second.png").as_uri(),
            (media_dir / "sub dir" / "third.webp").as_uri(),  # percent-encoded space
        )
        peers.send(worker, job)
        got, frames = peers.next_request()
        images = [rgb_from(first), rgb_from(second), rgb_from(third)]
        assert_rendered(preprocessor, job, images, got, frames)
        assert frames == 1 + 3 * 2

    def test_exif_orientation_is_applied(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        exif = Image.Exif()
        exif[0x0112] = 6  # Orientation: the camera was turned; show it rotated 90° clockwise
        jpeg = encode(noise_image(112, 56, seed=4), "JPEG", quality=95, exif=exif.tobytes())
        upright = rgb_from(jpeg).transpose(Image.Transpose.ROTATE_270)
        assert upright.size == (56, 112)
        job = jobs.job(data_uri(jpeg, "image/jpeg"))
        peers.send(worker, job)
        got, frames = peers.next_request()
        assert_rendered(preprocessor, job, [upright], got, frames)

    def test_transparency_is_composited_on_white(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        rgba = noise_image(80, 60, seed=5, mode="RGBA")
        palette = noise_image(70, 50, seed=6).convert("P", palette=Image.Palette.ADAPTIVE)
        palette.info["transparency"] = 0
        rgba_png, palette_png = encode(rgba, "PNG"), encode(palette, "PNG", transparency=0)

        def on_white(image: Image.Image) -> Image.Image:
            white = Image.new("RGBA", image.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")

        job = jobs.job(data_uri(rgba_png, "image/png"), data_uri(palette_png, "image/png"))
        peers.send(worker, job)
        got, frames = peers.next_request()
        expected = [on_white(Image.open(io.BytesIO(png))) for png in (rgba_png, palette_png)]
        assert_rendered(preprocessor, job, expected, got, frames)
        # and not what dropping the alpha channel would give
        dropped = preprocessor.process_image(rgb_from(rgba_png)).tensors["pixel_values"]
        assert not np.array_equal(got.mm_items[0].tensors["pixel_values"], dropped)

    def test_jobs_leave_in_arrival_order(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        big = jobs.job(data_uri(encode(noise_image(1600, 1200, seed=7), "JPEG"), "image/jpeg"))
        small = [jobs.job(png_uri(noise_image(32, 32, seed=8 + i))) for i in range(5)]
        text_only = jobs.job()  # no images: passes through, still in order
        sent = [big, small[0], small[1], text_only, *small[2:]]
        peers.send(worker, *sent)
        arrived = [peers.next_request()[0].request_id for _ in sent]
        assert arrived == [job.request_id for job in sent]


# ---------------------------------------------------------------- end to end: bad input


def _truncated_jpeg() -> str:
    jpeg = encode(noise_image(256, 256, seed=9), "JPEG", quality=90)
    return data_uri(jpeg[: len(jpeg) * 2 // 3], "image/jpeg")


# (case id, url builder given the media folder, error code, message pattern)
BAD_IMAGES: list[tuple[str, Callable[[Path], str], str, str]] = [
    ("undecodable-bytes", lambda _: data_uri(os.urandom(2000), "image/png"), "invalid_image",
     r"^image 0: not an image in a format we can read"),
    ("empty", lambda _: "data:image/png;base64,", "invalid_image", r"^image 0: image is empty"),
    ("truncated-jpeg", lambda _: _truncated_jpeg(), "invalid_image",
     r"^image 0: the JPEG data ends early: the file is cut short or corrupt \(image file is "
     r"truncated"),
    ("jpeg-cut-in-its-header", lambda _: data_uri(
        encode(noise_image(64, 64, seed=9), "JPEG")[:300], "image/jpeg"), "invalid_image",
     r"^image 0: the image data ends early: the file is cut short or corrupt \(Truncated File "
     r"Read\)$"),
    ("svg-text", lambda _: data_uri(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"),
     "invalid_image", r"^image 0: not an image in a format we can read"),
    ("png-header-then-junk",
     lambda _: data_uri(b"\x89PNG\r\n\x1a\n" + os.urandom(500), "image/png"),
     "invalid_image", r"^image 0: not an image in a format we can read"),
    ("data-uri-not-valid-base64", lambda _: "data:image/png;base64,iVBOR@@not*base64!",
     "invalid_image", r"^image 0: data URI is not valid base64$"),
    ("data-uri-not-base64", lambda _: "data:image/png,%89PNG", "invalid_image",
     r"^image 0: data URI is not base64"),
    ("data-uri-not-an-image", lambda _: "data:text/plain;base64,aGVsbG8=", "invalid_image",
     r"^image 0: data URI has media type 'text/plain', not image/\*"),
    ("file-outside-folder", lambda _: "file:///etc/hostname", "media_not_allowed",
     r"^image 0: file:///etc/hostname is outside the allowed media folder"),
    ("file-dot-dot", lambda media: f"file://{media}/../secret.png", "media_not_allowed",
     r"is outside the allowed media folder"),
    ("file-symlink-out", lambda media: (media / "link.png").as_uri(), "media_not_allowed",
     r"link.png is outside the allowed media folder"),
    ("file-missing", lambda media: (media / "missing.png").as_uri(), "invalid_image",
     r"^image 0: no such file: file://.*/missing.png"),
    ("file-is-a-folder", lambda media: (media / "folder").as_uri(), "invalid_image",
     r"^image 0: .*/folder is not a regular file"),
    ("http-scheme", lambda _: "http://example.com/cat.png", "media_not_allowed",
     r"^image 0: http: image URLs are not allowed \(allowed with --allow-http-media\)"),
    ("over-max-pixels", lambda _: png_uri(Image.new("RGB", (2100, 2000))),
     "image_too_large",
     rf"^image 0: 2100x2000 is 4200000 pixels, more than max_image_pixels {MAX_IMAGE_PIXELS}"),
    ("pillow-bomb-guard", lambda _: png_uri(Image.new("1", (9000, 9000))),
     "image_too_large", rf"^image 0: 81000000 pixels, more than max_image_pixels "
                        rf"{MAX_IMAGE_PIXELS}$"),  # the limit set, not Pillow's twice it
]


@pytest.fixture(scope="module")
def media_traps(media_dir: Path) -> None:
    """A file just outside the folder, a symlink to it from inside, and a folder."""
    secret = media_dir.parent / "secret.png"
    secret.write_bytes(encode(noise_image(32, 32), "PNG"))
    (media_dir / "link.png").symlink_to(secret)
    (media_dir / "folder").mkdir()


class TestBadInput:
    @pytest.mark.parametrize(
        ("make_url", "code", "pattern"),
        [case[1:] for case in BAD_IMAGES],
        ids=[case[0] for case in BAD_IMAGES],
    )
    def test_bad_image_fails_its_job_only(
        self, worker: Child, peers: Peers, jobs: Jobs, media_dir: Path, media_traps: None,
        make_url: Callable[[Path], str], code: str, pattern: str,
    ) -> None:
        bad = jobs.job(make_url(media_dir))
        self.assert_fails_then_serves(worker, peers, jobs, bad, code, pattern)

    def test_a_job_past_its_deadline_is_not_processed(
        self, worker: Child, peers: Peers, jobs: Jobs
    ) -> None:
        late = msgspec.structs.replace(jobs.job(png_uri(noise_image(40, 40))), deadline=1.0)
        self.assert_fails_then_serves(
            worker, peers, jobs, late, "timeout", r"passed its deadline", kind="retryable"
        )

    def test_second_image_is_named(self, worker: Child, peers: Peers, jobs: Jobs) -> None:
        bad = jobs.job(png_uri(noise_image(40, 40)), data_uri(b"not an image", "image/png"))
        self.assert_fails_then_serves(
            worker, peers, jobs, bad, "invalid_image", r"^image 1: not an image"
        )

    def test_placeholders_must_match_images(
        self, worker: Child, peers: Peers, jobs: Jobs
    ) -> None:
        bad = jobs.job(png_uri(noise_image(40, 40)), prompt_ids=jobs.prompt_ids(images=2))
        self.assert_fails_then_serves(
            worker, peers, jobs, bad, "invalid_request",
            r"^prompt has 2 image placeholder tokens but the job carries 1 image$",
        )

    def test_prompt_too_long_before_expansion(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        ids = jobs.prompt_ids(images=1)
        filler = [ids[0]] * (preprocessor.max_context + 1 - len(ids))
        bad = jobs.job(png_uri(noise_image(40, 40)), prompt_ids=filler + ids)
        self.assert_fails_then_serves(
            worker, peers, jobs, bad, "prompt_too_long",
            rf"^prompt is {preprocessor.max_context + 1} tokens before expanding its images, "
            rf"more than the model's context of {preprocessor.max_context}$",
        )

    def test_prompt_too_long_after_expansion(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        png = encode(noise_image(280, 280), "PNG")
        tokens = preprocessor.process_image(rgb_from(png)).num_tokens
        ids = jobs.prompt_ids(images=1)
        filler = [ids[0]] * (preprocessor.max_context - len(ids))  # exactly max_context
        bad = jobs.job(data_uri(png, "image/png"), prompt_ids=filler + ids)
        self.assert_fails_then_serves(
            worker, peers, jobs, bad, "prompt_too_long",
            rf"^prompt is {preprocessor.max_context + tokens - 1} tokens after expanding 1 image,"
            rf" more than the model's context of {preprocessor.max_context}$",
        )

    def test_unreachable_reply_to_does_not_stop_the_worker(
        self, worker: Child, peers: Peers, jobs: Jobs
    ) -> None:
        bad = jobs.job(data_uri(b"garbage", "image/png"), reply_to="not an endpoint")
        good = jobs.job(png_uri(noise_image(40, 40)))
        peers.send(worker, bad, good)
        assert peers.next_request()[0].request_id == good.request_id
        peers.assert_quiet()

    @staticmethod
    def assert_fails_then_serves(
        worker: Child, peers: Peers, jobs: Jobs, bad: MMJob, code: str, pattern: str,
        kind: str = "request",
    ) -> None:
        good = jobs.job(png_uri(noise_image(40, 40)))
        peers.send(worker, bad, good)
        failure = peers.next_failure()
        assert failure.request_id == bad.request_id
        assert (failure.error.kind, failure.error.code) == (kind, code), failure.error
        assert re.search(pattern, failure.error.message), failure.error.message
        # FIFO: had the bad job reached the engine, it would arrive before the good one
        assert peers.next_request()[0].request_id == good.request_id
        peers.assert_quiet()


class TestJobSocket:
    @pytest.mark.parametrize(
        "message",
        [
            [b"\xc1 not msgpack"],
            [b""],
            [msgspec.msgpack.encode({"request_id": "x", "reply_to": "y"})],
            [msgspec.msgpack.encode(["req", "x", "y", [1], SamplingParams(), []])],  # wrong tag
            [msgspec.msgpack.encode(["job", "x", "y", "not ids", [], SamplingParams()])],
            [b"\x91\xa3job", b"an extra frame"],
        ],
        ids=["not-msgpack", "empty", "a-map", "engine-request", "wrong-field-type", "short"],
    )
    def test_garbage_is_dropped_and_the_worker_serves_on(
        self, worker: Child, peers: Peers, jobs: Jobs, message: list[bytes]
    ) -> None:
        good = jobs.job(png_uri(noise_image(40, 40)))
        peers.send(worker, message, good)
        assert peers.next_request()[0].request_id == good.request_id
        peers.assert_quiet()
        assert "dropped an invalid message on the job socket" in role_log(worker)


class TestFilesDisabled:
    def test_file_urls_are_refused_without_allowed_media_dir(
        self, worker_without_files: Child, peers: Peers, jobs: Jobs, media_dir: Path
    ) -> None:
        path = media_dir / "allowed-elsewhere.png"
        path.write_bytes(encode(noise_image(40, 40), "PNG"))
        bad = jobs.job(path.as_uri())
        good = jobs.job(png_uri(noise_image(40, 40)))
        peers.send(worker_without_files, bad, good)
        failure = peers.next_failure()
        assert (failure.request_id, failure.error.code) == (bad.request_id, "media_not_allowed")
        assert failure.error.message == (
            "image 0: file:// URLs are disabled; start with --allowed-media-dir"
        )
        assert peers.next_request()[0].request_id == good.request_id


# ---------------------------------------------------------------- in-process: the media boundary


def policy(media_dir: Path | None, max_bytes: int = 1 << 20) -> MediaPolicy:
    return MediaPolicy(
        allowed_media_dir=media_dir.resolve() if media_dir else None,
        max_image_bytes=max_bytes,
        max_image_pixels=MAX_IMAGE_PIXELS,
    )


class TestMedia:
    def test_data_uri_round_trips(self) -> None:
        png = encode(noise_image(8, 8), "PNG")
        assert load_bytes(data_uri(png, "image/png"), 0, policy(None)) == png
        shouting = "DATA:Image/PNG;BASE64," + data_uri(png, "image/png").partition(",")[2]
        assert load_bytes(shouting, 0, policy(None)) == png

    def test_file_url_with_localhost_and_percent_encoding(self, tmp_path: Path) -> None:
        (tmp_path / "a b.png").write_bytes(b"x")
        url = f"file://localhost{tmp_path}/a%20b.png"
        assert load_bytes(url, 0, policy(tmp_path)) == b"x"

    @pytest.mark.parametrize(
        ("url", "code", "pattern"),
        [
            ("data:image/png;base64," + "A" * 2000, "image_too_large",
             r"^image 3: encoded image is about 1500 bytes, more than max_image_bytes 1000"),
            ("data:image/png;base64", "invalid_image", r"^image 3: data URI has no ','"),
            ("file://otherhost/etc/passwd", "media_not_allowed", r"names host 'otherhost'"),
            ("file:///x.png?y", "invalid_image", r"query or fragment"),
            ("file:x.png", "invalid_image", r"is not an absolute path"),
            ("cat.png", "media_not_allowed", r"^image 3: a URL without a scheme is not supported"),
            ("s3://bucket/cat.png", "media_not_allowed", r"^image 3: 's3' URLs are not supported"),
        ],
    )
    def test_refused_urls(self, tmp_path: Path, url: str, code: str, pattern: str) -> None:
        with pytest.raises(RequestError, match=pattern) as caught:
            load_bytes(url, 3, policy(tmp_path, max_bytes=1000))
        assert caught.value.code == code

    def test_file_over_max_bytes(self, tmp_path: Path) -> None:
        (tmp_path / "big.png").write_bytes(b"x" * 1001)
        with pytest.raises(RequestError, match=r"is 1001 bytes, more than max_image_bytes 1000"):
            load_bytes((tmp_path / "big.png").as_uri(), 0, policy(tmp_path, max_bytes=1000))

    def test_a_fifo_in_the_folder_does_not_block(self, tmp_path: Path) -> None:
        os.mkfifo(tmp_path / "pipe.png")
        with pytest.raises(RequestError, match=r"pipe.png is not a regular file"):
            load_bytes((tmp_path / "pipe.png").as_uri(), 0, policy(tmp_path))

    def test_file_urls_disabled(self, tmp_path: Path) -> None:
        with pytest.raises(RequestError, match=r"file:// URLs are disabled") as caught:
            load_bytes((tmp_path / "a.png").as_uri(), 0, policy(None))
        assert caught.value.code == "media_not_allowed"

    @pytest.mark.parametrize(
        ("image", "expected"),
        [
            (Image.new("LA", (2, 1), (0, 0)), [255, 255, 255]),  # fully transparent black
            (Image.new("LA", (2, 1), (0, 255)), [0, 0, 0]),
            (Image.new("RGBA", (2, 1), (200, 0, 0, 128)), [227, 127, 127]),
            (Image.new("L", (2, 1), 77), [77, 77, 77]),
            (Image.new("1", (2, 1), 1), [255, 255, 255]),
            (Image.new("CMYK", (2, 1), (0, 255, 255, 0)), [255, 0, 0]),
            (Image.fromarray(np.full((1, 2), 40000, np.uint16)), [156, 156, 156]),  # I;16
        ],
        ids=["LA-clear", "LA-opaque", "RGBA-half", "L", "1", "CMYK", "I;16"],
    )
    def test_to_rgb(self, image: Image.Image, expected: list[int]) -> None:
        rgb = to_rgb(image)
        assert rgb.mode == "RGB" and rgb.size == image.size
        np.testing.assert_array_equal(np.asarray(rgb)[0, 0], expected)

    def test_pixel_limit_is_checked_before_decoding(self) -> None:
        png = encode(Image.new("RGB", (300, 300)), "PNG")
        with pytest.raises(RequestError, match=r"300x300 is 90000 pixels") as caught:
            decode_image(png, 0, max_pixels=80_000)
        assert caught.value.code == "image_too_large"

    def test_exif_orientation(self) -> None:
        exif = Image.Exif()
        exif[0x0112] = 8
        jpeg = encode(noise_image(64, 32), "JPEG", exif=exif.tobytes())
        image = decode_image(jpeg, 0, MAX_IMAGE_PIXELS)
        assert image.size == (32, 64)
        expected = ImageOps.exif_transpose(Image.open(io.BytesIO(jpeg)))
        np.testing.assert_array_equal(np.asarray(image), np.asarray(expected))


class TestJpegDraftScale:
    """The rule: the largest of 1/8, 1/4, 1/2 leaving both sides at least the target's (libjpeg
    rounds up), and only where the resize rule gives that same target from the reduced size."""

    @pytest.mark.parametrize(("size", "scale"), [
        ((4000, 3200), 8), ((3993, 3193), 8),  # 500x400 after rounding up
        ((3992, 3200), 4), ((2000, 1600), 4), ((1997, 1600), 4), ((1996, 1600), 2),
        ((1000, 800), 2), ((999, 800), 2), ((998, 800), 1), ((500, 400), 1), ((100, 100), 1),
    ])
    def test_both_sides_stay_at_least_the_targets(self, size: tuple[int, int],
                                                  scale: int) -> None:
        assert jpeg_draft_scale(*size, lambda width, height: (500, 400)) == scale

    def test_a_reduction_that_would_change_the_target_is_not_taken(self) -> None:
        def quarter(width: int, height: int) -> tuple[int, int]:
            return width // 4, height // 4

        assert jpeg_draft_scale(4000, 4000, quarter) == 1

    def test_the_families_rules(self, preprocessors: dict[str, Any]) -> None:
        qwen, llava = preprocessors["qwen2_vl"], preprocessors["llava"]
        assert qwen.resized_size(4032, 3024) == (1148, 840)  # smart_resize to <= 1003520 px
        assert jpeg_draft_scale(4032, 3024, qwen.resized_size) == 2
        assert jpeg_draft_scale(*DRAFTED, qwen.resized_size) == 2
        assert jpeg_draft_scale(*JUST_BELOW, qwen.resized_size) == 1  # 1161x871 -> 1148x868
        assert jpeg_draft_scale(2000, 1500, qwen.resized_size) == 1  # 1000 < 1148
        assert llava.resized_size(4032, 3024) == (448, 336)  # shortest edge 336, then a crop
        assert jpeg_draft_scale(4032, 3024, llava.resized_size) == 8

    def test_a_turned_jpeg_is_reduced_then_turned_upright(
        self, preprocessors: dict[str, Any]
    ) -> None:
        exif = Image.Exif()
        exif[0x0112] = 6
        width, height = DRAFTED
        jpeg = encode(make_image(height, width), "JPEG", exif=exif.tobytes())
        image = decode_image(jpeg, 0, 10**8, preprocessors["qwen2_vl"].resized_size)
        assert image.size == (-(-width // 2), -(-height // 2))


class TestRender:
    @pytest.mark.parametrize(
        ("ids", "lengths", "offsets"),
        [
            ([9, 1, 2], [4], [0]),
            ([1, 9, 2, 9, 3], [3, 5], [1, 5]),
            ([9, 9], [2, 1], [0, 2]),
            ([1, 2], [], []),
        ],
    )
    def test_placeholder_offsets(
        self, ids: list[int], lengths: list[int], offsets: list[int]
    ) -> None:
        assert [offset for offset, _, _ in placeholder_offsets(ids, {9: lengths})] == offsets


# ---------------------------------------------------------------- end to end: http(s) image URLs


FETCH_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def fetching_worker(module_run_dir: Path, qwen_dir: Path, peers: Peers) -> Iterator[Child]:
    """A worker allowed to fetch from the loopback server (plain http, an internal address)."""
    worker = start_worker(
        "mm-worker-fetching", module_run_dir, qwen_dir, peers.engine_endpoint,
        "--allow-http-media", "--allow-internal-media", "--max-image-bytes", "1000000",
        "--media-fetch-timeout", str(FETCH_TIMEOUT_S), "--media-fetch-retries", "0",
    )
    yield worker
    assert stop_role(worker) == 0, role_log(worker)


class TestFetchedImages:
    def test_an_image_by_url_is_fetched_and_rendered(
        self, fetching_worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any,
        image_server: ImageServer,
    ) -> None:
        job = jobs.job(image_server.url("/image.png"))
        peers.send(fetching_worker, job)
        got, frames = peers.next_request()
        assert_rendered(preprocessor, job, [rgb_from(PNG)], got, frames)

    def test_jobs_behind_a_slow_fetch_keep_their_order(
        self, fetching_worker: Child, peers: Peers, jobs: Jobs, image_server: ImageServer,
    ) -> None:
        slow = jobs.job(image_server.url("/slow.png?first"))
        inline = jobs.job(png_uri(noise_image(40, 40)))
        slow_too = jobs.job(image_server.url("/slow.png?second"))
        peers.send(fetching_worker, slow, inline, slow_too)
        arrived = [peers.next_request()[0].request_id for _ in range(3)]
        assert arrived == [slow.request_id, inline.request_id, slow_too.request_id]
        # fetched ahead: the third job's fetch began while the head's was still running
        assert image_server.events.index("start /slow.png?second") < (
            image_server.events.index("end /slow.png?first")
        )

    @pytest.mark.parametrize(
        "path, code, pattern",
        [
            ("/to-metadata", "media_not_allowed",
             r"^image 0: 169.254.169.254 resolves to link-local address 169.254.169.254"),
            ("/huge-chunked", "image_too_large",
             r"^image 0: the file at .*/huge-chunked is larger than the 1000000-byte fetch limit"),
            ("/never-answers", "fetch_failed",
             rf"^image 0: fetching .*/never-answers took longer than {FETCH_TIMEOUT_S} s"),
            ("/missing", "fetch_failed", r"^image 0: fetching .*/missing: HTTP 404"),
        ],
        ids=["redirect-to-link-local", "body-over-cap-chunked", "never-answers", "not-found"],
    )
    def test_a_refused_or_failed_fetch_fails_its_job_alone(
        self, fetching_worker: Child, peers: Peers, jobs: Jobs, image_server: ImageServer,
        path: str, code: str, pattern: str,
    ) -> None:
        bad = jobs.job(image_server.url(path))
        good = jobs.job(png_uri(noise_image(40, 40)))
        started = time.monotonic()
        peers.send(fetching_worker, bad, good)
        failure = peers.next_failure()
        assert failure.request_id == bad.request_id
        assert (failure.error.kind, failure.error.code) == ("request", code), failure.error
        assert re.search(pattern, failure.error.message), failure.error.message
        assert time.monotonic() - started < FETCH_TIMEOUT_S + 5
        assert peers.next_request()[0].request_id == good.request_id
        peers.assert_quiet()

    def test_https_only_by_default(
        self, worker: Child, peers: Peers, jobs: Jobs, image_server: ImageServer,
    ) -> None:
        bad = jobs.job(image_server.url("/image.png"))
        peers.send(worker, bad)
        failure = peers.next_failure()
        assert failure.error.code == "media_not_allowed"
        assert "allowed with --allow-http-media" in failure.error.message


# ---------------------------------------------------------------- end to end: the input thread


@pytest.fixture(scope="module")
def watched_worker(
    module_run_dir: Path, qwen_dir: Path, peers: Peers
) -> Iterator[tuple[Child, StatsFeed]]:
    """A worker allowed to fetch from the loopback server, and the feed of its stats (published
    every 50 ms), which say what it holds and has done; TestInputThread's alone."""
    stats_endpoint = f"ipc://{module_run_dir}/stats-watched.sock"
    worker = start_worker(
        "mm-worker-watched", module_run_dir, qwen_dir, peers.engine_endpoint,
        "--allow-http-media", "--allow-internal-media", "--stats-endpoint", stats_endpoint,
        "--stats-interval", "0.05",
    )
    with StatsFeed(Targets("stats", (stats_endpoint,), module_run_dir)) as feed:
        yield worker, feed
    assert stop_role(worker) == 0, role_log(worker)


def big_image_uri(gradient: Callable[[str], Image.Image]) -> str:
    """12 MP, cheap to make and send, a second or so to decode and process."""
    return data_uri(encode(gradient("L").resize((4000, 3000)).convert("RGB")))


def next_snapshot(feed: StatsFeed, what: str, wanted: Callable[[Stats], bool]) -> Stats:
    """The first snapshot to arrive that satisfies `wanted` (it shows `what`)."""
    timeout_s = 30
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for stats in feed.receive(0.1):
            if wanted(stats):
                return stats
    raise AssertionError(f"no snapshot within {timeout_s} s shows {what}")


class TestInputThread:
    def test_a_cancel_and_a_fetch_are_taken_in_while_a_big_job_is_processed(
        self, watched_worker: tuple[Child, StatsFeed], peers: Peers, jobs: Jobs,
        image_server: ImageServer,
    ) -> None:
        worker, feed = watched_worker
        big = jobs.job(big_image_uri(Image.radial_gradient), big_image_uri(Image.linear_gradient))
        queued = jobs.job(png_uri(noise_image(40, 40, seed=7)))
        fetched = jobs.job(image_server.url("/image.png"))
        peers.send(worker, big, queued)
        next_snapshot(feed, "the big job processed, the other queued behind it",
                      lambda stats: stats.in_flight == 2 and stats.queues["jobs_queued"] == 1)
        # Meanwhile: cancel the queued one, send one more whose image is fetched.
        peers.send(worker, msgspec.msgpack.encode(CancelJobs(request_ids=[queued.request_id])),
                   fetched)
        taken_in = next_snapshot(feed, "a fetch started",
                                 lambda stats: stats.counters.get("fetches", 0) > 0)
        # One snapshot: the cancel applied and the fetch started before anything was sent.
        assert taken_in.counters.get("cancelled", 0) == 1
        assert taken_in.counters.get("sent", 0) == 0
        assert (taken_in.in_flight, taken_in.queues["jobs_queued"]) == (2, 1)
        arrived = [peers.next_request()[0].request_id for _ in range(2)]
        assert arrived == [big.request_id, fetched.request_id]  # the cancelled job never ran
        assert f"request {queued.request_id} cancelled by its frontend: skipped" in (
            role_log(worker))
        peers.assert_quiet()


# ---------------------------------------------------------------- end to end: --jpeg-draft


DRAFTED = (2400, 1800)
"""A JPEG the tiny Qwen2-VL (max 1003520 pixels: 1148x840) takes drafted at 1/2."""
JUST_BELOW = (2322, 1741)
"""The largest 4:3 JPEG it does not: 1161x871 would be resized to 1148x868."""
# Measured on photo-like JPEGs (BENCHMARKS.md, "JPEG reduce-on-decode"): the mean |diff| of the
# uint8 pixels is largest just above the threshold (4.7 at 2323x1742, 3.7 here at 2400x1800)
# and falls as the JPEG grows (1.5 at 4032x3024).
DRAFT_MEAN_DIFF_BOUND = 5.0


def draft_worker(name: str, run_dir: Path, model_dir: Path, peers: Peers,
                 processes: int) -> Iterator[Child]:
    worker = start_worker(name, run_dir, model_dir, peers.engine_endpoint, "--jpeg-draft",
                          "--mm-processes", str(processes))
    yield worker
    assert stop_role(worker) == 0, role_log(worker)


@pytest.fixture(scope="module")
def drafting_worker(module_run_dir: Path, qwen_dir: Path, peers: Peers) -> Iterator[Child]:
    yield from draft_worker("mm-worker-draft", module_run_dir, qwen_dir, peers, 1)


@pytest.fixture(scope="module")
def drafting_pool(module_run_dir: Path, qwen_dir: Path, peers: Peers) -> Iterator[Child]:
    yield from draft_worker("mm-worker-draft-pool", module_run_dir, qwen_dir, peers, 2)


def photo_jpeg(size: tuple[int, int], seed: int) -> bytes:
    return encode(make_image(*size, seed=seed), "JPEG", quality=90)


def assert_drafted(preprocessor: Any, job: MMJob, jpeg: bytes, got: EngineRequest,
                   frames: int) -> None:
    """`got` carries the in-process drafted decode's tensors, with the exact decode's grid and
    token count and pixels within the measured difference of the exact ones."""
    drafted = decode_image(jpeg, 0, 10**8, preprocessor.resized_size)
    assert drafted.size == tuple(-(-side // 2) for side in Image.open(io.BytesIO(jpeg)).size)
    assert_rendered(preprocessor, job, [drafted], got, frames)
    exact = preprocessor.process_image(rgb_from(jpeg))
    (item,) = got.mm_items
    np.testing.assert_array_equal(item.tensors["image_grid_thw"], exact.tensors["image_grid_thw"])
    assert item.length == exact.num_tokens
    diff = np.abs(item.tensors["pixel_values"].astype(np.int16)
                  - exact.tensors["pixel_values"].astype(np.int16))
    assert 0 < diff.mean() < DRAFT_MEAN_DIFF_BOUND


class TestJpegDraft:
    def test_a_big_jpeg_is_decoded_reduced_to_the_processors_size(
        self, drafting_worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        jpeg = photo_jpeg(DRAFTED, seed=20)
        job = jobs.job(data_uri(jpeg))
        peers.send(drafting_worker, job)
        got, frames = peers.next_request()
        assert_drafted(preprocessor, job, jpeg, got, frames)

    def test_a_small_jpeg_a_png_and_a_jpeg_just_below_the_threshold_are_exact(
        self, drafting_worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        small = photo_jpeg((640, 480), seed=21)
        png = encode(make_image(*DRAFTED, seed=22), "PNG")
        below = photo_jpeg(JUST_BELOW, seed=23)
        job = jobs.job(data_uri(small), data_uri(below), data_uri(png, "image/png"))
        peers.send(drafting_worker, job)
        got, frames = peers.next_request()
        assert_rendered(preprocessor, job, [rgb_from(data) for data in (small, below, png)],
                        got, frames)

    def test_a_drafted_image_and_the_exact_one_never_share_a_hash(
        self, worker: Child, drafting_worker: Child, peers: Peers, jobs: Jobs
    ) -> None:
        """Every cache keyed by the hash (the engine's, vLLM's) tells the two settings' renderings
        apart: the setting is part of what a hash covers, for every image."""
        url = data_uri(photo_jpeg((640, 480), seed=26))
        hashes = []
        for role in (worker, drafting_worker):  # an engine epoch: each hashes for its cache
            peers.send(role, replace(jobs.job(url), engine_epoch=7))
            got, _ = peers.next_request()
            hashes.append(got.mm_items[0].mm_hash)
        assert all(hashes) and hashes[0] != hashes[1]

    def test_the_pool_processes_draft_too(
        self, drafting_pool: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        big, below = photo_jpeg(DRAFTED, seed=24), photo_jpeg(JUST_BELOW, seed=25)
        drafted, exact = jobs.job(data_uri(big)), jobs.job(data_uri(below))
        peers.send(drafting_pool, drafted, exact)
        got, frames = peers.next_request()
        assert got.request_id == drafted.request_id
        assert_drafted(preprocessor, drafted, big, got, frames)
        got, frames = peers.next_request()
        assert_rendered(preprocessor, exact, [rgb_from(below)], got, frames)


# ---------------------------------------------------------------- end to end: shared memory


SHM_IMAGE = (728, 728)
"""2,704 patches: 1.6 MB of uint8 pixel_values (one frame of 588 bytes each), over SHM_MIN_BYTES
(1 MiB)."""
SHM_IMAGE_BIG = (868, 868)
"""3,844 patches: 2.3 MB."""


def shm_slots(endpoint: str | None) -> dict[str, bool]:
    """The shared-memory slots of the worker at `endpoint` (named by host and job endpoint),
    and whether each is full."""
    tag = shm.sender_tag(f"{socket.gethostname()}/{endpoint}")
    return {path.name: path.read_bytes()[0] == 1
            for path in sorted(shm.SHM_DIR.glob(f"mmlane-{tag}-*"))}


@pytest.fixture(scope="module")
def bounded_worker(module_run_dir: Path, qwen_dir: Path, peers: Peers) -> Iterator[Child]:
    """A worker with 3 MiB for tensors in shared memory, started where a killed one with its
    name left a slot."""
    endpoint = f"ipc://{module_run_dir}/mm-worker-shm.sock"
    leftover = shm.SHM_DIR / f"mmlane-{shm.sender_tag(f'{socket.gethostname()}/{endpoint}')}-1-0"
    leftover.write_bytes(b"\1" * 4096)
    worker = start_worker("mm-worker-shm", module_run_dir, qwen_dir, peers.engine_endpoint,
                          "--shm-transport-mb", "3")
    assert worker.endpoint == endpoint
    yield worker
    assert stop_role(worker) == 0, role_log(worker)


class TestSharedMemory:
    def test_a_big_tensor_reaches_the_engine_through_shared_memory(
        self, worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        png = encode(noise_image(*SHM_IMAGE, seed=11), "PNG")
        job = jobs.job(data_uri(png, "image/png"))
        peers.send(worker, job)
        got, frames = peers.next_request()
        assert_rendered(preprocessor, job, [rgb_from(png)], got, frames)  # the same pixels
        assert frames == 2  # msgpack body + image_grid_thw: pixel_values came in a slot
        assert list(shm_slots(worker.endpoint).values()) == [False]  # emptied by the engine

    def test_beyond_its_bound_tensors_go_as_frames(
        self, bounded_worker: Child, peers: Peers, jobs: Jobs, preprocessor: Any
    ) -> None:
        sizes = [SHM_IMAGE, SHM_IMAGE, SHM_IMAGE_BIG]
        pngs = [encode(noise_image(*size, seed=20 + i), "PNG") for i, size in enumerate(sizes)]
        arrived = []
        for png, via_shm in zip(pngs, [True, True, False], strict=True):
            job = jobs.job(data_uri(png, "image/png"))
            peers.send(bounded_worker, job)  # one at a time: each block taken before the next
            got, frames = peers.next_request()
            assert_rendered(preprocessor, job, [rgb_from(png)], got, frames, via_shm=via_shm)
            arrived.append(frames)
        # 1.6 MB takes a 2 MiB slot, reused for the second; 2.3 MB needs a 3 MiB one: 5 > 3
        assert arrived == [2, 2, 3]
        assert list(shm_slots(bounded_worker.endpoint).values()) == [False]

    def test_a_killed_workers_slots_are_unlinked_when_its_successor_starts(
        self, bounded_worker: Child
    ) -> None:
        assert not any(name.endswith("-1-0") for name in shm_slots(bounded_worker.endpoint))
        assert "unlinked 1 shared-memory slot(s) a previous MM worker left" in (
            role_log(bounded_worker))

    def test_a_stopped_worker_unlinks_its_slots(
        self, module_run_dir: Path, qwen_dir: Path, peers: Peers, jobs: Jobs
    ) -> None:
        worker = start_worker("mm-worker-shm-stop", module_run_dir, qwen_dir,
                              peers.engine_endpoint)
        peers.send(worker, jobs.job(png_uri(noise_image(*SHM_IMAGE, seed=13))))
        assert peers.next_request()[1] == 2
        assert len(shm_slots(worker.endpoint)) == 1
        assert stop_role(worker) == 0, role_log(worker)
        assert shm_slots(worker.endpoint) == {}

    def test_an_engine_over_tcp_gets_frames(
        self, module_run_dir: Path, qwen_dir: Path, jobs: Jobs, preprocessor: Any
    ) -> None:
        ctx = zmq.Context.instance()
        with StandInEngine.at(ctx, f"tcp://127.0.0.1:{free_tcp_port()}") as engine:
            worker = start_worker("mm-worker-tcp", module_run_dir, qwen_dir, engine.endpoint)
            assert worker.endpoint is not None
            sender = push(ctx, worker.endpoint)
            try:
                png = encode(noise_image(*SHM_IMAGE, seed=12), "PNG")
                job = jobs.job(data_uri(png, "image/png"))
                send(sender, job)
                got, frames = engine.take_frames(RECV_TIMEOUT_S)
                assert_rendered(preprocessor, job, [rgb_from(png)], got, frames, via_shm=False)
                assert frames == 3
            finally:
                sender.close(linger=0)
                assert stop_role(worker) == 0, role_log(worker)
