"""A second memory tier for cached blocks: the host table and its replacement policy.

Rationale
    GPU memory is the first tier; what the prefix-subset rule evicts from it is lost unless
    a second tier keeps it. CaR (multi-tier KV reuse) keeps finished requests' KV in an
    external tier with its own replacement policy and reloads it for a later request that
    shares the prefix, instead of recomputing it. This module is the integer half of that:
    which block identities the host tier holds, in which slot, in which state, and which
    one leaves when a new one needs a slot. Copies (bytes) are the KV cache floor's.

Approach
    A block is named by ``(group, identity)`` (the allocator's 128-bit block identity as
    16 bytes), so a host copy serves every request whose prompt hashes to it, whatever GPU
    block held it. `HostTable` has a fixed number of slots; an entry is
    ``OFFLOADING`` (its copy is in flight: not readable, not evictable) or ``RESIDENT``.
    A reload pins the entries it reads (not evictable until unpinned). Where a block's data
    is (`Tier`) combines the host state with the GPU index: ``GPU``, ``HOST``, ``BOTH``,
    ``IN_FLIGHT``.

    Replacement (`TierRules.policy`), among entries that are resident and not pinned,
    is `ReplacementOrder`'s (the simulator's host tier, `jenga.sim.tiers`, uses it too,
    with entries of any size): entries sit in buckets by priority, each bucket in
    least-recently-used order, and the victim is the first movable entry of the smallest
    bucket::

        buckets: {0: {k7, k2, k9}, 1: {k4}, 3: {k1, k5}}     victim: first movable of
                    ^ oldest                                   the smallest bucket

    - ``LRU``: every entry in bucket 0: the least recently offloaded or read entry;
    - ``SCORE`` (CaR): every identity has a score; +1 when a request whose prompt holds it
      enters the scheduler's window, +1 when that request is sent to the GPU, -2 when it
      completes; an entry's bucket is its score, so the smallest score leaves; ties: the
      least recently used, where a score event moving an entry to another bucket counts as
      a use (it is the newest of its new bucket).

    CaR's prefetch timing rule (`should_prefetch`): start fetching a waiting request's KV
    once the soonest-finishing running request will finish within the transfer time,
    ``min_i (TPOT * remaining_i - elapsed_i) <= size / bandwidth``, so the copy ends about
    when a slot frees, and fetch at once when nothing runs.

Limitations
    Text groups only (identities of token blocks; image and recurrent-state blocks stay in
    the GPU tier). Scores of identities in neither tier are forgotten once they return to 0.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from jenga.errors import InvalidSize

Key = tuple[int, bytes]  # (group, 16-byte block identity)


class TierPolicy(enum.Enum):
    LRU = "lru"
    SCORE = "score"


class Tier(enum.Enum):
    """Where a cached block's data is."""

    GPU = "gpu"
    HOST = "host"
    BOTH = "both"
    IN_FLIGHT = "in_flight"  # its offload copy is still running


class EntryState(enum.Enum):
    OFFLOADING = "offloading"
    RESIDENT = "resident"


@dataclass(frozen=True)
class TierRules:
    """The host tier's rules, one value: replacement policy, the high-water mark above which
    cached GPU blocks are offloaded in the background, and CaR's score deltas."""

    policy: TierPolicy = TierPolicy.LRU
    high_water: float = 0.9
    window_gain: int = 1
    sent_gain: int = 1
    complete_loss: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            try:
                object.__setattr__(self, "policy", TierPolicy(self.policy))
            except ValueError:
                names = [p.value for p in TierPolicy]
                raise InvalidSize(
                    f"tier policy must be one of {names}, got {self.policy!r}"
                ) from None
        water = self.high_water
        if isinstance(water, bool) or not isinstance(water, (int, float)) or not 0 < water <= 1:
            raise InvalidSize(f"tier high-water mark must be in (0, 1], got {water!r}")


@dataclass
class Entry:
    slot: int
    state: EntryState
    pins: int = 0


def should_prefetch(remaining_service_s: Sequence[float], transfer_s: float) -> bool:
    """CaR's prefetch rule: fetch now when the soonest-finishing running request (its
    predicted remaining service time, ``TPOT * remaining_i - elapsed_i``) finishes within
    the transfer time; always when nothing runs."""
    return not remaining_service_s or min(remaining_service_s) <= transfer_s


class ReplacementOrder:
    """The order in which a tier's entries leave under a `TierPolicy` (module note):
    buckets by priority (LRU: 0; SCORE: ``score_of(key)``), each least recently used
    first. The caller says when a key is used (`touch`) and when its score changed
    (`rescore`), and which keys can leave (`order`'s ``movable``)."""

    def __init__(self, policy: TierPolicy, score_of: Callable[[Hashable], int]) -> None:
        self.policy, self.score_of = TierPolicy(policy), score_of
        self.buckets: dict[int, dict[Hashable, None]] = {}
        self.bucket_of: dict[Hashable, int] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.bucket_of

    def __len__(self) -> int:
        return len(self.bucket_of)

    def priority(self, key: Hashable) -> int:
        return 0 if self.policy is TierPolicy.LRU else self.score_of(key)

    def add(self, key: Hashable) -> None:
        """A new entry: the most recently used of its priority's bucket."""
        bucket = self.bucket_of[key] = self.priority(key)
        self.buckets.setdefault(bucket, {})[key] = None

    def remove(self, key: Hashable) -> None:
        b = self.bucket_of.pop(key)
        del self.buckets[b][key]
        if not self.buckets[b]:
            del self.buckets[b]

    def touch(self, key: Hashable) -> None:
        """A use: ``key`` becomes the most recently used of its bucket."""
        bucket = self.buckets[self.bucket_of[key]]
        del bucket[key]
        bucket[key] = None

    def rescore(self, key: Hashable) -> None:
        """Move ``key`` to the bucket of its current priority (no-op when absent or equal)."""
        if key in self.bucket_of and self.priority(key) != self.bucket_of[key]:
            self.remove(key)
            self.add(key)

    def order(self, movable: Callable[[Hashable], bool] = lambda key: True) -> Iterator[Hashable]:
        """Movable keys, first victim first: smallest bucket, then least recently used."""
        for b in sorted(self.buckets):
            for key in self.buckets[b]:
                if movable(key):
                    yield key

    def check_invariants(self) -> None:
        listed = {k: b for b, keys in self.buckets.items() for k in keys}
        if listed != self.bucket_of or any(not keys for keys in self.buckets.values()):
            raise AssertionError("replacement buckets do not list exactly its entries")
        for key, bucket in self.bucket_of.items():
            if bucket != self.priority(key):
                raise AssertionError(f"entry {key!r}: bucket {bucket} is not its score's")


class HostTable:
    """The host tier's cache table: ``(group, identity)`` -> slot, state, pins, score."""

    def __init__(self, num_slots: int, rules: TierRules) -> None:
        if type(num_slots) is not int or num_slots <= 0:
            raise InvalidSize(f"a host tier needs >= 1 slot, got {num_slots!r}")
        self.num_slots = num_slots
        self.rules = rules
        self._free = list(range(num_slots - 1, -1, -1))
        self._entries: dict[Key, Entry] = {}
        self.scores: dict[Key, int] = {}
        self.order = ReplacementOrder(rules.policy, self._score)
        self.counters = {"tier.host.evicted": 0, "tier.host.refused": 0}

    def _score(self, key: Hashable) -> int:
        return self.scores.get(key, 0)  # type: ignore[call-overload]

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Entry | None:
        return self._entries.get(key)

    def keys(self) -> list[Key]:
        return list(self._entries)

    def tier(self, key: Key, on_gpu: bool) -> Tier | None:
        """Where ``key``'s data is (None: nowhere); ``on_gpu``: the GPU index holds it."""
        entry = self._entries.get(key)
        if entry is None:
            return Tier.GPU if on_gpu else None
        if entry.state is EntryState.OFFLOADING:
            return Tier.IN_FLIGHT
        return Tier.BOTH if on_gpu else Tier.HOST

    def reserve(self, key: Key) -> int | None:
        """A slot for a new entry of ``key`` (state ``OFFLOADING``), evicting the policy's
        victim when no slot is free; None when ``key`` is present or nothing can leave."""
        if key in self._entries:
            return None
        if not self._free:
            victim = self._victim()
            if victim is None:
                self.counters["tier.host.refused"] += 1
                return None
            self.drop(victim)
            self.counters["tier.host.evicted"] += 1
        slot = self._free.pop()
        self._entries[key] = Entry(slot, EntryState.OFFLOADING)
        self.order.add(key)
        return slot

    def _victim(self) -> Key | None:
        def movable(key: Hashable) -> bool:
            entry = self._entries[key]  # type: ignore[index]
            return entry.state is EntryState.RESIDENT and not entry.pins

        return next(self.order.order(movable), None)  # type: ignore[return-value]

    def complete(self, key: Key) -> None:
        """The offload copy of ``key`` finished: its entry is readable."""
        self._entries[key].state = EntryState.RESIDENT

    def drop(self, key: Key) -> None:
        """Forget ``key`` (an aborted offload, or the policy's victim); its slot is free."""
        entry = self._entries.pop(key)
        self.order.remove(key)
        self._free.append(entry.slot)
        if self.scores.get(key) == 0:
            del self.scores[key]

    def touch(self, key: Key) -> None:
        self.order.touch(key)

    def pin(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self._entries[key].pins += 1

    def unpin(self, keys: Iterable[Key]) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins:
                entry.pins -= 1

    # -- CaR's score events ------------------------------------------------------------
    def _add(self, keys: Iterable[Key], delta: int) -> None:
        for key in keys:
            score = self.scores.get(key, 0) + delta
            if score == 0 and key not in self._entries:
                self.scores.pop(key, None)
            else:
                self.scores[key] = score
            self.order.rescore(key)

    def on_window(self, keys: Iterable[Key]) -> None:
        """A request whose prompt holds ``keys`` entered the scheduler's window."""
        self._add(keys, self.rules.window_gain)

    def on_sent(self, keys: Iterable[Key]) -> None:
        """That request was sent to the GPU (admitted)."""
        self._add(keys, self.rules.sent_gain)

    def on_complete(self, keys: Iterable[Key]) -> None:
        """That request completed its generation."""
        self._add(keys, -self.rules.complete_loss)

    def check_invariants(self) -> None:
        slots = [e.slot for e in self._entries.values()]
        assert len(set(slots)) == len(slots), "two host entries share a slot"
        assert not set(slots) & set(self._free), "a host slot is both used and free"
        assert len(slots) + len(self._free) == self.num_slots, "host slots leaked"
        assert set(self.order.bucket_of) == set(self._entries), "replacement order is stale"
        self.order.check_invariants()
