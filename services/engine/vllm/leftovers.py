"""vLLM's processes that outlive a killed engine role, ended when the role starts again.

vLLM runs its engine core (and, across GPUs, its workers) as processes of their own. When the
engine role is killed (kill -9, the OOM killer), they live on, orphaned, holding the memory and
the devices that the role's restart needs. `mmlane serve` kills a dead role's whole process
group, but supervisord and most other supervisors only know the role. So the role writes down
the processes vLLM starts (pid and start time, in RUN_DIR/vllm-NAME.pids): while vLLM starts, as
they appear (a role killed while vLLM loads leaves its engine core behind too), and once more
when vLLM is up. At its next start it first kills those of them that still run, and a clean stop
removes the file. A pid is only killed while its start time is the recorded one, so a reused pid
is left alone.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import psutil  # a dependency of vLLM's

log = logging.getLogger(__name__)

WAIT_S = 30.0
"""How long the killed processes may take to go."""
WATCH_S = 0.5
"""How often the processes are written down again while vLLM starts."""


def pids_file(run_dir: Path, name: str) -> Path:
    return run_dir / f"vllm-{name}.pids"


def end_leftovers(path: Path) -> list[int]:
    """Kill the processes `path` lists that still run as the ones written down, wait for them
    to go, and remove the file; their pids."""
    try:
        recorded = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except ValueError:  # a file cut short by the kill: nothing reliable to end
        log.warning("ignoring the unreadable leftover list %s", path)
        path.unlink(missing_ok=True)
        return []
    alive = []
    for pid, started in recorded:
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                process.kill()
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
        except psutil.Error as exc:  # not ours to kill, say
            log.error("cannot end leftover vLLM process %d: %s", pid, exc)
    _, stuck = psutil.wait_procs(alive, timeout=WAIT_S)
    if alive:
        log.warning("ended %d vLLM process(es) a killed engine left running: %s",
                    len(alive), ", ".join(str(p.pid) for p in alive))
    if stuck:
        log.error("vLLM process(es) %s did not end within %.0f s",
                  ", ".join(str(p.pid) for p in stuck), WAIT_S)
    path.unlink(missing_ok=True)
    return [p.pid for p in alive]


class Watch:
    """While vLLM starts (a context manager around the start): writes this process's
    descendants down whenever they change, checked every WATCH_S seconds, and once more at the
    end."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-leftovers", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        _write(self._path, _descendants())

    def _run(self) -> None:
        written: list[tuple[int, float]] | None = None
        while not self._done.wait(WATCH_S):
            now = _descendants()
            if now != written:
                _write(self._path, now)
                written = now


def _descendants() -> list[tuple[int, float]]:
    """This process's descendants as (pid, start time)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append((child.pid, child.create_time()))
        except psutil.NoSuchProcess:  # gone since it was listed: nothing to end
            pass
    return found


def _write(path: Path, processes: list[tuple[int, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(processes))
    partial.replace(path)  # whole or not at all, whenever the role is killed
