"""MLA, sliding-window MLA and sink full attention: their pages, their rules, and an
allocator serving them exactly as it serves the K/V kinds whose token rules they share."""

from __future__ import annotations

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig
from jenga.pages import vmm_page_table
from jenga.policies import (
    FullAttentionPolicy,
    MLAPolicy,
    SinkFullAttentionPolicy,
    SlidingWindowMLAPolicy,
    SlidingWindowPolicy,
    policy_for,
)
from jenga.specs import KVGroup, LayerSpec, ModelSpec, SpecError

from jenga import JengaAllocator, Kind


def test_an_mla_page_holds_one_latent_per_token():
    # DeepSeek-V3: one 576-wide latent (512 + 64 rope) per token, bf16
    mla = LayerSpec(Kind.MLA, num_kv_heads=1, head_dim=576, block_size=64)
    kv = LayerSpec(Kind.FULL, num_kv_heads=1, head_dim=576, block_size=64)
    assert mla.bytes_per_token == 576 * 2
    assert mla.page_bytes == 64 * 576 * 2 == kv.page_bytes // 2
    assert (mla.num_kv_tensors, kv.num_kv_tensors) == (1, 2)
    swa = LayerSpec(Kind.SLIDING_WINDOW_MLA, num_kv_heads=1, head_dim=576, window=128)
    assert swa.page_bytes == 16 * 576 * 2 and swa.num_kv_tensors == 1


def test_kind_fields_are_checked():
    with pytest.raises(SpecError, match="sliding_window_mla layer needs window > 0, got None"):
        LayerSpec(Kind.SLIDING_WINDOW_MLA, num_kv_heads=1, head_dim=8)
    with pytest.raises(SpecError, match="window=64 given for a mla layer"):
        LayerSpec(Kind.MLA, num_kv_heads=1, head_dim=8, window=64)
    with pytest.raises(SpecError, match="multiple of block_size 16, got 4"):
        LayerSpec(Kind.SINK_FULL, num_kv_heads=1, head_dim=8, sink_len=4)
    with pytest.raises(SpecError, match="sink_len=32 given for a full layer"):
        LayerSpec(Kind.FULL, num_kv_heads=1, head_dim=8, sink_len=32)
    sink = LayerSpec(Kind.SINK_FULL, num_kv_heads=2, head_dim=8, sink_len=32)
    assert sink.page_bytes == LayerSpec(Kind.FULL, num_kv_heads=2, head_dim=8).page_bytes


def test_each_kind_has_its_policy_with_its_token_rule():
    mla = policy_for(LayerSpec(Kind.MLA, num_kv_heads=1, head_dim=8, block_size=4))
    swa = policy_for(
        LayerSpec(Kind.SLIDING_WINDOW_MLA, num_kv_heads=1, head_dim=8, block_size=4, window=10)
    )
    sink = policy_for(
        LayerSpec(Kind.SINK_FULL, num_kv_heads=1, head_dim=8, block_size=4, sink_len=8)
    )
    assert (type(mla), type(swa), type(sink)) == (
        MLAPolicy,
        SlidingWindowMLAPolicy,
        SinkFullAttentionPolicy,
    )
    full, window = FullAttentionPolicy(4), SlidingWindowPolicy(4, window=10)
    hits = [True, True, False, True, True, True]
    for length in range(40):
        assert mla.first_live_block(length) == full.first_live_block(length) == 0
        assert sink.num_blocks(length) == full.num_blocks(length)
        assert swa.first_live_block(length) == window.first_live_block(length)
        assert swa.active_blocks(length) == window.active_blocks(length)
    assert mla.possible_prefix(hits) == full.possible_prefix(hits) == {4, 8}
    assert swa.possible_prefix(hits) == window.possible_prefix(hits) == {4, 8, 24}


def _served(kinds: tuple[Kind, Kind]) -> tuple[list[int], list[list[int]], dict[str, int]]:
    """Serve two requests sharing a 24-token prefix on a model of ``kinds``; return the
    second request's hit, its block tables and the allocator's stats."""
    window = {"window": 8}
    groups = (
        GroupConfig("a", kinds[0], 4, 2, 1),
        GroupConfig("b", kinds[1], 4, 2, 1, **window),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, total_units=16))
    prompt = list(range(24))
    alloc.add_request("r0", prompt)
    assert alloc.allocate("r0", 24) is not None
    alloc.cache("r0", 24)
    alloc.free("r0")
    hit = alloc.add_request("r1", [*prompt, 7, 8, 9])
    assert alloc.allocate("r1", 27 - hit) is not None
    tables = [alloc.block_table("r1", g) for g in range(2)]
    alloc.check_invariants(expensive=True)
    return [hit], tables, alloc.stats()


def test_an_mla_model_is_served_as_its_kv_twin():
    """Block for block: MLA + sliding-window MLA take the same blocks and hits as full +
    sliding window (the page size is the page table's business, not the allocator's)."""
    assert _served((Kind.MLA, Kind.SLIDING_WINDOW_MLA)) == _served((Kind.FULL, Kind.SLIDING_WINDOW))
    hit, tables, _ = _served((Kind.MLA, Kind.SLIDING_WINDOW_MLA))
    assert hit == [24]
    assert -1 not in tables[0] and len(tables[0]) == 7


def test_the_page_table_sizes_an_mla_group_by_its_latent_and_never_splits_it():
    mla = LayerSpec(Kind.MLA, num_kv_heads=1, head_dim=576, block_size=64)
    swa = LayerSpec(Kind.SLIDING_WINDOW_MLA, num_kv_heads=1, head_dim=576, window=128)
    model = ModelSpec(
        "mla", (KVGroup("mla", mla, tuple(range(4))), KVGroup("swa", swa, (4, 5))), 4096
    )
    for kv_split in (False, True):  # one latent: no K/V halves to split
        table = vmm_page_table(model, kv_split=kv_split)
        assert table.group("mla").small_page_bytes == 64 * 576 * 2
        assert table.group("swa").small_page_bytes == 16 * 576 * 2
        assert (table.group("mla").num_ranges, table.group("swa").num_ranges) == (4, 2)
