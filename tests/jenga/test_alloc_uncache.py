"""`JengaAllocator.uncache_blocks`: blocks whose data went bad (a failed KV load) leave the
prefix cache; a cached one is freed at once, a held one is never hit again and is freed,
not cached, when released.

Setup: one full-attention group, 4 tokens per block, 2 blocks per 1-unit page, 8 units.
"""

from __future__ import annotations

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.errors import InvalidSize
from jenga.plan import UnmapPage
from jenga.specs import Kind

PROMPT = list(range(100, 117))  # 4 complete blocks and one token


def _alloc() -> JengaAllocator:
    alloc = JengaAllocator(AllocatorConfig((GroupConfig("full", Kind.FULL, 4, 2, 1),), 8))
    alloc.add_request("a", PROMPT)
    assert alloc.allocate("a", len(PROMPT)) is not None
    alloc.cache("a", len(PROMPT))
    return alloc


def test_a_held_block_loses_its_identity_and_is_freed_at_release() -> None:
    alloc = _alloc()
    table = alloc.block_table("a", 0)
    assert alloc.prefix_match(PROMPT).hit == 16
    assert not alloc.uncache_blocks(0, [table[2]])  # no page changes while it is held
    assert not alloc.is_cached_block(0, table[2])
    assert alloc.prefix_match(PROMPT).hit == 8
    alloc.free("a")
    assert alloc.usage().cached_blocks == (3,)  # blocks 0, 1, 3 are cached; 2 went free
    assert alloc.prefix_match(PROMPT).hit == 8
    alloc.check_invariants(expensive=True)


def test_a_cached_block_is_freed_and_an_emptied_page_unmapped() -> None:
    alloc = _alloc()
    table = alloc.block_table("a", 0)
    alloc.free("a")
    assert alloc.usage().used_blocks == (0,) and alloc.usage().cached_blocks == (4,)
    plan = alloc.uncache_blocks(0, [table[2], table[3]])  # both blocks of one page
    assert [(op.group, op.page) for op in plan.ops if isinstance(op, UnmapPage)] == [(0, 1)]
    assert alloc.usage().cached_blocks == (2,)
    assert alloc.prefix_match(PROMPT).hit == 8
    assert not alloc.uncache_blocks(0, [table[2]])  # already gone: nothing to do
    assert alloc.stats()["blocks.evicted"] == 2
    alloc.check_invariants(expensive=True)


def test_an_id_outside_the_group_is_refused_with_nothing_changed() -> None:
    alloc = _alloc()
    table = alloc.block_table("a", 0)
    assert alloc.usage().mapped_pages == (3,)  # 3 pages: 6 blocks
    with pytest.raises(InvalidSize, match=r"block 16 is outside group 0's 6 blocks"):
        alloc.uncache_blocks(0, [table[0], 16])
    assert alloc.prefix_match(PROMPT).hit == 16
    alloc.check_invariants(expensive=True)
