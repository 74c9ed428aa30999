"""What a `JengaAllocator` shows of itself: usage, counters, eviction orders, cache
lookups and its invariant check. Read-only; `jenga.allocator` holds the calls that change
anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jenga.requests import NULL_BLOCK, check_live_tables
from jenga.substates import fine_group, fine_lookup, fine_mask, fine_table

if TYPE_CHECKING:
    from jenga.requests import LiveRequest


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
    _prefix_step: int
    _states: Any  # `jenga.substates.SubBlockStates` or None
    policies: Any
    config: Any

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
            states = self._states
            retained = states.retained if states is not None else None
            check_live_tables(self._requests, self.policies, self._core, retained)

    # -- prefix matching (the lookup side of `JengaAllocator.prefix_match`) ----------
    def _lookup(self, g: int, policy: Any, req: LiveRequest, n: int) -> np.ndarray:
        """Group g's cached block per block of the ``n`` tokens (-1: none)."""
        t = policy.tokens_per_block
        if not policy.caches_blocks:  # nothing of it is in the index
            return np.full(n // t, -1, dtype=np.int64)
        if policy.reads_images:
            return self._core.lookup(g, req.image_hashes(policy))
        found = self._core.lookup(g, req.identities(t, 0, n // t))
        if len(found) < n // t:  # the caller's digests end sooner
            found = np.concatenate([found, np.full(n // t - len(found), -1, found.dtype)])
        return found

    def _match(
        self, req: LiveRequest, max_hit: int | None = None
    ) -> tuple[int, list[list[int]], int]:
        """The hit length, per group the block table a request with that hit starts with,
        and the longest prefix valid in any single group (see `prefix_match`).

        The hit is the longest p < len(prompt) (and p <= ``max_hit``), a multiple of every
        text group's block size, valid in every group (`Policy.valid_prefix_mask`, the
        vectorized `possible_prefix`).
        """
        n = len(req.tokens)
        step = self._prefix_step
        valid = np.ones(n // step, dtype=bool)
        whole = len(valid) > 0 and len(valid) * step == n  # one token is always computed
        junction = 0
        proof = self.config.hit_proof
        lookups: list[np.ndarray] = []
        unit = self._states.unit if self._states is not None else 0
        for g, policy in enumerate(self.policies):
            if fine_group(policy, unit):  # hits inside its blocks (`jenga.substates`)
                found = fine_lookup(self._core, g, req, unit, n)
                lookups.append(found)
                mask = fine_mask(policy, found, step, unit, n)
            else:
                found = self._lookup(g, policy, req, n)
                lookups.append(found)
                mask = policy.valid_prefix_mask(found >= 0, step, n, req.images)
            if proof is not None:  # speculative decoding: hits followed by cached steps
                mask = proof.proven(mask, policy.holds_state, whole)
            elif whole:
                mask[-1] = False
            alone = np.flatnonzero(mask)
            if len(alone) and policy.caches_blocks:
                junction = max(junction, int(alone[-1] + 1) * step)
            valid &= mask
        if max_hit is not None:
            valid[max(max_hit, 0) // step :] = False
        if not any(p.caches_blocks for p in self.policies):
            valid[:] = False  # no group keeps anything a hit could reuse
        hits = np.flatnonzero(valid)
        hit = int(hits[-1] + 1) * step if len(hits) else 0
        tables: list[list[int]] = []
        for g, policy in enumerate(self.policies):
            if fine_group(policy, unit):
                tables.append(fine_table(policy, lookups[g], unit, hit) if hit else [])
                continue
            table = [NULL_BLOCK] * (policy.hit_table_length(hit, req.images) if hit else 0)
            take = policy.hit_blocks(hit, req.images) if hit else range(0)
            table[take.start : take.stop] = lookups[g][take.start : take.stop].tolist()
            tables.append(table)
        return hit, tables, junction
