"""scripts/soak.py, briefly: a mixed load where every request gets the answer it should, and
samples of every role's RSS and fds (the ten-minute run's figures are in BENCHMARKS.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, processes, running

pytest.importorskip("matplotlib", reason="the soak's chart needs the 'bench' extra")


def test_a_short_soak_answers_every_request_as_expected(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", "--minutes", "0.4", "--sample-s", "2",
         "--clients", "3", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    samples = result["samples"]
    assert len(samples) >= 3
    roles = samples[-1]["roles"]
    assert {name.split("-")[0] for name in roles} >= {"frontend", "mm", "engine"}, roles
    assert all(role["rss_mib"] > 0 and role["fds"] > 0 for role in roles.values())
    actions = {outcome.split(":")[0] for outcome in result["outcomes"]}
    assert actions >= {"text", "new image", "repeated image", "bad input"}, actions
    assert not any("UNEXPECTED" in outcome for outcome in result["outcomes"])
    both = tmp_path / "both"  # the same run drawn twice, as a before and an after
    chart = subprocess.run(
        [sys.executable, "scripts/soak.py", "--chart-of", f"before={out}.json",
         "--chart-of", f"after={out}.json", "--out", str(both)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert chart.returncode == 0 and both.with_suffix(".png").stat().st_size > 0, chart.stderr


def test_sigterm_stops_the_roles_the_soak_started(tmp_path: Path) -> None:
    """The benchmark scripts start `mmlane serve`'s roles in sessions of their own
    (bench_common.serving), which no signal to the script's process group reaches: SIGTERM
    (`timeout`'s) must stop them on its way out, as Ctrl-C does."""
    soak = subprocess.Popen(
        [sys.executable, "scripts/soak.py", "--minutes", "5", "--sample-s", "1",
         "--out", str(tmp_path / "soak")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert soak.stdout is not None
        soak.stdout.readline()  # its first sample: the roles serve, the load runs
        sessions = {process.session for process in processes()
                    if process.parent == soak.pid and process.session == process.pid}
        assert len(sessions) == 3, sessions  # frontend, MM worker, engine
        soak.send_signal(signal.SIGTERM)
        _, stderr = soak.communicate(timeout=90)
    finally:
        soak.kill()
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert not [process for process in running() if process.session in sessions]
