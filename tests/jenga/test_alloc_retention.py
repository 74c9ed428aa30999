"""Retention boundaries (`AllocationRules.retention_interval`) in the prefix-subset evictor.

Setup of every test: a full-attention group (16 tokens per block) and a sliding-window
group (window 8, 4 tokens per block), one block per large page and one unit per page.
Request "a" (64 tokens) is prefilled 16 tokens at a time, so each call releases the
sliding blocks that left its window (early releases); "b" (128 other tokens) then runs the
same way through a pool that cannot keep both.

A hit at length R reads the sliding blocks of tokens R - 7 .. R - 1, the blocks whose
prefix p (tokens up to the block's end) has R - 7 < p <= R. With interval 16 the early
blocks at p = 12, 16 (blocks 2, 3: boundary 16) and 28, 32 (blocks 6, 7: boundary 32)
are read by a boundary hit; blocks 0, 1, 4, 5, 8, 9 are not, and are demoted.
"""

from __future__ import annotations

import pytest
from jenga.allocator import AllocationRules, AllocatorConfig, GroupConfig, JengaAllocator
from jenga.specs import Kind, SpecError

from jenga import _core as J

A_PROMPT = list(range(100, 164))
B_PROMPT = list(range(500, 628))
BOUNDARIES = (16, 32, 48)


def _alloc(total: int, interval: int) -> JengaAllocator:
    groups = (
        GroupConfig("full", Kind.FULL, 16, 1, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 1, 1, window=8),
    )
    rules = AllocationRules(retention_interval=interval)
    return JengaAllocator(AllocatorConfig(groups, total, rules))


def _fill(alloc: JengaAllocator, request_id: str, tokens: list[int]) -> None:
    """Prefill ``tokens`` 16 at a time, caching each chunk, then free the request."""
    alloc.add_request(request_id, tokens)
    done = 0
    while done < len(tokens):
        assert alloc.allocate(request_id, 16) is not None
        done += 16
        alloc.cache(request_id, done)
    alloc.free(request_id)


def _hits(alloc: JengaAllocator) -> list[int]:
    """a's hit for a query of each boundary plus two tokens."""
    return [alloc.prefix_match(A_PROMPT[: r + 2]).hit for r in BOUNDARIES]


@pytest.mark.parametrize(
    ("interval", "order"),
    [
        # the early blocks 0-9 LRU (head first), then the last window a's free released
        (0, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 14, 13, 12, 11, 10]),
        # demoted first: early blocks no boundary of 16 reads
        (16, [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 15, 14, 13, 12, 11, 10]),
        # boundary 32 reads blocks 6, 7 only
        (32, [0, 1, 2, 3, 4, 5, 8, 9, 6, 7, 15, 14, 13, 12, 11, 10]),
    ],
)
def test_early_blocks_no_boundary_reads_are_evicted_first(interval: int, order: list[int]) -> None:
    alloc = _alloc(total=64, interval=interval)
    _fill(alloc, "a", A_PROMPT)
    assert alloc.eviction_order("swa") == order
    assert alloc.eviction_order("full") == [3, 2, 1, 0]  # never demoted
    assert _hits(alloc) == [16, 32, 48]
    alloc.check_invariants(expensive=True)


@pytest.mark.parametrize(
    ("interval", "hits"),
    [
        (0, [0, 0, 0]),  # LRU: a's early window blocks, the oldest, go before b's
        (16, [16, 32, 48]),  # every boundary's window outlives b's demoted blocks
        (32, [0, 32, 48]),  # boundary 16 is no retention boundary: its window is demoted
    ],
)
def test_boundary_hits_survive_a_later_request_under_pressure(
    interval: int, hits: list[int]
) -> None:
    alloc = _alloc(total=40, interval=interval)
    _fill(alloc, "a", A_PROMPT)
    assert _hits(alloc) == [16, 32, 48]
    _fill(alloc, "b", B_PROMPT)
    assert alloc.stats()["blocks.evicted"] > 0
    assert _hits(alloc) == hits
    alloc.check_invariants(expensive=True)


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(SpecError, match="retention_interval must be >= 0, got -16"):
        AllocationRules(retention_interval=-16)


def test_the_core_refuses_bad_retention_rules_and_keeps_its_own() -> None:
    core = J.Core([1, 1], [1, 1], 8)
    with pytest.raises(ValueError, match="need one retention reach per group: got 1 for 2"):
        core.rules = J.Rules(retention_interval=16, retention_reach=[7])
    with pytest.raises(ValueError, match="retention reaches must be >= -1, got -2"):
        core.rules = J.Rules(retention_interval=16, retention_reach=[7, -2])
    with pytest.raises(ValueError, match="retention_interval must be >= 0, got -1"):
        core.rules = J.Rules(retention_interval=-1)
    assert core.rules.retention_interval == 0
    assert core.rules.retention_reach == [-1, -1]
