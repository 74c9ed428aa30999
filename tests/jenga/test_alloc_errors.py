"""Bad input: each case raises its own exception class, with the numbers, changing nothing."""

from __future__ import annotations

import pytest
from jenga.allocator import (
    AllocatorConfig,
    DoubleFree,
    DuplicateRequest,
    GroupConfig,
    ImageSpan,
    InvalidSize,
    JengaAllocator,
    PageTooLarge,
    UnknownRequest,
)
from jenga.specs import Kind, SpecError

from jenga import _core as J


def small(max_len: int | None = 64) -> JengaAllocator:
    group = GroupConfig("f", Kind.FULL, 4, 2, 1)
    return JengaAllocator(AllocatorConfig((group,), 4, max_model_len=max_len))


def test_unknown_request():
    alloc = small()
    with pytest.raises(UnknownRequest, match=r"unknown request 'x' \(0 live requests\)"):
        alloc.allocate("x", 1)
    with pytest.raises(UnknownRequest):
        alloc.free("x")
    with pytest.raises(UnknownRequest):
        alloc.block_table("x", 0)


def test_double_free_and_duplicate():
    alloc = small()
    alloc.add_request("a", [1, 2, 3])
    with pytest.raises(DuplicateRequest, match="'a' is already live"):
        alloc.add_request("a", [1])
    alloc.free("a")
    with pytest.raises(DoubleFree, match="'a' was already freed"):
        alloc.free("a")
    assert isinstance(DoubleFree("x"), UnknownRequest)
    alloc.add_request("a", [1, 2])  # an id may be reused once freed
    alloc.check_invariants(expensive=True)


@pytest.mark.parametrize("n", [0, -3])
def test_non_positive_token_counts(n: int):
    alloc = small()
    alloc.add_request("a", [1, 2, 3])
    with pytest.raises(InvalidSize, match=f"num_new_tokens must be > 0, got {n}"):
        alloc.allocate("a", n)
    assert alloc.num_tokens("a") == 0


def test_lengths_beyond_max_model_len():
    alloc = small(max_len=8)
    with pytest.raises(InvalidSize, match="9 tokens exceed max_model_len 8"):
        alloc.add_request("a", list(range(9)))
    alloc.add_request("a", list(range(8)))
    assert alloc.allocate("a", 8) is not None
    with pytest.raises(InvalidSize, match="9 tokens exceed max_model_len 8"):
        alloc.allocate("a", 1)
    with pytest.raises(InvalidSize, match="prompt has 0 tokens"):
        alloc.add_request("b", [])
    # an empty prompt that looks nothing up (an engine may schedule slots before tokens)
    assert alloc.add_request("c", [], use_cache=False) == 0
    assert alloc.allocate("c", 5) is not None and alloc.num_tokens("c") == 5
    alloc.free("c")


def test_cache_beyond_allocated():
    alloc = small()
    alloc.add_request("a", list(range(10)))
    alloc.allocate("a", 4)
    with pytest.raises(InvalidSize, match="5 computed tokens, but only 4 allocated and 10 known"):
        alloc.cache("a", 5)


def test_window_larger_than_max_len_and_bad_specs():
    group = GroupConfig("w", Kind.SLIDING_WINDOW, 4, 2, 1, window=100)
    with pytest.raises(InvalidSize, match="window 100 > max_model_len 64"):
        JengaAllocator(AllocatorConfig((group,), 4, max_model_len=64))
    with pytest.raises(SpecError, match="sliding window must be > 0, got 0"):
        JengaAllocator(
            AllocatorConfig((GroupConfig("w", Kind.SLIDING_WINDOW, 4, 2, 1, window=0),), 4)
        )
    with pytest.raises(SpecError, match="tokens_per_block must be > 0, got 0"):
        JengaAllocator(AllocatorConfig((GroupConfig("f", Kind.FULL, 0, 2, 1),), 4))


def test_page_larger_than_pool_and_empty_pool():
    big = GroupConfig("mamba", Kind.MAMBA, 512, 8, 5)
    with pytest.raises(PageTooLarge, match="costs 5 units, the pool holds 4"):
        JengaAllocator(AllocatorConfig((big,), 4))
    with pytest.raises(InvalidSize, match="total_units must be > 0, got 0"):
        JengaAllocator(AllocatorConfig((GroupConfig("f", Kind.FULL, 4, 2, 1),), 0))
    with pytest.raises(InvalidSize, match="blocks_per_large_page 0"):
        JengaAllocator(AllocatorConfig((GroupConfig("f", Kind.FULL, 4, 0, 1),), 4))


def test_bad_images():
    alloc = small()
    with pytest.raises(InvalidSize, match=r"image span \[2, 12\)"):
        alloc.add_request("a", list(range(10)), images=[ImageSpan(2, 10, 7)])
    with pytest.raises(InvalidSize, match=r"image span \[3, 5\)"):
        alloc.add_request("a", list(range(10)), images=[ImageSpan(2, 2, 7), ImageSpan(3, 2, 8)])


def test_core_rejects_bad_arguments_without_changing_state():
    with pytest.raises(ValueError, match="total_units must be > 0, got 0"):
        J.Core([2], [1], 0)
    with pytest.raises(ValueError, match="group 1: blocks_per_page and units_per_page must be > 0"):
        J.Core([2, 0], [1, 1], 4)
    core = J.Core([2], [1], 4)
    with pytest.raises(ValueError, match="block count must be >= 0, got -1"):
        core.allocate(1, [-1], 1)
    with pytest.raises(ValueError, match="one count per group: got 2 for 1 groups"):
        core.allocate(1, [1, 1], 1)
    assert core.allocate(1, [1], 1) == [[0]]
    with pytest.raises(ValueError, match="block 0 is not in use"):
        core.release(0, [0, 0], 2)  # listed twice, held once: nothing released
    assert core.block_info(0, 0)[:2] == (1, 1)
    with pytest.raises(ValueError, match="block 1 is not in use"):
        core.allocate(1, [1], 3, [[1]])  # release of a free block inside allocate
    with pytest.raises(ValueError, match="block 5 is neither in use nor cached"):
        core.acquire(0, [5], 4)
    with pytest.raises(ValueError, match="only owned blocks can be cached"):
        core.commit(0, [1], [9], [1])
    with pytest.raises(IndexError, match="group 3 out of range"):
        core.lookup(3, [1]).tolist()
    core.check_invariants(True)
    assert core.free_units == 3
