"""One run of the bench: every mode in turn, each through the same phases, then the results.

First every process starts (all at once, before anything is measured: one engine for every
mode, each mode's own servers). Then per mode: warm its processes up, calibrate the engine, run
the phases (idle, probe-idle, a probe phase per probe size, the load phases). At the end every
process stops. Figures are computed from the client's records (and, for shared and split, the
server's handoff times and executor-probe waits), then summarised into a `ModeResult`.
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from bench.client import BenchClient, Record
from bench.config import BenchConfig
from bench.images import ImageSource
from bench.inproc import Handoffs, ProbeStart, ProbeStop, ProbeWaits, TakeHandoffs
from bench.modes import DESIGNS, Control, Deployment, EngineCalibration, deploy_all
from bench.results import (
    BenchResult,
    CpuResult,
    EngineHoldResult,
    Goal,
    ImageResult,
    Latency,
    Machine,
    ModeResult,
    PhaseResult,
    ProbeResult,
    TextResult,
)
from bench.stats import cpu_seconds, latency, machine_busy_seconds
from bench.workload import (
    Phase,
    RequestMaker,
    class_of,
    plan_phases,
    planned_seconds,
    run_phase,
)
from mmlane.launcher import Child, stop_all
from mmlane.model import load_preprocessor, resolve_model_dir

OTHERS = "others"
"""The `cpu_s` key of every other process on the machine: other users' work, and the other
modes' idle processes. Large values mean the figures were measured on a busy machine."""
PROBE_REPLY = "invalid_request"
"""The error code a tokenizer probe is answered with (its text forges the image token)."""
SATURATED_BELOW = 0.9


class Progress:
    """A progress bar over the planned phase seconds of every mode (tqdm, from the extra)."""

    def __init__(self, total_s: float, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=round(total_s), unit="s", disable=not enabled or None,
                         bar_format="{desc} {bar} {n_fmt}/{total_fmt} s [{elapsed}]")
        self._base = 0.0

    def status(self, text: str) -> None:
        self._bar.set_description_str(text)

    def phase_tick(self, seconds: float) -> None:
        self._bar.n = round(self._base + seconds)
        self._bar.refresh()

    def phase_done(self, seconds: float) -> None:
        self._base += seconds
        self.phase_tick(0)

    def close(self) -> None:
        self._bar.close()


class Assets:
    """What every mode shares: the preprocessor, the images, the engine calibration."""

    def __init__(self, config: BenchConfig, model_dir: Path) -> None:
        self.pre = load_preprocessor(model_dir)
        if config.image_files:
            self.sweep = [ImageSource.from_file(path) for path in config.image_files]
        else:
            self.sweep = [ImageSource.generated(spec, config.seed) for spec in config.sweep_sizes]
        self.probe = [ImageSource.generated(spec, config.seed) for spec in config.probe_specs]
        per_request = config.images_per_request
        classes = {}
        for first in range(0, len(self.sweep) * per_request, per_request):
            sources = [self.sweep[(first + i) % len(self.sweep)] for i in range(per_request)]
            classes[class_of(sources)] = sources
        words = random.Random(config.seed).choices(["word", "token", "image"], k=config.text_words)
        self.calibration = EngineCalibration(
            self.pre, " ".join(words) + "?", classes, config.max_image_pixels
        )


def run_bench(config: BenchConfig, run_dir: Path, *, progress: bool = True) -> BenchResult:
    model_dir = resolve_model_dir(config.model)
    started, began = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    load_start = list(os.getloadavg())
    bar = Progress(len(config.modes) * planned_seconds(config), progress)
    children: list[Child] = []
    try:
        bar.status("preparing images")
        assets = Assets(config, model_dir)
        bar.status("starting every process")
        deployments = deploy_all(config.modes, config, model_dir, run_dir, children)
        modes = [_run_mode(deployments[mode], config, run_dir, assets, bar)
                 for mode in config.modes]
    finally:
        bar.status("stopping")
        stop_all(children)
        bar.close()
    return BenchResult(
        started_at=started.isoformat(timespec="seconds"),
        duration_s=round(time.monotonic() - began, 1),
        command=_command(),
        machine=_machine(load_start),
        settings=config,
        modes=modes,
        goals=judge_goals(modes),
    )


def _command() -> list[str]:
    """This process's command line, as `mmlane ...` when it is the mmlane command."""
    if Path(sys.argv[0]).name in ("mmlane", "cli.py"):
        return ["mmlane", *sys.argv[1:]]
    return list(sys.argv)


def _machine(load_start: list[float]) -> Machine:
    import torch
    import transformers

    return Machine(
        cpus=os.cpu_count() or 0, platform=platform.platform(),
        python=platform.python_version(), torch=str(torch.__version__),
        transformers=str(transformers.__version__),
        load_avg_start=[round(x, 2) for x in load_start],
        load_avg_end=[round(x, 2) for x in os.getloadavg()],
    )


# ---------------------------------------------------------------- one mode


def _run_mode(
    deployment: Deployment, config: BenchConfig, run_dir: Path, assets: Assets, bar: Progress
) -> ModeResult:
    mode = deployment.mode
    ctx = zmq.Context()
    control = None if deployment.control_endpoint is None else \
        Control(ctx, deployment.control_endpoint)
    maker = RequestMaker(config, assets.pre.family.image_token, assets.sweep)
    rng = np.random.default_rng(config.seed)
    try:
        with BenchClient(deployment.client_endpoint) as client:
            bar.status(f"{mode}: warming up")
            _warm_up(client, maker, assets)
            service: dict[str, float] = {}
            if deployment.engine_endpoint is not None:
                bar.status(f"{mode}: calibrating the engine")
                service = assets.calibration.measure(ctx, deployment.engine_endpoint, run_dir)
            phases = []
            for phase in plan_phases(config, assets.probe):
                bar.status(f"{mode}: {phase.name}")
                phases.append(_run_phase(client, control, deployment, maker, phase, config,
                                         rng, service, bar.phase_tick))
                bar.phase_done(phase.seconds)
    finally:
        if control is not None:
            control.close()
        ctx.destroy(linger=0)
    return summarize(mode, deployment.pids(), service, phases)


def _warm_up(client: BenchClient, maker: RequestMaker, assets: Assets) -> None:
    """A few requests of every kind, so first-call costs stay out of the figures."""
    records = [client.submit(*maker.text("warm-up")) for _ in range(3)]
    for source in [*assets.sweep, *assets.probe]:
        record = client.submit(*maker.image_of("warm-up", [source]))
        record.done.wait(300)
        records.append(record)
    records.append(client.submit(*maker.probe("warm-up")))
    for record in records:
        record.done.wait(300)


def _run_phase(
    client: BenchClient, control: Control | None, deployment: Deployment, maker: RequestMaker,
    phase: Phase, config: BenchConfig, rng: np.random.Generator, service: dict[str, float],
    tick: Callable[[float], None],
) -> PhaseResult:
    pids = deployment.pids()
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    machine_before = machine_busy_seconds()
    if control is not None and phase.probes:
        control.ask(ProbeStart(config.probe_interval_ms))
    records, start, drain_s = run_phase(client, maker, phase, config, rng, tick)
    executor_waits: list[float] | None = None
    handoffs: dict[str, float] | None = None
    if control is not None:
        if phase.probes:
            reply = control.ask(ProbeStop())
            assert isinstance(reply, ProbeWaits)
            executor_waits = reply.waits_s
        taken = control.ask(TakeHandoffs())
        assert isinstance(taken, Handoffs)
        handoffs = taken.at
    cpu_s = {name: _minus(cpu_seconds(pid), cpu_before[name]) for name, pid in pids.items()}
    cpu_s[OTHERS] = _others(_minus(machine_busy_seconds(), machine_before), cpu_s)
    return phase_result(phase, config, records, start, drain_s, service, handoffs,
                        executor_waits, cpu_s)


def _others(machine: float | None, cpu_s: dict[str, float | None]) -> float | None:
    """The machine's busy CPU seconds that none of this mode's processes used."""
    if machine is None or any(v is None for v in cpu_s.values()):
        return None
    return round(max(0.0, machine - sum(v or 0.0 for v in cpu_s.values())), 3)


def _minus(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else round(after - before, 3)


def phase_result(
    phase: Phase, config: BenchConfig, records: list[Record], start: float, drain_s: float,
    service: dict[str, float], handoffs: dict[str, float] | None,
    executor_waits: list[float] | None, cpu_s: dict[str, float | None],
) -> PhaseResult:
    """Every figure of one phase, from its records."""
    done = [r for r in records if r.finished is not None]
    text = [r for r in done if r.kind == "text" and r.error is None]
    images = [r for r in done if r.kind == "image" and r.error is None]
    probes = [r for r in done if r.kind == "probe" and r.error == PROBE_REPLY]
    measures_images = phase.image_rate > 0 or phase.loop_source is not None
    return PhaseResult(
        name=phase.name, kind=phase.kind, seconds=phase.seconds, drain_s=round(drain_s, 3),
        offered_text_per_s=phase.text_rate,
        offered_images_per_s=phase.image_rate * config.images_per_request,
        image_size=phase.loop_source.name if phase.loop_source else None,
        requests=dict(Counter(r.kind for r in done)),
        images=sum(r.images for r in images),
        unfinished=len(records) - len(done),
        errors=_errors(done),
        images_per_s=_images_per_s(images) if measures_images else None,
        text=latency(_latencies(text)),
        image=latency(_latencies(images)),
        text_engine_hold=latency(_engine_hold(text, service)),
        image_engine_hold=latency(_engine_hold(images, service)),
        text_handoff=None if handoffs is None else latency(_handoff(text, handoffs)),
        image_handoff=None if handoffs is None else latency(_handoff(images, handoffs)),
        probe_roundtrip=latency(_latencies(probes)) if phase.probes else None,
        probe_executor_wait=None if executor_waits is None else latency(executor_waits),
        cpu_s=cpu_s,
    )


def _at(moment: float | None) -> float:
    assert moment is not None
    return moment


def _images_per_s(images: list[Record]) -> float:
    """Images finished per second from the first image's submit to the last one's reply: under
    a saturating load the server is busy all that time, so this is its throughput."""
    if len(images) < 2:
        return 0.0
    span = max(_at(r.finished) for r in images) - min(_at(r.submitted) for r in images)
    return round(sum(r.images for r in images) / span, 3)


def _latencies(records: list[Record]) -> list[float]:
    """Submit to terminal reply, in seconds."""
    return [_at(r.finished) - _at(r.submitted) for r in records]


def _errors(done: list[Record]) -> dict[str, int]:
    """Failed requests by error code; a probe counts when it got anything but its refusal."""
    errors: Counter[str] = Counter()
    for record in done:
        if record.kind == "probe":
            if record.error != PROBE_REPLY:
                errors[f"probe:{record.error or 'answered'}"] += 1
        elif record.error is not None:
            errors[record.error] += 1
    return dict(errors)


def _engine_hold(records: list[Record], service: dict[str, float]) -> list[float]:
    """First output's arrival minus submit, minus the idle engine's time for that class."""
    return [
        max(0.0, _at(r.first_output) - _at(r.submitted) - service[r.request_class] / 1000)
        for r in records if r.request_class in service
    ]


def _handoff(records: list[Record], handoffs: dict[str, float]) -> list[float]:
    """Submit to the in-process server's send to the engine."""
    return [handoffs[r.request_id] - _at(r.submitted) for r in records if r.request_id in handoffs]


# ---------------------------------------------------------------- summaries


def summarize(
    mode: str, pids: dict[str, int], service: dict[str, float], phases: list[PhaseResult]
) -> ModeResult:
    """The headline figures of one mode, from its phases."""
    idle = next(p for p in phases if p.kind == "idle")
    loaded = [p for p in phases if p.kind == "load"][-1]  # the saturating load
    probe_idle = next(p for p in phases if p.kind == "probe-idle")
    offered = loaded.offered_images_per_s
    errors: Counter[str] = Counter()
    for phase in phases:
        errors.update(phase.errors)
    return ModeResult(
        mode=mode, design=DESIGNS[mode], processes=pids,
        engine_service_ms={name: round(ms, 3) for name, ms in service.items()},
        text=TextResult(
            idle=idle.text, loaded=loaded.text,
            ratio_p50=_ratio(loaded.text.p50_ms, idle.text.p50_ms),
            ratio_p99=_ratio(loaded.text.p99_ms, idle.text.p99_ms),
        ),
        engine_hold=EngineHoldResult(
            text_idle=idle.text_engine_hold, text_loaded=loaded.text_engine_hold,
            image_loaded=loaded.image_engine_hold, exact_text_idle=idle.text_handoff,
            exact_text_loaded=loaded.text_handoff,
            exact_image_loaded=loaded.image_handoff,
        ),
        image=ImageResult(
            latency=loaded.image, images_per_s=loaded.images_per_s, offered_images_per_s=offered,
            saturated=(None if loaded.images_per_s is None
                       else loaded.images_per_s < SATURATED_BELOW * offered),
        ),
        probe=[_probe(phase, probe_idle) for phase in phases if phase.kind == "probe"],
        cpu=_cpu(idle, loaded, [p for p in phases if p.kind in ("idle", "load")]),
        errors=dict(errors),
        phases=phases,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _probe(phase: PhaseResult, probe_idle: PhaseResult) -> ProbeResult:
    assert phase.probe_roundtrip is not None and probe_idle.probe_roundtrip is not None
    baseline = probe_idle.probe_roundtrip.p50_ms
    roundtrip = phase.probe_roundtrip
    if baseline is None or roundtrip.n == 0:
        wait = Latency(n=0)
    else:  # the percentiles of max(0, sample - baseline) are those of the samples, shifted
        wait = Latency(n=roundtrip.n, **{
            name: max(0.0, getattr(roundtrip, name) - baseline)
            for name in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "max_ms")
        })
    return ProbeResult(
        image_size=phase.image_size or "", wait=wait, roundtrip=roundtrip,
        roundtrip_idle=probe_idle.probe_roundtrip, executor_wait=phase.probe_executor_wait,
        images_per_s=phase.images_per_s,
    )


def _cpu(idle: PhaseResult, loaded: PhaseResult, phases: list[PhaseResult]) -> CpuResult:
    text_request_s: dict[str, float | None] = {}
    image_s: dict[str, float | None] = {}
    per_request_s: dict[str, float | None] = {}
    for name, idle_cpu in idle.cpu_s.items():
        if name == OTHERS:
            continue
        per_text = _per(idle_cpu, idle.requests.get("text", 0))
        text_request_s[name] = per_text
        loaded_cpu = loaded.cpu_s.get(name)
        image_s[name] = None
        if loaded_cpu is not None and per_text is not None:
            rest = loaded_cpu - per_text * loaded.requests.get("text", 0)
            image_s[name] = _per(max(0.0, rest), loaded.images)
        spent = [p.cpu_s.get(name) for p in phases]
        requests = sum(p.requests.get("text", 0) + p.requests.get("image", 0) for p in phases)
        per_request_s[name] = (
            None if any(s is None for s in spent) else _per(sum(filter(None, spent)), requests)
        )
    others = loaded.cpu_s.get(OTHERS)
    return CpuResult(
        text_request_s=text_request_s, image_s=image_s, per_request_s=per_request_s,
        others_cores_loaded=(None if others is None
                             else round(others / (loaded.seconds + loaded.drain_s), 2)),
    )


def _per(seconds: float | None, count: int) -> float | None:
    return None if seconds is None or count == 0 else round(seconds / count, 5)


# ---------------------------------------------------------------- goals

TEXT_P99_RATIO = 1.2
PROBE_WAIT_P50_MS = 0.5
IMAGES_VS_SPLIT = 0.95


def judge_goals(modes: list[ModeResult]) -> list[Goal]:
    """Issue 5's goals, judged on this run's mmlane mode (and its split mode, for images/s)."""
    by_mode = {mode.mode: mode for mode in modes}
    mmlane, split = by_mode.get("mmlane"), by_mode.get("split")
    ratio = mmlane.text.ratio_p99 if mmlane else None
    probe_p50 = None
    if mmlane and mmlane.probe and all(p.wait.p50_ms is not None for p in mmlane.probe):
        probe_p50 = max(p.wait.p50_ms for p in mmlane.probe)  # type: ignore[type-var]
    images = None
    if mmlane and split and mmlane.image.images_per_s is not None and split.image.images_per_s:
        images = round(mmlane.image.images_per_s / split.image.images_per_s, 3)
    return [
        Goal(name="text_p99_ratio", target=TEXT_P99_RATIO, value=ratio,
             met=None if ratio is None else ratio <= TEXT_P99_RATIO,
             description="mmlane: text p99 under the saturating image load / idle text p99"),
        Goal(name="probe_wait_p50_ms", target=PROBE_WAIT_P50_MS, value=probe_p50,
             met=None if probe_p50 is None else probe_p50 < PROBE_WAIT_P50_MS,
             description="mmlane: tokenizer-probe wait p50, the worst probe image size"),
        Goal(name="images_per_s_vs_split", target=IMAGES_VS_SPLIT, value=images,
             met=None if images is None else images >= IMAGES_VS_SPLIT,
             description="images/s under the saturating load: mmlane / split"),
    ]
