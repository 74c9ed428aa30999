"""Speculative decoding's hit proof: a prefix hit must be followed by cached steps in
every token group (vLLM's EAGLE last-block drop), state groups need only the hit."""

from __future__ import annotations

import numpy as np
import pytest
from jenga.allocator import AllocationRules, AllocatorConfig, GroupConfig
from jenga.config import HitProof
from jenga.specs import SpecError

from jenga import JengaAllocator, Kind

PROMPT = list(range(32))  # 8 blocks of 4


def _alloc(proof: HitProof | None, *groups: GroupConfig) -> JengaAllocator:
    groups = groups or (GroupConfig("full", Kind.FULL, 4, 2, 1),)
    alloc = JengaAllocator(AllocatorConfig(groups, total_units=32, hit_proof=proof))
    alloc.add_request("a", PROMPT)
    assert alloc.allocate("a", 32) is not None
    alloc.cache("a", 32)
    alloc.free("a")
    return alloc


@pytest.mark.parametrize(
    ("prompt_len", "proof", "hit"),
    [
        (40, None, 32),  # all 8 cached blocks
        (40, HitProof(), 28),  # the last cached block proves the hit below it
        (40, HitProof(steps=2), 24),
        (32, None, 28),  # the whole prompt: one token is always computed
        (32, HitProof(), 28),  # proven by the prompt's last block (hybrid coordinator)
        (32, HitProof(to_prompt_end=False), 24),  # proof below the last token (unitary)
        (33, HitProof(to_prompt_end=False), 28),
    ],
)
def test_a_hit_is_followed_by_its_proof(prompt_len: int, proof: HitProof | None, hit: int):
    alloc = _alloc(proof)
    prompt = [*PROMPT, *range(1000, 1000 + prompt_len - 32)][:prompt_len]
    match = alloc.prefix_match(prompt)
    assert match.hit == hit
    assert alloc.add_request("b", prompt, match=match) == hit
    table = alloc.block_table("b", 0)
    assert len(table) == hit // 4 and -1 not in table  # the hit's blocks, shared
    alloc.check_invariants(expensive=True)


def test_a_window_needs_its_blocks_and_the_proof_a_state_only_the_hit():
    window = GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 2, 1, window=8)
    mamba = GroupConfig("mamba", Kind.MAMBA, 8, 1, 1)
    prompt = [*PROMPT, 5, 6, 7, 8]
    assert _alloc(None, window).prefix_match(prompt).hit == 32
    assert _alloc(HitProof(), window).prefix_match(prompt).hit == 28
    # Mamba states at 8, 16, 24, 32 (interval 8); the full group proves 24 by 28..32
    full = GroupConfig("full", Kind.FULL, 4, 2, 1)
    assert _alloc(None, full, mamba).prefix_match(prompt).hit == 32
    assert _alloc(HitProof(), full, mamba).prefix_match(prompt).hit == 24


def test_proof_masks_and_bad_steps():
    mask = np.array([True, True, False, True, True, True])
    assert HitProof().proven(mask.copy(), False, False).tolist() == [
        True, False, False, True, True, False,
    ]  # fmt: skip
    assert HitProof(steps=2).proven(mask.copy(), False, True).tolist() == [
        False, False, False, True, False, False,
    ]  # fmt: skip
    assert HitProof().proven(mask.copy(), True, True).tolist() == [*mask[:-1], False]
    with pytest.raises(SpecError, match="hit proof steps must be > 0, got 0"):
        HitProof(steps=0)


def test_the_proof_a_hit_used_is_kept_like_the_hit_after_it_leaves_a_window():
    """A proven hit reads the block after it without holding it. When that proof block
    later leaves its owner's window, it must not go to the demoted tier (evicted before
    every finished request's blocks): the next request with the prefix needs it as
    proof as much as it needs the hit's blocks. Here "c" finished first (its sliding
    blocks the least recently used), "b" hit a's prefix proven by a's sliding block 7,
    then "a" decoded past it: c's blocks go first, the proof after them."""
    groups = (
        GroupConfig("full", Kind.FULL, 4, 1, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 1, 1, window=8),
    )
    rules = AllocationRules(demote_window_releases=True)
    config = AllocatorConfig(groups, total_units=64, rules=rules, hit_proof=HitProof())
    alloc = JengaAllocator(config)
    alloc.add_request("c", list(range(500, 508)))
    assert alloc.allocate("c", 8) is not None
    alloc.cache("c", 8)
    c_blocks = alloc.block_table("c", 1)
    alloc.free("c")
    alloc.add_request("a", PROMPT)
    assert alloc.allocate("a", 32) is not None
    alloc.cache("a", 32)
    proof = alloc.block_table("a", 1)[7]
    assert alloc.add_request("b", [*PROMPT, 900]) == 28  # proven by a's block 7
    assert proof not in alloc.block_table("b", 1)
    for token in range(12):  # a decodes: its window leaves block 7
        alloc.append_tokens("a", [700 + token])
        assert alloc.allocate("a", 1) is not None
    assert alloc.block_table("a", 1)[7] == -1
    order = alloc.eviction_order("swa")
    assert max(order.index(b) for b in c_blocks) < order.index(proof)
    alloc.check_invariants(expensive=True)


def test_a_per_block_proof_is_one_block_of_the_group_and_only_where_asked():
    """vLLM's margin: each group proves a hit with one of its own blocks (4 tokens here),
    not a prefix step (8: the lcm with the Mamba interval); ``groups`` names the groups
    that need a proof (a state group never does)."""
    full = GroupConfig("full", Kind.FULL, 4, 2, 1)
    mamba = GroupConfig("mamba", Kind.MAMBA, 8, 1, 1)
    prompt = [*PROMPT[:28], 99, 99, 99, 99]

    def hit(proof: HitProof | None) -> int:
        alloc = JengaAllocator(AllocatorConfig((full, mamba), total_units=32, hit_proof=proof))
        alloc.add_request("a", PROMPT[:28])  # attention to 28, states at 8, 16, 24
        assert alloc.allocate("a", 28) is not None
        alloc.cache("a", 28)
        alloc.free("a")
        return alloc.prefix_match(prompt).hit

    assert hit(None) == 24
    assert hit(HitProof()) == 16  # 24 would need 32 cached
    assert hit(HitProof(per_block=True)) == 24  # proven by the block 24..28
    assert hit(HitProof(groups=(1,))) == 24  # only the Mamba group: no proof needed
