"""`JengaAllocator` owns its unit count: `set_total_units` grows and shrinks it at run time
(a shrink evicts cached pages in step 3's order, or refuses with nothing changed), and
`units_needed` answers what one allocation can newly map.

Setup: one full-attention group, 4 tokens per block, 2 blocks per 1-unit large page.
"""

from __future__ import annotations

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.errors import CapacityInUse, InvalidSize, PageTooLarge
from jenga.plan import MappingPlan, UnmapPage
from jenga.specs import Kind

OLD = list(range(100, 116))
LIVE = list(range(300, 316))


def _alloc(total_units: int = 8) -> JengaAllocator:
    return JengaAllocator(
        AllocatorConfig((GroupConfig("full", Kind.FULL, 4, 2, 1),), total_units=total_units)
    )


def _old_cached_live_running() -> JengaAllocator:
    """ "old" (16 tokens, 2 pages) finished and cached; "live" (16 tokens, 2 pages) runs."""
    alloc = _alloc()
    for rid, prompt in (("old", OLD), ("live", LIVE)):
        alloc.add_request(rid, prompt)
        assert alloc.allocate(rid, len(prompt)) is not None
        alloc.cache(rid, len(prompt))
    alloc.free("old")
    return alloc


def test_growing_adds_free_units_and_an_allocation_refused_before_then_fits() -> None:
    alloc = _alloc(total_units=4)
    alloc.add_request("a", list(range(40)))
    assert alloc.units_needed("a", 40) == 5  # 10 blocks, 2 per 1-unit page
    assert alloc.allocate("a", 40) is None
    assert alloc.set_total_units(6) == MappingPlan()
    assert (alloc.total_units, alloc.config.total_units, alloc.usage().free_units) == (6, 6, 6)
    got = alloc.allocate("a", 40)
    assert got is not None and got.plan.num_maps == 5
    assert alloc.usage().used_units == 5
    alloc.check_invariants(expensive=True)


def test_units_needed_is_zero_within_held_blocks_and_bounds_what_allocate_maps() -> None:
    alloc = _alloc()
    alloc.add_request("a", list(range(6)))
    assert alloc.units_needed("a", 6) == 1  # 2 blocks: one page
    got = alloc.allocate("a", 6)
    assert got is not None and got.plan.num_maps == 1
    assert alloc.units_needed("a", 2) == 0  # tokens 7, 8 fit block 1
    assert alloc.units_needed("a", 3) == 1  # token 9 needs block 2: a new page
    with pytest.raises(InvalidSize, match="num_new_tokens must be > 0, got 0"):
        alloc.units_needed("a", 0)


def test_shrinking_takes_free_units_then_evicts_cached_pages_in_step_3_order() -> None:
    alloc = _old_cached_live_running()
    use = alloc.usage()
    assert (use.used_units, use.free_units, use.cached_blocks) == (4, 4, (4,))
    assert alloc.set_total_units(4) == MappingPlan()  # the 4 free units go, nothing evicted
    # one more unit: old's page holding the longest prefix goes first
    assert alloc.set_total_units(3) == MappingPlan((UnmapPage(0, 1),))
    assert alloc.prefix_match([*OLD, 1]).hit == 8  # old's first page is still cached
    assert alloc.set_total_units(2) == MappingPlan((UnmapPage(0, 0),))
    use = alloc.usage()
    assert (use.total_units, use.used_units, use.free_units, use.cached_blocks) == (2, 2, 0, (0,))
    assert alloc.prefix_match([*OLD, 1]).hit == 0
    alloc.check_invariants(expensive=True)


def test_shrinking_below_what_live_requests_hold_changes_nothing() -> None:
    alloc = _old_cached_live_running()
    before = (alloc.usage(), alloc.eviction_order(0), alloc.page_eviction_order())
    message = (
        "cannot shrink from 8 to 1 units: 4 are mapped, 2 of them by live requests "
        r"\(2 on evictable cached pages, 4 free\); nothing was changed"
    )
    with pytest.raises(CapacityInUse, match=message):
        alloc.set_total_units(1)
    assert (alloc.usage(), alloc.eviction_order(0), alloc.page_eviction_order()) == before
    assert alloc.total_units == alloc.config.total_units == 8
    assert alloc.prefix_match([*OLD, 1]).hit == 16
    alloc.check_invariants(expensive=True)


def test_a_capacity_that_no_large_page_fits_or_no_unit_at_all_is_refused() -> None:
    alloc = JengaAllocator(
        AllocatorConfig((GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 2, 2, window=8),), 8)
    )
    with pytest.raises(PageTooLarge, match="a large page costs 2 units, the pool would hold 1"):
        alloc.set_total_units(1)
    with pytest.raises(InvalidSize, match="total_units must be > 0, got 0"):
        alloc.set_total_units(0)
    assert alloc.total_units == 8
