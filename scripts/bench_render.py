"""The render tier against vLLM's own: `POST /v1/chat/completions/render`, mmlane against
`vllm launch render` on the same model directory, one after the other on the same cores.

    .venv-vllm/bin/python scripts/bench_render.py [--seconds 30] [--clients 4] [--model M]
        [--mm-processes 0[,N...]] [--loads 1024x1024,4032x3024,text]

For each server and each load (a 1024x1024 JPEG, a 4032x3024 JPEG, text only), CLIENTS clients
post renders back to back for SECONDS, each image one of 24 distinct photo-like JPEGs (a new
one each time, so no cache answers: vLLM's render is started with --mm-processor-cache-gb 0 and
mmlane's with --mm-cache-gb 0). It prints requests/s and p50/p99 latency, then text render
latency alone and under two clients of 12 MP renders. `--mm-processes`: one mmlane server for
each value (its MM worker's --mm-processes; 0, the default, is one per core under
`--backend vllm-remote`, which these servers run).
Run it alone: it measures the machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mmlane.common import cpu_wheels  # noqa: E402

cpu_wheels.apply()  # this script runs where vLLM is: before transformers imports torchvision

from bench.images import data_uri, encode, make_image  # noqa: E402
from bench.stats import percentile  # noqa: E402
from mmlane.common.sockets import free_tcp_port  # noqa: E402
from mmlane.model import resolve_model_dir  # noqa: E402

SIZES = {"1024x1024": (1024, 1024), "4032x3024": (4032, 3024)}
DISTINCT = 24


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--model", default=None,
                        help="the model directory (e.g. a tiny model under $MMLANE_HOME); "
                        "default: the embedded tiny Qwen2-VL")
    parser.add_argument("--mm-processes", default="0",
                        help="comma-separated: an mmlane server with each as its MM worker's "
                        "--mm-processes (default: %(default)s, its own default)")
    parser.add_argument("--loads", default=",".join([*SIZES, "text"]),
                        help="comma-separated loads to time (default: %(default)s)")
    args = parser.parse_args()
    model = resolve_model_dir(args.model)
    images = {name: [data_uri(encode(make_image(*size, seed=seed), quality=90))
                     for seed in range(DISTINCT)] for name, size in SIZES.items()}
    loads = [(name, uris) for name, uris in [*images.items(), ("text", [])]
             if name in args.loads.split(",")]
    out = Path(tempfile.mkdtemp(prefix="bench-render-"))
    print(f"model {model}; {args.clients} clients, {args.seconds:g} s a load; logs in {out}")
    servers = ["vllm", *(f"mmlane-mm{count}" if int(count) else "mmlane"
                         for count in args.mm_processes.split(","))]
    for server in servers:
        port = free_tcp_port()
        process = _start(server, model, port, out)
        try:
            _wait_ready(port, model.name, process, out / f"{server}.log")
            # Its HTTP port answers text before every process is up (mmlane's MM worker and its
            # pool start after the frontend): one image render each, not timed, so that no
            # load below waits for a start.
            _render(port, model.name, images["1024x1024"][0])
            for name, uris in loads:
                count, latencies, seconds = _load(port, model.name, uris, args.clients,
                                                  args.seconds)
                print(f"{server:<10} {name:<10} {count / seconds:8.1f} req/s   "
                      f"p50 {percentile(latencies, 50):7.1f} ms   "
                      f"p99 {percentile(latencies, 99):7.1f} ms   (n={count})")
            idle = _text_probe(port, model.name, 40)
            with _background(port, model.name, images["4032x3024"], 2):
                loaded = _text_probe(port, model.name, 40)
            print(f"{server:<10} text render p50 idle {percentile(idle, 50):.1f} ms, under two "
                  f"12 MP streams {percentile(loaded, 50):.1f} ms "
                  f"(x{percentile(loaded, 50) / percentile(idle, 50):.1f})")
        finally:
            process.terminate()
            process.wait(60)
    return 0


def _start(server: str, model: Path, port: int, out: Path) -> subprocess.Popen:
    log = (out / f"{server}.log").open("w")
    if server == "vllm":
        command = [str(Path(sys.executable).with_name("vllm")), "launch", "render", str(model),
                   "--served-model-name", model.name, "--port", str(port),
                   "--mm-processor-cache-gb", "0"]
    else:
        # A render takes no engine: the remote backend's role loads no model (its replica,
        # never reached, is down). vLLM's environment runs no hf backend.
        command = [sys.executable, "-m", "mmlane.cli", "serve", "--model", str(model),
                   "--backend", "vllm-remote", "--vllm-url", f"http://127.0.0.1:{free_tcp_port()}",
                   "--port", str(free_tcp_port()), "--http-port", str(port),
                   "--mm-cache-gb", "0", "--run-dir", str(out / f"run-{server}"),
                   "--mm-processes", server.removeprefix("mmlane").removeprefix("-mm") or "0"]
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=cpu_wheels.child_env())


def _wait_ready(port: int, model: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited; see {log}")
        try:
            _render(port, model, None)
            return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the server did not start; see {log}")


def _render(port: int, model: str, image: str | None) -> float:
    """One chat render's latency in milliseconds."""
    content: list[dict] = [{"type": "text", "text": "Describe it."}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions/render",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as reply:
        reply.read()
    return (time.perf_counter() - started) * 1000


def _load(port: int, model: str, uris: list[str], clients: int,
          seconds: float) -> tuple[int, list[float], float]:
    """Renders back to back from `clients` threads for `seconds`: their count and latencies."""
    latencies: list[float] = []
    stop = time.monotonic() + seconds
    turn = iter(range(10**9))
    lock = threading.Lock()

    def client() -> None:
        while time.monotonic() < stop:
            with lock:
                number = next(turn)
            latency = _render(port, model, uris[number % len(uris)] if uris else None)
            with lock:
                latencies.append(latency)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return len(latencies), latencies, time.perf_counter() - started


def _text_probe(port: int, model: str, count: int) -> list[float]:
    return [_render(port, model, None) for _ in range(count)]


class _background:
    """Clients rendering images back to back until the block ends."""

    def __init__(self, port: int, model: str, uris: list[str], clients: int) -> None:
        self._args = (port, model, uris)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._flow, args=(n,)) for n in range(clients)]

    def __enter__(self) -> None:
        for thread in self._threads:
            thread.start()
        time.sleep(2.0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _flow(self, number: int) -> None:
        port, model, uris = self._args
        while not self._stop.is_set():
            _render(port, model, uris[number % len(uris)])
            number += 2


if __name__ == "__main__":
    sys.exit(main())
