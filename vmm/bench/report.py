"""vmm-bench results: summaries, overhead ratios, bars, the rich table and the JSON file.

Rationale: a figure is only useful beside its baseline and its machine, so one result
holds ours and raw for the same case, and the JSON carries the machine facts.
Approach: `OpResult` pairs two `vmm.bench.stats.Summary`s; `Report` collects results and
bars, renders them with rich and writes the schema below.
Limitations: ratios of medians hide tails on purpose; read p99 and max beside them.

Every figure is nanoseconds *per chunk* (per call for ops that have no chunk count:
reserve, tensor view). A one-by-one sample is one call; a batched sample is one call
over `num_chunks` chunks divided by `num_chunks`, so ours and raw compare per chunk.
The overhead ratio is ours p50 / raw p50 (medians resist the scheduler noise of a
shared machine; avg, p99 and max are printed beside them).

JSON schema ("vmm-bench/1"):

    {"schema": "vmm-bench/1", "machine": {...}, "args": {...},
     "results": [{"op", "backend", "chunk_size", "num_chunks", "mode", "layout", "unit",
                  "ours": SUMMARY, "raw": SUMMARY, "ratio_p50"}],
     "bars": [{"name", "limit", "value", "unit", "passed", "detail"}],
     "skipped": [{"op", "reason"}],
     "passed": bool}
    SUMMARY = {"n", "avg", "p50", "p99", "max"}   (nanoseconds; floats; `vmm.bench.stats`)

A CUDA run adds `machine.device = {"name", "emulated", "granularity"}`. On the test
suite's CUDA driver emulator (`emulated`: true) every result's backend is "cuda-emulated"
and the table title says so: those are host mmap/mprotect costs, never GPU figures.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vmm.bench.stats import Summary

SCHEMA = "vmm-bench/1"


@dataclass(frozen=True)
class OpResult:
    """One op under one configuration, measured through vmm ("ours") and raw."""

    op: str
    backend: str
    chunk_size: int
    num_chunks: int
    mode: str  # "one_by_one" | "batched"
    layout: str  # "contiguous" | "scattered" | "-"
    ours: Summary
    raw: Summary
    unit: str = "ns_per_chunk"

    @property
    def ratio_p50(self) -> float:
        return self.ours.p50 / self.raw.p50 if self.raw.p50 > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio_p50"] = self.ratio_p50
        return out


@dataclass(frozen=True)
class Bar:
    """A speed goal checked by this run: `value` must be <= `limit`."""

    name: str
    limit: float
    value: float
    unit: str  # "x raw" or "us"
    detail: str

    @property
    def passed(self) -> bool:
        return self.value <= self.limit


@dataclass
class Report:
    args: dict[str, Any]
    results: list[OpResult] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    #: CUDA runs: {"name": the driver's device name, "emulated": bool}
    device: dict[str, Any] = field(default_factory=dict)
    #: ops this run could not measure, with the reason
    skipped: list[dict[str, str]] = field(default_factory=list)

    @property
    def emulated(self) -> bool:
        return bool(self.device.get("emulated"))

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.bars)

    def find(self, **where: Any) -> OpResult | None:
        """The first result whose fields equal `where` (e.g. op="map", mode="batched")."""
        for r in self.results:
            if all(getattr(r, k) == v for k, v in where.items()):
                return r
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "machine": machine_facts() | ({"device": self.device} if self.device else {}),
            "args": self.args,
            "results": [r.to_json() for r in self.results],
            "bars": [asdict(b) | {"passed": b.passed} for b in self.bars],
            "skipped": list(self.skipped),
            "passed": self.passed,
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")


def machine_facts() -> dict[str, Any]:
    """What a reader needs to compare figures across machines."""
    facts: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        facts["torch"] = torch.__version__
    return facts


def _us(ns: float) -> str:
    us = ns / 1000.0
    return f"{us:.2f}" if us < 100 else f"{us:.0f}"


def _stats(s: Summary) -> str:
    return " / ".join(_us(v) for v in (s.p50, s.avg, s.p99, s.max))


def size_label(num_bytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if num_bytes >= 1 << shift and num_bytes % (1 << shift) == 0:
            return f"{num_bytes >> shift}{unit}"
    return f"{num_bytes}B"


_MODES = {"one_by_one": "1-by-1", "batched": "batched"}
_LAYOUTS = {"contiguous": "contig", "scattered": "scatter", "-": ""}


def render(report: Report, console: Any = None) -> None:
    """Print the results table (µs: p50 / avg / p99 / max) and the bars with rich."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: wide enough for one line per row
            console = Console(width=150)
    backend = report.args.get("backend", "?")
    if report.device:
        backend += f" on {report.device['name']}"
    if report.emulated:
        backend += ": EMULATED on host memory, not GPU figures"
    table = Table(
        title=f"vmm-bench ({backend}): µs per chunk, per call for reserve/free/tensor_view",
        caption="ours/raw = ratio of medians",
    )
    table.add_column("op")
    table.add_column("chunk×n", justify="right")
    table.add_column("mode")
    table.add_column("layout")
    table.add_column("ours p50 / avg / p99 / max", justify="right", no_wrap=True)
    table.add_column("raw p50 / avg / p99 / max", justify="right", no_wrap=True)
    table.add_column("ours/raw", justify="right")
    for r in report.results:
        table.add_row(
            r.op, f"{size_label(r.chunk_size)}×{r.num_chunks}", _MODES.get(r.mode, r.mode),
            _LAYOUTS.get(r.layout, r.layout), _stats(r.ours), _stats(r.raw), f"{r.ratio_p50:.2f}",
        )  # fmt: skip
    console.print(table)
    for skip in report.skipped:
        reason = escape(skip["reason"])  # reasons may hold brackets: '.[torch]'
        console.print(f"[yellow]not measured[/yellow] {escape(skip['op'])}: {reason}")
    for bar in report.bars:
        verdict = "[green]PASS[/green]" if bar.passed else "[red]FAIL[/red]"
        console.print(
            f"{verdict} {bar.name}: {bar.value:.2f} {bar.unit} (limit {bar.limit:g}; {bar.detail})"
        )
