"""A grid sweep: shipped scenarios x KV sizes x seeds, every Jenga row against `vllm_v1`.

Rationale
    One scenario at one KV size is one corner. A claim such as "Jenga is never worse
    than today's vLLM" needs the corners next to it: other traces, a smaller cache,
    other arrival draws. The grid runs each cell on one trace under `vllm_v1` and the
    Jenga rows and reports, per cell and Jenga row, ours / vllm_v1 on the four numbers a
    deployment asks about: decode batch (requests running per step), prefix hit rate,
    preemptions and mean committed KV memory.

Approach
    A cell is (scenario, KV size, seed). KV sizes are either shares of each scenario's
    own KV memory (``kv_scales``: 1 = the scenario as shipped, 0.5 = half of it) or
    absolute GiB (``kv_gib``). Each cell runs ``vllm_v1`` plus the requested Jenga rows
    (default: the scenario's Jenga rows and ``jenga_vmm_group``, the recommended
    geometry; `max_page` is a baseline and left out) through `scenarios.run_scenario`.
    `ratio` is ours / vllm_v1 with 0 / 0 read as 1 (both preempted nothing) and x / 0 as
    infinity (written ``null`` in JSON, ``inf`` in tables). For hit rate and decode
    batch > 1 is better; for preemptions and committed bytes < 1 is.

Limitations
    Cells run one after another in one process (two cores here). A scenario's workload
    is run as shipped, so the grid's cost is the sum of its scenarios' costs; the quick
    default (`QUICK_SCENARIOS`, three KV shares, seed 0) keeps to the cheap ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from rich import box
from rich.table import Table

from jenga.sim.metrics import Summary, summarize
from jenga.sim.protocol import SimError
from jenga.sim.scenarios import (
    JENGA_NAMES,
    RECOMMENDED,
    SCENARIOS,
    Scenario,
    get_scenario,
    run_scenario,
)

BASELINE = "vllm_v1"
# every shipped scenario vllm_v1 can serve (it does not model cross attention: the
# Llama 3.2 Vision scenario has no baseline row)
QUICK_SCENARIOS = tuple(sorted(n for n in SCENARIOS if n != "mmmu-llama-vision"))
QUICK_KV_SCALES = (1.0, 0.5, 0.25)
# (Summary field, column label, higher is better)
GRID_METRICS = (
    ("avg_decode_batch", "batch", True),
    ("hit_rate", "hit", True),
    ("preemptions", "preempt", False),
    ("mean_committed_gib", "commit", False),
)


@dataclass(frozen=True)
class Cell:
    """One grid point: its scenario name, KV GiB, seed, summaries and rows that failed."""

    scenario: str
    kv_gib: float
    kv_label: str
    seed: int
    summaries: dict[str, Summary]
    not_run: dict[str, str] = field(default_factory=dict)


def parse_scenarios(text: str | None) -> list[str]:
    """``None`` -> the quick set, ``"all"`` -> every shipped scenario, else a list."""
    if text is None:
        return list(QUICK_SCENARIOS)
    if text.strip() == "all":
        return sorted(SCENARIOS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise SimError(f"--sweep-scenarios must name distinct scenarios, got {text!r}")
    for name in names:
        get_scenario(name)  # raises SimError naming the known ones
    return names


def parse_sizes(text: str | None, what: str, default: Sequence[float] = ()) -> list[float]:
    """``"1,0.5"`` -> [1.0, 0.5]; each finite and > 0, distinct."""
    if text is None:
        return list(default)
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise SimError(f"{what} expects numbers like 1,0.5,0.25, got {text!r}") from exc
    bad = [v for v in values if not 0 < v < math.inf]
    if not values or bad or len(set(values)) != len(values):
        raise SimError(f"{what} expects distinct finite numbers > 0, got {text!r}")
    return values


def allocators_for(scenario: Scenario, requested: Sequence[str] | None) -> tuple[str, ...]:
    """``vllm_v1`` first, then the requested rows (default: the scenario's Jenga rows and
    the recommended geometry)."""
    if requested:
        rows = [n for n in requested if n != BASELINE]
    else:
        rows = [n for n in scenario.allocators if n in JENGA_NAMES and n != "max_page"]
        rows += [RECOMMENDED] if RECOMMENDED not in rows else []
    return (BASELINE, *rows)


def run_grid(
    names: Sequence[str],
    seeds: Sequence[int],
    kv_scales: Sequence[float] = QUICK_KV_SCALES,
    kv_gib: Sequence[float] = (),
    allocators: Sequence[str] | None = None,
    on_cell: Callable[[Cell], None] | None = None,
) -> list[Cell]:
    """Every (scenario, KV size, seed) cell; absolute ``kv_gib`` replace ``kv_scales``."""
    cells: list[Cell] = []
    for name in names:
        base = get_scenario(name)
        scenario = replace(base, allocators=allocators_for(base, allocators))
        own = scenario.kv_bytes(scenario.model_spec()) / 2**30
        sizes = [(g, f"{g:g} GiB") for g in kv_gib] or [
            (own * s, f"x{s:g} ({own * s:.1f} GiB)") for s in kv_scales
        ]
        for gib, label in sizes:
            for seed in seeds:
                results, missing = run_scenario(replace(scenario, kv_gib=gib, seed=seed))
                cell = Cell(
                    name, gib, label, seed, {r.allocator: summarize(r) for r in results}, missing
                )
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    return cells


def ratio(mine: float, base: float) -> float:
    """ours / vllm_v1; 0 / 0 = 1 (equal), x / 0 = inf."""
    if base:
        return mine / base
    return 1.0 if not mine else math.inf


def _ratio_text(metric: str, mine: float, base: float) -> str:
    """The ratio, or both values when the baseline's is 0 (``42.0 % vs 0``, ``3 vs 0``)."""
    if ratio(mine, base) != math.inf:
        return f"{ratio(mine, base):.2f}"
    return f"{100 * mine:.1f} % vs 0" if metric == "hit_rate" else f"{mine:g} vs 0"


def _why(reason: str) -> str:
    """A not-run reason in a few words (the JSON keeps it whole)."""
    for short in ("does not fit", "not modelled"):
        if short in reason:
            return short
    return reason.split(": ", 1)[-1][:40]


def rows(cells: Sequence[Cell]) -> list[tuple[Cell, str, list[str]]]:
    """(cell, Jenga row, ratio texts per `GRID_METRICS`) for every row that ran beside the
    baseline. A cell where nothing ran is one row ``every row`` with the reason; a row
    (or a baseline) that did not run reads its reason in every column."""
    out: list[tuple[Cell, str, list[str]]] = []
    for cell in cells:
        base = cell.summaries.get(BASELINE)
        if not cell.summaries:
            why = _why(next(iter(cell.not_run.values()), "no allocator"))
            out.append((cell, "every row", [why] * len(GRID_METRICS)))
            continue
        names = [n for n in cell.summaries if n != BASELINE] + list(cell.not_run)
        for name in dict.fromkeys(n for n in names if n != BASELINE):
            mine = cell.summaries.get(name)
            if base is None or mine is None:
                missing = BASELINE if base is None else name
                why = f"{missing}: {_why(cell.not_run.get(missing, ''))}"
                out.append((cell, name, [why] * len(GRID_METRICS)))
                continue
            texts = [_ratio_text(m, getattr(mine, m), getattr(base, m)) for m, _, _ in GRID_METRICS]
            out.append((cell, name, texts))
    return out


def losing(cells: Sequence[Cell], tolerance: float = 0.98) -> list[tuple[Cell, str, str]]:
    """(cell, row, metric) where a Jenga row is worse than ``tolerance`` x vllm_v1 on a
    higher-is-better metric, or commits / preempts more (ratio > 1)."""
    found = []
    for cell in cells:
        base = cell.summaries.get(BASELINE)
        if base is None:
            continue
        for name, mine in cell.summaries.items():
            if name == BASELINE:
                continue
            for metric, _, higher in GRID_METRICS:
                r = ratio(getattr(mine, metric), getattr(base, metric))
                if (higher and r < tolerance) or (not higher and r > 1.0):
                    found.append((cell, name, metric))
    return found


HEADER = ("scenario", "KV", "seed", "allocator", *(f"{label} x" for _, label, _ in GRID_METRICS))


def grid_table(cells: Sequence[Cell]) -> Table:
    t = Table(
        title=f"ours / {BASELINE} per cell (batch, hit: > 1 better; preempt, commit: < 1 better)",
        box=box.SIMPLE_HEAD,
    )
    for col in HEADER:
        t.add_column(col, justify="left" if col in ("scenario", "allocator") else "right")
    for cell, name, texts in rows(cells):
        t.add_row(cell.scenario, cell.kv_label, str(cell.seed), name, *texts)
    return t


def grid_markdown(cells: Sequence[Cell]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for cell, name, texts in rows(cells):
        cells_text = [cell.scenario, cell.kv_label, str(cell.seed), name, *texts]
        lines.append("| " + " | ".join(cells_text) + " |")
    return "\n".join(lines) + "\n"


def grid_json(cells: Sequence[Cell]) -> dict[str, object]:
    """Every cell: its summaries, ratios per Jenga row (``null`` = x / 0), rows not run."""
    out = []
    for cell in cells:
        base = cell.summaries.get(BASELINE)
        ratios: dict[str, dict[str, float | None]] = {}
        for name, mine in cell.summaries.items():
            if name == BASELINE or base is None:
                continue
            ratios[name] = {}
            for metric, _, _ in GRID_METRICS:
                r = ratio(getattr(mine, metric), getattr(base, metric))
                ratios[name][metric] = None if r == math.inf else r
        out.append(
            {
                "scenario": cell.scenario,
                "kv_gib": cell.kv_gib,
                "kv": cell.kv_label,
                "seed": cell.seed,
                "summaries": {n: s.as_dict() for n, s in cell.summaries.items()},
                "ratios_vs_vllm_v1": ratios,
                "not_run": cell.not_run,
            }
        )
    return {"baseline": BASELINE, "metrics": [m for m, _, _ in GRID_METRICS], "cells": out}
