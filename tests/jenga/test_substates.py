"""Mamba states cached inside a checkpoint interval (`jenga.substates`, ``state_unit``).

A full-attention group of 2-token blocks and a Mamba group of 8-token intervals, named by
the caller's 2-token digests, with ``state_unit`` 2: a request whose step ends at 6
tokens names its running state there; its next step first moves the name to a fresh
block (a copy the engine runs); a later request with the prefix hits 6 tokens and its
first allocation copies the named state into a block of its own. Every copy's endpoints
stay referenced until `release_retained`. With 4-token attention blocks the attention
block holding token 6 is named and copied the same way (its KV is append-only).
"""

from __future__ import annotations

import hashlib

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.errors import InvalidSize
from jenga.prefix import BlockIdentity
from jenga.requests import NULL_BLOCK
from jenga.specs import Kind

FULL, MAMBA = 0, 1


def _digests(tokens: list[int]) -> list[bytes]:
    out, parent = [], b""
    for i in range(len(tokens) // 2):
        parent = hashlib.sha256(parent + repr(tokens[2 * i : 2 * i + 2]).encode()).digest()
        out.append(parent)
    return out


def _allocator(unit: int | None = 2, mamba_block: int = 8, full_block: int = 2) -> JengaAllocator:
    groups = (
        GroupConfig("full", Kind.FULL, full_block, 4, 1),
        GroupConfig("mamba", Kind.MAMBA, mamba_block, 2, 1),
    )
    identity = BlockIdentity(digest_block_size=2)
    config = AllocatorConfig(
        groups, 64, identity=identity, mamba_step_end_only=True, state_unit=unit
    )
    return JengaAllocator(config)


PROMPT = list(range(1, 8))  # 7 tokens: the last hash boundary below the end is 6


def _produce(alloc: JengaAllocator) -> int:
    """Request "p" computes 6 tokens and names its running state there."""
    alloc.add_request("p", PROMPT, digests=_digests(PROMPT))
    assert alloc.allocate("p", 6) is not None
    alloc.cache("p", 6)
    named = alloc.cache_state("p", 6)
    assert [g for g, _ in named] == [MAMBA]
    return named[0][1]


def test_a_named_state_is_hit_inside_the_interval_and_copied_by_the_hitter() -> None:
    alloc = _allocator()
    x = _produce(alloc)
    alloc.free("p")  # finished: its named state stays cached in place
    prompt = [*PROMPT[:6], 50, 51, 52]
    match = alloc.prefix_match(prompt, digests=_digests(prompt))
    assert match.hit == 6 and match.tables[MAMBA] == [x]
    assert alloc.add_request("h", prompt, digests=_digests(prompt)) == 6
    got = alloc.allocate("h", 3)
    assert got is not None
    (copy,) = got.copies
    assert (copy.group, copy.index, copy.src, copy.retained) == (MAMBA, 0, x, (x,))
    assert alloc.block_table("h", MAMBA)[0] == copy.dst and copy.dst != x
    alloc.check_invariants(True)  # x: one reference kept for the copy
    alloc.release_retained(MAMBA, [x])
    alloc.check_invariants(True)
    with pytest.raises(InvalidSize, match="retained reference"):
        alloc.release_retained(MAMBA, [x])
    alloc.free("h")
    # the named state is still cached: another request hits it
    assert alloc.prefix_match(prompt, digests=_digests(prompt)).hit == 6


def test_the_producers_next_step_moves_the_name_off_its_running_block() -> None:
    alloc = _allocator()
    x = _produce(alloc)
    assert alloc.has_named_state("p")
    (copy,), _ = alloc.move_state("p")
    assert copy.moved and (copy.src, copy.index) == (x, 0) and copy.retained == (x, copy.dst)
    assert alloc.block_table("p", MAMBA) == [x]  # the producer keeps writing x
    assert not alloc.has_named_state("p")
    alloc.check_invariants(True)
    match = alloc.prefix_match([*PROMPT[:6], 9, 9], digests=_digests([*PROMPT[:6], 9, 9]))
    assert match.hit == 6 and match.tables[MAMBA] == [copy.dst]
    alloc.release_retained(MAMBA, [x, copy.dst])
    assert alloc.allocate("p", 1) is not None  # writes x in place: no longer named
    alloc.free("p")
    alloc.check_invariants(True)
    assert not alloc.has_named_state("p")


def test_without_state_unit_the_hit_stops_at_the_checkpoint_below() -> None:
    alloc = _allocator(unit=None)
    alloc.add_request("p", PROMPT, digests=_digests(PROMPT))
    assert alloc.allocate("p", 6) is not None
    alloc.cache("p", 6)
    with pytest.raises(InvalidSize, match="state_unit"):
        alloc.cache_state("p", 6)
    alloc.free("p")
    prompt = [*PROMPT[:6], 50]
    assert alloc.prefix_match(prompt, digests=_digests(prompt)).hit == 0


def test_names_only_inside_an_interval_and_where_the_digests_reach() -> None:
    alloc = _allocator()
    prompt = list(range(1, 12))
    alloc.add_request("p", prompt, digests=_digests(prompt)[:2])  # digests of 4 tokens
    assert alloc.allocate("p", 10) is not None
    assert alloc.cache_state("p", 8) == ()  # a checkpoint: `cache` names it
    assert alloc.cache_state("p", 5) == ()  # not on the unit
    assert alloc.cache_state("p", 10) == ()  # no digest for 10 tokens yet
    assert alloc.block_table("p", MAMBA)[0] == NULL_BLOCK  # the span's skipped checkpoint
    with pytest.raises(InvalidSize, match="11 tokens, 10 allocated"):
        alloc.cache_state("p", 11)


@pytest.mark.parametrize(("unit", "block"), [(3, 8), (4, 6)])
def test_a_state_unit_off_the_digest_or_checkpoint_grid_is_refused(unit: int, block: int) -> None:
    with pytest.raises(InvalidSize, match=f"state_unit {unit}"):
        _allocator(unit=unit, mamba_block=block)


def test_a_larger_attention_block_is_named_hit_and_copied_like_the_state() -> None:
    alloc = _allocator(full_block=4)
    alloc.add_request("p", PROMPT, digests=_digests(PROMPT))
    assert alloc.allocate("p", 6) is not None
    alloc.cache("p", 6)
    named = dict(alloc.cache_state("p", 6))
    a0, a1 = alloc.block_table("p", FULL)
    assert named == {FULL: a1, MAMBA: alloc.block_table("p", MAMBA)[0]}
    moved, _ = alloc.move_state("p")  # the names leave the blocks "p" keeps writing
    assert {c.group for c in moved} == {FULL, MAMBA} and all(c.moved for c in moved)
    dst = {c.group: c.dst for c in moved}
    for c in moved:
        alloc.release_retained(c.group, list(c.retained))
    alloc.free("p")
    prompt = [*PROMPT[:6], 50, 51, 52]
    match = alloc.prefix_match(prompt, digests=_digests(prompt))
    # the whole block below, then the block named at 6 (inside the second)
    assert match.hit == 6 and match.tables[FULL] == [a0, dst[FULL]]
    # diverging at 5: the attention block below holds (4), no state there: no hit
    other = [*prompt[:5], 9, 9]
    short = alloc.prefix_match(other, digests=_digests(other))
    assert (short.hit, short.junction) == (0, 4)
    assert alloc.add_request("h", prompt, digests=_digests(prompt)) == 6
    got = alloc.allocate("h", 3)
    assert got is not None
    copies = {c.group: c for c in got.copies}
    assert (copies[FULL].index, copies[FULL].src, copies[FULL].retained) == (
        1,
        dst[FULL],
        (dst[FULL],),
    )
    assert alloc.block_table("h", FULL)[:2] == [a0, copies[FULL].dst]
    for c in got.copies:
        alloc.release_retained(c.group, list(c.retained))
    alloc.check_invariants(True)
    # the hitter's own copy is named by its whole 8 tokens once computed
    assert alloc.cache("h", 8) >= 1
    alloc.free("h")
    alloc.check_invariants(True)


def test_an_attention_block_named_later_in_its_block_serves_a_shorter_hit() -> None:
    """Attention KV is append-only: the block named at 6 also holds tokens 0..3, so a
    hit of 4 (where the state is kept) reads it (EAGLE keeps the state one unit below
    the attention block's name)."""
    alloc = _allocator(full_block=8)
    alloc.add_request("p", PROMPT, digests=_digests(PROMPT))
    assert alloc.allocate("p", 4) is not None
    assert [g for g, _ in alloc.cache_state("p", 4, states=True)] == [MAMBA]
    for c in alloc.move_state("p")[0]:
        alloc.release_retained(c.group, list(c.retained))
    assert alloc.allocate("p", 2) is not None
    ((g, x),) = alloc.cache_state("p", 6, states=False)
    assert g == FULL and alloc.block_table("p", FULL) == [x]
    alloc.free("p")
    prompt = [*PROMPT[:6], 50, 51]
    match = alloc.prefix_match(prompt, digests=_digests(prompt))
    assert match.hit == 4 and match.tables[FULL] == [x]
    # diverging before 4: neither group holds anything below
    other = [*PROMPT[:3], 9, 9, 9]
    assert alloc.prefix_match(other, digests=_digests(other)).hit == 0
    alloc.check_invariants(True)


def test_a_checkpoint_kept_below_the_running_state_is_named_by_its_position() -> None:
    """An engine that writes the state after 10 tokens inside a 12-token step (vLLM's
    internal prefill checkpoint) gets a block just below the running state for it, named
    at 10 and never at its own boundary (8: it does not hold that state)."""
    alloc = _allocator(mamba_block=4)
    prompt = list(range(1, 13))
    alloc.add_request("p", prompt, digests=_digests(prompt))
    plain = _allocator(mamba_block=4)
    plain.add_request("p", prompt, digests=_digests(prompt))
    assert plain.allocate("p", 12) is not None
    assert plain.block_table("p", MAMBA)[:2] == [NULL_BLOCK, NULL_BLOCK]  # skipped
    assert alloc.allocate("p", 12, checkpoint=True) is not None
    kept = alloc.block_table("p", MAMBA)[1]
    assert kept != NULL_BLOCK and alloc.block_table("p", MAMBA)[0] == NULL_BLOCK
    alloc.cache("p", 12)
    named, _ = alloc.cache_checkpoint("p", 1, 10)
    assert named == ((MAMBA, kept),)
    alloc.free("p")
    at_10 = [*prompt[:10], 50, 51, 52]
    match = alloc.prefix_match(at_10, digests=_digests(at_10))
    assert match.hit == 10 and match.tables[MAMBA] == [NULL_BLOCK, NULL_BLOCK, kept]
    at_8 = [*prompt[:8], 50, 51, 52]
    assert alloc.prefix_match(at_8, digests=_digests(at_8)).hit == 0
    alloc.check_invariants(True)
    assert alloc.add_request("q", prompt, digests=_digests(prompt)) == 10  # the hit
    with pytest.raises(InvalidSize, match="checkpoint after 14 tokens, 10 allocated"):
        alloc.cache_checkpoint("q", 1, 14)


def test_no_checkpoint_block_where_the_step_moves_scratch_states_there() -> None:
    """With a draft's scratch state after the running one, a later step moves it past
    the new running state instead of skipping entries: no block is kept for a checkpoint
    and none is named (the entry below the running state is not the checkpoint's)."""
    groups = (
        GroupConfig("full", Kind.FULL, 2, 4, 1),
        GroupConfig("mamba", Kind.MAMBA, 4, 2, 1, speculative_states=1),
    )
    config = AllocatorConfig(
        groups,
        64,
        identity=BlockIdentity(digest_block_size=2),
        mamba_step_end_only=True,
        state_unit=2,
    )
    alloc = JengaAllocator(config)
    prompt = list(range(1, 21))
    alloc.add_request("p", prompt, digests=_digests(prompt))
    assert alloc.allocate("p", 4) is not None  # running state 0, scratch 1
    assert alloc.allocate("p", 16, checkpoint=True) is not None  # skips 2, moves 1
    assert alloc.block_table("p", MAMBA)[3] == NULL_BLOCK  # below the running state
    alloc.cache("p", 20)
    assert alloc.cache_checkpoint("p", 3, 18)[0] == ()
    alloc.check_invariants(True)


def test_a_checkpoint_on_its_blocks_own_boundary_keeps_that_name() -> None:
    """A checkpoint at 8 in the entry covering 4..8 is that entry's own state: `cache`
    named it, and `cache_checkpoint` reports it (the engine defers hits on it)."""
    alloc = _allocator(mamba_block=4)
    prompt = list(range(1, 13))
    alloc.add_request("p", prompt, digests=_digests(prompt))
    assert alloc.allocate("p", 12, checkpoint=True) is not None
    kept = alloc.block_table("p", MAMBA)[1]
    alloc.cache("p", 12)
    assert alloc.cache_checkpoint("p", 1, 8)[0] == ((MAMBA, kept),)
    alloc.free("p")
    at_8 = [*prompt[:8], 50, 51, 52]
    match = alloc.prefix_match(at_8, digests=_digests(at_8))
    assert match.hit == 8 and match.tables[MAMBA] == [NULL_BLOCK, kept]
    alloc.check_invariants(True)
