"""vLLM's processes and shared memory that outlive a killed engine role or engine core, ended
when the role stops or starts again.

vLLM runs its engine core (and, across GPUs, its workers) as processes of their own. When the
engine role is killed (kill -9, the OOM killer), they live on, orphaned, holding the memory and
the devices that the role's restart needs. `mmlane serve` kills a dead role's whole process
group, but supervisord and most other supervisors only know the role. So the role writes down
the processes vLLM starts (pid and start time, in RUN_DIR/vllm-NAME.pids): while vLLM starts, as
they appear (a role killed while vLLM loads leaves its engine core behind too), and once more
when vLLM is up. At its next start it first kills those of them that still run. A pid is only
killed while its start time is the recorded one, so a reused pid is left alone.

With them it writes down the files under /dev/shm that those processes map (vLLM's message
queues between its engine core and workers, 160-240 MB each on the CPU). Their creator unlinks
them when it stops, but a killed one cannot, and neither can the resource tracker of a process
group killed whole: each kill would leave a few hundred MB of memory taken. So once the
processes are gone, the files are unlinked too: at the role's next start, and at its stop
(whether vLLM shut down cleanly or its engine core had died), which then removes the list.
"""

from __future__ import annotations

import contextlib
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
SHM_DIR = Path("/dev/shm")


def pids_file(run_dir: Path, name: str) -> Path:
    return run_dir / f"vllm-{name}.pids"


def end_leftovers(path: Path) -> list[int]:
    """Kill the processes `path` lists that still run as the ones written down, wait for them
    to go, unlink the shared memory it lists, and remove the file; the pids killed."""
    try:
        recorded = json.loads(path.read_text())
        processes, shared = recorded["processes"], recorded["shm"]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError, KeyError):  # cut short by the kill, or of another version
        log.warning("ignoring the unreadable leftover list %s", path)
        path.unlink(missing_ok=True)
        return []
    alive = []
    for pid, started in processes:
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                shared += _mapped_shm(pid)  # also what it made since it was written down
                process.kill()
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
        except psutil.Error as exc:  # not ours to kill, say
            log.error("cannot end leftover vLLM process %d: %s", pid, exc)
    _, stuck = psutil.wait_procs(alive, timeout=WAIT_S)
    if alive:
        log.warning("ended %d vLLM process(es) left running: %s",
                    len(alive), ", ".join(str(p.pid) for p in alive))
    if stuck:
        log.error("vLLM process(es) %s did not end within %.0f s",
                  ", ".join(str(p.pid) for p in stuck), WAIT_S)
    else:
        _unlink(shared)
    path.unlink(missing_ok=True)
    return [p.pid for p in alive]


def _unlink(shared: list[str]) -> None:
    freed = []
    for name in set(shared):
        file = SHM_DIR / name
        with contextlib.suppress(OSError):
            size = file.stat().st_size
            file.unlink()
            freed.append(size)
    if freed:
        log.warning("unlinked %d shared-memory file(s) vLLM's ended processes left (%.0f MB)",
                    len(freed), sum(freed) / 1e6)


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
        written: dict[str, list] | None = None
        while not self._done.wait(WATCH_S):
            now = _descendants()
            if now != written:
                _write(self._path, now)
                written = now


def _descendants() -> dict[str, list]:
    """This process's descendants as (pid, start time), and the /dev/shm files they map."""
    processes, shared = [], set()
    for child in psutil.Process().children(recursive=True):
        try:
            processes.append((child.pid, child.create_time()))
            shared.update(_mapped_shm(child.pid))
        except psutil.NoSuchProcess:  # gone since it was listed: nothing to end
            pass
    return {"processes": processes, "shm": sorted(shared)}


def _mapped_shm(pid: int) -> list[str]:
    """The names of the files under SHM_DIR that process `pid` maps (not those unlinked)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    names = set()
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1]
        name = path.removeprefix(f"{SHM_DIR}/")
        if name != path and "/" not in name and not name.endswith(" (deleted)"):
            names.add(name)
    return sorted(names)


def _write(path: Path, found: dict[str, list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(found))
    partial.replace(path)  # whole or not at all, whenever the role is killed
