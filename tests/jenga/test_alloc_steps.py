"""The five allocation steps one by one, remaps across groups, and all-or-nothing rollback."""

from __future__ import annotations

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.plan import MapPage, MappingPlan, UnmapPage
from jenga.specs import Kind

from jenga import _core as J


def plan(core: J.Core) -> list[tuple[int, int, int, int]]:
    return core.drain_plan()


def test_steps_1_2_4_5_in_order_with_lru_and_prefix_tie_break():
    core = J.Core([4], [1], 1)
    a = core.allocate(1, [2], 10)  # step 2 maps page 0 for owner 1
    assert a == [[0, 1]]
    assert core.allocate(2, [1], 11) == [[2]]  # no unit left: step 4, owner 1's page
    assert core.commit(0, [0, 1], [100, 101], [16, 32]) == 2
    core.release(0, [0, 1], 12)
    assert core.eviction_order(0) == [1, 0]  # same time: the longer prefix goes first
    # owner 3: step 4 takes slot 3, then step 5 evicts 1 (prefix 32) and 0 (prefix 16)
    assert core.allocate(3, [3], 13) == [[3, 1, 0]]
    counters = core.counters()
    assert [counters[f"alloc.step.{i}"] for i in range(1, 6)] == [0, 2, 0, 2, 2]
    assert core.lookup(0, [100, 101]).tolist() == [-1, -1]
    assert plan(core) == [(0, 0, 0, 0)]
    core.check_invariants(True)


def test_step1_prefers_own_page_over_new_page():
    core = J.Core([4], [1], 4)
    assert core.allocate(1, [1], 1) == [[0]]
    assert core.allocate(2, [1], 2) == [[4]]  # own nothing: new page 1
    assert core.allocate(1, [2], 3) == [[1, 2]]  # own page 0
    assert core.allocate(2, [4], 4) == [[5, 6, 7, 8]]  # own page 1, then page 2
    assert [p[2] for p in plan(core)] == [0, 1, 2]


def test_step3_remaps_units_of_evicted_pages_lru_across_groups():
    # group 0: 2 blocks per 1-unit page; group 1: 1 block per 2-unit page (a Mamba-like state)
    core = J.Core([2, 1], [1, 2], 3)
    assert core.allocate(1, [4, 0], 1) == [[0, 1, 2, 3], []]
    core.commit(0, [0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4])
    core.release(0, [2, 3], 2)  # page 1 evictable, newest access 2
    core.release(0, [0, 1], 3)  # page 0 evictable, newest access 3
    assert core.page_eviction_order() == [(0, 1), (0, 0)]
    plan(core)
    # 1 unit free, the 2-unit page needs 1 more: evict page 1 only, remap its unit
    assert core.allocate(2, [0, 1], 4) == [[], [0]]
    assert plan(core) == [(1, 0, 1, 0), (0, 1, 0, 1)]  # Unmap(0, 1), Map(1, 0, reused=1)
    assert core.lookup(0, [1, 2, 3, 4]).tolist() == [0, 1, -1, -1]
    counters = core.counters()
    assert (counters["alloc.step.3"], counters["pages.evicted"]) == (1, 1)
    assert (counters["plan.remapped_units"], counters["blocks.evicted"]) == (1, 2)
    assert core.free_units == 0
    core.check_invariants(True)


def test_step3_not_taken_when_eviction_cannot_free_enough():
    core = J.Core([1, 1], [1, 3], 3)
    assert core.allocate(1, [2, 0], 1) == [[0, 1], []]
    core.commit(0, [0], [7], [1])
    core.release(0, [0], 2)  # one evictable unit, one unit free: the 3-unit page cannot fit
    plan(core)
    assert core.allocate(2, [0, 1], 3) is None
    assert core.lookup(0, [7]).tolist() == [0]  # nothing was evicted for nothing
    assert plan(core) == []


def test_failed_allocation_rolls_back_evictions_releases_and_maps():
    core = J.Core([2, 2], [1, 1], 3)
    assert core.allocate(1, [4, 1], 1) == [[0, 1, 2, 3], [0]]
    core.commit(0, [0, 1, 2, 3], [10, 11, 12, 13], [1, 2, 3, 4])
    core.release(0, [0, 1, 2, 3], 2)
    core.commit(1, [0], [20], [1])
    plan(core)
    before = (
        core.free_units,
        core.eviction_order(0),
        core.page_eviction_order(),
        core.block_info(1, 0),
        core.group_counts(0),
        core.group_counts(1),
    )
    # group 0 fits (own free page / eviction), group 1 wants 9 blocks: impossible
    assert core.allocate(1, [3, 9], 3, [[], [0]]) is None
    after = (
        core.free_units,
        core.eviction_order(0),
        core.page_eviction_order(),
        core.block_info(1, 0),
        core.group_counts(0),
        core.group_counts(1),
    )
    assert after == before
    assert core.lookup(0, [10, 11, 12, 13]).tolist() == [0, 1, 2, 3]
    assert plan(core) == []
    assert core.counters()["alloc.failures"] == 1
    core.check_invariants(True)
    # and the same call that fits afterwards behaves exactly as if the failure never was
    # (pages 0 and 1 of g0 were released together: page 1, ending the longer prefix, is
    # evicted first, then page 0; group 1's block 0 is cached again, its free slot 1 serves)
    assert core.allocate(1, [3, 1], 4, [[], [0]]) == [[3, 2, 1], [1]]


def _full_and_window_16_tokens(window: int) -> JengaAllocator:
    groups = (
        GroupConfig("full", Kind.FULL, 4, 2, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 2, 1, window=window),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, total_units=4))
    alloc.add_request("a", list(range(16)))
    got = alloc.allocate("a", 16)
    assert got is not None and got.new_blocks == ((0, 1, 2, 3), (0, 1, 2, 3))
    alloc.cache("a", 16)
    return alloc


def test_allocator_returns_none_and_changes_nothing_when_no_room():
    alloc = _full_and_window_16_tokens(window=16)  # the window still needs every block
    before = (alloc.usage(), alloc.block_table("a", 0), alloc.block_table("a", 1))
    assert alloc.allocate("a", 4) is None  # both groups need a 5th block; no unit left
    assert (alloc.usage(), alloc.block_table("a", 0), alloc.block_table("a", 1)) == before
    alloc.check_invariants(expensive=True)


def test_blocks_leaving_the_window_are_cached_then_remapped_to_full_attention():
    alloc = _full_and_window_16_tokens(window=4)
    got = alloc.allocate("a", 4)
    # the window releases blocks 0-2 (cached); full attention's 5th block evicts window
    # page 0 (blocks 0, 1) by step 3 and reuses its unit; the window's 5th block evicts
    # cached block 2 by step 5
    assert got is not None
    assert got.released == ((), (0, 1, 2))
    assert got.new_blocks == ((4,), (2,))
    assert got.plan == MappingPlan((UnmapPage(1, 0), MapPage(0, 2, reused_units=1)))
    assert alloc.block_table("a", "swa") == [-1, -1, -1, 3, 2]
    alloc.check_invariants(expensive=True)


def test_free_returns_plan_of_emptied_pages_and_keeps_hashed_blocks():
    alloc = JengaAllocator(AllocatorConfig((GroupConfig("f", Kind.FULL, 2, 2, 1),), 4))
    alloc.add_request("a", list(range(7)))
    got = alloc.allocate("a", 7)
    assert got is not None
    assert got.plan == MappingPlan((MapPage(0, 0), MapPage(0, 1)))
    assert alloc.cache("a", 5) == 2  # blocks 0, 1 complete within 5 tokens
    assert alloc.free("a") == MappingPlan((UnmapPage(0, 1),))
    use = alloc.usage()
    assert (use.cached_blocks, use.free_blocks, use.used_units) == ((2,), (0,), 1)
    with pytest.raises(ValueError, match="not in use"):
        alloc._core.release(0, [0], 99)


def test_step3_ties_evict_the_longest_prefix_first_across_groups():
    # two groups, 2 blocks per 1-unit page; one request's prefix spans pages 0..2 of group 0
    # and pages 0..1 of group 1 (a sliding window keeps only its tail), all released together
    core = J.Core([2, 2], [1, 1], 5)
    assert core.allocate(1, [6, 4], 1) == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3]]
    core.commit(0, [0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15], [16, 32, 48, 64, 80, 96])
    core.commit(1, [0, 1, 2, 3], [20, 21, 22, 23], [48, 64, 80, 96])
    core.release(0, [0, 1, 2, 3, 4, 5], 2)
    core.release(1, [0, 1, 2, 3], 2)
    # equal newest access: the page ending the longer prefix first, then group, then page
    assert core.page_eviction_order() == [(0, 2), (1, 1), (0, 1), (1, 0), (0, 0)]
    core.check_invariants(True)
    plan(core)
    # a 1-unit page for a new owner: the tail page of group 0 goes, the head survives
    assert core.allocate(2, [1, 0], 3) == [[5], []]
    assert core.lookup(0, [10, 11, 12, 13, 14, 15]).tolist() == [0, 1, 2, 3, -1, -1]
    assert core.page_eviction_order() == [(1, 1), (0, 1), (1, 0), (0, 0)]
    core.check_invariants(True)


def test_step3_older_access_still_goes_before_a_longer_prefix():
    core = J.Core([1], [1], 2)
    assert core.allocate(1, [2], 1) == [[0, 1]]
    core.commit(0, [0, 1], [1, 2], [16, 32])
    core.release(0, [0], 2)  # prefix 16, older
    core.release(0, [1], 3)  # prefix 32, newer
    assert core.page_eviction_order() == [(0, 0), (0, 1)]


def test_plan_ops_are_shared_and_equal_to_fresh_ones(monkeypatch):
    import jenga.plan as plan_mod

    monkeypatch.setattr(plan_mod, "_OPS_CACHED_MAX", 2)
    monkeypatch.setattr(plan_mod, "_op_cache", {})
    a = plan_mod.plan_from_keys([(1, 0, 3, 0), (0, 1, 4, 2)])
    assert a.ops == (UnmapPage(0, 3), MapPage(1, 4, 2))
    b = plan_mod.plan_from_keys([(1, 0, 3, 0)])
    assert b.ops[0] is a.ops[0]  # the same frozen op, not rebuilt
    c = plan_mod.plan_from_keys([(0, 2, 5, 0)])  # a third op: the cache is cleared first
    assert c.ops == (MapPage(2, 5, 0),) and len(plan_mod._op_cache) == 1
