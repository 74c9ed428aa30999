"""Page census of ours on VMM pages: what holds each group's pages when requests are
preempted, and how long the prefix hits of first admissions are.

Rationale
    On per_group VMM pages a group gets another group's memory only as whole pages: a
    page that holds one live block keeps all its slots, cached or free, in its group.
    When ours preempts where vLLM's manager (one pool of interchangeable slots) does not,
    the question is which pages pinned the bytes. This module records, per step and per
    group, the mapped pages, the pages that hold a live block, the pages with none (all
    cached: evictable whole), the live and cached blocks and the pages the live blocks
    would need if packed; and the prefix-hit length of every first admission (the
    ``num_computed_tokens`` vLLM's scheduler reports), so lost hits show at which prefix
    boundary they were lost.

Approach
    `PageCensus` is an ``after_step`` observer for `side_by_side.run_case`. Block states
    come from the allocator core (`jenga._core.Core.block_info`), page size from the
    layout; vLLM's own manager is observed for admissions only. ``main`` runs one cell
    and prints the census of the first preemption steps and the hit histogram.

Limitations
    Walks every block id of every group after each step (slow on real-scale pools: a
    diagnosis tool for the small stand-ins).

Usage::

    python -m integrations.vllm.harness.page_census --case ministral --memory-mb 256 \
        --requests 256 --seed 0 --manager jenga-vmm-group --option pack_window_blocks=true
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from integrations.vllm.harness import replay
from integrations.vllm.harness import side_by_side as sbs

_USED, _CACHED = 1, 2  # Core.block_info states


@dataclass(frozen=True)
class GroupCensus:
    """One group's pages after one step (blocks of ``blocks_per_page`` per page)."""

    mapped_pages: int
    live_pages: int  # pages holding at least one live (used) block
    idle_pages: int  # mapped pages without a live block (evictable whole)
    live_blocks: int
    cached_blocks: int
    pages_needed: int  # ceil(live_blocks / blocks_per_page)
    live_per_page: tuple[tuple[int, int], ...]  # (live blocks, pages with that many)

    @property
    def stranded_pages(self) -> int:
        """Pages the live blocks pin beyond a packed placement."""
        return self.live_pages - self.pages_needed


def group_census(core: Any, g: int, blocks_per_page: int) -> GroupCensus:
    """The census of group ``g`` of a `jenga._core.Core`."""
    mapped = int(core.group_counts(g)[0])
    live: Counter[int] = Counter()
    cached = 0
    block = 0
    while True:
        try:
            state = core.block_info(g, block)[0]
        except IndexError:
            break
        if state == _USED:
            live[block // blocks_per_page] += 1
        elif state == _CACHED:
            cached += 1
        block += 1
    n_live = sum(live.values())
    return GroupCensus(
        mapped_pages=mapped,
        live_pages=len(live),
        idle_pages=mapped - len(live),
        live_blocks=n_live,
        cached_blocks=cached,
        pages_needed=-(-n_live // blocks_per_page),
        live_per_page=tuple(sorted(Counter(live.values()).items())),
    )


@dataclass
class PageCensus:
    """``after_step`` observer: admissions' hit lengths for any manager; for ours on
    VMM pages also the census of every step that preempted (``preempting``, step index
    first) and of the step before the first preemption (``before_first``)."""

    hit_lengths: Counter[int] = field(default_factory=Counter)
    preempting: list[tuple[int, int, list[GroupCensus]]] = field(default_factory=list)
    before_first: list[GroupCensus] = field(default_factory=list)
    steps: int = 0
    _last: list[GroupCensus] = field(default_factory=list)
    _admitted: set[str] = field(default_factory=set)

    def __call__(self, scheduler: Any, out: Any) -> None:
        for req in out.scheduled_new_reqs:  # vLLM 0.33 sends resumed requests here too
            if req.req_id not in self._admitted:
                self._admitted.add(req.req_id)
                self.hit_lengths[int(req.num_computed_tokens)] += 1
        kv = scheduler.kv_cache_manager
        step, self.steps = self.steps, self.steps + 1
        if not hasattr(kv, "allocator") or not kv.layout.options.tensor_geometry.on_vmm_ranges:
            return
        core = kv.allocator._core
        now = [
            group_census(core, g, group.pages.blocks_per_large_page)
            for g, group in enumerate(kv.layout.groups)
        ]
        preempted = len(out.preempted_req_ids or ())
        if preempted:
            if not self.preempting:
                self.before_first = self._last
            self.preempting.append((step, preempted, now))
        self._last = now


def run_cell(
    case: str,
    memory_mb: int,
    workload: sbs.Workload,
    manager: str,
    options: dict[str, Any] | None = None,
    observer: PageCensus | None = None,
) -> tuple[sbs.Row, PageCensus]:
    """One side-by-side run of ``manager`` with a census observer (``observer``, or a
    new one)."""
    setup = sbs.scheduler_setup(workload)
    setup = replace(setup, jenga_options={**(setup.jenga_options or {}), **(options or {})})
    census = PageCensus() if observer is None else observer
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = replay.write_tiny_model(Path(tmp) / "model")
        row = sbs.run_case(
            model_dir,
            case,
            memory_mb,
            workload,
            manager=manager,
            setup=setup,
            checked=False,
            observer=census,
        )
    return row, census


def format_census(census: PageCensus, first: int = 3) -> str:
    """The hit histogram and the census before and at the first ``first`` preemptions."""
    lines = [f"first-admission hit lengths: {dict(sorted(census.hit_lengths.items()))}"]
    shown = [("before first preemption", census.before_first)]
    shown += [(f"step {s} ({n} preempted)", c) for s, n, c in census.preempting[:first]]
    for title, groups in shown:
        lines.append(title)
        for g, c in enumerate(groups):
            lines.append(
                f"  g{g}: mapped {c.mapped_pages} live pages {c.live_pages} (need "
                f"{c.pages_needed}, stranded {c.stranded_pages}) idle {c.idle_pages} "
                f"live {c.live_blocks} cached {c.cached_blocks} live/page {c.live_per_page}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="ministral", choices=sbs.cases.CASES)
    parser.add_argument("--memory-mb", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--manager", default="jenga-vmm-group", choices=sbs.MANAGERS)
    parser.add_argument(
        "--option", action="append", default=[], help="jenga option NAME=JSON (repeatable)"
    )
    parser.add_argument("--first", type=int, default=3, help="preemption steps shown")
    args = parser.parse_args(argv)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    load = sbs.Workload(requests=args.requests, seed=args.seed)
    row, census = run_cell(args.case, args.memory_mb, load, args.manager, options)
    print(
        f"{args.case} {args.manager} {args.memory_mb} MiB {args.requests} requests seed "
        f"{args.seed}: {row.avg_running} running, {row.preemptions} preemptions, "
        f"{row.hit_tokens} hit tokens"
    )
    print(format_census(census, args.first))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
