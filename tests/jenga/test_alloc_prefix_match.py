"""The allocator's per-admission economies: one prefix lookup per admission (`prefix_match` adopted
by `add_request`), plan ops handed to a `plan_sink`, and `grow` (new ids, no Allocation)."""

from __future__ import annotations

import pytest
from jenga.allocator import AllocatorConfig, AllocatorError, GroupConfig, InvalidInput
from jenga.plan import plan_from_keys
from jenga.specs import Kind

from jenga import JengaAllocator

PROMPT = list(range(16))


def _alloc() -> JengaAllocator:
    groups = (
        GroupConfig("full", Kind.FULL, 4, 2, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 2, 1, window=8),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, total_units=8))
    alloc.add_request("a", PROMPT)
    assert alloc.allocate("a", 16) is not None
    alloc.cache("a", 16)
    alloc.free("a")
    return alloc


def test_an_adopted_match_claims_exactly_what_a_fresh_lookup_claims():
    fresh, reused = _alloc(), _alloc()
    prompt = [*PROMPT, 99, 98, 97]
    match = reused.prefix_match(prompt)
    assert (match.hit, match.junction) == fresh.match_prefix_junction(prompt)
    assert reused.add_request("b", prompt, match=match) == fresh.add_request("b", prompt)
    assert match.request is None  # adopted, hashes and all: it cannot be adopted twice
    for g in range(2):
        assert reused.block_table("b", g) == fresh.block_table("b", g)
    for alloc in (fresh, reused):
        assert alloc.allocate("b", 3) is not None
        alloc.cache("b", 19)
    assert reused.stats() == fresh.stats()
    reused.check_invariants(expensive=True)


def test_a_match_is_not_adopted_after_a_call_that_may_evict():
    alloc = _alloc()
    match = alloc.prefix_match([*PROMPT, 5])
    alloc.add_request("c", [7] * 24, use_cache=False)
    assert alloc.allocate("c", 24) is not None  # evicts cached pages: the match is stale
    now = alloc.match_prefix([*PROMPT, 5])
    assert now < match.hit  # adopting the stale match would claim evicted blocks
    assert alloc.add_request("b", [*PROMPT, 5], match=match) == now
    assert match.request is not None  # looked up again instead
    alloc.check_invariants(expensive=True)


def test_a_match_of_another_prompt_is_refused():
    alloc = _alloc()
    match = alloc.prefix_match([*PROMPT, 5])
    with pytest.raises(InvalidInput, match="17-token prompt"):
        alloc.add_request("b", PROMPT, match=match)
    assert alloc.stats()["requests.live"] == 0


def test_a_plan_sink_gets_the_ops_the_plans_would_hold():
    plain, sunk = _alloc(), _alloc()
    keys: list[tuple[int, int, int, int]] = []
    sunk.plan_sink = keys.extend
    plans = []
    for alloc in (plain, sunk):
        alloc.add_request("b", [3] * 12, use_cache=False)
        got = alloc.allocate("b", 12)
        assert got is not None
        plans.append(got.plan)
        plans.append(alloc.free("b"))
    assert not plans[2] and not plans[3]  # with a sink, calls return empty plans
    assert plan_from_keys(keys).ops == plans[0].ops + plans[1].ops
    assert plans[0].ops  # the trace maps pages at all


def test_grow_returns_the_new_ids_and_needs_a_sink():
    alloc = _alloc()
    alloc.add_request("b", [3] * 4, use_cache=False)
    with pytest.raises(AllocatorError, match="plan_sink"):
        alloc.grow("b", 4)
    keys: list[tuple[int, int, int, int]] = []
    alloc.plan_sink = keys.extend
    got = alloc.grow("b", 4)
    assert got is not None and [list(ids) for ids in got] == [
        alloc.block_table("b", g) for g in range(2)
    ]
    assert alloc.grow("b", 1) is not None  # the next token fits the held blocks
    alloc.check_invariants(expensive=True)
