"""What the benchmark scripts share: `mmlane serve`'s roles, text latency under image load.

`serving` starts the three roles exactly as `mmlane serve ARGS` does (the launcher's `serve_config`
and `start_roles`), so a benchmark measures the command a user runs.

Importing it puts the checkout on the path (as scripts/bench_vllm.py does): the scripts run as
`python scripts/x.py`, and bench/ (the image helpers, the MM lane's bench) is not installed. A
script imports it before `bench` (third-party before first-party, as ruff orders them).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.images import data_uri, encode, make_image  # noqa: E402
from bench.stats import percentile  # noqa: E402
from mmlane.client import Client, user_message  # noqa: E402
from mmlane.common.sockets import free_tcp_port  # noqa: E402
from mmlane.launcher import (  # noqa: E402
    SERVE_SETTINGS,
    serve_config,
    sigterm_as_interrupt,
    start_roles,
    stop_all,
)
from mmlane.model import resolve_model_dir  # noqa: E402
from mmlane.protocol.errors import MMLaneError  # noqa: E402
from mmlane.protocol.messages import (  # noqa: E402
    ChatMessage,
    ImagePart,
    ImageUrl,
    TextPart,
    VideoPart,
    VideoSampling,
)

BIG = (4032, 3024)


def big_jpeg() -> bytes:
    """The 4032x3024 photo-like JPEG every benchmark sends (12 MP, about 5.5 MB)."""
    return encode(make_image(*BIG, seed=1), quality=90)


def big_jpeg_url() -> str:
    return data_uri(big_jpeg())


@contextlib.contextmanager
def serving(run_dir: Path, *serve_args: str, log_dir: Path | None = None) -> Iterator[str]:
    """`mmlane serve SERVE_ARGS` on a free port; yields the client endpoint, stops at exit
    (also when SIGTERM ends the benchmark: it raises KeyboardInterrupt meanwhile)."""
    port = free_tcp_port()
    argv = ["--port", str(port), "--run-dir", str(run_dir), *serve_args]
    config = serve_config(SERVE_SETTINGS.parse(argv))
    model_dir = str(resolve_model_dir(config.engine.model))
    config.engine.model = config.mm_worker.model = config.frontend.model = model_dir
    with sigterm_as_interrupt():
        children = start_roles(config.roles(), run_dir, config.startup_timeout_s,
                               log_dir=log_dir)
        try:
            yield config.frontend.client_endpoint
        finally:
            stop_all(children)


def text_latencies(endpoint: str, count: int, max_tokens: int = 1) -> list[float]:
    """Seconds for each of `count` text-only chat requests, sent one at a time."""
    latencies = []
    with Client(endpoint) as client:
        for i in range(count):
            start = time.perf_counter()
            client.chat([user_message(f"Quick question number {i}?")], max_tokens=max_tokens)
            latencies.append(time.perf_counter() - start)
    return latencies


@dataclass
class ImageLoad:
    """Clients that each keep one image request (a video's, with `video`) in flight, back to
    back, until stopped."""

    endpoint: str
    url: str
    clients: int
    completed: int = 0
    video_fps: float | None = None
    """`url` is a video's: each request sends it as a video part, sampled at this many frames
    a second."""

    def __enter__(self) -> ImageLoad:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._flow, name=f"image-client-{i}")
            for i in range(self.clients)
        ]
        for thread in self._threads:
            thread.start()
        time.sleep(2.0)  # let the MM worker and the engine fill up
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _flow(self) -> None:
        with Client(self.endpoint) as client:
            while not self._stop.is_set():
                # A new uuid names the image anew each time: the feature cache misses, so
                # every request costs the full decode and preprocessing.
                source = ImageUrl(url=self.url, uuid=uuid.uuid4().hex)
                video = self.video_fps is not None
                part = VideoPart(video_url=source) if video else ImagePart(image_url=source)
                message = ChatMessage(role="user", content=[part, TextPart(text="Describe.")])
                sampling = VideoSampling(fps=self.video_fps)
                try:
                    client.chat([message], max_tokens=1, mm_processor_kwargs=sampling)
                except MMLaneError as exc:  # a load of failures is other work: say so, stop
                    print(f"{part.type} load stopped: {exc}", file=sys.stderr)
                    return
                self.completed += 1


def report(name: str, latencies: list[float]) -> None:
    ms = [x * 1000 for x in latencies]
    print(f"{name:<40} p50 {percentile(ms, 50):7.1f} ms   p90 {percentile(ms, 90):7.1f} ms"
          f"   p99 {percentile(ms, 99):7.1f} ms   (n={len(ms)})")
