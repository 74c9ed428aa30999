"""Timing and summaries shared by vmm-bench and every script under benchmarks/.

Rationale
---------
Each benchmark times a call many times and reports avg / p50 / p99 / max. Written once
per script, the loops drifted (nanoseconds here, seconds there, garbage collection on or
off) and so did the percentiles (nearest rank rounded down, rounded, interpolated), so
two tables could disagree on what "p99" means. One module fixes both.

Approach
--------
* `Summary.of(samples)`: n, avg, p50, p99 and max; percentiles interpolate linearly
  between order statistics (numpy's default method), so p50 of an even count is the mean
  of the middle two, as `statistics.median` gives. `Summary.scaled` converts units.
* `time_calls(fn, n)`: `fn(i)` for i in range(n), each timed with `time.perf_counter_ns`,
  garbage collection paused (`gc_paused`, which collects once after). `timed_calls` /
  `timed_once` also return what the calls returned, for loops that thread their outputs.

The clock's own cost (~50 ns per read pair) is inside every sample, as it is in the raw
baselines timed the same way.

Limitations
-----------
Imports only the standard library, so an interpreter without this package (the vLLM
replay of benchmarks/jenga_bench.py) can load the file by path. Wall-clock samples on a
shared machine are noisy; medians resist that, p99 and max do not.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

clock = time.perf_counter_ns


@dataclass(frozen=True)
class Summary:
    """avg / p50 / p99 / max of `n` samples, in the samples' unit."""

    n: int
    avg: float
    p50: float
    p99: float
    max: float

    @staticmethod
    def of(samples: Sequence[float]) -> Summary:
        if not samples:
            raise ValueError("a summary needs at least one sample")
        ordered = sorted(float(s) for s in samples)
        return Summary(
            n=len(ordered),
            avg=sum(ordered) / len(ordered),
            p50=percentile(ordered, 50.0),
            p99=percentile(ordered, 99.0),
            max=ordered[-1],
        )

    def scaled(self, factor: float) -> Summary:
        """The same summary with every figure multiplied by `factor` (a unit change)."""
        return Summary(self.n, self.avg * factor, self.p50 * factor, self.p99 * factor,
                       self.max * factor)  # fmt: skip


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated `q`-th percentile (0..100) of sorted samples (numpy's default)."""
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while timing; a full collection after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


def time_calls(fn: Callable[[int], Any], calls: int) -> list[int]:
    """Nanoseconds of each of `calls` calls `fn(0)`, `fn(1)`, ..., garbage collection paused."""
    with gc_paused():
        times, _ = timed_calls(fn, range(calls))
    return times


def timed_calls(fn: Callable[[Any], Any], args: Iterable[Any]) -> tuple[list[int], list[Any]]:
    """`fn(a)` for each of `args`: (nanoseconds of each call, what each returned)."""
    times, outs = [], []
    for a in args:
        t0 = clock()
        out = fn(a)
        times.append(clock() - t0)
        outs.append(out)
    return times, outs


def timed_once(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(nanoseconds of `fn()`, what it returned)."""
    t0 = clock()
    out = fn()
    return clock() - t0, out
