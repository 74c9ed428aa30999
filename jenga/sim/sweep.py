"""Sweeps: one scenario at several values of one knob, over one or more trace seeds.

Rationale
    Prefix-cache benefits show when the cache is too small for every shared prefix: the
    allocator that keeps more prefixes per byte hits more. One run at one point hides the
    shape. The Jenga paper's Fig. 17 sweeps the *number of articles* at a fixed memory;
    a KV-size sweep asks the same question from the other side. Either is a sweep over
    one knob, and each point is a set of seeds (`jenga.sim.seeds`).

Approach
    ``--sweep KEY=V1,V2,...``: ``KEY`` is ``kv_gib`` or a workload parameter
    (``articles`` is short for ``num_articles``). `run_sweep` returns, per value, every
    allocator's summary per seed; `sweep_table` prints one metric's mean and range per
    allocator and, for the scenario's headline baseline, the best Jenga row's ratio;
    `plot_sweep` draws means with min-max bars, one marker style per allocator. A sweep
    reports `SWEEP_METRICS`: the prefix hit rate and the throughput (requests per
    simulated second), the two panels of the paper's Fig. 17.

Limitations
    Points and seeds run one after another (two cores here); a large sweep takes a while.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich import box
from rich.table import Table

from jenga.sim import seeds
from jenga.sim.protocol import SimError
from jenga.sim.scenarios import JENGA_NAMES, Scenario

Sweep = dict[float, tuple[seeds.PerSeed, dict[str, str]]]  # value -> (per seed, not run)
ALIASES = {"articles": "num_articles", "kv": "kv_gib"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
SWEEP_METRICS = ("hit_rate", "requests_per_s")  # Fig. 17a and 17b
LABELS = {"hit_rate": "prefix hit rate (%)", "requests_per_s": "throughput (requests / hour)"}
SCALES = {"hit_rate": 100.0, "waste": 100.0, "requests_per_s": 3600.0}  # as LABELS says


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``"articles=1,2,4"`` -> ("num_articles", [1, 2, 4])."""
    key, sep, rest = text.partition("=")
    try:
        values = [float(x) for x in rest.split(",") if x.strip()]
    except ValueError as exc:
        raise SimError(f"--sweep expects KEY=V1,V2,..., got {text!r}") from exc
    if not sep or not key.strip() or not values or not all(math.isfinite(v) for v in values):
        raise SimError(f"--sweep expects KEY=V1,V2,... (finite numbers), got {text!r}")
    return ALIASES.get(key.strip(), key.strip().replace("-", "_")), values


def at_point(scenario: Scenario, key: str, value: float) -> Scenario:
    """``scenario`` with ``key`` (kv_gib or a workload parameter) set to ``value``."""
    if key == "kv_gib":
        return replace(scenario, kv_gib=value)
    params = dict(scenario.workload_params)
    params[key] = int(value) if value == int(value) else value
    return replace(scenario, workload_params=params)


def run_sweep(
    scenario: Scenario,
    key: str,
    values: list[float],
    seed_list: list[int] | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
) -> Sweep:
    out: Sweep = {}
    for value in values:
        point = at_point(scenario, key, value)
        out[value] = seeds.run_seeds(point, seed_list or [scenario.seed], on_step)
    return out


def _names(scenario: Scenario, sweep: Sweep) -> list[str]:
    ran = {name for per_seed, _ in sweep.values() for runs in per_seed.values() for name in runs}
    return [n for n in scenario.allocators if n in ran]


def _cell(per_seed: seeds.PerSeed, name: str, metric: str) -> str:
    values = [getattr(runs[name], metric) for runs in per_seed.values() if name in runs]
    if not values:
        return "does not fit"
    s = seeds.Spread.of([float(v) for v in values])
    scale = SCALES.get(metric, 1.0)
    if s.n == 1:
        return f"{scale * s.mean:.1f}"
    return f"{scale * s.mean:.1f} ({scale * s.lo:.1f}-{scale * s.hi:.1f})"


def best_jenga_ratio(
    per_seed: seeds.PerSeed, metric: str, baseline: str
) -> tuple[str, seeds.Spread] | None:
    """The Jenga row with the best mean ratio against ``baseline`` on ``metric``."""
    found = seeds.ratios(per_seed, metric, baseline)
    rows = [(n, s) for n, s in found.items() if n in JENGA_NAMES and n != "max_page"]
    return max(rows, key=lambda row: row[1].mean) if rows else None


def sweep_table(scenario: Scenario, key: str, sweep: Sweep, metric: str = "hit_rate") -> Table:
    names = _names(scenario, sweep)
    baseline = scenario.headline[1]
    n_seeds = len(next(iter(sweep.values()))[0])
    t = Table(
        title=f"{scenario.label}: {LABELS.get(metric, metric)} by {key} "
        f"(mean (min-max) over {n_seeds} seed(s))",
        box=box.SIMPLE_HEAD,
    )
    t.add_column(key, justify="right", no_wrap=True)
    for name in names:
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column(f"best Jenga / {baseline}", justify="right", no_wrap=True)
    for value, (per_seed, _) in sweep.items():
        best = best_jenga_ratio(per_seed, metric, baseline)
        ratio = (
            "n/a"
            if best is None
            else f"{best[1].mean:.2f}x ({best[1].lo:.2f}-{best[1].hi:.2f}) {best[0]}"
        )
        t.add_row(f"{value:g}", *(_cell(per_seed, n, metric) for n in names), ratio)
    return t


def sweep_json(key: str, sweep: Sweep, metric: str, baseline: str) -> list[dict[str, object]]:
    """One point per value: spreads, ``ratios`` on ``metric`` against ``baseline``,
    ``throughput_ratios`` (requests per second against the baseline), every seed."""
    points: list[dict[str, object]] = []
    for value, (per_seed, not_run) in sweep.items():
        points.append(
            {
                "key": key,
                "value": value,
                "spreads": {
                    n: {m: s.as_dict() for m, s in ms.items()}
                    for n, ms in seeds.spreads(per_seed).items()
                },
                "ratios": {
                    n: s.as_dict() for n, s in seeds.ratios(per_seed, metric, baseline).items()
                },
                "throughput_ratios": {
                    n: s.as_dict()
                    for n, s in seeds.ratios(per_seed, "requests_per_s", baseline).items()
                },
                "per_seed": {
                    seed: {n: s.as_dict() for n, s in runs.items()}
                    for seed, runs in per_seed.items()
                },
                "not_run": not_run,
            }
        )
    return points


def plot_sweep(
    scenario: Scenario, key: str, sweep: Sweep, plot_dir: str, metric: str = "hit_rate"
) -> Path:
    """Means with min-max bars per allocator; series are dodged sideways and marked
    differently so equal values stay visible; a log2 x axis for doubling sweeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    scale = SCALES.get(metric, 1.0)
    values = list(sweep)
    log_x = min(values) > 0 and max(values) >= 8 * min(values)
    names = _names(scenario, sweep)
    for i, name in enumerate(names):
        dodge = 2 ** (0.04 * (i - (len(names) - 1) / 2)) if log_x else 1.0
        xs, mid, low, high = [], [], [], []
        for value, (per_seed, _) in sweep.items():
            got = [float(getattr(r[name], metric)) for r in per_seed.values() if name in r]
            if got:
                s = seeds.Spread.of(got)
                xs.append(value * dodge)
                mid.append(scale * s.mean)
                low.append(scale * (s.mean - s.lo))
                high.append(scale * (s.hi - s.mean))
        ax.errorbar(xs, mid, yerr=[low, high], marker=MARKERS[i % len(MARKERS)], capsize=3,
                    label=name, alpha=0.85, ms=6 - 0.5 * (i % 3))  # fmt: skip
    if log_x:
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [f"{v:g}" for v in values])
    label = LABELS.get(metric, metric)
    ax.set(xlabel=key, ylabel=label, title=scenario.label)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{metric}_vs_{key}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
