"""Output of a comparison: a rich table, a JSON document, PNG plots.

Rationale
    The same numbers must reach a terminal reader, a script and a figure, so all three
    are rendered from the `Summary` rows and the run timelines, never recomputed. A
    reader should see at once whether Jenga wins: the scenario's headline metric gets
    one sentence under the table, naming every Jenga row's ratio to the baseline.

Approach
    `table` renders one row per allocator; `headline_line` compares every Jenga row
    with the scenario's baseline on its headline metric; ratios against uniform paging
    follow. `to_json` writes summaries, the scenario and (optionally) the timelines;
    `plot` writes, with engine steps on the x axis, ``memory_<alloc>.png`` (needed /
    waste / cached / free per step, like the paper's Fig. 16), ``decode_batch.png`` (one
    panel per allocator, so equal series stay visible; Fig. 15), ``hit_rate.png`` (only
    when some allocator hit; Fig. 17) and ``full_share.png`` (the full-attention share of
    held KV; Fig. 16c/d). `seeds_table` renders mean and range over seeds. matplotlib is
    imported only by `plot`, with the Agg backend.

Limitations
    Timelines with many steps are plotted as they are (no downsampling).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from jenga.sim.engine import RunResult
from jenga.sim.metrics import SELF_SHARE_FLOOR, GiB, Summary
from jenga.sim.scenarios import HEADLINE_METRICS, JENGA_NAMES, Scenario
from jenga.sim.seeds import LOWER_IS_BETTER, PerSeed, Spread, spreads
from jenga.sim.seeds import ratios as seed_ratios

TABLE_COLUMNS = (
    "allocator",
    "steps",
    "sim s",
    "avg batch",
    "max batch",
    "waste %",
    "hit %",
    "preempt",
    "peak GiB",
    "commit GiB",
    "full %",
    "alloc µs avg/p99",
)


def table(scenario: Scenario, summaries: list[Summary], missing: dict[str, str]) -> Table:
    """One row per allocator. "avg batch": mean decode batch; "full %": the full-attention
    groups' share of held KV (min-max over busy steps); "commit GiB": mean committed."""
    t = Table(
        title=f"{scenario.label}: {scenario.model} on {scenario.gpu}, {scenario.workload}",
        box=box.SIMPLE_HEAD,
    )
    for col in TABLE_COLUMNS:
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
            f"{100 * s.self_share_min:.0f}-{100 * s.self_share_max:.0f}"
            if s.self_share_max
            else "-",
            f"{s.alloc_us_avg:.0f}/{s.alloc_us_p99:.0f}",
        )
    for name in missing:
        t.add_row(name, *(["n/a"] * (len(TABLE_COLUMNS) - 1)))
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


SEED_COLUMNS = (
    ("avg_decode_batch", "avg decode batch", 1.0, 2),
    ("hit_rate", "hit %", 100.0, 1),
    ("waste", "waste %", 100.0, 2),
    ("sim_time_s", "sim s", 1.0, 1),
    ("steps", "steps", 1.0, 0),
    ("preemptions", "preempt", 1.0, 1),
)


def _spread_text(s: Spread, scale: float, digits: int) -> str:
    if s.n == 1:
        return f"{scale * s.mean:.{digits}f}"
    return f"{scale * s.mean:.{digits}f} ({scale * s.lo:.{digits}f}-{scale * s.hi:.{digits}f})"


def seeds_table(scenario: Scenario, per_seed: PerSeed) -> Table:
    """Mean (min-max) over seeds per allocator, and the per-seed ratio to the baseline."""
    metric, baseline = scenario.headline
    by_name = spreads(per_seed)
    ratio = seed_ratios(per_seed, metric, baseline)
    t = Table(
        title=f"{scenario.label}: {scenario.model} on {scenario.gpu}, {scenario.workload}, "
        f"mean (min-max) over {len(per_seed)} seeds",
        box=box.SIMPLE_HEAD,
    )
    t.add_column("allocator", no_wrap=True)
    for _, label, _, _ in SEED_COLUMNS:
        t.add_column(label, justify="right", no_wrap=True)
    t.add_column(f"{metric} / {baseline}", justify="right", no_wrap=True)
    for name, ms in by_name.items():
        cells = [_spread_text(ms[m], scale, digits) for m, _, scale, digits in SEED_COLUMNS]
        r = ratio.get(name)
        ratio_text = "n/a" if r is None else f"{r.mean:.2f}x ({r.lo:.2f}-{r.hi:.2f})"
        t.add_row(name, *cells, ratio_text)
    return t


def headline(scenario: Scenario, summaries: list[Summary]) -> list[tuple[str, str, float]]:
    """(Jenga row, baseline, ratio) on the scenario's headline metric for every Jenga row
    that ran (`max_page`, a baseline on the Jenga core, excluded), in table order; > 1 =
    better. Empty when the baseline or every Jenga row is missing."""
    metric, baseline = scenario.headline
    base = next((s for s in summaries if s.allocator == baseline), None)
    rows = [s for s in summaries if s.allocator in JENGA_NAMES and s.allocator != "max_page"]
    if base is None:
        return []
    lower = metric in LOWER_IS_BETTER

    def ratio(s: Summary) -> float:
        mine, theirs = getattr(s, metric), getattr(base, metric)
        num, den = (theirs, mine) if lower else (mine, theirs)
        return num / den if den else (float("inf") if num else 1.0)

    return [(s.allocator, baseline, ratio(s)) for s in rows]


def headline_line(scenario: Scenario, summaries: list[Summary]) -> str | None:
    """One sentence under the table: every Jenga row's ratio to the baseline on the
    headline metric (> 1 = better), then which rows beat it."""
    found = headline(scenario, summaries)
    if not found:
        return None
    metric, baseline = scenario.headline
    value = {s.allocator: getattr(s, metric) for s in summaries}
    fmt = (lambda v: f"{100 * v:.1f} %") if metric in ("hit_rate", "waste") else "{:.2f}".format
    label = HEADLINE_METRICS.get(metric, metric)
    rows = ", ".join(f"{name} {x:.2f}x ({fmt(value[name])})" for name, _, x in found)
    winners = [name for name, _, x in found if x > 1]
    if not winners:
        verdict = f"no Jenga row beats {baseline}"
    elif len(winners) == 1:
        verdict = f"{winners[0]} beats {baseline}"
    else:
        verdict = f"{', '.join(winners[:-1])} and {winners[-1]} beat {baseline}"
    return f"{label.capitalize()} vs {baseline} ({fmt(value[baseline])}): {rows}; {verdict}."


def print_report(
    console: Console, scenario: Scenario, summaries: list[Summary], missing: dict[str, str]
) -> None:
    console.print(table(scenario, summaries, missing))
    line = headline_line(scenario, summaries)
    if line:
        console.print(f"[bold]{line}", soft_wrap=True)  # one line, however wide
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
        "headline": headline_line(scenario, summaries),
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


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = ("-", "--", ":", "-.")


def _memory_plot(plt: Any, result: RunResult, path: Path) -> None:
    """Stacked KV memory per step (the paper's Fig. 16): needed, waste, cached, free; a
    dashed line marks the full-attention groups' share of what is held."""
    tl = result.timeline
    steps = tl["step"]
    needed = [n / GiB for n in tl["needed_bytes"]]
    waste = [
        max(0.0, (lv - n)) / GiB for lv, n in zip(tl["live_bytes"], tl["needed_bytes"], strict=True)
    ]
    cached = [c / GiB for c in tl["cached_bytes"]]
    cap = result.capacity_bytes / GiB
    free = [max(0.0, cap - a - b - c) for a, b, c in zip(needed, waste, cached, strict=True)]
    fig, ax = plt.subplots(figsize=(8.2, 3.5))
    ax.stackplot(
        steps,
        needed,
        waste,
        cached,
        free,
        labels=["needed", "waste", "cached", "free"],
        colors=["#4c72b0", "#c44e52", "#8c8c8c", "#e8e8e8"],
    )
    full = [
        n for n, kind in result.group_kinds.items() if kind == "full" and n in result.group_live
    ]
    if full and len(result.group_live) > 1:
        held = [sum(result.group_live[n][i] for n in full) / GiB for i in range(len(steps))]
        ax.plot(steps, held, color="#ffbf00", lw=1.2, ls="--", label="full-attention groups")
    committed = [c / GiB for c in tl["committed_bytes"]]
    ax.plot(steps, committed, color="black", lw=1, ls=":", label="committed")
    ax.set(xlabel="engine step", ylabel="KV memory (GiB)", title=f"memory: {result.allocator}")
    ax.set_xlim(0, max(1, len(steps) - 1))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _decode_plot(plt: Any, results: list[RunResult], path: Path) -> None:
    """One panel per allocator (identical series cannot hide each other), shared axes."""
    fig, axes = plt.subplots(
        len(results), 1, figsize=(7, 0.3 + 1.15 * len(results)), sharex=True, sharey=True,
        squeeze=False,
    )  # fmt: skip
    for i, (ax, r) in enumerate(zip(axes[:, 0], results, strict=True)):
        batch = r.timeline["decode_batch"]
        mean = statistics.fmean([b for b in batch if b > 0] or [0])
        ax.step(r.timeline["step"], batch, where="post", lw=1, color=f"C{i}")
        ax.axhline(mean, color=f"C{i}", lw=0.8, ls="--")
        ax.set_title(f"{r.allocator}: mean {mean:.2f}", fontsize=7, loc="right", pad=2)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("engine step")
    fig.supylabel("decode batch size", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _share_points(r: RunResult) -> list[tuple[float, float]]:
    """(step, full-attention % of held KV) over steps holding >= 10 % of the KV memory."""
    full = [n for n, k in r.group_kinds.items() if k == "full" and n in r.group_live]
    if not full or len(r.group_live) < 2:
        return []
    floor = SELF_SHARE_FLOOR * r.capacity_bytes
    steps, live = r.timeline["step"], r.timeline["live_bytes"]
    return [
        (step, 100 * sum(r.group_live[n][j] for n in full) / total)
        for j, (step, total) in enumerate(zip(steps, live, strict=True))
        if total >= floor and total > 0
    ]


def _share_plot(plt: Any, results: list[RunResult], path: Path) -> bool:
    """Full-attention share of held KV per step (Fig. 16c/d's used-self); False if none.
    Equal series stay visible: each has its own line style and markers at its own steps."""
    series = [(i, r, pts) for i, r in enumerate(results) if (pts := _share_points(r))]
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for k, (i, r, pts) in enumerate(series):
        every = max(len(series), len(pts) // 10)
        ax.plot(*zip(*pts, strict=True), lw=1.2, ls=STYLES[k % len(STYLES)],
                marker=MARKERS[i % len(MARKERS)], ms=5, label=r.allocator,
                markevery=(k * every // len(series), every))  # fmt: skip
    ax.set(xlabel="engine step", ylabel="full-attention share (%)",
           title="full-attention share of held KV (steps holding >= 10 %)")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _hit_plot(plt: Any, summaries: list[Summary], path: Path) -> bool:
    """Prefix hit rate per allocator; nothing is written when no allocator hit."""
    if not any(s.hit_rate for s in summaries):
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([s.allocator for s in summaries], [100 * s.hit_rate for s in summaries])
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set(ylabel="prefix hit rate (%)", title="prefix hit rate")
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(results: list[RunResult], summaries: list[Summary], plot_dir: str) -> list[Path]:
    """Write the PNGs into ``plot_dir`` (only plots with something to show); their paths."""
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
    if results:
        _decode_plot(plt, results, out / "decode_batch.png")
        paths.append(out / "decode_batch.png")
    if _hit_plot(plt, summaries, out / "hit_rate.png"):
        paths.append(out / "hit_rate.png")
    if _share_plot(plt, results, out / "full_share.png"):
        paths.append(out / "full_share.png")
    return paths
