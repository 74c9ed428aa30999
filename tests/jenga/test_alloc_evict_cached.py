"""`JengaAllocator.evict_cached`: give prefix-cache memory back on request (a shared pool's
reclaim), whole evictable large pages in step 3's order, nothing else.

Setup: a full-attention group (4 tokens per block, 2 blocks per 1-unit page) and a
sliding-window group (window 8, 4 tokens per block, 2 blocks per 2-unit page), 24 units.
"old" (16 tokens) finishes first, then "new" (8 tokens); "live" (8 tokens) keeps running.
"""

from __future__ import annotations

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.errors import InvalidSize
from jenga.plan import UnmapPage
from jenga.specs import Kind

OLD = list(range(100, 116))
NEW = list(range(200, 208))
LIVE = list(range(300, 308))


def _alloc() -> JengaAllocator:
    groups = (
        GroupConfig("full", Kind.FULL, 4, 2, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 2, 2, window=8),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, 24))
    for rid, prompt in (("old", OLD), ("new", NEW), ("live", LIVE)):
        alloc.add_request(rid, prompt)
        assert alloc.allocate(rid, len(prompt)) is not None
        alloc.cache(rid, len(prompt))
    alloc.free("old")
    alloc.free("new")
    return alloc


def _unmaps(plan) -> list[tuple[int, int]]:
    assert all(isinstance(op, UnmapPage) for op in plan.ops)
    return [(op.group, op.page) for op in plan.ops]


def test_pages_go_in_step_3_order_until_the_units_are_free() -> None:
    alloc = _alloc()
    # old's pages (older) before new's; among old's, the longest prefix first
    order = [(0, 1), (1, 1), (0, 0), (1, 0), (0, 2), (1, 2)]
    assert alloc.page_eviction_order() == order
    free = alloc.usage().free_units
    assert free == 24 - (3 + 3 * 2 + 1 + 2)  # live holds full page 3 and swa page 3
    plan = alloc.evict_cached(2)  # 1 unit (full page 1) is not enough: + swa page 1
    assert _unmaps(plan) == order[:2]
    assert alloc.usage().free_units == free + 3
    assert alloc.page_eviction_order() == order[2:]
    assert alloc.prefix_match([*OLD, 1]).hit == 8  # old's tail blocks left the index
    assert alloc.prefix_match([*NEW, 1]).hit == 8  # new's pages are untouched
    assert alloc.stats()["pages.evicted"] == 2
    alloc.check_invariants(expensive=True)


def test_everything_evictable_goes_and_live_pages_stay() -> None:
    alloc = _alloc()
    order = alloc.page_eviction_order()
    live_tables = [alloc.block_table("live", g) for g in range(2)]
    plan = alloc.evict_cached(1000)  # more than exists: all evictable pages, no error
    assert _unmaps(plan) == order
    use = alloc.usage()
    assert use.free_units == 24 - 3 and use.cached_blocks == (0, 0)
    assert use.mapped_pages == (1, 1) and use.used_blocks == (2, 2)
    assert [alloc.block_table("live", g) for g in range(2)] == live_tables
    assert alloc.prefix_match([*OLD, 1]).hit == 0 and alloc.prefix_match([*NEW, 1]).hit == 0
    assert alloc.prefix_match([*LIVE, 1]).hit == 8  # live's blocks are committed, in use
    assert not alloc.evict_cached(5)  # nothing left: an empty plan
    alloc.check_invariants(expensive=True)


def test_zero_units_evict_nothing_and_a_negative_count_is_refused() -> None:
    alloc = _alloc()
    before = (alloc.usage(), alloc.page_eviction_order())
    assert not alloc.evict_cached(0)
    with pytest.raises(InvalidSize, match="-1"):
        alloc.evict_cached(-1)
    assert (alloc.usage(), alloc.page_eviction_order()) == before
    alloc.check_invariants(expensive=True)


def test_cached_blocks_on_a_page_pinned_by_a_live_block_stay() -> None:
    alloc = _alloc()
    assert alloc.add_request("hit", [*OLD[:4], 9, 9, 9, 9]) == 4  # old's block 0 of each group
    assert [alloc.block_table("hit", g) for g in range(2)] == [[0], [0]]
    pinned = [(0, 0), (1, 0)]  # their pages, with old's cached block 1 on each
    assert not set(pinned) & set(alloc.page_eviction_order())
    plan = alloc.evict_cached(1000)
    assert not set(pinned) & set(_unmaps(plan))
    assert alloc.usage().cached_blocks == (1, 1)
    assert alloc.prefix_match([*OLD[:4], 1]).hit == 4  # block 0 still cached (and in use)
    alloc.check_invariants(expensive=True)
