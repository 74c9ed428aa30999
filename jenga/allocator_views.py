"""What a `JengaAllocator` shows of itself: usage, counters, eviction orders, cache
lookups and its invariant check. Read-only; `jenga.allocator` holds the calls that change
anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jenga.requests import NULL_BLOCK, check_live_tables
from jenga.substates import fine_group, fine_mask, fine_table, hit_unit

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

    @property
    def _state_unit(self) -> int:
        """Tokens between the positions states are hit at inside an interval (0: none)."""
        return self.config.state_unit or 0

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
    def _lookup(
        self, g: int, policy: Any, req: LiveRequest, n: int, t: int | None = None
    ) -> np.ndarray:
        """Group g's cached block after every ``t`` of the ``n`` tokens (-1: none; ``t``:
        its block, or a fine group's unit, `jenga.substates`)."""
        t = t or policy.tokens_per_block
        if not policy.caches_blocks:  # nothing of it is in the index
            return np.full(n // t, -1, dtype=np.int64)
        if policy.reads_images:
            return self._core.lookup(g, req.image_hashes(policy))
        found = self._core.lookup(g, req.identities(t, 0, n // t))
        if len(found) < n // t:  # the caller's digests end sooner
            found = np.concatenate([found, np.full(n // t - len(found), -1, found.dtype)])
        return found

    def _match(
        self, req: LiveRequest, max_hit: int | None = None, restored_states: bool = False
    ) -> tuple[int, list[list[int]], int, bool]:
        """The hit length, per group the block table a request with that hit starts with,
        the longest prefix valid in any single group (see `prefix_match`), and whether
        the hit runs deeper than the state groups' cached states (``restored_states``).

        The hit is the longest p < len(prompt) (and p <= ``max_hit``), a multiple of every
        text group's block size, valid in every group (`Policy.valid_prefix_mask`, the
        vectorized `possible_prefix`). With ``restored_states`` (a caller that restores
        the state groups' states itself: a KV connector) it is the longest p valid in
        every group that holds no state, unless a state group alone is valid past it
        (then its other groups' blocks were evicted: the common hit is taken); a state
        group not valid at that p starts with no state (NULL entries).
        """
        lookups, masks, junction = self._group_masks(req)
        step = self._prefix_step
        valid = np.ones(len(req.tokens) // step, dtype=bool)
        states = np.ones_like(valid)
        limit = len(valid) if max_hit is None else max(max_hit, 0) // step
        deepest_state = 0  # the longest prefix one state group alone serves, capped
        for policy, alone in zip(self.policies, masks, strict=True):
            mask = alone.copy()
            mask[limit:] = False
            if policy.holds_state:
                states &= mask
                deepest_state = max(deepest_state, _last_valid(mask, step))
            else:
                valid &= mask
        if not any(p.caches_blocks for p in self.policies):
            valid[:] = False  # no group keeps anything a hit could reuse
        hit = _last_valid(valid & states, step)
        deep = _last_valid(valid, step) if restored_states else hit
        unit = self._state_unit
        diverged = deep > hit and deepest_state <= deep and not unit  # whole states only
        hit = deep if diverged else hit
        tables: list[list[int]] = []
        for g, policy in enumerate(self.policies):
            if fine_group(policy, unit):
                tables.append(fine_table(policy, lookups[g], unit, hit) if hit else [])
                continue
            table = [NULL_BLOCK] * (policy.hit_table_length(hit, req.images) if hit else 0)
            take = policy.hit_blocks(hit, req.images) if hit else range(0)
            if diverged and policy.holds_state and not masks[g][hit // step - 1]:
                take = range(0)  # no state cached at the hit: the caller restores it
            table[take.start : take.stop] = lookups[g][take.start : take.stop].tolist()
            tables.append(table)
        return hit, tables, junction, diverged

    def _touch_proof(self, req: LiveRequest, hit: int, now: int) -> None:
        """A proven hit used the cached blocks after it as its proof: each is taken and
        given back (last used now, and marked as having served a hit), as the hit's own
        blocks are, so a proof block that left a running request's window is not demoted
        below them and the next request with this prefix finds the proof still there."""
        assert self.config.hit_proof is not None
        stop_tokens = hit + self.config.hit_proof.steps * self._prefix_step
        for g, policy in enumerate(self.policies):
            if policy.reads_images or policy.holds_state:
                continue
            t = policy.tokens_per_block
            found = self._core.lookup(g, req.identities(t, hit // t, stop_tokens // t))
            proof = [int(b) for b in found if b >= 0]
            if proof:
                self._core.acquire(g, proof, now)
                self._core.release(g, proof, now)

    def _group_masks(self, req: LiveRequest) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        """Per group the prompt's cache lookup and which prefixes (``step``, ``2*step``,
        ...) the group alone serves, and the longest prefix any caching group that holds
        no state serves (any caching group where none does: a state group past every
        token group's prefix names no place a state is missing)."""
        n = len(req.tokens)
        step = self._prefix_step
        whole = n // step > 0 and n // step * step == n  # one token is always computed
        junction = 0
        token_groups = any(p.caches_blocks and not p.holds_state for p in self.policies)
        proof = self.config.hit_proof
        lookups: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        unit = self._state_unit
        for g, policy in enumerate(self.policies):
            # a fine group is hit inside its blocks (`jenga.substates`)
            found = self._lookup(g, policy, req, n, unit if fine_group(policy, unit) else None)
            mask = _alone(policy, found, step, unit, req)
            lookups.append(found)
            if proof is not None and (proof.groups is None or g in proof.groups):
                # speculative decoding: hits followed by cached steps
                mask = self._proven(policy, found, mask, req, whole)
            elif whole:
                mask[-1] = False
            if policy.caches_blocks and not (policy.holds_state and token_groups):
                junction = max(junction, _last_valid(mask, step))
            masks.append(mask)
        return lookups, masks, junction

    def _proven(
        self, policy: Any, found: np.ndarray, mask: np.ndarray, req: LiveRequest, whole: bool
    ) -> np.ndarray:
        """A group's proven hits on the prefix-step grid; with ``per_block`` proofs the
        proof is checked on the group's own block grid (one block past the hit)."""
        proof = self.config.hit_proof
        assert proof is not None
        step, n = self._prefix_step, len(req.tokens)
        unit = self._state_unit
        t = hit_unit(policy, unit)
        if not proof.per_block or policy.holds_state or t == step:
            return proof.proven(mask, policy.holds_state, whole)
        own = proof.proven(_alone(policy, found, t, unit, req), False, n % t == 0)
        at = np.arange(1, len(mask) + 1, dtype=np.int64) * step // t - 1
        mask = mask & own[at]
        if whole and len(mask):
            mask[-1] = False
        return mask


def _alone(policy: Any, found: np.ndarray, step: int, unit: int, req: LiveRequest) -> np.ndarray:
    """Which prefixes ``step``, ``2*step``, ... the group alone serves, from its lookup
    ``found`` (per unit for a fine group, `jenga.substates.fine_mask`; else per block)."""
    n = len(req.tokens)
    if fine_group(policy, unit):
        return fine_mask(policy, found, step, unit, n)
    return policy.valid_prefix_mask(found >= 0, step, n, req.images)


def _last_valid(mask: np.ndarray, step: int) -> int:
    """The longest prefix a mask over ``step``, ``2*step``, ... marks valid (0: none)."""
    hits = np.flatnonzero(mask)
    return int(hits[-1] + 1) * step if len(hits) else 0
