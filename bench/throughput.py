"""`python -m bench --throughput`: how many images per second each MM-lane design preprocesses.

No engine and no client: each design is handed the same `--throughput-images` JPEGs (one
generated photo of `--throughput-size`, the same bytes every time) as fast as it takes them, and
timed from the first hand-over to the last finished image:

    in-process, 1 thread   decode + the image processor on one thread of this process: vLLM's
                           one-thread MM executor inside its API process
    in-process, 2 threads  the same on a pool of two threads of one process (GIL-bound)
    mm-worker, N procs     a real `mmlane mm-worker --mm-processes N` process, this bench
                           standing in for the engine socket: it pushes jobs, takes the rendered
                           EngineRequests (over ipc, so through shared memory)

The in-process designs run with float pixels (the HF image processor as it is called by
default: rescaled, normalised float32, what vLLM's renderer makes with the PIL backend) and with
uint8 ones (`Preprocessor.process_image`, mmlane's path: the engine normalises); the MM worker
makes uint8. The MM worker's feature cache never hits: its jobs carry no engine epoch, so it
commits nothing. Designs alternate for `--throughput-rounds` rounds, so that a drift in the
machine's load shows in all of them alike; each figure is the median of its rounds.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import msgspec
import zmq

from bench.config import BenchConfig, parse_size
from bench.images import data_uri, generated_jpeg
from mmlane.common.config import load_config, run_dir_defaults
from mmlane.common.settings import Settings
from mmlane.launcher import start_roles, stop_all
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.mm_worker.media import decode_image
from mmlane.model import Preprocessor, load_preprocessor, resolve_model_dir
from mmlane.protocol.codec import Codec
from mmlane.protocol.messages import (
    EngineInput,
    FrontendInput,
    ImageUrl,
    MMJob,
    RequestFailed,
    SamplingParams,
)


class DesignResult(msgspec.Struct, kw_only=True):
    design: str
    """'in-process, 1 thread', 'in-process, 2 threads' or 'mm-worker, N procs'."""
    pixels: str
    """'float' (normalised float32) or 'uint8'."""
    images_per_s: list[float]
    """One figure per round."""
    median_images_per_s: float


class ThroughputResult(msgspec.Struct, kw_only=True):
    image_size: str
    images: int
    rounds: int
    cpus: int
    load_avg_start: list[float]
    designs: list[DesignResult]


class LoneMMWorker:
    """One `mmlane mm-worker ARGS` whose engine is the caller: push jobs, take what it sends."""

    def __init__(self, run_dir: Path, model_dir: Path, *worker_args: str) -> None:
        engine, jobs = f"ipc://{run_dir}/bench-engine.sock", f"ipc://{run_dir}/bench-jobs.sock"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.preprocessor = load_preprocessor(model_dir)
        self._prompt = self.preprocessor.tokenize_batch([self.preprocessor.render_prompt(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
        )])[0]
        self._codec: Codec = Codec(EngineInput, accept_shm=True)  # an ipc socket, as an engine's
        self.reply_to = f"ipc://{run_dir}/bench-failed.sock"
        """Where the jobs say their errors go: `take` raises the first that comes."""
        argv = ["--model", str(model_dir), "--engine-endpoint", engine,
                "--mm-worker-endpoint", jobs, *worker_args]
        with run_dir_defaults(run_dir):  # as `mmlane mm-worker ARGV` started there builds it
            config = load_config(MMWorkerConfig, Settings(MMWorkerConfig).parse(argv))
        ctx: zmq.Context = zmq.Context.instance()
        self._sink = ctx.socket(zmq.PULL)
        self._sink.bind(engine)
        self._source = ctx.socket(zmq.PUSH)
        self._source.connect(jobs)
        self._failed = ctx.socket(zmq.PULL)
        self._failed.bind(self.reply_to)
        # Last: once its process starts, only __exit__ stops it (start_roles stops it itself
        # if it is interrupted before the worker is ready).
        self._children = start_roles({"mm-worker": config}, run_dir, 300,
                                     log_dir=run_dir / "logs")

    def __enter__(self) -> LoneMMWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(self._children)
        self._sink.close(linger=0)
        self._source.close(linger=0)
        self._failed.close(linger=0)

    def push(
        self, url: str, request_id: str, uuid: str | None = None, **job_fields: object
    ) -> None:
        """Send one job with one image, as a frontend would."""
        self.send(MMJob(request_id=request_id, reply_to=self.reply_to,
                        prompt_token_ids=self._prompt, images=[ImageUrl(url=url, uuid=uuid)],
                        sampling=SamplingParams(), **job_fields))  # type: ignore[arg-type]

    def send(self, job: MMJob) -> None:
        """Send one job, as a frontend would."""
        self._source.send_multipart(self._codec.encode(job))

    def take(self) -> int:
        """Wait for the next EngineRequest the worker sends; its size in bytes, all frames.
        A job that fails instead ends the benchmark with its error (a figure without it would
        be of other work)."""
        poller = zmq.Poller()
        poller.register(self._sink, zmq.POLLIN)
        poller.register(self._failed, zmq.POLLIN)
        if self._failed in dict(poller.poll()):
            codec: Codec[FrontendInput] = Codec(FrontendInput)
            failed = codec.decode(self._failed.recv_multipart())
            assert isinstance(failed, RequestFailed), failed
            raise SystemExit(f"job {failed.request_id} failed: {failed.error.message}")
        frames = self._sink.recv_multipart(copy=False)
        self._codec.decode(frames)
        return sum(len(frame.buffer) for frame in frames)


def worker_images_per_s(run_dir: Path, model_dir: Path, url: str, images: int,
                        processes: int) -> float:
    """Images/s out of one MM worker with `processes` image processes."""
    with LoneMMWorker(run_dir, model_dir, "--mm-processes", str(processes)) as lone:
        for warm in range(processes):  # every process has run the processor once
            lone.push(url, f"warm-{warm}")
        for _ in range(processes):
            lone.take()
        started = time.perf_counter()
        for i in range(images):
            lone.push(url, str(i))
        for _ in range(images):
            lone.take()
        return images / (time.perf_counter() - started)


def _work(pre: Preprocessor, pixels: str, max_pixels: int) -> Callable[[bytes], object]:
    """One image's in-process preprocessing: decode, then the processor (float) or mmlane's
    uint8 path."""
    def float_path(data: bytes) -> object:
        return pre.image_processor(images=[decode_image(data, 0, max_pixels)],
                                   return_tensors="np")

    def uint8_path(data: bytes) -> object:
        return pre.process_image(decode_image(data, 0, max_pixels))

    return float_path if pixels == "float" else uint8_path


def _inprocess(work: Callable[[bytes], object], data: bytes, images: int, threads: int) -> float:
    """Images/s of `work` on a pool of `threads` threads of this process."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, [data] * threads))  # warm
        started = time.perf_counter()
        list(pool.map(work, [data] * images))
        return images / (time.perf_counter() - started)


def worker_processes(config: BenchConfig) -> list[int]:
    """The `--mm-processes` settings to run: the configured ones, else 1, 2 and every core."""
    return config.throughput_processes or sorted({1, 2, len(os.sched_getaffinity(0))})


def run_throughput(config: BenchConfig, run_dir: Path,
                   progress: Callable[[str], None] = print) -> ThroughputResult:
    spec = parse_size(config.throughput_size)
    data = generated_jpeg(spec, seed=config.seed)
    model_dir = resolve_model_dir(config.model)
    pre = load_preprocessor(model_dir)
    load_avg = list(os.getloadavg())
    images, url = config.throughput_images, data_uri(data)
    runs: dict[tuple[str, str], Callable[[], float]] = {}
    dirs = (run_dir / f"throughput-{index}" for index in itertools.count())  # a worker's each

    def worker(processes: int) -> Callable[[], float]:
        return lambda: worker_images_per_s(next(dirs), model_dir, url, images, processes)

    for threads in (1, 2):
        for pixels in ("float", "uint8"):
            work = _work(pre, pixels, config.max_image_pixels)
            name = f"in-process, {threads} thread{'s' if threads > 1 else ''}"
            runs[(name, pixels)] = partial(_inprocess, work, data, images, threads)
    for n in worker_processes(config):
        runs[(f"mm-worker, {n} proc{'s' if n > 1 else ''}", "uint8")] = worker(n)
    figures: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for round_ in range(config.throughput_rounds):
        for (design, pixels), run in runs.items():
            figures[(design, pixels)].append(run())
            progress(f"round {round_ + 1}: {design} ({pixels}): "
                     f"{figures[(design, pixels)][-1]:.2f} images/s")
    return ThroughputResult(
        image_size=spec.name, images=config.throughput_images, rounds=config.throughput_rounds,
        cpus=len(os.sched_getaffinity(0)), load_avg_start=load_avg,
        designs=[DesignResult(design=design, pixels=pixels, images_per_s=rates,
                              median_images_per_s=statistics.median(rates))
                 for (design, pixels), rates in figures.items()],
    )


def table(result: ThroughputResult) -> str:
    base = result.designs[0].median_images_per_s
    lines = [f"{result.image_size} JPEG, {result.images} images per run, median of "
             f"{result.rounds} round(s), {result.cpus} CPUs, load average "
             f"{'/'.join(f'{x:.2f}' for x in result.load_avg_start)} at the start",
             f"{'design':24} {'pixels':6} {'images/s':>9} {'vs first':>9}"]
    for d in result.designs:
        lines.append(f"{d.design:24} {d.pixels:6} {d.median_images_per_s:9.2f} "
                     f"{d.median_images_per_s / base:8.2f}x")
    return "\n".join(lines)


def chart(result: ThroughputResult, path: Path) -> None:
    """One bar per design and pixel convention: median images/s, each round a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.4), layout="constrained")
    labels = [f"{d.design}\n{d.pixels}" for d in result.designs]
    colours = ["#999999" if d.design.startswith("in-process") else "#1f77b4"
               for d in result.designs]
    xs = range(len(result.designs))
    ax.bar(xs, [d.median_images_per_s for d in result.designs], color=colours)
    for x, d in zip(xs, result.designs, strict=True):
        ax.plot([x] * len(d.images_per_s), d.images_per_s, "k.", ms=5)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="images/s", title=f"MM lane throughput: {result.image_size} JPEGs, "
           f"{result.cpus} CPUs (bars: median of {result.rounds}; dots: rounds)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=80)
    plt.close(fig)
