"""What a `JengaAllocator` shows of itself: usage, counters, eviction orders, cache
lookups and its invariant check. Read-only; `jenga.allocator` holds the calls that change
anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jenga.requests import check_live_tables


@dataclass(frozen=True)
class Usage:
    """Unit and block accounting at one moment.

    ``used_units + free_units == total_units``. ``mapped_pages[g]`` large pages of group g
    hold ``used_blocks[g]`` blocks owned by requests, ``cached_blocks[g]`` evictable
    blocks, and the rest free.
    """

    total_units: int
    used_units: int
    free_units: int
    mapped_pages: tuple[int, ...]
    used_blocks: tuple[int, ...]
    cached_blocks: tuple[int, ...]
    free_blocks: tuple[int, ...]


class AllocatorViews:
    """The read-only side of `JengaAllocator` (a base class: it reads the allocator's core,
    groups and requests)."""

    _core: Any
    _stats: dict[str, int]
    _requests: Any
    _group_index: dict[str, int]
    policies: Any

    @property
    def num_groups(self) -> int:
        return len(self._group_index)

    def _group(self, group: int | str) -> int:
        if isinstance(group, str):
            if group not in self._group_index:
                raise KeyError(f"no group {group!r}; groups: {list(self._group_index)}")
            return self._group_index[group]
        if not 0 <= group < self.num_groups:
            raise IndexError(f"group {group} out of range [0, {self.num_groups})")
        return group

    def core_memory_bytes(self) -> int:
        return int(self._core.memory_bytes())  # C++ container capacities, not Python's

    def lookup(self, group: int, identities: np.ndarray) -> np.ndarray:
        return self._core.lookup(group, identities)  # block id per identity, -1: absent

    def evicted_blocks(self) -> int:
        return int(self._core.counters()["blocks.evicted"])  # whole pages' blocks too

    def is_cached_block(self, group: int, block: int) -> bool:
        return bool(self._core.block_info(group, block)[2])  # hashed: in the prefix index

    def eviction_order(self, group: int | str) -> list[int]:
        """Cached blocks of ``group`` in the order step 5 would evict them."""
        return list(self._core.eviction_order(self._group(group)))

    def page_eviction_order(self) -> list[tuple[int, int]]:
        """Evictable large pages ``(group, page)`` in the order step 3 would evict them."""
        return [(int(g), int(p)) for g, p in self._core.page_eviction_order()]

    def usage(self) -> Usage:
        counts = [self._core.group_counts(g) for g in range(self.num_groups)]
        free, total = int(self._core.free_units), int(self._core.total_units)
        return Usage(
            total_units=total,
            used_units=total - free,
            free_units=free,
            mapped_pages=tuple(int(c[0]) for c in counts),
            used_blocks=tuple(int(c[3]) for c in counts),
            cached_blocks=tuple(int(c[1]) for c in counts),
            free_blocks=tuple(int(c[2]) for c in counts),
        )

    def stats(self) -> dict[str, int]:
        """Counters in dotted keys, e.g. ``"alloc.step.3"``, ``"blocks.evicted"``,
        ``"plan.remapped_units"``, ``"prefix.hit_tokens"``, ``"units.free.current"``,
        ``"blocks.cached.<group>"``."""
        out = {k: int(v) for k, v in self._core.counters().items()}
        out.update(self._stats)
        out["requests.live"] = len(self._requests)
        use = self.usage()
        for g, name in enumerate(self._group_index):
            out[f"pages.mapped.{name}"] = use.mapped_pages[g]
            out[f"blocks.used.{name}"] = use.used_blocks[g]
            out[f"blocks.cached.{name}"] = use.cached_blocks[g]
        return out

    def check_invariants(self, expensive: bool = False) -> None:
        """Raise AssertionError when bookkeeping disagrees (C++ core + Python tables).

        Cheap: unit accounting and set sizes. Expensive: every page and block, plus every
        live request's table (`jenga.requests.check_live_tables`)."""
        try:
            self._core.check_invariants(expensive)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from exc
        if expensive:
            check_live_tables(self._requests, self.policies, self._core)
