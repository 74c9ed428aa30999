"""Chunk pinning of the VMM geometries, measured on a running scheduler.

Rationale
    On VMM ranges a large page (``k`` chunks) goes back to the pool, or to another group,
    only when none of its blocks is held by a live request. A page holding one live block
    among ``B`` pins ``k`` chunks for that block. This module measures how much memory
    live blocks pin beyond what they need, so placement policies (the
    allocation order, page geometry) can be compared side by side.

Approach
    After every step, per group: the set of distinct allocator blocks the running
    requests hold (a prefix block shared by several requests counts once), grouped by
    large page (``block // B``). Two figures, in chunks:

    - *single-pinned*: chunks of pages that hold exactly one live block (the page stays
      mapped for that block alone);
    - *packable*: chunks that could be unmapped if each group's live blocks were packed
      into as few pages as possible: ``(pages with a live block - ceil(live / B)) * k``.

    Both are summed over steps, with the mapped chunks (the allocator's used units), so a
    run reports each as a fraction of its mapped chunk-steps.

Limitations
    Cached (evictable) blocks are not counted as pinning: they are what a prefix cache is
    for, and a page holding only cached blocks is evictable whole. Only managers on VMM
    pages (``pages="vmm"``) are measured; on vLLM's tensors every slot is its own page.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from jenga.allocator import NULL_BLOCK


@dataclass
class PinningTally:
    """Chunk-steps summed over a run's steps (see the module note)."""

    steps: int = 0
    mapped: int = 0
    single_pinned: int = 0
    packable: int = 0

    def add(self, mapped: int, single_pinned: int, packable: int) -> None:
        self.steps += 1
        self.mapped += mapped
        self.single_pinned += single_pinned
        self.packable += packable

    @property
    def single_pinned_fraction(self) -> float:
        """Share of mapped chunk-steps held by pages with exactly one live block."""
        return round(self.single_pinned / self.mapped, 4) if self.mapped else 0.0

    @property
    def packable_fraction(self) -> float:
        """Share of mapped chunk-steps that packing the live blocks would free."""
        return round(self.packable / self.mapped, 4) if self.mapped else 0.0


def chunk_pinning(manager: Any, request_ids: list[str]) -> tuple[int, int, int]:
    """(mapped chunks, single-pinned chunks, packable chunks) of a jenga manager on VMM
    pages, for the live blocks of ``request_ids`` (the running requests)."""
    alloc = manager.allocator
    single = packable = 0
    for g, group in enumerate(manager.layout.groups):
        per_page = group.pages.blocks_per_large_page
        units = group.pages.units_per_large_page
        live: set[int] = set()
        for rid in request_ids:
            live.update(b for b in alloc.block_table(rid, g) if b != NULL_BLOCK)
        per_page_live = Counter(b // per_page for b in live)
        single += sum(1 for n in per_page_live.values() if n == 1) * units
        packable += (len(per_page_live) - -(-len(live) // per_page)) * units
    return alloc.usage().used_units, single, packable
