"""vLLM's processes that outlive a killed engine role, ended when the role starts again.

vLLM runs its engine core (and, across GPUs, its workers) as processes of their own. When the
engine role is killed (kill -9, the OOM killer), they live on, orphaned, holding the memory and
the devices that the role's restart needs. `mmlane serve` kills a dead role's whole process
group, but supervisord and most other supervisors only know the role. So the role writes down
the processes vLLM started (pid and start time, in RUN_DIR/vllm-NAME.pids) once vLLM is up; at
its next start it first kills those of them that still run, and a clean stop removes the file.
A pid is only killed while its start time is the recorded one, so a reused pid is left alone.
(vLLM's processes started by a role killed before vLLM was up are not written down.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psutil  # a dependency of vLLM's

log = logging.getLogger(__name__)

WAIT_S = 30.0
"""How long the killed processes may take to go."""


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


def write_down(path: Path) -> None:
    """List this process's descendants (vLLM's, once it is up) in `path`."""
    children = psutil.Process().children(recursive=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps([[p.pid, p.create_time()] for p in children]))
    partial.replace(path)
