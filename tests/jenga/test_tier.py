"""The host tier's table: slots, states, LRU and CaR's score replacement, the prefetch rule."""

from __future__ import annotations

import pytest
from jenga.errors import InvalidSize
from jenga.tier import EntryState, HostTable, Tier, TierPolicy, TierRules, should_prefetch


def key(i: int) -> tuple[int, bytes]:
    return (0, i.to_bytes(16, "little"))


def filled(policy: TierPolicy, n: int = 3) -> HostTable:
    table = HostTable(n, TierRules(policy=policy))
    for i in range(n):
        assert table.reserve(key(i)) is not None
        table.complete(key(i))
    return table


def test_states_and_tiers():
    table = HostTable(2, TierRules())
    slot = table.reserve(key(1))
    assert slot is not None and table.reserve(key(1)) is None  # present: no second slot
    assert table.tier(key(1), on_gpu=True) is Tier.IN_FLIGHT
    table.complete(key(1))
    assert table.tier(key(1), on_gpu=True) is Tier.BOTH
    assert table.tier(key(1), on_gpu=False) is Tier.HOST
    assert table.tier(key(2), on_gpu=True) is Tier.GPU
    assert table.tier(key(2), on_gpu=False) is None


def test_lru_replaces_the_least_recently_used_resident_unpinned_entry():
    table = filled(TierPolicy.LRU)
    table.touch(key(0))
    assert table.reserve(key(9)) is not None
    assert table.get(key(1)) is None and table.get(key(0)) is not None
    table.pin([key(2)])
    table.complete(key(9))
    table.reserve(key(10))  # 2 is pinned: 0 is the least recent one left
    assert table.get(key(2)) is not None and table.get(key(0)) is None
    table.check_invariants()


def test_in_flight_and_pinned_entries_never_leave():
    table = HostTable(2, TierRules())
    table.reserve(key(0))  # offloading
    table.reserve(key(1))
    table.complete(key(1))
    table.pin([key(1)])
    assert table.reserve(key(2)) is None
    assert table.counters["tier.host.refused"] == 1
    table.unpin([key(1)])
    assert table.reserve(key(2)) is not None
    assert table.get(key(0)).state is EntryState.OFFLOADING  # type: ignore[union-attr]


def test_score_policy_follows_window_sent_and_completion_events():
    table = filled(TierPolicy.SCORE)
    table.on_window([key(0)])  # 0: waiting in the window (+1)
    table.on_window([key(1)])
    table.on_sent([key(1)])  # 1: running (+2)
    table.on_window([key(2)])
    table.on_sent([key(2)])
    table.on_complete([key(2)])  # 2: done (0): the smallest score leaves first
    assert table.scores == {key(0): 1, key(1): 2, key(2): 0}
    table.reserve(key(3))
    assert table.get(key(2)) is None
    table.complete(key(3))
    table.reserve(key(4))  # 3 scores 0, 0 scores 1: 3 leaves although it is newer
    assert table.get(key(3)) is None and table.get(key(0)) is not None


def test_lru_ignores_scores():
    table = filled(TierPolicy.LRU)
    table.on_window([key(0)])
    table.reserve(key(3))
    assert table.get(key(0)) is None


def test_prefetch_rule():
    assert should_prefetch([], 5.0)  # nothing runs: fetch now
    assert not should_prefetch([0.5, 0.3], 0.1)  # a slot frees after the copy would end
    assert should_prefetch([0.5, 0.08], 0.1)


@pytest.mark.parametrize("water", [0, -1, 1.01, float("nan"), True, "0.9"])
def test_high_water_outside_0_1_is_refused(water):
    with pytest.raises(InvalidSize, match=r"high-water mark must be in \(0, 1\], got"):
        TierRules(high_water=water)


def test_policy_by_name_and_bad_slots():
    assert TierRules(policy="score").policy is TierPolicy.SCORE  # type: ignore[arg-type]
    with pytest.raises(InvalidSize, match="needs >= 1 slot, got 0"):
        HostTable(0, TierRules())


def test_a_score_event_counts_as_a_use_among_equal_scores():
    """Entries 0, 1, 2 score 0 with 0 the least recently used; 0's request runs and
    completes (+1 +1 -2): back at score 0, it is the newest of that bucket, so 1 leaves."""
    table = filled(TierPolicy.SCORE)
    table.on_window([key(0)])
    table.on_sent([key(0)])
    table.on_complete([key(0)])
    assert table.scores == {key(0): 0}
    assert list(table.order.order()) == [key(1), key(2), key(0)]
    table.reserve(key(3))
    assert table.get(key(1)) is None and table.get(key(0)) is not None
    table.check_invariants()
