"""How much work one unit takes: bounded by time (`--max-unit-ms`), not by a fixed token count.

A unit is what the runner's thread does between two scheduling decisions (runner.py): while
it runs, a text request that has just arrived waits. So while other interactive work is held, a
unit is sized to take about `max_unit_ms`; while none is, about `idle_unit_ms` (default
IDLE_UNIT_MS, config.py), which costs less per token (a whole 1024x1024 prompt in a few forward
passes rather than eleven), but a text request that arrives during such a unit waits for all of
it: with whole vision passes and prompts as idle units (before passes had a lane of their own),
text requests arriving at random moments under a stream of 1 MP images took 8x longer at the
median than with small units (BENCHMARKS.md, "Units bounded by time"). So a unit takes the idle
budget only while text has been quiet: no text-only request but the unit's own has arrived for
QUIET_S. Under a stream of text, units stay small, and the first text request after a quiet
spell waits for one idle unit at most. An image prompt's units run on the bulk lane's thread,
which no text request waits for: they take the idle budget always (`idle_chunks`).

A unit may follow the moment's load only where that changes no bit. A prefill chunk's size
would: a chunk's shape changes its sums (and the prefix cache keys chunks by their size), so a
request's chunk size is fixed for the whole engine: `--prefill-chunk-tokens` (default
PREFILL_CHUNK_TOKENS, config.py), or, with 0, `derive_chunk_tokens` at startup, which takes the
largest power of two whose prefill, timed on the loaded model from position 0, fits the budget.
Derived, it follows the moment's timing (one VM derived 64 in one start and 128 in the next;
BENCHMARKS.md), and a request's tokens with it: so deriving is opt-in. What a unit varies is how
many whole chunks of one request it runs: the same chunks, the same bits, fewer steps; where the
runner's startup check allows, as one forward pass (runner.py), so a larger unit also costs less
per token. (Vision passes are no units: they run whole, on the vision lane's thread, beside the
units; vision_lane.py.)

The cost of a prefill token is estimated first by timing the loaded model at startup, then kept
current by an exponentially weighted moving average of the units that run on the runner's
thread: the device, its clocks and whatever else shares it set the real cost. The bulk lane's
units are left out: they run below the runner's thread, so their time is also what it took.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

MIN_CHUNK_TOKENS = 16
"""The smallest prefill chunk the calibration picks, even where it costs more than the budget:
below it, a unit is mostly overhead."""
MAX_CHUNK_TOKENS = 4096
"""The largest prefill chunk the calibration picks (and times)."""
TIMED_RUNS = 5
"""Runs of each thing the calibration times, after one to warm up: it keeps the fastest, the
cost without whatever else shares the device at that moment."""
EWMA_WEIGHT = 0.25
"""The weight of a unit's observed cost in the running estimate."""
QUIET_S = 5.0
"""How long after a text-only request's arrival other requests' units keep to `max_unit_ms`
while nothing interactive is held. Under text arriving at random at R/s, a text request comes
after such a quiet spell with odds e^(-5R): 8% at 0.5/s, under 1% at 1/s. With 1 s, sparse
text under a stream of 12 MP images waited twice as long at p99 (BENCHMARKS.md, "Idle units
while text is quiet")."""


def chunk_sizes(max_tokens: int) -> list[int]:
    """The chunk sizes the calibration times: powers of two from MIN_CHUNK_TOKENS up to
    MAX_CHUNK_TOKENS or `max_tokens`, whichever is smaller (at least MIN_CHUNK_TOKENS)."""
    top = max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, max_tokens))
    return [1 << power for power in range(MIN_CHUNK_TOKENS.bit_length() - 1,
                                          top.bit_length())]


def derive_chunk_tokens(seconds_for: Callable[[int], float], budget_s: float,
                        max_tokens: int) -> tuple[int, float]:
    """The largest of `chunk_sizes(max_tokens)` whose prefill takes at most `budget_s` by
    `seconds_for(size)` (timed in increasing order, stopping at the first that does not fit),
    and its measured seconds per token; the smallest size where none fits."""
    chosen, cost = 0, 0.0
    for size in chunk_sizes(max_tokens):
        seconds = seconds_for(size)
        if chosen and seconds > budget_s:
            break
        chosen, cost = size, seconds / size
        if seconds > budget_s:  # the smallest size, over budget: it stays, nothing larger fits
            break
    return chosen, cost


class UnitBudget:
    """The time a unit may take while other interactive work waits, and how much of each kind
    of work fits in it, by estimates kept current from the units that run."""

    def __init__(self, max_unit_s: float, *, idle_unit_s: float, prefill_token_s: float) -> None:
        if not (max_unit_s > 0 and idle_unit_s > 0):
            raise ValueError(f"unit budgets must be positive, got {max_unit_s}, {idle_unit_s}")
        self.max_unit_s = max_unit_s
        """Seconds a unit may take while other interactive work waits."""
        self.idle_unit_s = idle_unit_s
        """Seconds a unit may take while none does and text has been quiet."""
        self.prefill_token_s = prefill_token_s
        """Seconds per prefill token (EWMA)."""
        self._text_arrivals = (-math.inf, -math.inf)
        """When the latest two text-only requests arrived (`time.monotonic()`), latest last."""

    def text_arrived(self, at: float) -> None:
        """A text-only request arrived at `at` (`time.monotonic()`): other requests' units
        keep to `max_unit_s` until QUIET_S after it."""
        earlier, latest = self._text_arrivals
        if at >= latest:
            self._text_arrivals = (latest, at)
        elif at > earlier:
            self._text_arrivals = (at, latest)

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        self.prefill_token_s = _ewma(self.prefill_token_s, seconds / tokens)

    def unit_s(self, *, busy: bool, own_arrival: float | None = None) -> float:
        """The seconds a unit may take, while other interactive work waits (`busy`) or not.
        `own_arrival`: when the unit's request arrived, if it is a text-only one: a long text
        prompt that came alone prefills in idle units too."""
        earlier, latest = self._text_arrivals
        other = earlier if latest == own_arrival else latest
        if busy or time.monotonic() - other < QUIET_S:
            return self.max_unit_s
        return self.idle_unit_s

    def prefill_chunks(self, chunk_tokens: int, *, busy: bool,
                       own_arrival: float | None = None) -> int:
        """Whole chunks of `chunk_tokens` that fit the unit (`unit_s`); at least one."""
        return _fitting(self.unit_s(busy=busy, own_arrival=own_arrival),
                        chunk_tokens * self.prefill_token_s)


    def idle_chunks(self, chunk_tokens: int) -> int:
        """Whole chunks of `chunk_tokens` that fit an idle unit; at least one: the size of an
        image prompt's unit on the bulk lane, which no text request waits for (runner.py)."""
        return _fitting(self.idle_unit_s, chunk_tokens * self.prefill_token_s)


def _fitting(budget_s: float, each_s: float) -> int:
    if each_s <= 0:
        return 1 << 30  # nothing measured costs anything: everything fits
    return max(1, min(1 << 30, math.floor(budget_s / each_s)))


def _ewma(estimate: float, observed: float) -> float:
    return (1 - EWMA_WEIGHT) * estimate + EWMA_WEIGHT * observed


def synchronize(device: torch.device) -> None:
    """Wait for the kernels this thread queued on the device, which run asynchronously on CUDA:
    time what they took. Only this thread's current stream: the runner's thread does not wait
    for the vision lane's pass on its own stream, nor the lane for the runner's units."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def seconds_on(device: torch.device, run: Callable[[], object]) -> float:
    """How long `run` takes on `device`, its kernels included: the fastest of TIMED_RUNS runs
    after one to warm up."""
    run()
    return min(_once(device, run) for _ in range(TIMED_RUNS))


def _once(device: torch.device, run: Callable[[], object]) -> float:
    synchronize(device)
    started = time.monotonic()
    run()
    synchronize(device)
    return time.monotonic() - started
