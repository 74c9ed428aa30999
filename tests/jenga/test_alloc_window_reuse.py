"""``reuse_window_releases``: a window group reuses its own stranded early releases.

With several blocks per large page, a sliding-window request's live window pins a page
whose other blocks left the window (early releases, cached). Those blocks can only leave
the page one by one (step 5), so before the rule the group mapped a new page for every
window step and its pinned pages kept the cached leftovers: memory no other group could
get by step 3. The rule (with ``demote_window_releases``) puts "evict a demoted block in a
page that is not wholly evictable" right after step 4, while less than a quarter of the
pool is free (with memory to spare, new pages keep the releases cached for prefix hits).

Setup: a full group (1 block per page) and a sliding-window group (window 8, 4 tokens per
block, 4 blocks per page). Request "a" prefills 32 tokens (swa blocks 0-7 on pages 0, 1)
and decodes one token, which releases swa blocks 0-5: page 0 becomes wholly evictable,
page 1 keeps 4, 5 cached beside the live 6, 7.
"""

from __future__ import annotations

import pytest
from jenga.allocator import (
    AllocationOrder,
    AllocationRules,
    AllocatorConfig,
    GroupConfig,
    JengaAllocator,
)
from jenga.specs import Kind


def _decode_after_prefill(
    reuse: bool, order: AllocationOrder, total: int = 12
) -> tuple[JengaAllocator, object]:
    """12 units: after the decode's full block 11 are used, 1 free (under a quarter)."""
    groups = (
        GroupConfig("full", Kind.FULL, 4, 1, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 4, 1, window=8),
    )
    rules = AllocationRules(order=order, demote_window_releases=True, reuse_window_releases=reuse)
    alloc = JengaAllocator(AllocatorConfig(groups, total, rules))
    alloc.add_request("a", list(range(100, 132)))
    assert alloc.allocate("a", 32) is not None
    alloc.cache("a", 32)
    alloc.append_tokens("a", [7])
    got = alloc.allocate("a", 1)
    assert got is not None and got.released == ((), (0, 1, 2, 3, 4, 5))
    return alloc, got


@pytest.mark.parametrize("order", [AllocationOrder.COMPACT, AllocationOrder.PINNED])
def test_the_window_step_reuses_a_stranded_release_not_a_new_page(order: AllocationOrder):
    alloc, got = _decode_after_prefill(True, order)
    # block 4 (page 1, pinned by 6 and 7), not block 0: page 0 stays wholly evictable
    assert got.new_blocks == ((8,), (4,))
    assert alloc.usage().mapped_pages == (9, 2)
    assert alloc.eviction_order("swa") == [0, 1, 2, 3, 5]
    assert alloc.page_eviction_order()[:1] == [(1, 0)]
    alloc.check_invariants(expensive=True)


def test_with_memory_to_spare_the_window_maps_a_new_page():
    alloc, got = _decode_after_prefill(True, AllocationOrder.COMPACT, total=64)
    assert got.new_blocks == ((8,), (8,))
    assert alloc.usage().mapped_pages == (9, 3)


def test_the_paper_order_maps_a_new_page_before_step_4_and_so_before_the_rule():
    alloc, got = _decode_after_prefill(True, AllocationOrder.PAPER)
    assert got.new_blocks == ((8,), (8,))
    assert alloc.usage().mapped_pages == (9, 3)


@pytest.mark.parametrize("order", list(AllocationOrder))
def test_without_the_rule_the_window_maps_a_new_page(order: AllocationOrder):
    alloc, got = _decode_after_prefill(False, order)
    assert got.new_blocks == ((8,), (8,))
    assert alloc.usage().mapped_pages == (9, 3)
    assert alloc.eviction_order("swa") == [0, 1, 2, 3, 4, 5]
    alloc.check_invariants(expensive=True)
