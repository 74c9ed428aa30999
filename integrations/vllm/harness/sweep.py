"""Side by side over a grid: requests x memory x seeds, per case, ours against vLLM's.

Rationale
    One workload at one memory size says little about where a manager loses: a claim such
    as "runs and hits at least as much as vLLM's manager" has to hold in every cell of a
    grid around the traces it was measured on. This module runs `side_by_side.run_case`
    for every case, memory size, request count and workload seed, and hands the cells to
    `sweep_report` (ratio tables, heat maps).

Approach
    ``--sweep requests=8,16,32 memory-mb=128,256 seeds=0-2`` (or ``memory-gib=20,40``)
    on the side-by-side command line; a key left out takes the command's own value
    (``--requests``, ``--memory-mb``, ``--seed``). Each cell runs every manager of
    ``--managers`` (vLLM's must be one: ratios are taken against it) with the scheduler
    alone plus the committed-bytes reading (no per-step block check, no pinning walk),
    with the scheduler limits of that cell's workload. The JSON (``--json``)
    is rewritten after every case, so a long sweep cut short keeps its finished cases.

Limitations
    Cells run one after another in one process; a 6 x 4 x 3 grid of the four small cases
    with two managers is 576 runs (minutes on one idle core).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.vllm.harness import sweep_report


class SweepSpecError(ValueError):
    """A ``--sweep`` item that does not parse (the item and why in the message)."""


@dataclass(frozen=True)
class Grid:
    """The values one sweep takes per key."""

    requests: tuple[int, ...]
    memory_mb: tuple[int, ...]
    seeds: tuple[int, ...]

    @property
    def cells(self) -> int:
        return len(self.requests) * len(self.memory_mb) * len(self.seeds)


_KEYS = ("requests", "memory-mb", "memory-gib", "seeds")


def _values(item: str, text: str, lowest: int) -> tuple[int, ...]:
    """``8,16`` or ``0-2`` (inclusive) or a mix, each value ``>= lowest``."""
    out: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.partition("-")
        try:
            bounds = (int(lo), int(hi)) if dash else (int(part), int(part))
        except ValueError:
            raise SweepSpecError(f"--sweep {item!r}: {part!r} is not an integer or a-b") from None
        if bounds[0] > bounds[1]:
            raise SweepSpecError(f"--sweep {item!r}: range {part!r} runs backwards")
        out.extend(range(bounds[0], bounds[1] + 1))
    if min(out) < lowest:
        raise SweepSpecError(f"--sweep {item!r}: {min(out)} is below {lowest}")
    return tuple(dict.fromkeys(out))  # in order, once each


def parse_grid(items: Sequence[str], *, requests: int, memory_mb: int, seed: int) -> Grid:
    """The grid of ``KEY=VALUES`` items; a key not given takes the value after it."""
    given: dict[str, tuple[int, ...]] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or key not in _KEYS:
            raise SweepSpecError(f"--sweep {item!r}: expected KEY=VALUES with KEY in {_KEYS}")
        if key in given or (
            key.startswith("memory") and any(k.startswith("memory") for k in given)
        ):
            raise SweepSpecError(f"--sweep {item!r}: {key} given twice")
        given[key] = _values(item, text, 0 if key == "seeds" else 1)
    memory = given.get("memory-mb") or tuple(g * 1024 for g in given.get("memory-gib", ()))
    return Grid(
        requests=given.get("requests", (requests,)),
        memory_mb=memory or (memory_mb,),
        seeds=given.get("seeds", (seed,)),
    )


def run_grid(
    case_names: Sequence[str],
    grid: Grid,
    run_cell: Callable[[str, int, int, int], dict[str, Any]],
    *,
    on_case: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per case, memory, requests and seed, in that nesting order:
    ``rows`` is ``run_cell(case, memory_mb, requests, seed)`` (manager -> row dict).
    ``on_case(cells so far)`` is called after each case."""
    cells: list[dict[str, Any]] = []
    for case in case_names:
        for memory in grid.memory_mb:
            for requests in grid.requests:
                for seed in grid.seeds:
                    start = time.perf_counter()
                    rows = run_cell(case, memory, requests, seed)
                    if "vllm" not in rows:
                        raise SweepSpecError(
                            f"a sweep compares against vLLM's manager; got {sorted(rows)}"
                        )
                    cells.append(
                        {"case": case, "memory_mb": memory, "requests": requests, "seed": seed}
                        | {"rows": rows}
                    )
                    took = time.perf_counter() - start
                    print(
                        f"{case} {memory} MiB {requests} req seed {seed}: {took:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        if on_case is not None:
            on_case(cells)
    return cells


def write_outputs(payload: dict[str, Any], table: Path | None, plots: Path | None) -> str:
    """The ratio table (returned, and written to ``table``) and heat maps in ``plots``."""
    text = sweep_report.markdown(payload)
    if table is not None:
        table.write_text(text)
    if plots is not None and sweep_report.heat_maps(payload, plots) is None:
        print("matplotlib is not importable here: no heat maps", file=sys.stderr)
    return text
