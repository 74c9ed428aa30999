"""Seeds as an axis: one scenario over several trace seeds, each metric as mean and range.

Rationale
    One trace draw is one sample: the Jenga paper's Fig. 15 reports a single draw
    (2.05x), and ten seeds of the same setup spread over a wide band. A figure should
    say which band, so every metric (and every ratio against a baseline) is reported as
    its mean and its min-max over seeds, computed per seed before averaging.

Approach
    `run_seeds` re-runs `scenarios.run_scenario` with ``seed`` replaced and keeps every
    `Summary`; `Spread` is (mean, lo, hi) of one metric; `ratios` divides each seed's
    metric by the baseline's on the *same* trace. `parse_seeds` reads ``0-9`` or
    ``0,3,7``.

Limitations
    Seeds run one after another (two cores here); ten seeds cost ten runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from jenga.sim.metrics import Summary, summarize
from jenga.sim.protocol import SimError
from jenga.sim.scenarios import Scenario, run_scenario

METRICS = (
    "avg_decode_batch",
    "hit_rate",
    "waste",
    "sim_time_s",
    "steps",
    "preemptions",
    "self_share_min",
    "self_share_max",
    "requests_per_s",
)
LOWER_IS_BETTER = frozenset({"sim_time_s", "steps", "waste", "preemptions"})

PerSeed = dict[int, dict[str, Summary]]  # seed -> allocator -> summary


@dataclass(frozen=True)
class Spread:
    """Mean and range of one metric over seeds."""

    mean: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise SimError("no values to summarize")
        return cls(statistics.fmean(values), min(values), max(values), len(values))

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "min": self.lo, "max": self.hi, "n": self.n}


def parse_seeds(text: str) -> list[int]:
    """``"0-9"`` -> 0..9, ``"0,3,7"`` -> [0, 3, 7] (mixed forms allowed)."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            if not part.strip():
                continue
            lo, sep, hi = part.partition("-")
            seeds.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError as exc:
        raise SimError(f"--seeds expects e.g. 0-9 or 0,3,7, got {text!r}") from exc
    if not seeds or len(set(seeds)) != len(seeds):
        raise SimError(f"--seeds must name distinct seeds, got {text!r}")
    return seeds


def run_seeds(
    scenario: Scenario,
    seeds: list[int],
    on_step: Callable[[str, int, int], None] | None = None,
) -> tuple[PerSeed, dict[str, str]]:
    """Every allocator's summary for every seed; allocators that could not run, and why."""
    per_seed: PerSeed = {}
    not_run: dict[str, str] = {}
    for seed in seeds:
        results, missing = run_scenario(replace(scenario, seed=seed), on_step=on_step)
        per_seed[seed] = {r.allocator: summarize(r) for r in results}
        not_run.update({name: f"seed {seed}: {why}" for name, why in missing.items()})
    return per_seed, not_run


def allocators_of(per_seed: PerSeed) -> list[str]:
    """Allocators that ran under every seed, in run order."""
    runs = list(per_seed.values())
    return [name for name in runs[0] if all(name in r for r in runs)] if runs else []


def spreads(per_seed: PerSeed) -> dict[str, dict[str, Spread]]:
    """allocator -> metric -> Spread over seeds."""
    out: dict[str, dict[str, Spread]] = {}
    for name in allocators_of(per_seed):
        out[name] = {
            m: Spread.of([float(getattr(r[name], m)) for r in per_seed.values()]) for m in METRICS
        }
    return out


def ratios(per_seed: PerSeed, metric: str, baseline: str) -> dict[str, Spread]:
    """allocator -> Spread of (its metric / the baseline's) per seed, inverted for metrics
    where lower is better (so > 1 always means better than the baseline). Seeds where the
    baseline's metric is 0 are left out."""
    out: dict[str, Spread] = {}
    invert = metric in LOWER_IS_BETTER
    for name in allocators_of(per_seed):
        values = []
        for runs in per_seed.values():
            if baseline not in runs:
                continue
            mine, base = getattr(runs[name], metric), getattr(runs[baseline], metric)
            num, den = (base, mine) if invert else (mine, base)
            if den:
                values.append(num / den)
        if values:
            out[name] = Spread.of(values)
    return out
