"""A small pure-Python model of the C++ allocator core (`jenga._core.Core`).

Same rules, simplest data structures: lists scanned with min() instead of ordered sets,
a copied snapshot instead of an undo log. The stateful tests drive both with the same
operations and require identical answers (block ids, plans, eviction orders).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
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

    def copy(self) -> MBlock:
        c = object.__new__(MBlock)
        c.__dict__.update(self.__dict__)
        return c

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

    def copy(self) -> MGroup:
        """A deep copy (by hand: copy.deepcopy was most of a replay's time)."""
        return MGroup(
            self.B,
            self.U,
            [MPage(P.mapped, P.owner, P.free[:]) for P in self.pages],
            [k.copy() for k in self.blocks],
            self.free_page_ids[:],
            dict(self.index),
        )


# Step ids as in the core: 1-5 the paper's steps; 6: step 5 on pages that are not wholly
# evictable; 7, 8: steps 2, 3 while their units are spare (frugal); 9: step 5 on the
# group's own demoted blocks on pinned pages, under pressure (window-release reuse);
# 10: a demoted block on the pinned page with the most used blocks (window packing).
STEP_ORDERS = {
    "PAPER": [1, 2, 3, 4, 5],
    "COMPACT": [1, 4, 2, 3, 5],
    "PINNED": [1, 4, 2, 6, 3, 5],
}
FRUGAL_ORDER = [1, 7, 8, 4, 5, 2, 3]
PACK_ORDER = [10, 1, 4, 2, 6, 3, 5]  # pack_window_blocks: the blocks a request keeps
REUSE_PRESSURE = 4  # step 9 runs while less than 1/4 of the pool is free


@dataclass
class Call:
    """One group's allocation as the steps see it: n blocks still to take into got."""

    g: int
    owner: int
    n: int
    now: int
    got: list[int]
    frugal: bool


class CoreModel:
    """``rules``: the core's `jenga._core.Rules` (read by field name), the same value.

    Every rule of the core's ``JENGA_RULES`` is modelled: the order (PAPER, COMPACT,
    PINNED), ``frugal_retry``, ``demote_window_releases``, ``reuse_window_releases``
    (step 9 right after step 4), ``pinned_lru_fair`` (step 6 yields to an older wholly
    evictable page), ``pack_window_blocks`` with ``window_blocks`` (a call's last kept
    blocks in `PACK_ORDER`), ``early_release_groups`` and ``retention_interval`` with
    ``retention_reach`` (an early block no retention boundary reads is demoted).
    """

    # False: ``pinned_lru_fair`` is ignored (the model as it was before it knew the rule;
    # a test shows that this model diverges from the core)
    knows_pinned_lru_fair = True
    # False: the retention rule is ignored (a test shows that this model diverges)
    knows_retention = True

    def __init__(self, bpp: list[int], upp: list[int], total: int, rules: Any = None):
        self.groups = [MGroup(b, u) for b, u in zip(bpp, upp, strict=True)]
        self.total = total
        self.free_units = total
        self.plan: list[tuple[int, int, int, int]] = []
        self.aside: set[int] = set()  # blocks set aside by pinned_lru_top (one group's call)
        self.reserve: list[int] = []
        # times each step id served (kept across rollbacks), and step 6's yields to step 3
        self.served: Counter[int | str] = Counter()
        self.steps: dict[int, Callable[[Call], int | None]] = {  # by the core's step ids
            1: self.step_own_free,
            2: self.step_new_page,
            3: self.step_evict_pages,
            4: self.step_any_free,
            5: self.step_evict_block,
            6: self.step_evict_pinned,
            7: self.step_new_page_spare,
            8: self.step_evict_pages_spare,
            9: self.step_reuse_demoted,
            10: self.step_pack,
        }
        self.set_rules(bpp, rules)

    def set_rules(self, bpp: list[int], rules: Any) -> None:
        order = list(STEP_ORDERS[rules.order.name if rules is not None else "PAPER"])
        if getattr(rules, "reuse_window_releases", False):
            order.insert(order.index(4) + 1, 9)  # right after step 4
        self.order = order
        # per group: allocate()'s releases are early
        self.early = list(getattr(rules, "early_release_groups", [])) or [False] * len(bpp)
        self.demote_early = getattr(rules, "demote_window_releases", False)
        self.frugal_retry = getattr(rules, "frugal_retry", True)
        self.lru_fair = self.knows_pinned_lru_fair and getattr(rules, "pinned_lru_fair", False)
        window = list(getattr(rules, "window_blocks", [])) or [0] * len(bpp)
        self.kept = window if getattr(rules, "pack_window_blocks", False) else [0] * len(bpp)
        self.interval = getattr(rules, "retention_interval", 0)
        self.reach = list(getattr(rules, "retention_reach", [])) or [-1] * len(bpp)

    def retained(self, g: int, prefix: int) -> bool:
        """A hit at the first multiple of the retention interval at or after ``prefix``
        reads the block (always, with retention off or for a group it does not thin)."""
        if not self.knows_retention or self.interval <= 0 or self.reach[g] < 0:
            return True
        return -prefix % self.interval < self.reach[g]

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
                if not P.mapped:
                    continue
                blocks = G.blocks[p * G.B : (p + 1) * G.B]
                cached = [k for k in blocks if k.state == CACHED]
                if cached and all(k.state != USED for k in blocks):
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
        thinned = not self.retained(g, k.prefix)
        k.demoted = early and not k.shared and (self.demote_early or thinned)
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
        snapshot = self.snapshot()
        for g, rel in enumerate(releases):
            for b in reversed(rel):
                self.release_one(g, b, now, self.early[g])
        released = self.snapshot()
        out = self.allocate_groups(owner, counts, now, self.order, frugal=False)
        if out is None:
            self.restore(released)
            if self.frugal_retry and self.may_fit_frugally(counts):
                self.set_frugal_reserve(counts)
                out = self.allocate_groups(owner, counts, now, FRUGAL_ORDER, frugal=True)
        if out is None:
            self.restore(snapshot)
        return out

    def snapshot(self) -> tuple[list[MGroup], int, int]:
        return [G.copy() for G in self.groups], self.free_units, len(self.plan)

    def restore(self, snapshot: tuple[list[MGroup], int, int]) -> None:
        """Back to a snapshot (each is restored at most once: it is not copied again)."""
        self.groups, self.free_units, plan_len = snapshot
        del self.plan[plan_len:]

    def allocate_groups(
        self, owner: int, counts: list[int], now: int, order: list[int], frugal: bool
    ) -> list[list[int]] | None:
        out: list[list[int]] = []
        for g, n in enumerate(counts):
            got: list[int] = []
            kept = 0 if frugal else min(n, self.kept[g])
            if not (
                self.serve(g, owner, n - kept, now, got, order, frugal)
                and self.serve(g, owner, kept, now, got, PACK_ORDER, frugal)
            ):
                return None
            out.append(got)
        return out

    def serve(
        self, g: int, owner: int, n: int, now: int, got: list[int], order: list[int], frugal: bool
    ) -> bool:
        """One group's n blocks into got, trying ``order``'s steps first to last."""
        ok = True
        while ok and n > 0:
            ok = False
            for step in order:
                k = self.steps[step](Call(g, owner, n, now, got, frugal))
                if k is not None:
                    self.served[step] += 1
                    n -= k
                    ok = True
                    break
        self.aside.clear()  # the core puts its set-aside heap entries back per group
        return ok

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
        evictable = self.evictable_page_set(g)
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

    def evictable_page_set(self, g: int) -> set[int]:
        return {p for _, _, h, p in self.evictable_pages() if h == g}

    # -- the steps: each serves some of the call's blocks (their count) or returns None ----
    def free_pages(self, c: Call) -> list[tuple[int, int]]:
        """(owner, page) of g's pages with a free block; frugal: not wholly evictable."""
        pwf = self.pages_with_free(c.g)
        if c.frugal:  # wholly evictable pages are kept for step 3
            evictable = self.evictable_page_set(c.g)
            pwf = [(o, p) for o, p in pwf if p not in evictable]
        return pwf

    def take_run(self, c: Call, page: int) -> int:
        k = min(c.n, len(self.groups[c.g].pages[page].free))
        for _ in range(k):
            c.got.append(self.take(c.g, page, c.now))
        return k

    def step_own_free(self, c: Call) -> int | None:  # 1
        own = [p for o, p in self.free_pages(c) if o == c.owner]
        return self.take_run(c, own[0]) if own else None

    def step_new_page(self, c: Call) -> int | None:  # 2
        if self.free_units < self.groups[c.g].U:
            return None
        return self.take_run(c, self.map_page(c.g, c.owner, 0))

    def step_evict_pages(self, c: Call) -> int | None:  # 3
        reused = self.evict_pages_for(c.g)
        if reused is None:
            return None
        return self.take_run(c, self.map_page(c.g, c.owner, reused))

    def step_any_free(self, c: Call) -> int | None:  # 4
        pwf = self.free_pages(c)
        return self.take_run(c, pwf[0][1]) if pwf else None

    def step_evict_block(self, c: Call) -> int | None:  # 5 (frugal: on pinned pages only)
        b = self.pinned_lru_top(c.g) if c.frugal else self.lru_top(c.g)
        return None if b is None else self.reuse_cached(c, b)

    def step_evict_pinned(self, c: Call) -> int | None:  # 6: step 5 on pinned pages
        b = self.pinned_lru_top(c.g)
        if b is None:
            return None
        if self.lru_fair:  # an older wholly evictable page goes first (step 3)
            pages = self.evictable_pages()
            if pages and pages[0][0] < self.groups[c.g].blocks[b].evict_time:
                self.served["lru_fair_yield"] += 1
                return None
        return self.reuse_cached(c, b)

    def step_new_page_spare(self, c: Call) -> int | None:  # 7: step 2 with spare units
        return self.step_new_page(c) if self.spare(c.g, c.n) else None

    def step_evict_pages_spare(self, c: Call) -> int | None:  # 8: step 3 with spare units
        return self.step_evict_pages(c) if self.spare(c.g, c.n) else None

    def step_reuse_demoted(self, c: Call) -> int | None:  # 9: own demoted blocks, pinned pages
        if self.free_units * REUSE_PRESSURE >= self.total:
            return None
        b = self.pinned_lru_top(c.g)
        if b is None or not self.groups[c.g].blocks[b].demoted:
            return None
        return self.reuse_cached(c, b)

    def step_pack(self, c: Call) -> int | None:  # 10: densest pinned page's demoted block
        G = self.groups[c.g]
        evictable = self.evictable_page_set(c.g)
        best: tuple[int, int, int] | None = None  # (-used, last access, block)
        for p, P in enumerate(G.pages):
            if not P.mapped or p in evictable:
                continue
            blocks = G.blocks[p * G.B : (p + 1) * G.B]
            used = sum(k.state == USED for k in blocks)
            for j, k in enumerate(blocks):
                if k.state == CACHED and k.demoted:
                    key = (-used, k.last, p * G.B + j)
                    best = key if best is None or key < best else best
        return None if best is None else self.reuse_cached(c, best[2])

    def lru_top(self, g: int) -> int | None:
        """The least recently used cached block not set aside in this group's call."""
        return next((b for b in self.eviction_order(g) if b not in self.aside), None)

    def pinned_lru_top(self, g: int) -> int | None:
        """The least recently used cached block on a page that is not wholly evictable.
        Blocks of wholly evictable pages met on the way are set aside until the group is
        served (the core moves their heap entries aside: later steps of the same group
        do not see them, even after their page stops being evictable)."""
        G = self.groups[g]
        evictable = self.evictable_page_set(g)
        for b in self.eviction_order(g):
            if b in self.aside:
                continue
            if b // G.B not in evictable:
                return b
            self.aside.add(b)
        return None

    def reuse_cached(self, c: Call, b: int) -> int:
        self.uncache(c.g, b)
        self.groups[c.g].blocks[b] = MBlock(USED, 1, False, 0, c.now, 0)
        c.got.append(b)
        return 1

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
