"""DeepSeek-V4's layer kinds: replayed sliding-window MLA (a window kind whose blocks are
never cached; a prefix hit of the other groups leaves its window to be allocated afresh
and recomputed), the circular buffer (one ring block per request) and compressed MLA (one
stored state per ``tokens_per_state`` tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from jenga.allocator import AllocatorConfig, GroupConfig
from jenga.policies import (
    CircularBufferPolicy,
    CompressedMLAPolicy,
    MLAPolicy,
    ReplaySlidingWindowMLAPolicy,
    SlidingWindowMLAPolicy,
    policy_for,
)
from jenga.specs import LayerSpec, SpecError

from jenga import NULL_BLOCK, JengaAllocator, Kind

WINDOW, BLOCK = 32, 16


def _replay_spec(**kw: int) -> LayerSpec:
    return LayerSpec(
        Kind.REPLAY_SLIDING_WINDOW_MLA, num_kv_heads=1, head_dim=576, window=WINDOW, **kw
    )


def test_its_page_holds_one_latent_per_token_and_it_needs_a_window():
    spec = _replay_spec(block_size=64)
    assert spec.bytes_per_token == 576 * 2 and spec.page_bytes == 64 * 576 * 2
    assert spec.num_kv_tensors == 1
    with pytest.raises(SpecError, match="replay_sliding_window_mla layer needs window > 0"):
        LayerSpec(Kind.REPLAY_SLIDING_WINDOW_MLA, num_kv_heads=1, head_dim=8)


def test_the_policy_keeps_the_window_but_takes_nothing_from_a_hit():
    replay = policy_for(_replay_spec(block_size=BLOCK))
    window = SlidingWindowMLAPolicy(BLOCK, window=WINDOW)
    assert type(replay) is ReplaySlidingWindowMLAPolicy
    assert (replay.caches_blocks, window.caches_blocks) == (False, True)
    for length in range(200):
        assert replay.first_live_block(length) == window.first_live_block(length)
        assert replay.active_blocks(length) == window.active_blocks(length)
        assert replay.num_blocks(length) == window.num_blocks(length)
    # a 96-token hit: blocks 0..3 lie below the window of token 96, 4 and 5 hold it
    assert replay.hit_blocks(96) == range(4, 4)
    assert replay.hit_table_length(96) == 4
    assert (window.hit_blocks(96), window.hit_table_length(96)) == (range(4, 6), 6)
    # no cached block needed: every block-aligned length is a valid prefix
    nothing = [False] * 6
    assert replay.possible_prefix(nothing) == {16, 32, 48, 64, 80, 96}
    assert window.possible_prefix(nothing) == set()
    mask = replay.valid_prefix_mask(np.zeros(6, dtype=bool), BLOCK, 100)
    assert mask.tolist() == [True] * 6


def _allocator(kinds: tuple[Kind, ...]) -> JengaAllocator:
    groups = tuple(
        GroupConfig(
            f"g{i}",
            kind,
            BLOCK,
            2,
            1,
            window=WINDOW if kind is Kind.REPLAY_SLIDING_WINDOW_MLA else None,
        )
        for i, kind in enumerate(kinds)
    )
    return JengaAllocator(AllocatorConfig(groups, total_units=64))


def test_a_hit_of_the_full_group_gives_the_window_fresh_blocks():
    """vLLM's bounded replay: the full-attention hit is shared; the replayed group's
    entries below the hit's window are NULL and the window's blocks come new."""
    alloc = _allocator((Kind.FULL, Kind.REPLAY_SLIDING_WINDOW_MLA))
    prompt = list(range(100))
    alloc.add_request("r0", prompt)
    assert alloc.allocate("r0", 100) is not None
    alloc.cache("r0", 100)
    first = [alloc.block_table("r0", g) for g in range(2)]
    assert not any(alloc.is_cached_block(1, b) for b in first[1] if b != NULL_BLOCK)
    alloc.free("r0")

    assert alloc.add_request("r1", prompt) == 96
    assert alloc.block_table("r1", 0) == first[0][:6]
    assert alloc.block_table("r1", 1) == [NULL_BLOCK] * 4
    got = alloc.allocate("r1", 4)
    assert got is not None
    assert [len(blocks) for blocks in got.new_blocks] == [1, 3]
    table = alloc.block_table("r1", 1)
    assert table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in table[4:] and len(table) == 7
    alloc.cache("r1", 100)
    assert not any(alloc.is_cached_block(1, b) for b in table[4:])
    alloc.check_invariants(expensive=True)


def test_a_model_of_replayed_groups_only_never_hits():
    alloc = _allocator((Kind.REPLAY_SLIDING_WINDOW_MLA,))
    prompt = list(range(64))
    alloc.add_request("r0", prompt)
    assert alloc.allocate("r0", 64) is not None
    alloc.cache("r0", 64)
    alloc.free("r0")
    assert alloc.add_request("r1", prompt) == 0
    alloc.check_invariants(expensive=True)


# -- circular buffer ---------------------------------------------------------------------
def test_a_ring_is_one_block_per_request_never_cached():
    ring = policy_for(LayerSpec(Kind.CIRCULAR_BUFFER, num_kv_heads=1, head_dim=1024, block_size=8))
    assert type(ring) is CircularBufferPolicy and not ring.caches_blocks
    assert [ring.num_blocks(n) for n in (0, 1, 8, 9, 5000)] == [0, 1, 1, 1, 1]
    assert [ring.first_live_block(n) for n in (0, 9, 5000)] == [0, 0, 0]
    assert [ring.kept_tokens(n) for n in (0, 3, 8, 5000)] == [0, 3, 8, 8]
    assert ring.hit_table_length(4096) == 0 and ring.hit_blocks(4096) == range(0)
    assert ring.possible_prefix([False] * 3) == {8, 16, 24}
    assert ring.valid_prefix_mask(np.zeros(3, dtype=bool), 8, 24).tolist() == [True] * 3
    # one block of 8 rows of one 1024-byte vector each
    spec = LayerSpec(Kind.CIRCULAR_BUFFER, num_kv_heads=1, head_dim=1024, dtype_bytes=4)
    assert spec.page_bytes == 16 * 1024 * 4 and spec.num_kv_tensors == 1


def test_a_ring_beside_a_full_group_is_claimed_once_and_never_hit():
    """vLLM's CircularBufferManager: one block per request, claimed with its first
    allocation, kept to the end; a hit of the full group claims a fresh ring."""
    groups = (
        GroupConfig("full", Kind.FULL, BLOCK, 2, 1),
        GroupConfig("ring", Kind.CIRCULAR_BUFFER, 8, 2, 1),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, total_units=64))
    prompt = list(range(100))
    alloc.add_request("r0", prompt)
    got = alloc.allocate("r0", 40)
    assert got is not None and [len(b) for b in got.new_blocks] == [3, 1]
    got = alloc.allocate("r0", 60)
    assert got is not None and [len(b) for b in got.new_blocks] == [4, 0]
    ring = alloc.block_table("r0", 1)
    assert len(ring) == 1 and ring[0] != NULL_BLOCK
    alloc.cache("r0", 100)
    assert not alloc.is_cached_block(1, ring[0])
    alloc.free("r0")
    assert alloc.add_request("r1", prompt) == 96  # the full group's blocks, 16-aligned
    assert alloc.block_table("r1", 1) == []
    got = alloc.allocate("r1", 4)
    assert got is not None and [len(b) for b in got.new_blocks] == [1, 1]
    alloc.check_invariants(expensive=True)


# -- compressed MLA ----------------------------------------------------------------------
def test_a_compressed_mla_page_holds_one_state_per_tokens_per_state_tokens():
    # DeepSeek-V4: a 584-byte fp8 state per 2 tokens (vLLM: num_states = 128 // 2)
    spec = LayerSpec(
        Kind.COMPRESSED_MLA,
        num_kv_heads=1,
        head_dim=584,
        dtype_bytes=1,
        block_size=128,
        tokens_per_state=2,
    )
    assert spec.page_bytes == 64 * 584 and spec.bytes_per_token == 292
    assert spec.num_kv_tensors == 1
    with pytest.raises(SpecError, match="tokens_per_state > 1 dividing block_size 16, got 3"):
        LayerSpec(Kind.COMPRESSED_MLA, num_kv_heads=1, head_dim=8, tokens_per_state=3)
    with pytest.raises(SpecError, match="got 1"):
        LayerSpec(Kind.COMPRESSED_MLA, num_kv_heads=1, head_dim=8)
    with pytest.raises(SpecError, match="tokens_per_state=4 given for a mla layer"):
        LayerSpec(Kind.MLA, num_kv_heads=1, head_dim=8, tokens_per_state=4)


def test_compressed_mla_follows_mla_token_rules():
    spec = LayerSpec(Kind.COMPRESSED_MLA, num_kv_heads=1, head_dim=8, tokens_per_state=4)
    compressed, mla = policy_for(spec), MLAPolicy(16)
    assert type(compressed) is CompressedMLAPolicy and compressed.caches_blocks
    hits = [True, True, False, True]
    assert compressed.possible_prefix(hits) == mla.possible_prefix(hits) == {16, 32}
    for length in range(70):
        assert compressed.num_blocks(length) == mla.num_blocks(length)
        assert compressed.first_live_block(length) == 0
