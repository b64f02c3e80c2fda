"""The workload: which requests the bench sends, when, and how a phase runs.

    Phase         what one phase offers: Poisson text and image arrivals, probes, image loops
    RequestMaker  builds each kind of request (deterministic prompts, unique image bytes)
    run_phase     drives one phase through a BenchClient, then waits for its last replies

Arrivals are open-loop: their times are drawn up front and kept whatever the server does, so
an overloaded server shows up as growing latency, not as fewer requests. The probe phases'
image loops are closed (each keeps one request in flight), like the probe measurement the issue
cites; probes are sent every `probe_interval_ms` regardless.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from bench.client import BenchClient, Record, request_frames
from bench.config import BenchConfig
from bench.images import ImageSource
from mmlane.client import user_message
from mmlane.protocol.messages import ChatMessage

_WORDS = (
    "the a model image request token latency engine worker frontend process thread queue "
    "photo camera street river mountain city light shadow colour window door garden table "
    "what where when why how which describe explain compare summarise list count"
).split()

MakeRequest = Callable[[str], tuple[Record, list[Any]]]


@dataclass(frozen=True)
class Phase:
    name: str
    kind: Literal["idle", "load", "probe-idle", "probe"]
    seconds: float
    text_rate: float = 0.0
    image_rate: float = 0.0
    probes: bool = False
    loop_source: ImageSource | None = None
    """Probe phases: the image the closed loops send."""


def plan_phases(config: BenchConfig, probe_sources: list[ImageSource]) -> list[Phase]:
    """idle, probe-idle, one probe phase per probe size, then the load phases in rate order."""
    phases = [
        Phase("idle", "idle", config.idle_s, text_rate=config.text_rate),
        Phase("probe-idle", "probe-idle", config.probe_idle_s, probes=True),
    ]
    phases += [
        Phase(f"probe-{source.name}", "probe", config.probe_s, probes=True, loop_source=source)
        for source in probe_sources
    ]
    phases += [
        Phase(f"load-{rate:g}", "load", config.phase_s, text_rate=config.text_rate,
              image_rate=rate)
        for rate in config.image_rates
    ]
    return phases


def planned_seconds(config: BenchConfig) -> float:
    """How long one mode's phases offer arrivals, in all (drains not counted)."""
    return (config.idle_s + config.probe_idle_s + len(config.probe_sizes) * config.probe_s
            + len(config.image_rates) * config.phase_s)


def poisson_arrivals(rate: float, seconds: float, rng: np.random.Generator) -> list[float]:
    """Offsets (seconds from the phase start) of a Poisson process of `rate` per second."""
    offsets, now = [], rng.exponential(1 / rate)
    while now < seconds:
        offsets.append(now)
        now += rng.exponential(1 / rate)
    return offsets


class RequestMaker:
    """Builds every request the bench sends (callable from any thread)."""

    def __init__(
        self, config: BenchConfig, image_token: str, sweep_sources: list[ImageSource]
    ) -> None:
        self._config = config
        self._probe_text = f"{image_token} is not mine to send"
        self._sources = sweep_sources
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()
        self._image_requests = 0

    def text(self, phase: str) -> tuple[Record, list[Any]]:
        with self._lock:
            words = self._rng.choices(_WORDS, k=self._config.text_words)
        return self._frames(Record("text", phase), [user_message(" ".join(words) + "?")])

    def image(self, phase: str) -> tuple[Record, list[Any]]:
        """The next image request: images taken in turn from the sweep sources."""
        per_request = self._config.images_per_request
        with self._lock:
            first = self._image_requests * per_request
            self._image_requests += 1
        sources = [self._sources[(first + i) % len(self._sources)] for i in range(per_request)]
        return self.image_of(phase, sources)

    def image_of(self, phase: str, sources: list[ImageSource]) -> tuple[Record, list[Any]]:
        record = Record("image", phase, request_class=class_of(sources), images=len(sources))
        urls = [source.data_uri() for source in sources]
        return self._frames(record, [user_message("Describe the image.", urls)])

    def probe(self, phase: str) -> tuple[Record, list[Any]]:
        """A request the tokenizer executor answers itself: its text forges the image token."""
        return self._frames(Record("probe", phase), [user_message(self._probe_text)])

    def _frames(self, record: Record, messages: list[ChatMessage]) -> tuple[Record, list[Any]]:
        return record, request_frames(record, messages, self._config.max_tokens)


def class_of(sources: list[ImageSource]) -> str:
    return "+".join(source.name for source in sources)


def run_phase(
    client: BenchClient, maker: RequestMaker, phase: Phase, config: BenchConfig,
    rng: np.random.Generator, tick: Callable[[float], None],
) -> tuple[list[Record], float, float]:
    """Offer `phase`'s arrivals, then wait (up to the drain timeout) for their replies.

    Returns the records, the phase's start (`time.monotonic()`) and the drain's length.
    """
    records: list[Record] = []
    start = time.monotonic() + 0.05  # let every thread be waiting before the first arrival
    end = start + phase.seconds
    threads = []

    def scheduled(offsets: list[float], make: MakeRequest, name: str) -> None:
        threads.append(threading.Thread(
            target=_send_at, args=(client, [start + o for o in offsets], make, phase.name,
                                   records),
            name=name, daemon=True,
        ))

    if phase.text_rate:
        scheduled(poisson_arrivals(phase.text_rate, phase.seconds, rng), maker.text, "bench-text")
    if phase.image_rate:
        scheduled(poisson_arrivals(phase.image_rate, phase.seconds, rng), maker.image,
                  "bench-images")
    if phase.probes:
        interval = config.probe_interval_ms / 1000
        scheduled(list(np.arange(0, phase.seconds, interval)), maker.probe, "bench-probe")
    if phase.loop_source is not None:
        source = phase.loop_source
        for index in range(config.probe_loops):
            threads.append(threading.Thread(
                target=_loop, args=(client, lambda p: maker.image_of(p, [source]), phase.name,
                                    end, end + config.drain_timeout_s, records),
                name=f"bench-loop-{index}", daemon=True,
            ))
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(0.25)
        tick(min(time.monotonic(), end) - start)
    drain_start = time.monotonic()
    deadline = drain_start + config.drain_timeout_s
    for record in list(records):
        record.done.wait(max(0.0, deadline - time.monotonic()))
    return records, start, time.monotonic() - drain_start


def _send_at(
    client: BenchClient, times: list[float], make: MakeRequest, phase: str, records: list[Record]
) -> None:
    for due in times:
        record, frames = make(phase)  # encode before the wait: a big image takes milliseconds
        time.sleep(max(0.0, due - time.monotonic()))
        records.append(client.submit(record, frames))


def _loop(
    client: BenchClient, make: MakeRequest, phase: str, end: float, give_up: float,
    records: list[Record],
) -> None:
    while time.monotonic() < end:
        record, frames = make(phase)
        records.append(client.submit(record, frames))
        if not record.done.wait(max(0.0, give_up - time.monotonic())):
            return
