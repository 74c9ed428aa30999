"""Summaries of a run: the numbers the paper's memory figures report.

Definitions (also in docs/simulator.md):
    waste            sum over steps of (live - needed) / sum over steps of live, where
                     live = bytes held for running requests and needed = bytes the
                     model's layer kinds must keep for them (`needs`). Byte-step
                     weighted, so long steady phases dominate as in the paper's Fig. 16.
    avg decode batch mean over steps that decode at least one request of the number of
                     requests decoding in that step (the paper's Fig. 15 quantity).
    hit rate         prefix-hit tokens / prompt tokens, over first admissions only
                     (recompute after preemption is not counted as a hit).
    requests per s   requests served / simulated seconds to finish the trace (the
                     throughput of the paper's Fig. 17b when every request arrives at 0).
    alloc cpu        measured wall time of all allocator calls in a step.
    self share       share of the KV held for running requests that full-attention
                     groups hold (min and max over steps holding >= 10 % of the KV
                     memory: the paper's used-self / (used-self + used-window), Fig. 16c/d).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from jenga.sim.engine import RunResult

GiB = float(1 << 30)


@dataclass(frozen=True)
class Summary:
    allocator: str
    steps: int
    sim_time_s: float
    avg_decode_batch: float
    max_decode_batch: int
    waste: float
    peak_live_gib: float
    mean_committed_gib: float
    capacity_gib: float
    hit_rate: float
    preemptions: int
    alloc_us_avg: float
    alloc_us_p50: float
    alloc_us_p99: float
    alloc_us_max: float
    self_share_min: float = 0.0
    self_share_max: float = 0.0
    requests_per_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def waste_fraction(result: RunResult) -> float:
    live = sum(result.timeline["live_bytes"])
    needed = sum(result.timeline["needed_bytes"])
    return max(0.0, (live - needed) / live) if live else 0.0


def avg_decode_batch(result: RunResult) -> float:
    batches = [b for b in result.timeline["decode_batch"] if b > 0]
    return statistics.fmean(batches) if batches else 0.0


SELF_SHARE_FLOOR = 0.10  # steps holding less than this share of the KV are start-up noise


def self_share_range(result: RunResult) -> tuple[float, float]:
    """(min, max) over busy steps of full-attention groups' share of live KV (0, 0 if none)."""
    full = [
        n for n, kind in result.group_kinds.items() if kind == "full" and n in result.group_live
    ]
    if not full or not result.group_live:
        return 0.0, 0.0
    live = result.timeline["live_bytes"]
    floor = SELF_SHARE_FLOOR * result.capacity_bytes
    shares = [
        sum(result.group_live[n][i] for n in full) / total
        for i, total in enumerate(live)
        if total > 0 and total >= floor
    ]
    return (min(shares), max(shares)) if shares else (0.0, 0.0)


def summarize(result: RunResult) -> Summary:
    tl = result.timeline
    cpu_us = sorted(1e6 * t for t in tl["alloc_cpu_s"])
    committed = tl["committed_bytes"]
    share_lo, share_hi = self_share_range(result)
    end_s = tl["time_s"][-1] if tl["time_s"] else 0.0
    return Summary(
        allocator=result.allocator,
        steps=len(tl["step"]),
        sim_time_s=end_s,
        avg_decode_batch=avg_decode_batch(result),
        max_decode_batch=int(max(tl["decode_batch"], default=0)),
        waste=waste_fraction(result),
        peak_live_gib=max(tl["live_bytes"], default=0) / GiB,
        mean_committed_gib=(statistics.fmean(committed) if committed else 0.0) / GiB,
        capacity_gib=result.capacity_bytes / GiB,
        hit_rate=result.hit_tokens / result.prompt_tokens if result.prompt_tokens else 0.0,
        preemptions=result.num_preemptions,
        alloc_us_avg=statistics.fmean(cpu_us) if cpu_us else 0.0,
        alloc_us_p50=_percentile(cpu_us, 0.50),
        alloc_us_p99=_percentile(cpu_us, 0.99),
        alloc_us_max=cpu_us[-1] if cpu_us else 0.0,
        self_share_min=share_lo,
        self_share_max=share_hi,
        requests_per_s=result.num_requests / end_s if end_s > 0 else 0.0,
    )
