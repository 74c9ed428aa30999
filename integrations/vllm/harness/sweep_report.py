"""Ratio tables and heat maps of a side-by-side sweep (`integrations.vllm.harness.sweep`).

Pure Python over the sweep's JSON (no vLLM import), so the tables and figures can be
regenerated from a saved sweep in any environment::

    python -m integrations.vllm.harness.sweep_report sweep.json --table out.md --plots DIR

Several JSON files (sweeps of the same managers run apart) are merged into one table
(``--merged FILE`` also writes the merged JSON).

Per case and manager of ours, one ratio ours ÷ vLLM per cell (requests x memory x seed)
for average running requests, prefix-hit tokens, preemptions and committed bytes. A
ratio whose vLLM value is 0 is 1 when ours is 0 too, else infinite. A cell *loses* when
ours runs or hits less than `LOSS_BELOW` of vLLM's, or commits more bytes.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS = ("avg_running", "hit_tokens", "preemptions", "committed_bytes")
SHORT = {"avg_running": "run", "hit_tokens": "hit", "preemptions": "pre", "committed_bytes": "mem"}
LOSS_BELOW = 0.98
"""A cell loses where ours ÷ vLLM on running or on hit tokens is below this."""


def ratio(ours: float, theirs: float) -> float:
    """ours ÷ theirs; 1 when both are 0, infinite when only theirs is."""
    if theirs == 0:
        return 1.0 if ours == 0 else math.inf
    return ours / theirs


def cell_ratios(cell: dict[str, Any], manager: str) -> dict[str, float]:
    """Ratio per `METRICS` of ``manager``'s row to vLLM's in one cell; a manager that
    raised (its row holds ``error``) counts as 0 running and hits, or vLLM's as infinite
    for ours."""
    ours, theirs = cell["rows"][manager], cell["rows"]["vllm"]
    if "error" in ours:
        return {"avg_running": 0.0, "hit_tokens": 0.0, "preemptions": 1.0, "committed_bytes": 1.0}
    if "error" in theirs:
        return {"avg_running": math.inf, "hit_tokens": math.inf, "preemptions": 1.0} | {
            "committed_bytes": 1.0
        }
    return {m: ratio(float(ours[m]), float(theirs[m])) for m in METRICS}


def loses(ratios: dict[str, float]) -> list[str]:
    """Which of running, hit tokens and committed bytes lose in one cell (empty: none)."""
    out = [m for m in ("avg_running", "hit_tokens") if ratios[m] < LOSS_BELOW]
    return out + (["committed_bytes"] if ratios["committed_bytes"] > 1.0 else [])


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3f}"


def _ours(payload: dict[str, Any]) -> list[str]:
    return [m for m in payload["managers"] if m != "vllm"]


def _axes(cells: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], list[int]]:
    """Sorted memory sizes, request counts and seeds of these cells."""
    return (
        sorted({c["memory_mb"] for c in cells}),
        sorted({c["requests"] for c in cells}),
        sorted({c["seed"] for c in cells}),
    )


def _case_table(cells: list[dict[str, Any]], manager: str) -> list[str]:
    memories, _, _ = _axes(cells)
    head = ["requests", "seed", *(f"{m} MiB" for m in memories)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_key = {(c["requests"], c["seed"], c["memory_mb"]): c for c in cells}
    for requests, seed in sorted({(c["requests"], c["seed"]) for c in cells}):
        row = [str(requests), str(seed)]
        for memory in memories:
            cell = by_key.get((requests, seed, memory))
            if cell is None:
                row.append("-")
                continue
            r = cell_ratios(cell, manager)
            text = " / ".join(_fmt(r[m]) for m in METRICS)
            row.append(f"**{text}**" if loses(r) else text)
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case and manager of ours: cells, losing cells, worst ratios."""
    out = []
    cases = list(dict.fromkeys(c["case"] for c in payload["cells"]))
    for case in cases:
        cells = [c for c in payload["cells"] if c["case"] == case]
        for manager in _ours(payload):
            ratios = [cell_ratios(c, manager) for c in cells]
            out.append(
                {
                    "case": case,
                    "manager": manager,
                    "cells": len(cells),
                    "losing": [
                        (c["memory_mb"], c["requests"], c["seed"], loses(r))
                        for c, r in zip(cells, ratios, strict=True)
                        if loses(r)
                    ],
                    "min_running": min(r["avg_running"] for r in ratios),
                    "min_hits": min(r["hit_tokens"] for r in ratios),
                    "max_committed": max(r["committed_bytes"] for r in ratios),
                }
            )
    return out


def markdown(payload: dict[str, Any]) -> str:
    """The summary, then per case and manager of ours a table of ratios per cell."""
    lines = [
        f"Command: `{payload.get('command', '?')}`",
        "",
        "Cells: ours ÷ vLLM as run / hit / pre / mem (average running, prefix-hit tokens, "
        f"preemptions, committed bytes); **bold**: running or hits below {LOSS_BELOW} "
        "or more bytes committed.",
        "",
        "| case | manager | cells | losing | min run | min hit | max mem |",
        "|---|---|---|---|---|---|---|",
    ]
    stats = summary(payload)
    for s in stats:
        lines.append(
            f"| {s['case']} | {s['manager']} | {s['cells']} | {len(s['losing'])} | "
            f"{_fmt(s['min_running'])} | {_fmt(s['min_hits'])} | {_fmt(s['max_committed'])} |"
        )
    errors = [
        f"- {c['case']}, {m}: {c['memory_mb']}, {c['requests']}, {c['seed']}: {r['error']}"
        for c in payload["cells"]
        for m, r in c["rows"].items()
        if "error" in r
    ]
    if errors:
        lines += ["", "Runs that raised (case, manager: memory MiB, requests, seed):", "", *errors]
    losing = [(s, cell) for s in stats for cell in s["losing"]]
    if losing:
        lines += ["", "Losing cells (case, manager: memory MiB, requests, seed: what):", ""]
        for s, (memory, requests, seed, what) in losing:
            names = ", ".join(SHORT[w] for w in what)
            lines.append(f"- {s['case']}, {s['manager']}: {memory}, {requests}, {seed}: {names}")
    for case in dict.fromkeys(c["case"] for c in payload["cells"]):
        cells = [c for c in payload["cells"] if c["case"] == case]
        for manager in _ours(payload):
            lines += ["", f"### {case}, {manager} ÷ vllm", "", *_case_table(cells, manager)]
    return "\n".join(lines) + "\n"


def heat_maps(payload: dict[str, Any], folder: Path) -> list[Path] | None:
    """One PNG per case and manager of ours: running and hit-token ratios, the worst
    seed per (requests, memory). None (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for case in dict.fromkeys(c["case"] for c in payload["cells"]):
        cells = [c for c in payload["cells"] if c["case"] == case]
        memories, requests, _ = _axes(cells)
        for manager in _ours(payload):
            fig, axes = plt.subplots(1, 2, figsize=(9, 0.45 * len(requests) + 2.0))
            fig.subplots_adjust(top=0.8, wspace=0.35)
            for ax, metric in zip(axes, ("avg_running", "hit_tokens"), strict=True):
                grid = [[math.nan] * len(memories) for _ in requests]
                for c in cells:
                    i, j = requests.index(c["requests"]), memories.index(c["memory_mb"])
                    value = min(cell_ratios(c, manager)[metric], 2.0)
                    grid[i][j] = value if math.isnan(grid[i][j]) else min(grid[i][j], value)
                image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
                for i in range(len(requests)):
                    for j in range(len(memories)):
                        ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
                ax.set_xticks(range(len(memories)), [str(m) for m in memories])
                ax.set_yticks(range(len(requests)), [str(r) for r in requests])
                ax.set_xlabel("memory (MiB)")
                ax.set_ylabel("requests")
                ax.set_title(f"{SHORT[metric]}: {manager} ÷ vllm (worst seed)", fontsize=9)
            fig.colorbar(image, ax=axes, shrink=0.8)
            fig.suptitle(case, fontsize=10, y=0.98)
            path = folder / f"{case}-{manager}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def merge(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One payload of sweeps run apart (say one process per case): the cells of all, in
    order, and each command; their managers must be the same."""
    first = payloads[0]
    for other in payloads[1:]:
        if other["managers"] != first["managers"]:
            raise ValueError(
                f"sweeps of different managers: {first['managers']} and {other['managers']}"
            )
    return first | {
        "command": " ; ".join(p.get("command", "?") for p in payloads),
        "cells": [c for p in payloads for c in p["cells"]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tables and heat maps of sweeps' JSON")
    parser.add_argument("json", type=Path, nargs="+", help="one sweep, or several to merge")
    parser.add_argument("--merged", type=Path, default=None, help="write the merged JSON here")
    parser.add_argument("--table", type=Path, default=None)
    parser.add_argument("--plots", type=Path, default=None)
    args = parser.parse_args(argv)
    payload = merge([json.loads(path.read_text()) for path in args.json])
    if args.merged is not None:
        args.merged.write_text(json.dumps(payload, indent=1))
    table = markdown(payload)
    if args.table is None:
        print(table)
    else:
        args.table.write_text(table)
    if args.plots is not None and heat_maps(payload, args.plots) is None:
        print("matplotlib is not importable here: no heat maps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
