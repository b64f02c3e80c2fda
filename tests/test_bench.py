"""`python -m bench`: its plumbing on a tiny workload, never its speed.

One real run of every mode (real processes, the tiny model, images of a few dozen pixels) checks
that each mode reports each figure, that the JSON file decodes as the documented schema, and that
the chart is written. The pieces with logic of their own (unique image bytes, Poisson arrivals,
settings) are checked directly, and each in-process design refuses bad requests as mmlane does
(it runs mmlane's own request checks and MM worker code).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from bench.cli import main
from bench.config import BenchConfig, ImageSpec, load_bench_config
from bench.images import ImageSource, jpeg_uri, make_image
from bench.inproc import MAX_IMAGES, InProcessConfig, InProcessServer
from bench.results import BenchResult, Latency, ModeResult
from bench.stats import cpu_seconds, percentile
from bench.throughput import ThroughputResult
from bench.workload import poisson_arrivals
from conftest import REPO, processes, running
from mmlane.client import Client, user_message
from mmlane.protocol.errors import FatalError, RequestError

pytest.importorskip("matplotlib", reason="the bench extra is not installed")
pytest.importorskip("tqdm", reason="the bench extra is not installed")

TINY = [
    "--idle-seconds", "1", "--phase-seconds", "1.5", "--image-rates", "4",
    "--image-sizes", "64,96x64", "--probe-sizes", "64", "--probe-loops", "2",
    "--probe-seconds", "1", "--probe-idle-seconds", "0.5", "--text-rate", "20",
    "--drain-timeout", "60", "--no-progress",
]


def python_m_bench(*argv: str, **popen: Any) -> subprocess.Popen[str]:
    """`python -m bench ARGV`, as a user runs it: from the checkout (bench/ is not installed)."""
    return subprocess.Popen([sys.executable, "-m", "bench", *argv], cwd=REPO, text=True, **popen)


@pytest.fixture(scope="module")
def bench_run(module_run_dir: Path) -> tuple[int, Path, Path]:
    out = module_run_dir / "out"
    out.mkdir()
    json_path, chart_path = out / "bench.json", out / "bench.png"
    bench = python_m_bench(*TINY, "--json", str(json_path), "--chart", str(chart_path),
                           "--run-dir", str(module_run_dir / "run"))
    try:
        return bench.wait(timeout=280), json_path, chart_path
    finally:
        bench.kill()


def _headline(mode: ModeResult) -> dict[str, object]:
    """Every figure the issue asks of each mode, by name."""
    figures: dict[str, object] = {
        "text idle": mode.text.idle, "text loaded": mode.text.loaded,
        "text ratio p50": mode.text.ratio_p50, "text ratio p99": mode.text.ratio_p99,
        "engine hold text idle": mode.engine_hold.text_idle,
        "engine hold text loaded": mode.engine_hold.text_loaded,
        "engine hold image loaded": mode.engine_hold.image_loaded,
        "image latency": mode.image.latency, "images/s": mode.image.images_per_s,
        "other processes' CPU": mode.cpu.others_cores_loaded,
    }
    for probe in mode.probe:
        figures[f"probe wait {probe.image_size}"] = probe.wait
        figures[f"probe roundtrip idle {probe.image_size}"] = probe.roundtrip_idle
    for process in mode.processes:
        figures[f"cpu per text request {process}"] = mode.cpu.text_request_s[process]
        figures[f"cpu per image {process}"] = mode.cpu.image_s[process]
        figures[f"cpu per request {process}"] = mode.cpu.per_request_s[process]
    return figures


class TestRun:
    def test_exits_zero(self, bench_run: tuple[int, Path, Path]) -> None:
        assert bench_run[0] == 0

    def test_json_decodes_as_the_documented_schema(
        self, bench_run: tuple[int, Path, Path]
    ) -> None:
        raw = json.loads(bench_run[1].read_bytes())
        result = msgspec.json.decode(bench_run[1].read_bytes(), type=BenchResult)
        assert result.schema == "mmlane-bench/1"
        assert set(raw) == set(BenchResult.__struct_fields__)
        for mode in raw["modes"]:
            assert set(mode) == set(ModeResult.__struct_fields__)
        assert result.machine.cpus >= 1 and len(result.machine.load_avg_start) == 3
        assert [goal.name for goal in result.goals] == [
            "text_p99_ratio", "probe_wait_p50_ms", "images_per_s_vs_split"
        ]
        assert all(goal.value is not None and goal.met is not None for goal in result.goals)

    def test_every_mode_reports_every_figure(self, bench_run: tuple[int, Path, Path]) -> None:
        result = msgspec.json.decode(bench_run[1].read_bytes(), type=BenchResult)
        assert [mode.mode for mode in result.modes] == ["shared", "split", "mmlane"]
        for mode in result.modes:
            assert mode.errors == {}, mode.mode
            assert set(mode.engine_service_ms) == {"text", "64", "96x64"}
            assert [probe.image_size for probe in mode.probe] == ["64"]
            missing = [
                name for name, value in _headline(mode).items()
                if value is None or (isinstance(value, Latency) and value.p99_ms is None)
            ]
            assert missing == [], f"{mode.mode} lacks {missing}"

    def test_exact_figures_only_where_the_bench_sees_inside(
        self, bench_run: tuple[int, Path, Path]
    ) -> None:
        result = msgspec.json.decode(bench_run[1].read_bytes(), type=BenchResult)
        for mode in result.modes:
            hold = mode.engine_hold
            exact = [hold.exact_text_idle, hold.exact_text_loaded, hold.exact_image_loaded,
                     *(probe.executor_wait for probe in mode.probe)]
            if mode.mode == "mmlane":
                assert exact == [None] * len(exact)
                assert set(mode.processes) == {"bench", "engine", "mm-worker", "frontend"}
            else:
                assert all(e is not None and e.n > 0 for e in exact), mode.mode
                assert set(mode.processes) == {"bench", "engine", "server"}

    def test_phases_run_in_order(self, bench_run: tuple[int, Path, Path]) -> None:
        result = msgspec.json.decode(bench_run[1].read_bytes(), type=BenchResult)
        for mode in result.modes:
            assert [p.name for p in mode.phases] == ["idle", "probe-idle", "probe-64", "load-4"]
            assert all(p.unfinished == 0 for p in mode.phases)

    def test_chart_is_a_png(self, bench_run: tuple[int, Path, Path]) -> None:
        image = Image.open(bench_run[2])
        assert image.format == "PNG" and image.width > 800


def test_throughput_run_reports_every_design(module_run_dir: Path) -> None:
    out = module_run_dir / "throughput"
    out.mkdir()
    json_path, chart_path = out / "throughput.json", out / "throughput.png"
    bench = python_m_bench("--throughput", "--throughput-size", "320x240",
                           "--throughput-images", "2", "--throughput-rounds", "2",
                           "--throughput-processes", "1,2", "--json", str(json_path),
                           "--chart", str(chart_path), "--run-dir", str(out / "run"),
                           stdout=subprocess.PIPE)
    try:
        stdout, _ = bench.communicate(timeout=280)
    finally:
        bench.kill()
    assert bench.returncode == 0
    result = msgspec.json.decode(json_path.read_bytes(), type=ThroughputResult)
    assert [(d.design, d.pixels) for d in result.designs] == [
        ("in-process, 1 thread", "float"), ("in-process, 1 thread", "uint8"),
        ("in-process, 2 threads", "float"), ("in-process, 2 threads", "uint8"),
        ("mm-worker, 1 proc", "uint8"), ("mm-worker, 2 procs", "uint8"),
    ]
    for design in result.designs:
        assert len(design.images_per_s) == 2 and all(r > 0 for r in design.images_per_s)
        assert design.median_images_per_s == pytest.approx(sum(design.images_per_s) / 2)
    assert (result.image_size, result.images, result.rounds) == ("320x240", 2, 2)
    assert chart_path.read_bytes().startswith(b"\x89PNG")
    assert "mm-worker, 2 procs" in stdout


def test_bench_video_prints_every_figure(module_run_dir: Path) -> None:
    """scripts/bench_video.py at tiny sizes (a 64x48 video of 1 s): each of its three parts
    prints its figures, for each design; their values are not looked at."""
    tiny = ["--size", "64x48", "--seconds", "1", "--rate", "10", "--keyframe-every", "4,250",
            "--videos", "2", "--processes", "2", "--decode-fps", "2", "--decode-repeats", "1",
            "--mm-processes", "2", "--image-size", "64x48", "--image-requests", "2",
            "--video-clients", "1"]
    run = subprocess.run([sys.executable, "scripts/bench_video.py", *tiny], cwd=REPO,
                         capture_output=True, text=True, timeout=280,
                         env={**os.environ, "TMPDIR": str(module_run_dir)})
    assert run.returncode == 0, run.stderr
    figure, ms = r" +\d+\.\d+", r" +\d+\.\d ms"
    for line in [
        rf"1 process \(the video lane's thread\){figure}{figure}",
        rf"pool of 2 processes{figure}{figure}",
        rf" +4 +2 +4{figure}{figure}{figure}",  # a keyframe every 4 frames, 2 fps: 4 kept
        rf" +250 +2 +4{figure}{figure}{figure}",
        rf"image latency, idle +p50{ms} +p90{ms} +p99{ms} +\(n=2\)",
        rf"image latency, 1 video clients +p50{ms} +p90{ms} +p99{ms} +\(n=2\)",
        r" +ratio of p50 \d+\.\d\dx, video requests completed meanwhile: \d+",
    ]:
        assert re.search(rf"^{line}$", run.stdout, re.MULTILINE), (line, run.stdout)


def _sessions_started_by(bench: subprocess.Popen[str], run_dir: Path) -> set[int]:
    """The sessions of the processes the bench started: each role runs in a session of its own
    (with its pool processes), and its command line names the run's folder."""
    marker = str(run_dir).encode()
    return {process.session for process in processes()
            if marker in process.cmdline and process.pid != bench.pid}


@pytest.mark.parametrize(("workload", "after_s"), [
    (["--throughput", "--throughput-size", "64x64", "--throughput-images", "400",
      "--throughput-processes", "2", "--throughput-rounds", "5"], 3.0),
    (TINY, 0.0),
], ids=["throughput, while measuring", "modes, while starting"])
def test_sigterm_stops_every_process_the_bench_started(
    workload: list[str], after_s: float, module_run_dir: Path
) -> None:
    run_dir = module_run_dir / f"sigterm-{len(workload)}"
    bench = python_m_bench(
        *workload, "--run-dir", str(run_dir), "--json", str(run_dir.with_suffix(".json")),
        "--chart", str(run_dir.with_suffix(".png")),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (sessions := _sessions_started_by(bench, run_dir)):
            assert bench.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(after_s)
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=90)
    finally:
        bench.kill()
    assert bench.returncode == 128 + signal.SIGTERM, stderr
    assert "bench: stopped by SIGTERM" in stderr
    assert not [process for process in running() if process.session in sessions]


def test_schema_flag_prints_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "BenchResult" in schema["$defs"] and "ModeResult" in schema["$defs"]


class TestImages:
    @pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
    def test_every_use_is_new_bytes_of_the_same_pixels(self, fmt: str) -> None:
        buffer = io.BytesIO()
        make_image(40, 30, seed=3).save(buffer, format=fmt)
        source = ImageSource("x", buffer.getvalue(), f"image/{fmt.lower()}")
        first, second = source.unique_bytes(), source.unique_bytes()
        assert first != second and source.unique
        pixels = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
                  for data in (buffer.getvalue(), first, second)]
        assert all((p == pixels[0]).all() for p in pixels)

    def test_data_uri_carries_the_marked_bytes(self) -> None:
        source = ImageSource.generated(ImageSpec(32, 24))
        decoded = base64.b64decode(source.data_uri().split(",", 1)[1])
        assert decoded != source.data and Image.open(io.BytesIO(decoded)).size == (32, 24)

    def test_other_formats_are_sent_as_they_are(self) -> None:
        source = ImageSource("x.gif", b"GIF89a....", "image/gif")
        assert not source.unique and source.unique_bytes() == b"GIF89a...."

    def test_generated_images_are_deterministic(self) -> None:
        a, b = make_image(64, 48, seed=1), make_image(64, 48, seed=1)
        assert a.tobytes() == b.tobytes() != make_image(64, 48, seed=2).tobytes()


class TestWorkload:
    def test_poisson_arrivals_have_the_rate(self) -> None:
        offsets = poisson_arrivals(50.0, 100.0, np.random.default_rng(0))
        assert 4500 < len(offsets) < 5500
        assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < 100

    def test_percentile_is_nearest_rank(self) -> None:
        values = list(range(1, 101))
        assert percentile(values, 50) == 51 and percentile(values, 99) == 99
        assert percentile([7.0], 99) == 7.0

    def test_cpu_seconds_of_this_process(self) -> None:
        assert cpu_seconds(1 << 30) is None
        seconds = cpu_seconds(__import__("os").getpid())
        assert seconds is None or seconds > 0


class TestSettings:
    @pytest.mark.parametrize(("values", "match"), [
        ({"modes": ["shared", "vllm"]}, "modes"),
        ({"image_rates": [1, 0]}, "image_rates"),
        ({"image_sizes": ["12y3"]}, "12y3"),
        ({"probe_loops": 0}, "probe_loops"),
        ({"image_files": ["/nonexistent.jpg"]}, "nonexistent"),
        ({"text_rat": 3}, "text_rat"),
    ])
    def test_bad_settings_are_refused_by_name(self, values: dict, match: str) -> None:
        with pytest.raises(FatalError, match=match):
            load_bench_config(values)

    def test_defaults_are_valid(self) -> None:
        assert load_bench_config({}) == BenchConfig()


def test_without_the_extra_it_fails_first_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["--modes", "split"]) == 1
    assert "pip install -e '.[bench]'" in capsys.readouterr().err


@pytest.fixture(scope="module", params=["shared", "split"])
def inproc_server(request: pytest.FixtureRequest, module_run_dir: Path) -> Iterator[str]:
    """A `python -m bench server` of each design, in this process, on ipc sockets; no engine:
    these requests never reach it."""
    run = module_run_dir / request.param
    run.mkdir()
    config = InProcessConfig(
        mode=request.param, client_endpoint=f"ipc://{run}/client", engine_endpoint=f"ipc://{run}/engine",
        output_endpoint=f"ipc://{run}/output", control_endpoint=f"ipc://{run}/control",
    )
    server, stop = InProcessServer(config), threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), name="bench-server")
    thread.start()
    yield config.client_endpoint
    stop.set()
    thread.join()
    server.close()


@pytest.mark.parametrize(("images", "text", "code", "match"), [
    ([jpeg_uri(8, 8)] * (MAX_IMAGES + 1), "x", "too_many_images", "too many images"),
    ([], "<|image_pad|>", "invalid_request", "reserved image token"),
    (["data:image/png;base64,AAAA"], "x", "invalid_image", "image 0"),
    (["file:///etc/hostname"], "x", "media_not_allowed", "image 0"),
], ids=["too-many-images", "forged-placeholder", "undecodable-image", "file-url"])
def test_inproc_designs_refuse_as_mmlane_does(
    inproc_server: str, images: list[str], text: str, code: str, match: str
) -> None:
    with Client(inproc_server, timeout_s=30) as client:
        with pytest.raises(RequestError, match=match) as exc:
            client.chat([user_message(text, images)], max_tokens=1)
    assert exc.value.code == code
