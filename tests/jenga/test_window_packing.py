"""Kept sliding-window blocks go to pages live blocks already pin (`pack_window_blocks`).

A page of VMM chunks goes back to the pool (or to another group) only when none of its
blocks is live. Blocks that left a window stay cached (demoted) on their pages; a new
block a request keeps should fill such a slot on a page that live blocks pin anyway,
not pin another page, so the pages whose live blocks all left the window drain whole.
"""

from __future__ import annotations

import jenga._core as J
import pytest
from jenga.allocator import JengaAllocator
from jenga.config import AllocationRules, AllocatorConfig, GroupConfig
from jenga.specs import Kind


def _core(pack: bool) -> J.Core:
    # one sliding-window group, 4 blocks per 1-unit page, 4 units; a request keeps 2 blocks
    rules = J.Rules(
        order=J.AllocationOrder.PINNED,
        early_release_groups=[True],
        demote_window_releases=True,
        reuse_window_releases=True,
        pack_window_blocks=pack,
        window_blocks=[2],
    )
    return J.Core([4], [1], 4, rules)


def _prefill_two(core: J.Core) -> None:
    """Owner 1 prefills 8 blocks (pages 0 and 1), keeps 6 and 7; owner 2 keeps 3 of page 0."""
    assert core.allocate(1, [8], 1) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    core.commit(0, list(range(8)), list(range(100, 108)), [4 * (i + 1) for i in range(8)])
    core.acquire(0, [3], 2)  # owner 2 shares block 3 (a prefix hit)
    assert core.allocate(1, [0], 3, [[0, 1, 2, 3, 4, 5]]) == [[]]  # 0-5 left the window


@pytest.mark.parametrize("pack", [False, True])
def test_kept_blocks_fill_the_densest_pinned_page(pack: bool) -> None:
    core = _core(pack)
    _prefill_two(core)
    # page 0: block 3 live (owner 2), 0-2 demoted; page 1: 6, 7 live, 4, 5 demoted
    got = core.allocate(3, [2], 4)
    if pack:  # the page with the most live blocks: page 1, least recently used first
        assert got == [[4, 5]]
        assert core.free_units == 2  # no page mapped for them
    else:  # a new page (page 2) although two pinned pages hold demoted slots
        assert got == [[8, 9]]
        assert core.free_units == 1
    core.check_invariants(True)


def test_blocks_released_right_after_keep_the_order() -> None:
    core = _core(True)
    _prefill_two(core)
    # 5 blocks: the first 3 leave the window right after (free units first: a new page),
    # the last 2 are kept (the demoted slots of page 1)
    assert core.allocate(3, [5], 4) == [[8, 9, 10, 4, 5]]
    core.check_invariants(True)


def test_window_block_counts_need_one_per_group() -> None:
    with pytest.raises(ValueError, match="one window block count per group: got 1 for 2"):
        J.Core([4, 4], [1, 1], 4, J.Rules(window_blocks=[2]))
    with pytest.raises(ValueError, match="window block counts must be >= 0, got -1"):
        J.Core([4], [1], 4, J.Rules(window_blocks=[-1]))


def test_policies_give_the_kept_block_counts() -> None:
    groups = (
        GroupConfig("full", Kind.FULL, 16, 1, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 16, 1, 1, window=64),
        GroupConfig("swa16", Kind.SLIDING_WINDOW, 16, 1, 1, window=16),
        GroupConfig("chunk", Kind.CHUNKED_LOCAL, 16, 1, 1, chunk=32),
    )
    rules = AllocationRules(pack_window_blocks=True, demote_window_releases=True)
    core_rules = JengaAllocator(AllocatorConfig(groups, 16, rules))._core.rules
    # a 64-token window touches at most 5 16-token blocks (unaligned), 16 tokens 2; a
    # 32-token chunk starts on a chunk boundary: 2
    assert core_rules.window_blocks == [0, 5, 2, 2]
    assert core_rules.pack_window_blocks is True
