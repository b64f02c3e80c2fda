"""What a process's stats say of its memory, and the bound on the freed memory glibc keeps: run
in a child process of its own (its allocator's thresholds are changed, as a role's are)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import ctypes, json
from mmlane.common import memory

memory.keep_freed_memory()  # as the engine and the MM worker: heap blocks up to 32 MiB
memory.bound_freed_memory(memory.usage())  # little is free yet: nothing to give back
untrimmed = memory.counters["heap_trims"]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(1 << 20) for _ in range(320)]  # 320 MiB of 1 MiB blocks, touched
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
for number, block in enumerate(blocks):  # holes: every tenth block stays in use
    if number % 10:
        libc.free(block)
before = memory.usage()
memory.bound_freed_memory(before)
after = memory.usage()
print(json.dumps({"before": before, "after": after, "untrimmed": untrimmed,
                  "trims": memory.counters["heap_trims"]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_freed_memory_past_the_bound_goes_back_and_what_is_in_use_stays() -> None:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=60, check=True)
    seen = json.loads(run.stdout)
    before, after = seen["before"], seen["after"]
    mib = 1 << 20
    assert before["heap_free"] > 256 * mib  # the holes: more than KEPT_FREE_BYTES kept
    assert (seen["untrimmed"], seen["trims"]) == (0, 1)
    assert before["anonymous"] - after["anonymous"] > 200 * mib  # their pages given back
    assert abs(after["heap_in_use"] - before["heap_in_use"]) < 4 * mib  # the rest in use
    assert 0 < after["anonymous"] < after["resident"]
