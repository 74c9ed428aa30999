"""Early releases of window groups: head-first ties, and the optional demotion tier.

Setup of every test: a full-attention group and a sliding-window group (window 8), 4 tokens
per block, one block per large page (so step 3 evicts single blocks' pages). Request "a"
(32 tokens) is prefilled; request "b" (8 other tokens) runs and finishes; only then "a"
decodes one token, which releases a's sliding blocks 0-5 (they left the window) at a time
*newer* than b's blocks.

- Always: blocks released together mid-request go head first among themselves (block 5
  still serves hits ending up to 32 together with a's later blocks; block 0 only up to 12).
  Tail first would cut every long prefix of "a" first.
- ``demote_window_releases=True``: they also go before every block released by `free`
  (b's prompt survives); plain LRU evicts b's whole prompt first.
"""

from __future__ import annotations

import pytest
from jenga.allocator import AllocationRules, AllocatorConfig, GroupConfig, JengaAllocator
from jenga.plan import UnmapPage
from jenga.specs import Kind

from jenga import _core as J

A_PROMPT = list(range(100, 132))
B_PROMPT = list(range(500, 508))
A_EARLY = [(1, p) for p in range(6)]  # a's released sliding pages, head first


def _alloc(total: int, demote: bool = False, kind: Kind = Kind.SLIDING_WINDOW) -> JengaAllocator:
    extra = {"window": 8} if kind is Kind.SLIDING_WINDOW else {"chunk": 8}
    groups = (
        GroupConfig("full", Kind.FULL, 4, 1, 1),
        GroupConfig("swa", kind, 4, 1, 1, **extra),
    )
    rules = AllocationRules(demote_window_releases=demote)
    return JengaAllocator(AllocatorConfig(groups, total, rules))


def _run_a_then_b_then_a_decodes(alloc: JengaAllocator) -> tuple[int, ...]:
    """Blocks: a full 0-7, a swa 0-7; b full 8-9, swa 8-9; a's decode: full 10, swa 10.

    Returns the swa blocks a's decode released: 0-5 for window 8 (token 33 reads 25-32),
    0-7 for chunk 8 (token 33 starts chunk 4).
    """
    alloc.add_request("a", A_PROMPT)
    assert alloc.allocate("a", 32) is not None
    alloc.cache("a", 32)
    alloc.add_request("b", B_PROMPT)
    assert alloc.allocate("b", 8) is not None
    alloc.cache("b", 8)
    alloc.free("b")
    alloc.append_tokens("a", [7])
    got = alloc.allocate("a", 1)
    assert got is not None
    assert got.released[0] == ()
    return got.released[1]


@pytest.mark.parametrize("kind", [Kind.SLIDING_WINDOW, Kind.CHUNKED_LOCAL])
def test_early_releases_go_head_first_after_older_blocks(kind: Kind):
    alloc = _alloc(total=64, kind=kind)
    released = _run_a_then_b_then_a_decodes(alloc)
    assert released == tuple(range(6 if kind is Kind.SLIDING_WINDOW else 8))
    # plain LRU between b (older) and a's batch; inside a's batch head first
    # (was [9, 8, 5, 4, 3, 2, 1, 0] with tail-first ties everywhere)
    assert alloc.eviction_order("swa") == [9, 8, *released]
    assert alloc.page_eviction_order() == [(0, 9), (1, 9), (0, 8), (1, 8)] + [
        (1, b) for b in released
    ]
    alloc.check_invariants(expensive=True)


@pytest.mark.parametrize("kind", [Kind.SLIDING_WINDOW, Kind.CHUNKED_LOCAL])
def test_demoted_early_releases_go_before_a_finished_prompt(kind: Kind):
    alloc = _alloc(total=64, demote=True, kind=kind)
    released = _run_a_then_b_then_a_decodes(alloc)
    assert alloc.eviction_order("swa") == [*released, 9, 8]
    assert alloc.page_eviction_order() == [(1, b) for b in released] + [
        (0, 9),
        (1, 9),
        (0, 8),
        (1, 8),
    ]
    alloc.check_invariants(expensive=True)


def test_step3_with_demotion_evicts_early_pages_and_keeps_the_finished_prompt():
    # 23 units: a holds 8 + 8, b 2 + 2, a's decode 1 + 1 -> 22 mapped, 1 free
    alloc = _alloc(total=23, demote=True)
    _run_a_then_b_then_a_decodes(alloc)
    assert alloc.usage().free_units == 1
    # c needs 2 full + 2 swa pages: 1 free unit, then step 3 evicts a's pages 0, 1, 2
    alloc.add_request("c", list(range(900, 908)))
    got = alloc.allocate("c", 8)
    assert got is not None
    unmapped = [op for op in got.plan.ops if isinstance(op, UnmapPage)]
    assert unmapped == [UnmapPage(1, 0), UnmapPage(1, 1), UnmapPage(1, 2)]
    assert alloc.prefix_match([*B_PROMPT, 1]).hit == 8  # b's prompt is still whole
    alloc.check_invariants(expensive=True)


def test_step3_without_demotion_evicts_the_older_finished_prompt():
    alloc = _alloc(total=23)
    _run_a_then_b_then_a_decodes(alloc)
    alloc.add_request("c", list(range(900, 908)))
    got = alloc.allocate("c", 8)
    assert got is not None
    unmapped = [op for op in got.plan.ops if isinstance(op, UnmapPage)]
    assert unmapped == [UnmapPage(0, 9), UnmapPage(1, 9), UnmapPage(0, 8)]
    assert alloc.prefix_match([*B_PROMPT, 1]).hit == 0


def test_failed_allocate_rolls_back_early_releases():
    alloc = _alloc(total=24, demote=True)
    alloc.add_request("b", B_PROMPT)  # b: full 0-1, swa 0-1, cached
    assert alloc.allocate("b", 8) is not None
    alloc.cache("b", 8)
    alloc.free("b")
    alloc.add_request("a", A_PROMPT)  # a: full 2-9, swa 2-9; 4 units free
    assert alloc.allocate("a", 32) is not None
    alloc.cache("a", 32)
    alloc.append_tokens("a", [7] * 32)
    # 32 more tokens need 16 blocks: 4 free units + b's 4 pages + 6 released swa blocks = 14
    assert alloc.allocate("a", 32) is None
    assert alloc.eviction_order("swa") == [1, 0]  # a's releases undone, b intact
    assert alloc.usage().free_units == 4
    alloc.check_invariants(expensive=True)
    got = alloc.allocate("a", 1)  # token 33 fits: releases swa 2-7, demoted, head first
    assert got is not None and got.released == ((), (2, 3, 4, 5, 6, 7))
    assert alloc.eviction_order("swa") == [2, 3, 4, 5, 6, 7, 1, 0]
    alloc.check_invariants(expensive=True)


def test_shared_block_takes_the_kind_of_its_last_release():
    core = J.Core([1], [1], 4, J.Rules(early_release_groups=[True], demote_window_releases=True))
    assert core.allocate(1, [2], 1) == [[0, 1]]
    core.commit(0, [0, 1], [10, 11], [4, 8])
    core.acquire(0, [0], 2)  # owner 2 shares block 0
    assert core.allocate(1, [0], 3, [[0, 1]]) == [[]]  # owner 1 drops both early
    assert core.eviction_order(0) == [1]  # block 0 is still held by owner 2
    core.release(0, [0], 4)  # owner 2 finishes: block 0 cached in the normal tier
    assert core.eviction_order(0) == [1, 0]
    core.check_invariants(True)


def test_early_release_flags_need_one_per_group():
    core = J.Core([1, 1], [1, 1], 4)
    assert core.rules.early_release_groups == [False, False]
    assert core.rules.demote_window_releases is False
    with pytest.raises(ValueError, match="one early-release flag per group: got 1 for 2 groups"):
        core.rules = J.Rules(early_release_groups=[True])
    with pytest.raises(ValueError, match=r"clock value 4611686018427387904 outside"):
        core.allocate(1, [1, 1], 1 << 62)


def test_only_window_and_chunk_groups_release_early():
    groups = (
        GroupConfig("full", Kind.FULL, 4, 1, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 1, 1, window=8),
        GroupConfig("chunk", Kind.CHUNKED_LOCAL, 4, 1, 1, chunk=8),
        GroupConfig("mamba", Kind.MAMBA, 4, 1, 1),
    )
    plain = JengaAllocator(AllocatorConfig(groups, 16))
    assert plain._core.rules.early_release_groups == [False, True, True, False]
    assert plain._core.rules.demote_window_releases is False
    demote = AllocationRules(demote_window_releases=True)
    demoting = JengaAllocator(AllocatorConfig(groups, 16, demote))
    assert demoting._core.rules.demote_window_releases is True


def test_a_block_that_served_a_hit_is_not_demoted():
    core = J.Core([1], [1], 8, J.Rules(early_release_groups=[True], demote_window_releases=True))
    assert core.allocate(1, [3], 1) == [[0, 1, 2]]
    core.commit(0, [0, 1, 2], [10, 11, 12], [4, 8, 12])
    assert core.allocate(3, [1], 2) == [[3]]
    core.commit(0, [3], [20], [4])
    core.release(0, [3], 3)  # a finished request's block, normal tier, time 3
    core.acquire(0, [1], 4)  # owner 2 hits block 1 ...
    core.release(0, [1], 5)  # ... and finishes; owner 1 still holds it
    assert core.allocate(1, [0], 6, [[0, 1]]) == [[]]  # owner 1 drops 0 and 1 early
    # block 0: demoted; block 1 served a hit, so it keeps its time 6 in the normal tier
    # (without that rule: [0, 1, 3])
    assert core.eviction_order(0) == [0, 3, 1]
    core.check_invariants(True)
