"""A host memory tier for the simulator: the link to it, its configuration, its contents.

Rationale
    KV reuse across requests is bounded by GPU memory: once the prefix cache is full,
    the next cached block to arrive evicts one, and a later request that needed it
    recomputes it. A second, larger tier in host memory (or a CXL device) keeps evicted
    blocks; a hit there costs a transfer over PCIe / CXL instead of a prefill, which for
    long prompts is several times cheaper. CaR (a multi-tier KV reuse system) adds two
    ideas on top: a replacement policy fed by the scheduler (a block some queued request
    will read is not evicted) and a prefetcher that starts the transfer while the request
    still waits. This module holds what the tier *is*; `jenga.sim.tier_engine` drives it.

Approach
    `Link`: one direction of the GPU <-> host link, ``latency + bytes / bandwidth`` per
    transfer; `LINKS` names PCIe 4.0 / 5.0 x16 and a CXL device. Transfers in one
    direction run one after another (`Link` users keep a busy-until time per direction;
    PCIe is full duplex, so offloads do not delay reloads).

    `TierConfig`: the tier's size, the host's memory (the tier must fit in it), the
    replacement policy, the high-water mark above which cached GPU blocks are offloaded
    in the background (CaR: 90 %), the scheduler window, prefetch on/off, layer-pipelined
    reloads on/off and write-through (vLLM's CPU offloading stores every computed block).
    Bad values are refused at construction with `TierError`, naming them.

    `HostTier`: block key -> `HostEntry` (size in bytes, when its copy is complete,
    pinned while a reload reads it). Which entry leaves is the replacement order of the
    mini engine's host tier, `jenga.tier.ReplacementOrder` (one implementation of both
    policies): buckets by priority, each least recently used first, the victim the first
    unpinned entry of the smallest bucket. ``lru`` puts every entry in bucket 0, ``score``
    in bucket ``score(key)`` where the score is CaR's: +1 when a request that reads the
    block enters the scheduler's window, +1 when it is sent to the GPU, -2 when it
    completes (so a block's score is the number of windowed plus running requests that
    read it); ties go to the least recently used (a rescore counts as a use). What this
    module adds is sizes: an insert evicts in that order until the new entry's bytes fit.

Limitations
    One link per direction, no contention with other traffic (CaR's GPU-direct CXL path);
    no compression of what is moved (CaR's optional sparsification is not modelled).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from jenga.sim.hardware import GB, GiB
from jenga.sim.protocol import SimError
from jenga.tier import ReplacementOrder, TierPolicy


class TierError(SimError):
    """A host tier configuration that cannot exist (sizes, high-water mark, policy...)."""


@dataclass(frozen=True)
class Link:
    """One direction of the GPU <-> host link."""

    name: str
    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not 0 < self.bytes_per_s < math.inf:
            raise TierError(f"link {self.name}: bandwidth must be > 0 B/s, got {self.bytes_per_s}")
        if not 0 <= self.latency_s < math.inf:
            raise TierError(f"link {self.name}: latency must be >= 0 s, got {self.latency_s}")

    def transfer_s(self, num_bytes: int) -> float:
        """Seconds to move ``num_bytes`` (0 for nothing)."""
        return self.latency_s + num_bytes / self.bytes_per_s if num_bytes > 0 else 0.0


# Effective DMA bandwidth, not the signalling rate: PCIe 4.0 x16 signals 32 GB/s and
# pinned-memory copies reach about 25 GB/s; PCIe 5.0 x16 about 50 GB/s. The CXL entry is
# CaR's figure ("CXL 3.0 can support 64 GB/s") with a device-side latency of 2 us.
LINKS: dict[str, Link] = {
    "pcie4": Link("PCIe 4.0 x16", 25 * GB, 10e-6),
    "pcie5": Link("PCIe 5.0 x16", 50 * GB, 10e-6),
    "cxl": Link("CXL 3.0 x16", 64 * GB, 2e-6),
}

POLICY_NAMES = ("lru", "score")


@dataclass(frozen=True)
class TierConfig:
    """The host tier of one run (see the module note)."""

    host_bytes: int
    host_memory_bytes: int
    link: Link = LINKS["pcie4"]
    policy: str = "lru"
    high_water: float = 0.9  # offload cached GPU blocks in the background above this share
    window: int = 8  # CaR's scheduler window: requests at the queue front seen ahead
    prefetch: bool = False  # CaR's prefetcher: reload while the request waits in the window
    pipelined: bool = True  # reload layer by layer, overlapping the prefill's compute
    # CaR's priority classes inside the window: GPU-resident history first, no history
    # second, history on the host last (stable within a class)
    window_priority: bool = False
    write_through: bool = False  # vLLM CPU offloading: store every computed block at once

    def __post_init__(self) -> None:
        if self.host_bytes <= 0:
            raise TierError(f"host tier size must be > 0 bytes, got {self.host_bytes}")
        if self.host_bytes > self.host_memory_bytes:
            raise TierError(
                f"host tier of {self.host_bytes} bytes ({self.host_bytes / GiB:.1f} GiB) exceeds "
                f"the host memory of {self.host_memory_bytes} bytes "
                f"({self.host_memory_bytes / GiB:.1f} GiB)"
            )
        if not 0.0 < self.high_water <= 1.0:  # NaN compares false: refused too
            raise TierError(f"high-water mark must be in (0, 1], got {self.high_water}")
        if self.policy not in POLICY_NAMES:
            raise TierError(f"host tier policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.window < 1:
            raise TierError(f"scheduler window must hold >= 1 request, got {self.window}")


@dataclass
class HostEntry:
    """One block's copy in host memory; readable from ``ready_s`` (its offload's end)."""

    size: int
    ready_s: float
    pins: int = 0  # reloads reading it now: not evictable


ScoreOf = Callable[[Hashable], int]


@dataclass
class HostTier:
    """The host tier's contents under one replacement policy (see the module note).

    Invariants: ``used_bytes == sum of entry sizes <= capacity_bytes``; the replacement
    order lists exactly the entries, each in the bucket of its score at its last rescore.
    """

    capacity_bytes: int
    policy: str
    score_of: ScoreOf
    entries: dict[Hashable, HostEntry] = field(default_factory=dict)
    used_bytes: int = 0
    num_evicted: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise TierError(f"host tier policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        self.order = ReplacementOrder(TierPolicy(self.policy), self.score_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def get(self, key: Hashable) -> HostEntry | None:
        return self.entries.get(key)

    def touch(self, key: Hashable) -> None:
        """A use: the entry becomes the most recently used of its bucket."""
        self.order.touch(key)

    def rescore(self, key: Hashable) -> None:
        """Move ``key`` to the bucket of its current score (no-op when absent)."""
        self.order.rescore(key)

    def insert(self, key: Hashable, size: int, ready_s: float) -> list[Hashable] | None:
        """Store ``key``; evict by policy to make room. Returns the evicted keys, or None
        (and nothing changed) when pinned entries leave no room. A present key is touched."""
        if key in self.entries:
            self.touch(key)
            return []
        if size > self.capacity_bytes:
            return None
        victims = self._victims(self.capacity_bytes - size)
        if victims is None:
            return None
        for victim in victims:
            self.remove(victim)
        self.num_evicted += len(victims)
        self.entries[key] = HostEntry(size, ready_s)
        self.order.add(key)
        self.used_bytes += size
        return victims

    def remove(self, key: Hashable) -> None:
        entry = self.entries.pop(key)
        self.order.remove(key)
        self.used_bytes -= entry.size

    def eviction_order(self) -> Iterator[Hashable]:
        """Unpinned keys, first victim first: smallest bucket, then least recently used."""
        return self.order.order(lambda key: not self.entries[key].pins)

    def _victims(self, keep_at_most: int) -> list[Hashable] | None:
        """Keys to evict so that at most ``keep_at_most`` bytes stay; None if impossible."""
        victims, used = [], self.used_bytes
        order = self.eviction_order()
        while used > keep_at_most:
            key = next(order, None)
            if key is None:
                return None
            victims.append(key)
            used -= self.entries[key].size
        return victims

    def check_invariants(self) -> None:
        total = sum(e.size for e in self.entries.values())
        if total != self.used_bytes or total > self.capacity_bytes:
            raise AssertionError(
                f"host tier holds {total} bytes, accounts {self.used_bytes}, "
                f"capacity {self.capacity_bytes}"
            )
        if self.order.bucket_of.keys() != self.entries.keys():
            raise AssertionError("host tier buckets do not list exactly its entries")
        if any(entry.pins < 0 for entry in self.entries.values()):
            raise AssertionError("a host entry has negative pins")
        self.order.check_invariants()
