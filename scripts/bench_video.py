"""Video benchmark: the MM lane's videos/s per core, decoding only the kept frames against every
frame, and image latency while videos stream against idle.

    python scripts/bench_video.py [--size 1280x720] [--seconds 10] [--rate 30]
                                  [--keyframe-every 30,250] [--fps 0.5] [--videos 8]
                                  [--processes 2,4] [--decode-fps 2,0.5] [--decode-repeats 3]
                                  [--mm-processes 4] [--image-size 1024x768]
                                  [--image-requests 30] [--video-clients 2]
                                  [--model DIR] [--parts 1,2,3]

The test video is made here with PyAV (libx264, a keyframe every `--keyframe-every` frames, the
first value): a window panning across a generated photo, `--seconds` long at `--rate` frames/s.

1. Videos/s per core of the MM lane (decode + render): one `mmlane mm-worker` alone, this script
   standing in for the engine socket (as scripts/bench_pipeline.py does), is pushed `--videos`
   jobs of the video (sampled at `--fps` by the model's rule) at once and timed until the last
   EngineRequest leaves it. `--mm-processes 1` (no pool: the video lane's own thread), then a
   pool of N processes for each of `--processes`, all of them free for videos
   (`--video-processes N`). The jobs carry no engine epoch, so every one is decoded.
2. Decoding only the kept frames against every frame, in this process, with mmlane's decoder
   (`decode_video`): as it runs (it seeks past runs of frames with no kept one where a keyframe
   allows), with seeking off (its own fallback: every frame up to the last kept one decoded,
   only the kept ones converted), and every frame decoded and converted to RGB; for each
   keyframe interval of `--keyframe-every` and sampling rate of `--decode-fps`. Median of
   `--decode-repeats` runs.
3. Image p50 latency while videos stream, against idle: `mmlane serve --mm-processes N` (hf
   backend, the model; videos in half the pool, the default); `--image-requests` image
   requests of a `--image-size` JPEG one at a time (a new uuid each: every one decoded), idle,
   then while `--video-clients` clients keep a video request each in flight back to back.
Parts 1 and 3 run `--model` (the embedded tiny Qwen2-VL by default); `--parts` picks the parts.
Prints the figures; it asserts nothing. Run it alone on the machine: it measures cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from fractions import Fraction
from functools import partial
from pathlib import Path

import av
import numpy as np
from bench_common import ImageLoad, report, serving

from bench.config import parse_size
from bench.images import data_uri, encode, make_image
from bench.throughput import LoneMMWorker
from mmlane.client import Client
from mmlane.mm_worker import video
from mmlane.mm_worker.video import Qwen2VLSampling, decode_video
from mmlane.model import resolve_model_dir
from mmlane.protocol.messages import (
    ChatMessage,
    ImagePart,
    ImageUrl,
    MMJob,
    SamplingParams,
    TextPart,
    VideoSampling,
)


def make_video(width: int, height: int, seconds: float, rate: int, keyframe_every: int) -> bytes:
    """An H.264 mp4: a `width`x`height` window panning across a generated photo twice as wide."""
    scene = np.asarray(make_image(2 * width, height, seed=1))
    frames = max(1, round(seconds * rate))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as output:
        stream = output.add_stream("libx264", rate=Fraction(rate))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = keyframe_every
        for i in range(frames):
            left = i * width // frames
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(scene[:, left:left + width]), format="rgb24")
            output.mux(stream.encode(frame))
        output.mux(stream.encode())
    return buffer.getvalue()


def video_uri(data: bytes) -> str:
    return data_uri(data, "video/mp4")


# ---------------------------------------------------------------- 1. videos/s per core


def worker_videos_per_s(run_dir: Path, model_dir: Path, url: str, args: argparse.Namespace,
                        processes: int) -> float:
    """Videos/s out of one MM worker with `processes` processes (1: no pool), all of them
    free for videos."""
    pool = ["--video-processes", str(processes)] if processes > 1 else []
    with LoneMMWorker(run_dir, model_dir, "--mm-processes", str(processes), *pool) as lone:
        pre = lone.preprocessor
        [prompt] = pre.tokenize_batch([pre.render_prompt([{"role": "user", "content": [
            {"type": "video"}, {"type": "text", "text": "What happens?"}]}])])

        def push(request_id: str) -> None:
            lone.send(MMJob(request_id=request_id, reply_to=lone.reply_to,
                            prompt_token_ids=list(prompt), images=[],
                            videos=[ImageUrl(url=url)],
                            sampling=SamplingParams(max_tokens=1),
                            video_sampling=VideoSampling(fps=args.fps)))

        for warm in range(processes):  # every process has decoded and rendered once
            push(f"warm-{warm}")
        for _ in range(processes):
            lone.take()
        started = time.perf_counter()
        for i in range(args.videos):
            push(str(i))
        for _ in range(args.videos):
            lone.take()
        return args.videos / (time.perf_counter() - started)


def bench_videos_per_core(args: argparse.Namespace, run_dir: Path, data: bytes) -> None:
    model_dir = resolve_model_dir(args.model)
    url = video_uri(data)
    print(f"\n1. MM lane, decode + render, {args.videos} videos sampled at {args.fps:g} fps, "
          f"{model_dir.name}")
    print(f"{'design':<36} {'videos/s':>9} {'per core':>9}")
    for processes in [1, *args.processes]:
        rate = worker_videos_per_s(run_dir / f"lane-{processes}", model_dir, url, args,
                                   processes)
        design = ("1 process (the video lane's thread)" if processes == 1
                  else f"pool of {processes} processes")
        print(f"{design:<36} {rate:>9.2f} {rate / processes:>9.2f}")


# ---------------------------------------------------------------- 2. kept frames against all


@contextlib.contextmanager
def seeking_off() -> Iterator[None]:
    """`decode_video` without its timeline: its own fallback, every frame up to the last kept
    one decoded (as where timestamps do not tell frames apart)."""
    timeline = video._Timeline.__dict__["of"]
    video._Timeline.of = classmethod(lambda cls, times, keyframes: None)  # type: ignore
    try:
        yield
    finally:
        video._Timeline.of = timeline  # type: ignore[method-assign]


def every_frame_converted(data: bytes) -> None:
    """Every frame decoded and converted to RGB, as a loader that keeps them all would."""
    with av.open(io.BytesIO(data), mode="r") as container:
        for frame in container.decode(container.streams.video[0]):
            frame.to_ndarray(format="rgb24")


def median_ms(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def bench_kept_frames(args: argparse.Namespace, videos: dict[int, bytes]) -> None:
    print(f"\n2. Decoding one video in this process, median of {args.decode_repeats} (ms)")
    print(f"{'keyframe every':>14} {'fps':>5} {'kept':>5} {'kept only':>10} "
          f"{'every frame':>12} {'all to RGB':>11}")
    for keyframe_every, data in videos.items():
        converted = median_ms(partial(every_frame_converted, data), args.decode_repeats)
        for fps in args.decode_fps:
            decode = partial(decode_video, data, 0, Qwen2VLSampling(fps=fps))
            kept = len(decode().frames_indices)
            only = median_ms(decode, args.decode_repeats)
            with seeking_off():
                every = median_ms(decode, args.decode_repeats)
            print(f"{keyframe_every:>14} {fps:>5g} {kept:>5} {only:>10.1f} {every:>12.1f} "
                  f"{converted:>11.1f}")


# ---------------------------------------------------------------- 3. images while videos stream


def image_latencies(endpoint: str, url: str, count: int) -> list[float]:
    """Seconds for each of `count` one-image requests, one at a time, each image new to the
    caches (a new uuid)."""
    latencies = []
    with Client(endpoint) as client:
        for _ in range(count):
            image = ImagePart(image_url=ImageUrl(url=url, uuid=uuid.uuid4().hex))
            started = time.perf_counter()
            client.chat([ChatMessage(role="user", content=[image, TextPart(text="Describe.")])],
                        max_tokens=1)
            latencies.append(time.perf_counter() - started)
    return latencies


def bench_images_while_videos_stream(args: argparse.Namespace, run_dir: Path,
                                     data: bytes) -> None:
    width, height = args.image_size.width, args.image_size.height
    image = data_uri(encode(make_image(width, height, seed=2), quality=90))
    serve = ["--mm-processes", str(args.mm_processes),
             *(["--model", args.model] if args.model else [])]
    with serving(run_dir / "serve", *serve, log_dir=run_dir / "serve-logs") as endpoint:
        image_latencies(endpoint, image, 3)  # warm up
        idle = image_latencies(endpoint, image, args.image_requests)
        with ImageLoad(endpoint, video_uri(data), args.video_clients,
                       video_fps=args.fps) as load:
            loaded = image_latencies(endpoint, image, args.image_requests)
    print(f"\n3. Image latency, {width}x{height} JPEG, `mmlane serve {' '.join(serve)}`")
    report("image latency, idle", idle)
    report(f"image latency, {args.video_clients} video clients", loaded)
    print(f"{'':<40} ratio of p50 {statistics.median(loaded) / statistics.median(idle):.2f}x"
          f", video requests completed meanwhile: {load.completed}")


def numbers(kind: Callable[[str], int | float]) -> Callable[[str], list]:
    return lambda text: [kind(item) for item in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default="1280x720", help="the video's WxH")
    parser.add_argument("--seconds", type=float, default=10.0, help="the video's length")
    parser.add_argument("--rate", type=int, default=30, help="the video's frames per second")
    parser.add_argument("--keyframe-every", type=numbers(int), default="30,250",
                        help="frames between keyframes (the first for parts 1 and 3)")
    parser.add_argument("--fps", type=float, default=0.5,
                        help="frames kept per second of video in parts 1 and 3 (Qwen2-VL's default "
                        "is 2; the tiny model's 4,096-token context takes 10 s of 720p at "
                        "0.5)")
    parser.add_argument("--videos", type=int, default=8, help="videos per design in part 1")
    parser.add_argument("--processes", type=numbers(int), default="2,4",
                        help="pool sizes to compare with 1 process in part 1")
    parser.add_argument("--decode-fps", type=numbers(float), default="2,0.5",
                        help="sampling rates in part 2")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--mm-processes", type=int, default=4,
                        help="the server's --mm-processes in part 3 (videos in half of them)")
    parser.add_argument("--image-size", type=parse_size, default="1024x768")
    parser.add_argument("--image-requests", type=int, default=30)
    parser.add_argument("--video-clients", type=int, default=2)
    parser.add_argument("--model", help="the model directory of parts 1 and 3 (default: the "
                        "embedded tiny Qwen2-VL)")
    parser.add_argument("--parts", type=numbers(int), default="1,2,3",
                        help="the parts to run")
    args = parser.parse_args()
    width, height = args.size.width, args.size.height
    videos = {every: make_video(width, height, args.seconds, args.rate, every)
              for every in args.keyframe_every}
    data = videos[args.keyframe_every[0]]
    print(f"test video: {width}x{height}, {args.seconds:g} s at {args.rate} fps, H.264, "
          f"{len(data) / 1e6:.1f} MB (a keyframe every {args.keyframe_every[0]} frames)")
    with tempfile.TemporaryDirectory(prefix="mmv-") as tmp:
        if 1 in args.parts:
            bench_videos_per_core(args, Path(tmp), data)
        if 2 in args.parts:
            bench_kept_frames(args, videos)
        if 3 in args.parts:
            bench_images_while_videos_stream(args, Path(tmp), data)


if __name__ == "__main__":
    main()
