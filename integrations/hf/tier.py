"""The host tier of `VmmCache`: idle conversations' caches offloaded to host memory.

Rationale
    A chat keeps one cache per conversation and hands it back to ``generate()`` with the
    extended prompt, so only the new turn is prefilled. Several conversations on one chunk
    pool (``VmmCache(pool=...)``) hold their K/V between turns while most of them wait for
    the user; when the pool cannot give a generating cache the chunks it needs, an idle
    conversation's K/V moves to host memory instead of being lost (CaR's second tier, per
    conversation rather than per prefix block: a `VmmCache` has no prefix cache), and comes
    back before that conversation's next forward touches it.

Approach
    One `ConversationTier` per chunk pool (every `VmmCache` built with that ``pool`` and
    tier options joins it; options must agree). Each cache is a `Member`; the members sit
    in a `jenga.tier.ReplacementOrder` under the tier's `TierRules` (LRU: the least
    recently used conversation first; ``"score"``: CaR's scores, below). ::

        cache A's forward: RowStore.ensure ─► begin(A): A on host? reload it (its rows
            re-registered, their blocks allocated, every block's bytes copied back)
        RowStore.grow_row ─► make_room(A, need): while mapped + need > high_water x budget,
            offload the policy's first idle member on the GPU (not A): copy every live
            block of its rows (all ranges) to one host buffer, free its rows

    A member is idle when it is not the one allocating: forwards run one at a time (one
    thread), and a forward's first layer allocates for the whole forward, so no other
    cache is inside a forward then. A full host tier drops entries in the same order
    among the host-resident members and the victim itself: a dropped member's K/V is gone,
    and its next use raises `CacheDropped` naming it (there are no token ids to recompute
    from). Scores (``"score"``): a forward adding more than one token per row starts a
    turn (+``window_gain`` +``sent_gain``: the request enters and is sent at once, HF
    has no queue); `VmmCache.end_turn` is the completion (-``complete_loss``).

Limitations
    Attention groups only (full, sliding window, chunked): a model with state or
    cross-attention groups is refused. Copies are synchronous, block by block (bytes of
    one block per range at a time); rows that share blocks (beam forks) are copied once
    per row and come back unshared. A turn whose prompt extension is one token does not
    count as a turn for the score policy. One thread drives all members.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from jenga.requests import NULL_BLOCK
from jenga.tier import ReplacementOrder

import vmm
from integrations.kvcache.tier import HostTierConfig


class Rows(Protocol):
    """What the tier needs of a cache's rows (`integrations.hf.cache.RowStore`)."""

    num_rows: int
    row_lengths: list[int]

    @property
    def is_open(self) -> bool: ...

    @property
    def kv(self) -> Any: ...

    def request(self, row: int) -> int: ...

    def table(self, row: int, group: int) -> list[int]: ...

    def grow_row(self, row: int, missing: int) -> None: ...


GPU, HOST, RELOADING, DROPPED = "gpu", "host", "reloading", "dropped"
_COUNTERS = ("tier.offloads", "tier.offload.bytes", "tier.reloads", "tier.reload.bytes",
             "tier.dropped", "tier.dropped.bytes")  # fmt: skip
_ids = itertools.count(1)


class CacheDropped(RuntimeError):
    """A conversation's K/V left the GPU while the host tier was full: it is gone."""


@dataclass(eq=False)
class Member:
    """One `VmmCache` in a tier: where its rows' K/V is, and its host copy."""

    key: int
    name: str
    store: Rows
    state: str = GPU
    host: torch.Tensor | None = None
    blocks: list[tuple[int, int, int]] = field(default_factory=list)  # (row, group, index)
    offloads: int = 0
    reloads: int = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.host is None else self.host.numel()


class ConversationTier:
    """The host tier shared by the `VmmCache` objects of one chunk pool (module note)."""

    def __init__(self, config: HostTierConfig) -> None:
        self.config, self.rules = config, config.rules
        self.members: dict[int, Member] = {}
        self.scores: dict[Hashable, int] = {}
        self.order = ReplacementOrder(self.rules.policy, lambda key: self.scores.get(key, 0))
        self.host_bytes = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)

    # ---- membership ------------------------------------------------------------------
    def join(self, store: Rows, name: str | None) -> Member:
        key = next(_ids)
        member = Member(key, name or f"VmmCache #{key}", store)
        self.members[key] = member
        self.order.add(key)
        return member

    def leave(self, member: Member) -> None:
        """The cache closed: its host copy (if any) is released."""
        self._release_host(member)
        self.members.pop(member.key, None)
        if member.key in self.order:
            self.order.remove(member.key)
        self.scores.pop(member.key, None)

    # ---- the generating member -------------------------------------------------------
    def begin(self, member: Member, new_tokens: int) -> None:
        """``member``'s forward adds ``new_tokens`` per row: reload it if it is on the
        host (raise `CacheDropped` if its K/V was dropped); a use in the policy's order;
        more than one token starts a turn (score events)."""
        self.check_usable(member)
        if member.state == HOST:
            self.reload(member)
        if new_tokens > 1:
            self._rescore(member, self.rules.window_gain + self.rules.sent_gain)
        self.order.touch(member.key)

    def end_turn(self, member: Member) -> None:
        if member.key in self.order:  # not closed, not dropped
            self._rescore(member, -self.rules.complete_loss)

    def _rescore(self, member: Member, delta: int) -> None:
        self.scores[member.key] = self.scores.get(member.key, 0) + delta
        self.order.rescore(member.key)

    def check_usable(self, member: Member) -> None:
        if member.state == DROPPED:
            raise CacheDropped(
                f"{member.name}: its K/V was dropped when it left the GPU with the host tier "
                f"full ({self.host_bytes} of {self.config.size_bytes} B held); this "
                "conversation cannot continue: start it again with a new cache"
            )

    def make_room(self, member: Member, need: int) -> None:
        """Offload idle members (policy order) while the pool's mapped chunks plus ``need``
        exceed the high-water mark; stops when no idle member is left on the GPU."""
        pool = member.store.kv.pool
        target = math.floor(self.rules.high_water * (pool.budget_bytes // pool.granularity))
        while pool.num_mapped + need > target:
            victim = next(self.order.order(lambda k: self._idle(k, member, pool)), None)
            if victim is None:
                return
            self.offload(self.members[victim])  # type: ignore[index]

    def _idle(self, key: Hashable, member: Member, pool: Any) -> bool:
        other = self.members[key]  # type: ignore[index]
        store = other.store
        return (
            other is not member and other.state == GPU and store.is_open
            and store.num_rows > 0 and store.kv.pool is pool
        )  # fmt: skip

    # ---- moves -----------------------------------------------------------------------
    def offload(self, member: Member) -> None:
        """Copy ``member``'s live blocks to host memory and free its rows; when the host
        tier cannot hold them, the policy's host entries (or ``member`` itself) drop."""
        store = member.store
        kv = store.kv
        blocks = [
            (row, g, i)
            for row in range(store.num_rows)
            for g in range(len(kv.geometries))
            for i, b in enumerate(store.table(row, g))
            if b != NULL_BLOCK
        ]
        nbytes = sum(kv.geometries[g].small_page_bytes * len(kv.ranges[g]) for _, g, _ in blocks)
        if not self._host_room(member, nbytes):
            self._free_rows(member)
            member.state = DROPPED
            self.counters["tier.dropped"] += 1
            self.counters["tier.dropped.bytes"] += nbytes
            self.order.remove(member.key)
            return
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=_on_cuda(kv))
        pos = 0
        for row, g, i in blocks:
            pos = self._copy_block(kv, g, store.table(row, g)[i], host, pos, to_host=True)
        member.host, member.blocks = host, blocks
        self.host_bytes += nbytes
        self._free_rows(member)
        member.state = HOST
        member.offloads += 1
        self.counters["tier.offloads"] += 1
        self.counters["tier.offload.bytes"] += nbytes

    def _host_room(self, member: Member, nbytes: int) -> bool:
        """Drop host entries, in the policy's order, until ``nbytes`` fit; False when
        ``member`` itself comes first (or never fits)."""
        while self.host_bytes + nbytes > self.config.size_bytes:
            first = next(
                self.order.order(lambda k: k == member.key or self.members[k].state == HOST),  # type: ignore[index]
                None,
            )
            if first is None or first == member.key:
                return False
            dropped = self.members[first]  # type: ignore[index]
            self.counters["tier.dropped"] += 1
            self.counters["tier.dropped.bytes"] += dropped.nbytes
            self._release_host(dropped)
            dropped.state = DROPPED
            self.order.remove(dropped.key)
        return True

    def _free_rows(self, member: Member) -> None:
        store = member.store
        for row in range(store.num_rows):
            store.kv.free(store.request(row))

    def reload(self, member: Member) -> None:
        """Register ``member``'s rows again, allocate their tokens (offloading others if
        the pool needs room; its own host copy is not a victim meanwhile) and copy every
        block back. On failure its rows are freed again and it stays on the host (its
        copy intact)."""
        store, host = member.store, member.host
        assert host is not None and member.state == HOST
        kv = store.kv
        added: list[int] = []
        member.state = RELOADING  # its host copy is read: not a host victim meanwhile
        try:
            for row in range(store.num_rows):
                rid = store.request(row)
                kv.add_request(rid, [0], use_cache=False)
                added.append(row)
                length = store.row_lengths[row]
                if length:
                    store.grow_row(row, length)
            pos = 0
            for row, g, i in member.blocks:
                table = store.table(row, g)
                if i >= len(table) or table[i] == NULL_BLOCK:
                    raise RuntimeError(
                        f"{member.name}: row {row} group {g} block {i} is not allocated on reload"
                    )
                pos = self._copy_block(kv, g, table[i], host, pos, to_host=False)
        except BaseException:
            for row in added:
                kv.free(store.request(row))
            member.state = HOST
            raise
        self.counters["tier.reloads"] += 1
        self.counters["tier.reload.bytes"] += host.numel()
        member.reloads += 1
        member.state = GPU
        self._release_host(member)

    def _release_host(self, member: Member) -> None:
        if member.host is not None:
            self.host_bytes -= member.host.numel()
            member.host, member.blocks = None, []

    @staticmethod
    def _copy_block(kv: Any, g: int, block: int, host: torch.Tensor, pos: int, *,
                    to_host: bool) -> int:  # fmt: skip
        """Copy ``block`` of group ``g`` (every range) to or from ``host[pos:]``."""
        geo = kv.geometries[g]
        size, offset = geo.small_page_bytes, geo.block_offset(block)
        for rng in kv.ranges[g]:
            gpu = rng.tensor((size,), torch.uint8, offset)
            if to_host:
                host[pos : pos + size].copy_(gpu)
            else:
                gpu.copy_(host[pos : pos + size])
            pos += size
        return pos

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["tier.host.bytes.current"] = self.host_bytes
        out["tier.host.members.current"] = sum(m.state == HOST for m in self.members.values())
        out["tier.members.current"] = len(self.members)
        return out


def _on_cuda(kv: Any) -> bool:
    """Whether the cache's memory is on a CUDA device (host copies then page-locked)."""
    return bool(kv.layer_view(kv.geometries[0].layer_ids[0]).device.type == "cuda")


_TIERS: weakref.WeakKeyDictionary[vmm.ChunkPool, ConversationTier] = weakref.WeakKeyDictionary()


def tier_for(pool: vmm.ChunkPool | None, config: HostTierConfig) -> ConversationTier:
    """The tier of ``pool`` (one per pool; a new one for a cache's own pool). Caches of
    one pool must give the same tier options (ValueError naming both)."""
    if pool is None:
        return ConversationTier(config)
    tier = _TIERS.get(pool)
    if tier is None:
        tier = _TIERS[pool] = ConversationTier(config)
        return tier
    old = tier.config
    if (old.size_bytes, old.rules) != (config.size_bytes, config.rules):
        raise ValueError(
            f"VmmCache tier options (tier_bytes={config.size_bytes}, "
            f"policy={config.rules.policy.value}, high_water={config.rules.high_water}) differ "
            f"from the tier of this pool (tier_bytes={old.size_bytes}, "
            f"policy={old.rules.policy.value}, high_water={old.rules.high_water})"
        )
    return tier
