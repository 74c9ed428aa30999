"""One prefix lookup per admission (`prefix_match` adopted by `add_request`), plans whose
raw keys and ops agree, and allocations within held blocks that build nothing."""

from __future__ import annotations

import pytest
from jenga.allocator import NULL_BLOCK, AllocatorConfig, GroupConfig, InvalidInput
from jenga.plan import MappingPlan, plan_from_keys
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
    match, looked_up = reused.prefix_match(prompt), fresh.prefix_match(prompt)
    assert (match.hit, match.junction) == (looked_up.hit, looked_up.junction)
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
    now = alloc.prefix_match([*PROMPT, 5]).hit
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


def test_a_plan_read_by_keys_holds_the_ops_read_by_objects():
    by_keys, by_ops = _alloc(), _alloc()
    keys: list[tuple[int, int, int, int]] = []
    plans = []
    for alloc in (by_keys, by_ops):
        alloc.add_request("b", [3] * 12, use_cache=False)
        got = alloc.allocate("b", 12)
        assert got is not None
        freed = alloc.free("b")
        if alloc is by_keys:  # an engine replaying keys into its own tables builds no op
            keys += got.plan.keys + freed.keys
        else:
            plans += [got.plan, freed]
    assert plan_from_keys(keys).ops == plans[0].ops + plans[1].ops
    assert plans[0].keys + plans[1].keys == keys
    assert plans[0].ops  # the trace maps pages at all


def test_allocate_returns_the_new_ids_and_nothing_within_held_blocks():
    alloc = _alloc()
    alloc.add_request("b", [3] * 3, use_cache=False)
    got = alloc.allocate("b", 3)
    assert got is not None and [list(ids) for ids in got.new_blocks] == [
        alloc.block_table("b", g) for g in range(2)
    ]
    held = alloc.allocate("b", 1)  # the 4th token fits the held 4-token blocks
    assert held is not None and held.new_blocks == alloc.no_blocks and not held.plan
    alloc.check_invariants(expensive=True)


def test_the_unmap_all_plan_is_the_only_plan_that_resets():
    assert not MappingPlan() and len(MappingPlan()) == 0
    reset = MappingPlan.unmap_all()
    assert reset and reset.reset and len(reset) == 0 and reset != MappingPlan()


def test_a_capped_match_takes_the_longest_hit_below_the_cap_valid_in_every_group():
    """16 tokens cached (full + an 8-token window, 4-token blocks): a cap of 14 hits 12,
    with the window blocks of 12 (block 1, which a hit of 16 skips); the adopted match
    claims exactly that."""
    alloc = _alloc()
    prompt = [*PROMPT, 99]
    assert alloc.prefix_match(prompt).hit == 16
    capped = alloc.prefix_match(prompt, max_hit=14)
    assert capped.hit == 12
    assert alloc.prefix_match(prompt, max_hit=3).hit == 0
    assert alloc.prefix_match(prompt, max_hit=0).hit == 0
    full = alloc.prefix_match(prompt).tables
    assert capped.tables[0] == full[0][:3]
    # the window of 12 reads blocks 1 and 2 (16's: 2 and 3, block 1 released there)
    assert full[1][1] == -1 and -1 not in capped.tables[1][1:3]
    assert capped.tables[1][2] == full[1][2]
    assert alloc.add_request("b", prompt, match=capped) == 12
    for g in range(2):
        assert alloc.block_table("b", g) == capped.tables[g]
    alloc.check_invariants(expensive=True)


# -- hits deeper than the cached Mamba states (a caller that restores the state) ------------
def _hybrid() -> tuple[JengaAllocator, list[int], list[int]]:
    """Full attention + step-end Mamba on 4-token blocks, a 16-token prompt computed one
    block per step (a state cached at every boundary); (allocator, attention ids, states)."""
    groups = (GroupConfig("attn", Kind.FULL, 4, 4, 1), GroupConfig("mamba", Kind.MAMBA, 4, 1, 1))
    alloc = JengaAllocator(AllocatorConfig(groups, 64, mamba_step_end_only=True))
    alloc.add_request("a", PROMPT)
    states = []
    for end in range(4, 17, 4):
        assert alloc.allocate("a", 4) is not None
        alloc.cache("a", end)
        states.append(alloc.block_table("a", 1)[-1])
    attn = alloc.block_table("a", 0)
    alloc.free("a")
    return alloc, attn, states


def test_restored_states_take_the_attention_hit_past_the_cached_states():
    alloc, attn, states = _hybrid()
    alloc.uncache_blocks("mamba", states[1:])  # only the state after 4 tokens stays
    prompt = [*PROMPT, 99, 98]
    assert (alloc.prefix_match(prompt).hit, alloc.prefix_match(prompt).diverged) == (4, False)
    match = alloc.prefix_match(prompt, restored_states=True)
    assert (match.hit, match.diverged, match.junction) == (16, True, 16)
    assert match.tables == [attn, [NULL_BLOCK] * 4]  # no state at 16: the caller restores it
    assert alloc.add_request("b", prompt, match=match) == 16
    got = alloc.allocate("b", 2)
    assert got is not None and got.new_blocks[1] and got.new_blocks[1][0] not in states[:1]
    assert alloc.block_table("b", 0)[:4] == attn
    alloc.check_invariants(expensive=True)


def test_a_state_cached_past_the_attention_hit_keeps_the_common_hit():
    """Mamba alone runs deeper (the attention tail was evicted): the hit every group
    agrees on, as vLLM's manager falls back to it."""
    alloc, attn, states = _hybrid()
    alloc.uncache_blocks("attn", attn[2:])  # attention serves 8 tokens
    alloc.uncache_blocks("mamba", states[1:3])  # states after 4 and 16 tokens stay
    match = alloc.prefix_match([*PROMPT, 99, 98], restored_states=True)
    # the junction is attention's 8: the state at 16 is cached already, none at 8
    assert (match.hit, match.diverged, match.junction) == (4, False, 8)
    assert match.tables == [attn[:1], [states[0]]]
