"""The Jenga paper's worked examples (arXiv 2503.18292), as exact tests.

The paper's figures were not retrievable here; each scenario is reconstructed from the
paper's text (page sizes 256/384 -> 768, Fig. 8's request-aware
versus interleaved placement, Fig. 11's prefix sets {4, 9, 10}, 1..9 and hit {4, 9}).
"""

from __future__ import annotations

import math

from jenga.allocator import (
    AllocationOrder,
    AllocationRules,
    AllocatorConfig,
    GroupConfig,
    JengaAllocator,
)
from jenga.plan import MapPage, MappingPlan, UnmapPage
from jenga.policies import FullAttentionPolicy, SlidingWindowPolicy
from jenga.specs import Kind


def one_group(blocks_per_page: int, total: int, order=AllocationOrder.PAPER) -> JengaAllocator:
    group = GroupConfig("full", Kind.FULL, 1, blocks_per_page, 1)
    return JengaAllocator(AllocatorConfig((group,), total, AllocationRules(order)))


def test_fig6_lcm_layout_256_and_384_share_768_byte_large_pages():
    small = {"a": 256, "b": 384}
    large = math.lcm(*small.values())
    assert large == 768
    groups = tuple(
        GroupConfig(name, Kind.FULL, 1, large // size, 1) for name, size in small.items()
    )
    assert [g.blocks_per_large_page for g in groups] == [3, 2]
    alloc = JengaAllocator(AllocatorConfig(groups, total_units=4))
    alloc.add_request("r", list(range(4)))
    got = alloc.allocate("r", 4)
    assert got is not None
    assert got.new_blocks == ((0, 1, 2, 3), (0, 1, 2, 3))
    # block -> (large page, byte offset inside it): a's 256-byte pages pack 3 per page,
    # b's 384-byte pages 2 per page; no byte of a mapped large page is lost to rounding.
    layout_a = [(b // 3, (b % 3) * 256) for b in got.new_blocks[0]]
    layout_b = [(b // 2, (b % 2) * 384) for b in got.new_blocks[1]]
    assert layout_a == [(0, 0), (0, 256), (0, 512), (1, 0)]
    assert layout_b == [(0, 0), (0, 384), (1, 0), (1, 384)]
    assert got.plan == MappingPlan((MapPage(0, 0), MapPage(0, 1), MapPage(1, 0), MapPage(1, 1)))
    assert alloc.usage().free_units == 0
    assert alloc.usage().free_blocks == (2, 0)  # a's second page has 2 free small pages
    alloc.check_invariants(expensive=True)


def _alternate(alloc: JengaAllocator, rounds: int) -> dict[str, list[int]]:
    for rid in "AB":
        alloc.add_request(rid, [7] * 8)
    tables: dict[str, list[int]] = {"A": [], "B": []}
    for _ in range(rounds):
        for rid in "AB":
            got = alloc.allocate(rid, 1)
            assert got is not None
            tables[rid].extend(got.new_blocks[0])
    return tables


def test_fig8_request_aware_allocation_returns_whole_large_pages_on_finish():
    alloc = one_group(blocks_per_page=3, total=4)
    assert _alternate(alloc, 3) == {"A": [0, 1, 2], "B": [3, 4, 5]}
    assert alloc.free("A") == MappingPlan((UnmapPage(0, 0),))
    assert alloc.usage().free_units == 3
    assert alloc.free("B") == MappingPlan((UnmapPage(0, 1),))
    alloc.check_invariants(expensive=True)


def test_fig8_interleaved_allocation_strands_pages_after_finish():
    alloc = one_group(blocks_per_page=3, total=4, order=AllocationOrder.COMPACT)
    assert _alternate(alloc, 3) == {"A": [0, 2, 4], "B": [1, 3, 5]}
    assert alloc.free("A") == MappingPlan(())  # both pages still hold B's blocks
    assert alloc.usage().free_units == 2
    assert alloc.usage().free_blocks == (3,)
    assert alloc.free("B") == MappingPlan((UnmapPage(0, 1), UnmapPage(0, 0)))  # tail first


def _full_and_window(window: int, blocks_per_page: int, total: int) -> JengaAllocator:
    groups = (
        GroupConfig("full", Kind.FULL, 1, blocks_per_page, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 1, blocks_per_page, 1, window=window),
    )
    return JengaAllocator(AllocatorConfig(groups, total))


def test_fig10_last_access_table_and_exact_eviction_order():
    """Prompt of 5 tokens, 3 decode steps, window 3, one token per block.

    Clock: add_request t=1, prefill t=2, decodes t=3,4,5, free t=6. A window block's last
    access is the step that released it (it left the window); full attention's blocks
    are all read until the request finishes.
    """
    alloc = _full_and_window(window=3, blocks_per_page=4, total=8)
    prompt = [11, 12, 13, 14, 15]
    alloc.add_request("r", prompt)
    assert alloc.allocate("r", 5) is not None
    alloc.cache("r", 5)
    for tok in (16, 17, 18):
        alloc.append_tokens("r", [tok])
        assert alloc.allocate("r", 1) is not None
        alloc.cache("r", alloc.num_tokens("r"))
    assert alloc.block_table("r", "swa") == [-1, -1, -1, -1, -1, 5, 6, 7]
    alloc.free("r")
    core = alloc._core
    last_access = {
        name: [core.block_info(g, b)[3] for b in range(8)] for g, name in enumerate(["full", "swa"])
    }
    assert last_access == {"full": [6] * 8, "swa": [3, 3, 3, 4, 5, 6, 6, 6]}
    # LRU first; equal times: the longest prefix first (keeps every group's prefix aligned),
    # except blocks that left the window together mid-request (0, 1, 2 at t=3): head first,
    # since block 2 still serves hits up to 5 with blocks 3 and 4, block 0 only up to 3.
    # (Before that rule the order was [2, 1, 0, 3, 4, 7, 6, 5].)
    assert alloc.eviction_order("swa") == [0, 1, 2, 3, 4, 7, 6, 5]
    assert alloc.eviction_order("full") == [7, 6, 5, 4, 3, 2, 1, 0]
    alloc.check_invariants(expensive=True)


def test_fig11_possible_prefixes_sliding_window_and_full():
    window = SlidingWindowPolicy(1, window=3)
    full = FullAttentionPolicy(1)
    swa_hits = [False, False, True, True, False, False, False, True, True, True]
    full_hits = [True] * 9 + [False]
    assert window.possible_prefix(swa_hits) == {4, 9, 10}
    assert full.possible_prefix(full_hits) == set(range(1, 10))
    both = window.possible_prefix(swa_hits) & full.possible_prefix(full_hits)
    assert both == {4, 9}
    assert max(both) == 9


def test_hit_is_longest_prefix_valid_in_every_group():
    alloc = _full_and_window(window=3, blocks_per_page=16, total=4)
    prompt = list(range(100, 110))
    alloc.add_request("a", prompt)
    assert alloc.allocate("a", 10) is not None
    assert alloc.cache("a", 10) == 20
    alloc.free("a")
    assert alloc.prefix_match(prompt).hit == 9  # capped: one token is always computed
    assert alloc.prefix_match([*prompt, 1, 2]).hit == 10
    assert alloc.prefix_match([*prompt[:5], 0, 0]).hit == 5
    assert alloc.add_request("b", [*prompt, 1]) == 10
    # the window group takes only the blocks the next token reads: [8, 10)
    assert alloc.block_table("b", "swa") == [-1] * 8 + [8, 9]
    assert alloc.block_table("b", "full") == list(range(10))
    alloc.check_invariants(expensive=True)
