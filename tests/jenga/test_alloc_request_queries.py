"""The allocator's per-request queries an engine uses instead of its internals:
`JengaAllocator.held_step` (grow with no core call) and `JengaAllocator.is_cached_block`."""

from __future__ import annotations

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator, UnknownRequest
from jenga.specs import Kind


def small() -> JengaAllocator:
    group = GroupConfig("f", Kind.FULL, 4, 2, 1)  # 4 tokens a block, 2 blocks a page
    return JengaAllocator(AllocatorConfig((group,), 4, max_model_len=64))


def test_held_step_grows_within_held_blocks_only() -> None:
    alloc = small()
    alloc.add_request("r", [1, 2, 3, 4, 5], use_cache=False)
    assert alloc.allocate("r", 7) is not None  # 7 tokens: blocks 0..1 (8 slots)
    step = alloc.held_step("r")
    counters = alloc.stats()
    assert step(8) is True and alloc.num_tokens("r") == 8  # the 8th slot is held
    assert step(9) is False and alloc.num_tokens("r") == 8  # a third block: not held
    assert alloc.stats() == counters  # no core call either way
    assert alloc.allocate("r", 1) is not None
    assert alloc.block_table("r", 0) == [0, 1, 2]
    alloc.check_invariants(expensive=True)


def test_held_step_of_an_unknown_request_is_refused() -> None:
    with pytest.raises(UnknownRequest, match=r"unknown request 'x' \(0 live requests\)"):
        small().held_step("x")


def test_is_cached_block_follows_the_prefix_index() -> None:
    alloc = small()
    alloc.add_request("r", list(range(9)), use_cache=False)
    assert alloc.allocate("r", 9) is not None  # blocks 0, 1, 2
    assert [alloc.is_cached_block(0, b) for b in (0, 1, 2)] == [False, False, False]
    alloc.cache("r", 9)  # blocks 0 and 1 complete within 9 computed tokens
    assert [alloc.is_cached_block(0, b) for b in (0, 1, 2)] == [True, True, False]
    alloc.free("r")
    assert [alloc.is_cached_block(0, b) for b in (0, 1)] == [True, True]  # cached, evictable
