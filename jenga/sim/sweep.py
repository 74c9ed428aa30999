"""Sweeps: one scenario at several KV cache sizes (the x axis of the paper's Fig. 17).

Rationale
    Prefix-cache benefits show when the cache is too small for every shared prefix: the
    allocator that keeps more prefixes per byte hits more. One run at one size hides the
    shape; a sweep shows where each allocator starts to thrash.

Approach
    `run_sweep` re-runs `scenarios.run_scenario` with ``kv_gib`` replaced, summarizes,
    and returns ``{kv_gib: [Summary, ...]}``; `sweep_table` and `plot_sweep` render it.

Limitations
    Sizes run one after another (two cores here); a large sweep takes a while.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich import box
from rich.table import Table

from jenga.sim.metrics import Summary, summarize
from jenga.sim.scenarios import Scenario, run_scenario

Sweep = dict[float, dict[str, Summary | None]]  # None: that allocator could not run


def run_sweep(
    scenario: Scenario,
    kv_gibs: list[float],
    on_step: Callable[[str, int, int], None] | None = None,
) -> Sweep:
    out: Sweep = {}
    for kv in kv_gibs:
        results, not_run = run_scenario(replace(scenario, kv_gib=kv), on_step=on_step)
        by_name: dict[str, Summary | None] = {r.allocator: summarize(r) for r in results}
        by_name.update({name: None for name in not_run})
        out[kv] = {name: by_name[name] for name in scenario.allocators if name in by_name}
    return out


def sweep_table(scenario: Scenario, sweep: Sweep) -> Table:
    names = list(next(iter(sweep.values())))
    t = Table(
        title=f"{scenario.name}: prefix hit rate % / avg decode batch by KV size",
        box=box.SIMPLE_HEAD,
    )
    t.add_column("KV GiB", justify="right", no_wrap=True, min_width=6)
    for name in names:
        t.add_column(name, justify="right", no_wrap=True)
    for kv, summaries in sweep.items():
        t.add_row(f"{kv:g}", *(_cell(summaries.get(name)) for name in names))
    return t


def _cell(s: Summary | None) -> str:
    return "does not fit" if s is None else f"{100 * s.hit_rate:.1f} / {s.avg_decode_batch:.2f}"


def sweep_json(sweep: Sweep) -> list[dict[str, object]]:
    return [
        {"kv_gib": kv, "summaries": {n: None if s is None else s.as_dict() for n, s in ss.items()}}
        for kv, ss in sweep.items()
    ]


def plot_sweep(sweep: Sweep, plot_dir: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(sweep)
    names = list(sweep[sizes[0]])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in names:
        points = [(kv, s.hit_rate) for kv in sizes if (s := sweep[kv].get(name)) is not None]
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=name)
    ax.set(xlabel="KV cache (GiB)", ylabel="prefix hit rate (%)", title="hit rate vs cache size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hit_rate_vs_kv.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
