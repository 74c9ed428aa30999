"""Output of a comparison: a rich table, a JSON document, PNG plots.

Rationale
    The same numbers must reach a terminal reader, a script and a figure, so all three
    are rendered from the `Summary` rows and the run timelines, never recomputed.

Approach
    `table` renders one row per allocator plus ratios against uniform paging; `to_json`
    writes summaries, the scenario and (optionally) the timelines; `plot` writes
    ``memory_<alloc>.png`` (needed / waste / cached / free over time, like the paper's
    Fig. 16), ``decode_batch.png`` (Fig. 15) and ``hit_rate.png`` (Fig. 17). matplotlib
    is imported only by `plot`, with the Agg backend.

Limitations
    Timelines with many steps are plotted as they are (no downsampling).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from jenga.sim.engine import RunResult
from jenga.sim.metrics import GiB, Summary
from jenga.sim.scenarios import Scenario


def table(scenario: Scenario, summaries: list[Summary], missing: dict[str, str]) -> Table:
    t = Table(
        title=f"{scenario.name}: {scenario.model} on {scenario.gpu}, {scenario.workload}",
        box=box.SIMPLE_HEAD,
    )
    for col in (
        "allocator",
        "steps",
        "sim s",
        "avg decode batch",
        "max batch",
        "waste %",
        "hit %",
        "preempt",
        "peak live GiB",
        "committed GiB",
        "alloc µs avg/p50/p99/max",
    ):
        t.add_column(col, justify="left" if col == "allocator" else "right", no_wrap=True)
    for s in summaries:
        t.add_row(
            s.allocator,
            str(s.steps),
            f"{s.sim_time_s:.1f}",
            f"{s.avg_decode_batch:.2f}",
            str(s.max_decode_batch),
            f"{100 * s.waste:.2f}",
            f"{100 * s.hit_rate:.1f}",
            str(s.preemptions),
            f"{s.peak_live_gib:.1f}",
            f"{s.mean_committed_gib:.1f}",
            f"{s.alloc_us_avg:.0f}/{s.alloc_us_p50:.0f}/{s.alloc_us_p99:.0f}/{s.alloc_us_max:.0f}",
        )
    for name in missing:
        t.add_row(name, *(["n/a"] * 10))
    return t


def ratios(summaries: list[Summary], baseline: str = "uniform") -> dict[str, dict[str, float]]:
    """Per allocator: decode batch, hit rate and sim time relative to ``baseline``."""
    base = next((s for s in summaries if s.allocator == baseline), None)
    if base is None:
        return {}
    out = {}
    for s in summaries:
        out[s.allocator] = {
            "decode_batch_x": s.avg_decode_batch / base.avg_decode_batch
            if base.avg_decode_batch
            else 0.0,
            "hit_rate_x": s.hit_rate / base.hit_rate if base.hit_rate else 0.0,
            "speedup_x": base.sim_time_s / s.sim_time_s if s.sim_time_s else 0.0,
        }
    return out


def print_report(
    console: Console, scenario: Scenario, summaries: list[Summary], missing: dict[str, str]
) -> None:
    console.print(table(scenario, summaries, missing))
    for name, r in ratios(summaries).items():
        if name != "uniform":
            hit = f"x{r['hit_rate_x']:.2f}" if r["hit_rate_x"] else "n/a"
            console.print(
                f"  {name:>16} vs uniform: decode batch x{r['decode_batch_x']:.2f}, "
                f"prefix hit rate {hit}, finishes x{r['speedup_x']:.2f} sooner"
            )
    for name, reason in missing.items():
        console.print(f"[yellow]{name} has no result: {reason}")


def to_json(
    scenario: Scenario,
    summaries: list[Summary],
    results: list[RunResult],
    missing: dict[str, str],
    with_timelines: bool = False,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "scenario": {k: v for k, v in asdict(scenario).items() if k != "engine"},
        "engine": asdict(scenario.engine),
        "summaries": [s.as_dict() for s in summaries],
        "ratios_vs_uniform": ratios(summaries),
        "not_run": missing,
    }
    if with_timelines:
        doc["timelines"] = {r.allocator: r.timeline for r in results}
    return doc


def write_json(doc: dict[str, Any], path: str) -> None:
    text = json.dumps(doc, indent=2, default=str)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


def _memory_plot(plt: Any, result: RunResult, path: Path) -> None:
    tl = result.timeline
    t = tl["time_s"]
    needed = [n / GiB for n in tl["needed_bytes"]]
    waste = [
        max(0.0, (lv - n)) / GiB for lv, n in zip(tl["live_bytes"], tl["needed_bytes"], strict=True)
    ]
    cached = [c / GiB for c in tl["cached_bytes"]]
    cap = result.capacity_bytes / GiB
    free = [max(0.0, cap - a - b - c) for a, b, c in zip(needed, waste, cached, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.stackplot(
        t,
        needed,
        waste,
        cached,
        free,
        labels=["needed", "waste", "cached", "free"],
        colors=["#4c72b0", "#dd8452", "#8c8c8c", "#e8e8e8"],
    )
    committed = [c / GiB for c in tl["committed_bytes"]]
    ax.plot(t, committed, color="black", lw=1, ls="--", label="committed")
    ax.set(
        xlabel="simulated time (s)", ylabel="KV memory (GiB)", title=f"memory: {result.allocator}"
    )
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(results: list[RunResult], summaries: list[Summary], plot_dir: str) -> list[Path]:
    """Write the PNGs into ``plot_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        path = out / f"memory_{r.allocator}.png"
        _memory_plot(plt, r, path)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        ax.plot(r.timeline["time_s"], r.timeline["decode_batch"], lw=1, label=r.allocator)
    ax.set(xlabel="simulated time (s)", ylabel="decode batch size", title="decode batch size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "decode_batch.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([s.allocator for s in summaries], [100 * s.hit_rate for s in summaries])
    ax.set(ylabel="prefix hit rate (%)", title="prefix hit rate")
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    paths.append(out / "hit_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
