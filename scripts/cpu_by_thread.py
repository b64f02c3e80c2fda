"""The CPU time each thread of a running server took while a command ran, per request.

    python scripts/cpu_by_thread.py --requests N -- COMMAND ...

Finds this machine's mmlane role processes (`mmlane.cli frontend|mm-worker|engine`) and
vLLM's (`VLLM::...`), reads every thread's user + system time from /proc before and after
COMMAND (a load: `vllm bench serve ...`, N requests), and prints each thread's difference
divided by N, then each process's sum. Python threads are named as `py-spy dump` names them
when py-spy is installed (else '?'); threads that took under 0.1 ms per request are left out.
Linux only; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

_ROLE = re.compile(rb"services\.cli\0(frontend|mm-worker|engine)\0")
_NAMED = re.compile(r"Thread (\d+) \([^)]*\): \"([^\"]*)\"")
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, required=True, help="requests COMMAND sends")
    parser.add_argument("command", nargs="+", help="the load to run (after --)")
    args = parser.parse_args()
    processes = _processes()
    names = _thread_names(processes)
    before = _cpu_ticks(processes)
    subprocess.run(args.command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spent = _cpu_ticks(processes)
    spent.subtract(before)
    per_request = _TICK_S * 1000 / args.requests
    by_process: Counter[str] = Counter()
    for (process, tid), ticks in sorted(spent.items()):
        by_process[process] += ticks
        if ticks * per_request >= 0.1:
            print(f"{process:18} {tid:8} {names.get(tid, '?'):32} "
                  f"{ticks * per_request:7.1f} ms/request")
    print(", ".join(f"{process} {ticks * per_request:.1f}"
                    for process, ticks in by_process.most_common()), "(ms per request)")


def _processes() -> dict[int, str]:
    """pid -> what it is: an mmlane role, or vLLM's name for its process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        role = _ROLE.search(cmdline)
        if role:
            found[int(entry.name)] = role[1].decode()
        elif comm.startswith("VLLM::"):
            found[int(entry.name)] = comm
    return found


def _thread_names(processes: dict[int, str]) -> dict[int, str]:
    if shutil.which("py-spy") is None:
        return {}
    names = {}
    for pid in processes:
        dump = subprocess.run(["py-spy", "dump", "-p", str(pid)], capture_output=True,
                              text=True, check=False).stdout
        names.update({int(tid): name for tid, name in _NAMED.findall(dump)})
    return names


def _cpu_ticks(processes: dict[int, str]) -> Counter[tuple[str, int]]:
    """Clock ticks (user + system) so far of each (process, thread)."""
    ticks: Counter[tuple[str, int]] = Counter()
    for pid, process in processes.items():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread or process ended
                continue
            ticks[(process, int(task.name))] = int(fields[11]) + int(fields[12])
    return ticks


if __name__ == "__main__":
    main()
