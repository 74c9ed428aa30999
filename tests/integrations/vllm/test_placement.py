"""Per-group placement arithmetic (`integrations.vllm.placement`); no vLLM needed."""

from __future__ import annotations

from itertools import pairwise

import pytest
from integrations.vllm.placement import (
    GroupPlacement,
    PlacementError,
    place_group,
    pool_least_waste_chunks,
)

KIB, MIB = 1 << 10, 1 << 20
CHUNK = 2 * MIB


@pytest.mark.parametrize(
    ("name", "layer_bytes", "layers", "epsilon", "expect"),
    [
        # Gemma 2 9B: 21 layers x 128 KiB; 1 % forces the exact LCM (21 chunks)
        ("gemma2-9b", 128 * KIB, 21, 0.01, (21, 128 * KIB, 16, 336)),
        ("gemma2-9b", 128 * KIB, 21, 0.05, (4, 128 * KIB, 3, 64)),
        # Ministral 8B: 9 layers x 64 KiB -> 7 blocks in 2 chunks, 64 KiB tail
        ("ministral-8b", 64 * KIB, 9, 0.05, (2, 64 * KIB, 7, 64)),
        # 4 layers x 64 KiB: 8 whole blocks per chunk, no tail, stride = the page
        ("attention", 64 * KIB, 4, 0.0, (1, 64 * KIB, 8, 32)),
        # a 304 KiB Mamba state (4 layers) is padded to 320 KiB, 8 blocks in 5 chunks
        ("mamba", 304 * KIB, 4, 0.05, (5, 320 * KIB, 8, 32)),
        ("mamba", 304 * KIB, 4, 0.0, (19, 304 * KIB, 32, 128)),
    ],
)
def test_smallest_page_within_epsilon(
    name: str, layer_bytes: int, layers: int, epsilon: float, expect: tuple[int, ...]
) -> None:
    p = place_group(layer_bytes, layers, CHUNK, epsilon=epsilon)
    assert (p.chunks_per_page, p.stride, p.blocks_per_page, p.ids_per_page) == expect
    assert p.tail_bytes <= epsilon * p.page_bytes
    assert p.page_bytes == p.blocks_per_page * p.block_bytes + p.tail_bytes


def test_ids_are_linear_per_layer_and_pages_never_overlap() -> None:
    """Layer l of vLLM id v at ``l*B*S + v*S``: every used id of page q lies in q's chunks,
    and no two (layer, used id) pairs share a byte."""
    p = place_group(128 * KIB, 21, CHUNK, epsilon=0.05)
    spans = []
    for block in range(4 * p.blocks_per_page):
        v = p.vllm_id(block)
        assert p.allocator_block(v) == block
        page = block // p.blocks_per_page
        for layer in range(p.num_layers):
            start = p.layer_offset(layer) + v * p.stride
            assert page * p.page_bytes <= start
            assert start + p.layer_bytes <= (page + 1) * p.page_bytes
            spans.append((start, start + p.layer_bytes))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans))


def test_unused_ids_and_impossible_geometries_are_refused() -> None:
    p = place_group(64 * KIB, 9, CHUNK, epsilon=0.05)
    with pytest.raises(PlacementError, match=r"slot 7 of page 0, which holds 7 blocks"):
        p.allocator_block(7)
    with pytest.raises(PlacementError, match=r"does not fit in 2 chunks"):
        place_group(3 * MIB, 2, CHUNK, epsilon=0.05, max_chunks=2)
    with pytest.raises(PlacementError, match=r"non-positive"):
        place_group(0, 2, CHUNK, epsilon=0.05)
    with pytest.raises(PlacementError, match=r"does not divide"):
        GroupPlacement(64 * KIB, 4, CHUNK, 1, 96 * KIB, 1)


def test_least_waste_when_nothing_is_within_epsilon() -> None:
    """300 KiB x 3 layers in at most 4 chunks: k=1, 2, 4 waste 56 %, 56 %, 45 %; k=3 holds 5
    blocks at a 384 KiB stride (26.8 %), the least."""
    p = place_group(300 * KIB, 3, CHUNK, epsilon=0.0, max_chunks=4)
    assert not p.within_epsilon
    assert (p.chunks_per_page, p.stride, p.blocks_per_page) == (3, 384 * KIB, 5)
    assert p.tail_bytes == 6 * MIB - 5 * 3 * 300 * KIB


@pytest.mark.parametrize(
    ("pool_mib", "expect"),
    [
        # 40 GiB: pages up to 80 chunks may be taken to cut waste -> Gemma 2 9B's exact
        # LCM (21 chunks, 16 blocks, no tail): 975 pages hold 15,600 blocks, not 15,360
        (40960, (21, 16, 0)),
        # 20 GiB: up to 40 chunks, the exact LCM again: 7,792 blocks, not 7,680 in 4-chunk
        # pages (vLLM's slots: 7,801; at 1/512 of the pool this ran 0.976x vLLM)
        (20480, (21, 16, 0)),
        # 1 GiB: 1-chunk pages at most; the smallest page within epsilon stands
        (1024, (4, 3, 128 * KIB)),
    ],
)
def test_a_large_pool_buys_less_waste_with_larger_pages(
    pool_mib: int, expect: tuple[int, int, int]
) -> None:
    limit = pool_least_waste_chunks(pool_mib * MIB, CHUNK)
    p = place_group(128 * KIB, 21, CHUNK, epsilon=0.05, least_waste_chunks=limit)
    assert (p.chunks_per_page, p.blocks_per_page, p.tail_bytes) == expect
    pages = pool_mib * MIB // p.page_bytes
    assert pages * p.blocks_per_page == {40960: 15600, 20480: 7792, 1024: 384}[pool_mib]


def test_least_waste_search_keeps_the_smaller_page_on_a_tie_and_stops_at_zero() -> None:
    # 4 layers x 64 KiB: 1 chunk has no tail, so a larger allowance changes nothing
    p = place_group(64 * KIB, 4, CHUNK, epsilon=0.05, least_waste_chunks=40)
    assert (p.chunks_per_page, p.tail_bytes) == (1, 0)
    # Ministral 8B's 9-layer groups: exact at 9 chunks (32 blocks) when allowed
    p = place_group(64 * KIB, 9, CHUNK, epsilon=0.05, least_waste_chunks=40)
    assert (p.chunks_per_page, p.blocks_per_page, p.tail_bytes) == (9, 32, 0)
