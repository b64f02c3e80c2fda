"""Pipeline benchmark: text latency idle and under image load, and the MM worker's images/s.

    python scripts/bench_pipeline.py [--text-requests 50] [--image-clients 2] [--images 20]

1. Starts `mmlane serve` on the embedded model; measures text-only request latency (sequential,
   max_tokens=1) while idle, then while `--image-clients` clients keep 4032x3024 JPEG requests
   in flight back to back.
2. Starts one MM worker alone with this script standing in for the engine socket, pushes
   `--images` jobs with 4032x3024 JPEGs, and times them out of the worker (images/s); then runs
   the same decode + HF image processor calls in a loop in this process for comparison.
Prints the figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from media import data_uri, encode, make_image  # noqa: E402
from protocol.codec import Codec  # noqa: E402
from protocol.messages import EngineInput, ImageUrl, MMJob, SamplingParams  # noqa: E402
from services.client import Client, user_message  # noqa: E402
from services.launcher import start_roles, stop_all  # noqa: E402
from services.mm_worker.media import decode_image  # noqa: E402
from services.model import load_preprocessor, resolve_model_dir  # noqa: E402

BIG = (4032, 3024)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def text_latencies(endpoint: str, count: int) -> list[float]:
    latencies = []
    with Client(endpoint) as client:
        for i in range(count):
            start = time.perf_counter()
            client.chat([user_message(f"Quick question number {i}?")], max_tokens=1)
            latencies.append(time.perf_counter() - start)
    return latencies


def keep_images_flowing(endpoint: str, url: str, stop: threading.Event, done: list[int]) -> None:
    with Client(endpoint) as client:
        while not stop.is_set():
            client.chat([user_message("Describe.", [url])], max_tokens=1)
            done.append(1)


def report(name: str, latencies: list[float]) -> None:
    ms = [x * 1000 for x in latencies]
    print(f"{name:<34} p50 {percentile(ms, 50):8.1f} ms   p99 {percentile(ms, 99):8.1f} ms"
          f"   (n={len(ms)})")


def bench_serve(args: argparse.Namespace, model_dir: Path, run_dir: Path, url: str) -> None:
    port = 18765
    roles = {
        "engine": ["--model", str(model_dir), "--engine-endpoint", f"ipc://{run_dir}/e.sock"],
        "mm-worker": ["--model", str(model_dir), "--engine-endpoint", f"ipc://{run_dir}/e.sock",
                      "--mm-worker-endpoint", f"ipc://{run_dir}/m.sock"],
        "frontend": ["--model", str(model_dir), "--engine-endpoint", f"ipc://{run_dir}/e.sock",
                     "--mm-worker-endpoint", f"ipc://{run_dir}/m.sock",
                     "--output-endpoint", f"ipc://{run_dir}/f.sock", "--port", str(port)],
    }
    children = start_roles(roles, run_dir, 300)
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        text_latencies(endpoint, 5)  # warm up
        idle = text_latencies(endpoint, args.text_requests)
        stop, done = threading.Event(), []
        loaders = [
            threading.Thread(target=keep_images_flowing, args=(endpoint, url, stop, done),
                             name=f"image-client-{i}")
            for i in range(args.image_clients)
        ]
        for t in loaders:
            t.start()
        time.sleep(2.0)  # let the MM worker fill up
        loaded = text_latencies(endpoint, args.text_requests)
        stop.set()
        for t in loaders:
            t.join()
        report("text latency, idle", idle)
        report(f"text latency, {args.image_clients} image clients", loaded)
        print(f"{'':<34} ratio of p50 {statistics.median(loaded) / statistics.median(idle):.2f}x"
              f", image requests completed meanwhile: {len(done)}")
    finally:
        stop_all(children)


def bench_mm_worker(args: argparse.Namespace, model_dir: Path, run_dir: Path, jpeg: bytes) -> None:
    engine = f"ipc://{run_dir}/bench-engine.sock"
    jobs = f"ipc://{run_dir}/bench-jobs.sock"
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.PULL)
    sink.bind(engine)
    children = start_roles(
        {"mm-worker": ["--model", str(model_dir), "--engine-endpoint", engine,
                       "--mm-worker-endpoint", jobs]}, run_dir, 300)
    pre = load_preprocessor(model_dir)
    prompt = pre.tokenize_batch([pre.render_prompt(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])])[0]
    source = ctx.socket(zmq.PUSH)
    source.connect(jobs)
    codec = Codec(EngineInput)
    url = data_uri(jpeg)
    try:
        job = MMJob(request_id="warm", reply_to=f"ipc://{run_dir}/none.sock",
                    prompt_token_ids=prompt, images=[ImageUrl(url=url)], sampling=SamplingParams())
        source.send_multipart(codec.encode(job))
        codec.decode(sink.recv_multipart(copy=False))
        start = time.perf_counter()
        for i in range(args.images):
            source.send_multipart(codec.encode(MMJob(
                request_id=str(i), reply_to=job.reply_to, prompt_token_ids=prompt,
                images=[ImageUrl(url=url)], sampling=SamplingParams())))
        frame_bytes = 0
        for _ in range(args.images):
            frames = sink.recv_multipart(copy=False)
            frame_bytes = sum(len(f.buffer) for f in frames)
        worker = args.images / (time.perf_counter() - start)
    finally:
        stop_all(children)
        sink.close(linger=0)
        source.close(linger=0)

    start = time.perf_counter()
    for _ in range(args.images):  # the same decode and processing calls the worker makes
        pre.process_image(decode_image(jpeg, 0, 64_000_000))
    in_process = args.images / (time.perf_counter() - start)
    print(f"MM worker, {BIG[0]}x{BIG[1]} JPEG           {worker:8.2f} images/s"
          f"   ({frame_bytes / 1e6:.1f} MB per request to the engine)")
    print(f"in-process decode + HF processor loop {in_process:8.2f} images/s"
          f"   (worker / loop = {worker / in_process:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text-requests", type=int, default=50)
    parser.add_argument("--image-clients", type=int, default=2)
    parser.add_argument("--images", type=int, default=20)
    args = parser.parse_args()
    model_dir = resolve_model_dir(None)
    jpeg = encode(make_image(*BIG, seed=1), quality=90)
    print(f"4032x3024 test JPEG: {len(jpeg) / 1e6:.1f} MB")
    with tempfile.TemporaryDirectory(prefix="mmb-") as tmp:
        bench_serve(args, model_dir, Path(tmp), data_uri(jpeg))
        bench_mm_worker(args, model_dir, Path(tmp), jpeg)


if __name__ == "__main__":
    main()
