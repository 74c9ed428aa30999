"""A small pure-Python model of the C++ allocator core (`jenga._core.Core`).

Same rules, simplest data structures: lists scanned with min() instead of ordered sets,
a deepcopy snapshot instead of an undo log. The stateful tests drive both with the same
operations and require identical answers (block ids, plans, eviction orders).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

FREE, USED, CACHED = 0, 1, 2
MAP, UNMAP = 0, 1
DEMOTED_OFFSET = 1 << 62  # a demoted block ranks this much older than its last access


@dataclass
class MBlock:
    state: int = FREE
    refcount: int = 0
    hashed: bool = False
    hash: int = 0
    last: int = 0
    prefix: int = 0
    early: bool = False  # cached by allocate()'s release list of an early-release group
    demoted: bool = False  # early, and early releases are demoted
    shared: bool = False  # served a prefix hit since it was taken

    @property
    def evict_time(self) -> int:
        return self.last - DEMOTED_OFFSET if self.demoted else self.last

    @property
    def tie(self) -> int:
        """Smaller first: the longest prefix first, the shortest first for early blocks."""
        return self.prefix if self.early else -self.prefix


@dataclass
class MPage:
    mapped: bool = False
    owner: int = -1
    free: list[int] = field(default_factory=list)  # stack of free slots, top = end


@dataclass
class MGroup:
    B: int
    U: int
    pages: list[MPage] = field(default_factory=list)
    blocks: list[MBlock] = field(default_factory=list)
    free_page_ids: list[int] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)


STEP_ORDERS = {"PAPER": [1, 2, 3, 4, 5], "COMPACT": [1, 4, 2, 3, 5]}  # PINNED: not modelled


class CoreModel:
    """``rules``: the core's `jenga._core.Rules` (read by field name), the same value."""

    def __init__(self, bpp: list[int], upp: list[int], total: int, rules: Any = None):
        self.groups = [MGroup(b, u) for b, u in zip(bpp, upp, strict=True)]
        self.total = total
        self.free_units = total
        self.order = STEP_ORDERS[rules.order.name if rules is not None else "PAPER"]
        self.plan: list[tuple[int, int, int, int]] = []
        # per group: allocate()'s releases are early
        self.early = list(getattr(rules, "early_release_groups", [])) or [False] * len(bpp)
        self.demote_early = getattr(rules, "demote_window_releases", False)
        self.frugal_retry = getattr(rules, "frugal_retry", True)

    # -- derived views -----------------------------------------------------------------
    def num_cached(self, g: int, p: int) -> int:
        G = self.groups[g]
        return sum(G.blocks[p * G.B + s].state == CACHED for s in range(G.B))

    def num_used(self, g: int, p: int) -> int:
        G = self.groups[g]
        return sum(G.blocks[p * G.B + s].state == USED for s in range(G.B))

    def evictable_pages(self) -> list[tuple[int, int, int, int]]:
        """(newest access, -longest prefix of that access, group, page), evicted in order."""
        out = []
        for g, G in enumerate(self.groups):
            for p, P in enumerate(G.pages):
                if P.mapped and self.num_cached(g, p) > 0 and self.num_used(g, p) == 0:
                    cached = [
                        G.blocks[p * G.B + s]
                        for s in range(G.B)
                        if G.blocks[p * G.B + s].state == CACHED
                    ]
                    newest = max(k.evict_time for k in cached)
                    tie = min(k.tie for k in cached if k.evict_time == newest)
                    out.append((newest, tie, g, p))
        return sorted(out)

    def eviction_order(self, g: int) -> list[int]:
        G = self.groups[g]
        keys = [(k.evict_time, k.tie, b) for b, k in enumerate(G.blocks) if k.state == CACHED]
        return [b for _, _, b in sorted(keys)]

    def page_eviction_order(self) -> list[tuple[int, int]]:
        return [(g, p) for _, _, g, p in self.evictable_pages()]

    def pages_with_free(self, g: int) -> list[tuple[int, int]]:
        G = self.groups[g]
        return sorted((P.owner, p) for p, P in enumerate(G.pages) if P.mapped and P.free)

    # -- primitives --------------------------------------------------------------------
    def map_page(self, g: int, owner: int, reused: int) -> int:
        G = self.groups[g]
        if G.free_page_ids:
            p = G.free_page_ids.pop()
        else:
            p = len(G.pages)
            G.pages.append(MPage(free=list(range(G.B - 1, -1, -1))))
            G.blocks.extend(MBlock() for _ in range(G.B))
        G.pages[p].mapped = True
        G.pages[p].owner = owner
        self.free_units -= G.U
        self.plan.append((MAP, g, p, reused))
        return p

    def unmap_page(self, g: int, p: int) -> None:
        G = self.groups[g]
        assert len(G.pages[p].free) == G.B
        G.pages[p].mapped = False
        G.free_page_ids.append(p)
        self.free_units += G.U
        self.plan.append((UNMAP, g, p, 0))

    def take(self, g: int, p: int, now: int) -> int:
        G = self.groups[g]
        b = p * G.B + G.pages[p].free.pop()
        G.blocks[b] = MBlock(USED, 1, False, 0, now, 0)
        return b

    def push_free(self, g: int, b: int) -> None:
        G = self.groups[g]
        G.blocks[b].state = FREE
        G.pages[b // G.B].free.append(b % G.B)

    def uncache(self, g: int, b: int) -> None:
        G = self.groups[g]
        k = G.blocks[b]
        del G.index[k.hash]
        k.hashed = False
        k.state = -1  # limbo

    def release_one(self, g: int, b: int, now: int, early: bool = False) -> None:
        G = self.groups[g]
        k = G.blocks[b]
        k.refcount -= 1
        if k.refcount > 0:
            return
        k.last = now
        k.early = early
        k.demoted = early and self.demote_early and not k.shared
        if k.hashed:
            k.state = CACHED
            return
        self.push_free(g, b)
        if len(G.pages[b // G.B].free) == G.B:
            self.unmap_page(g, b // G.B)

    # -- API -------------------------------------------------------------------------
    def validate_release(self, g: int, blocks: list[int]) -> None:
        G = self.groups[g]
        need: dict[int, int] = {}
        for b in blocks:
            need[b] = need.get(b, 0) + 1
            if not 0 <= b < len(G.blocks) or G.blocks[b].state != USED:
                raise ValueError(b)
            if G.blocks[b].refcount < need[b]:
                raise ValueError(b)

    def release(self, g: int, blocks: list[int], now: int) -> None:
        self.validate_release(g, blocks)
        for b in reversed(blocks):
            self.release_one(g, b, now)

    def allocate(
        self, owner: int, counts: list[int], now: int, releases: list[list[int]]
    ) -> list[list[int]] | None:
        for g, rel in enumerate(releases):
            self.validate_release(g, rel)
        snapshot = copy.deepcopy((self.groups, self.free_units, len(self.plan)))
        for g, rel in enumerate(releases):
            for b in reversed(rel):
                self.release_one(g, b, now, self.early[g])
        released = copy.deepcopy((self.groups, self.free_units, len(self.plan)))
        out = self.allocate_groups(owner, counts, now, self.order, frugal=False)
        if out is None:
            self.groups, self.free_units, plan_len = released
            del self.plan[plan_len:]
            if self.frugal_retry and self.may_fit_frugally(counts):
                self.set_frugal_reserve(counts)
                order = [1, 7, 8, 4, 5, 2, 3]  # 7, 8: steps 2, 3 with spare units only
                out = self.allocate_groups(owner, counts, now, order, frugal=True)
        if out is None:
            self.groups, self.free_units, plan_len = snapshot
            del self.plan[plan_len:]
        return out

    def allocate_groups(
        self, owner: int, counts: list[int], now: int, order: list[int], frugal: bool
    ) -> list[list[int]] | None:
        out: list[list[int]] = []
        for g, n in enumerate(counts):
            got: list[int] = []
            while n > 0:
                for step in order:
                    k = self.try_step(step, g, owner, n, now, got, frugal)
                    if k is not None:
                        n -= k
                        break
                else:
                    return None
            out.append(got)
        return out

    def may_fit_frugally(self, counts: list[int]) -> bool:
        """Frugal retry's bound: pages still short after every free/cached block fit."""
        pool = self.free_units + sum(self.groups[h].U for _, _, h, _ in self.evictable_pages())
        need = 0
        for g, n in enumerate(counts):
            G = self.groups[g]
            costless = sum(
                k.state == CACHED or (G.pages[b // G.B].mapped and k.state == FREE)
                for b, k in enumerate(G.blocks)
            )
            short = n - costless
            if short > 0:
                need += -(-short // G.B) * G.U
        return need <= pool

    def costless(self, g: int) -> int:
        """Free or cached blocks of g on mapped pages that are not wholly evictable."""
        G = self.groups[g]
        evictable = {p for _, _, h, p in self.evictable_pages() if h == g}
        return sum(
            (k.state == CACHED or (G.pages[b // G.B].mapped and k.state == FREE))
            and b // G.B not in evictable
            for b, k in enumerate(G.blocks)
        )

    def min_units(self, g: int, n: int) -> int:
        G = self.groups[g]
        return -(-max(0, n - self.costless(g)) // G.B) * G.U

    def set_frugal_reserve(self, counts: list[int]) -> None:
        self.reserve = [
            sum(self.min_units(h, counts[h]) for h in range(g + 1, len(counts)))
            for g in range(len(counts))
        ]

    def spare(self, g: int, n: int) -> bool:
        G = self.groups[g]
        pool = self.free_units + sum(self.groups[h].U for _, _, h, _ in self.evictable_pages())
        return pool - G.U >= self.reserve[g] + self.min_units(g, max(0, n - G.B))

    def try_step(
        self, step: int, g: int, owner: int, n: int, now: int, got: list[int], frugal: bool
    ) -> int | None:
        G = self.groups[g]
        pwf = self.pages_with_free(g)
        if frugal:  # wholly evictable pages are kept for step 3
            evictable = {p for _, _, h, p in self.evictable_pages() if h == g}
            pwf = [(o, p) for o, p in pwf if p not in evictable]
        if step in (7, 8):
            if not self.spare(g, n):
                return None
            step -= 5
        if step == 1:
            own = [p for o, p in pwf if o == owner]
            if not own:
                return None
            page = own[0]
        elif step == 2:
            if self.free_units < G.U:
                return None
            page = self.map_page(g, owner, 0)
        elif step == 3:
            reused = self.evict_pages_for(g)
            if reused is None:
                return None
            page = self.map_page(g, owner, reused)
        elif step == 4:
            if not pwf:
                return None
            page = pwf[0][1]
        else:
            order = self.eviction_order(g)
            if frugal:
                order = [b for b in order if b // G.B not in evictable]
            if not order:
                return None
            b = order[0]
            self.uncache(g, b)
            G.blocks[b] = MBlock(USED, 1, False, 0, now, 0)
            got.append(b)
            return 1
        k = min(n, len(G.pages[page].free))
        for _ in range(k):
            got.append(self.take(g, page, now))
        return k

    def evict_pages_for(self, g: int) -> int | None:
        need = self.groups[g].U
        pages = self.evictable_pages()
        units = sum(self.groups[h].U for _, _, h, _ in pages)
        if self.free_units >= need or self.free_units + units < need:
            return None
        before = self.free_units
        while self.free_units < need:
            _, _, h, p = self.evictable_pages()[0]
            H = self.groups[h]
            for s in range(H.B):
                b = p * H.B + s
                if H.blocks[b].state == CACHED:
                    self.uncache(h, b)
                    self.push_free(h, b)
            self.unmap_page(h, p)
        return min(need, self.free_units - before)

    def acquire(self, g: int, blocks: list[int], now: int) -> None:
        G = self.groups[g]
        for b in blocks:
            if not 0 <= b < len(G.blocks) or G.blocks[b].state not in (USED, CACHED):
                raise ValueError(b)
        for b in blocks:
            k = G.blocks[b]
            k.state = USED
            k.refcount += 1
            k.last = now
            k.shared = True

    def commit(self, g: int, blocks: list[int], hashes: list[int], prefixes: list[int]) -> int:
        G = self.groups[g]
        for b in blocks:
            if not 0 <= b < len(G.blocks) or G.blocks[b].state != USED:
                raise ValueError(b)
        added = 0
        for b, h, p in zip(blocks, hashes, prefixes, strict=True):
            k = G.blocks[b]
            if k.hashed or h in G.index:
                continue
            G.index[h] = b
            k.hashed, k.hash, k.prefix = True, h, p
            added += 1
        return added

    def lookup(self, g: int, hashes: list[int]) -> list[int]:
        return [self.groups[g].index.get(h, -1) for h in hashes]

    def drain_plan(self) -> list[tuple[int, int, int, int]]:
        out, self.plan = self.plan, []
        return out
