"""KVCache: plans applied through vmm, windows unmapped, pages returned, chunks remapped."""

from __future__ import annotations

import pytest
import torch
from integrations.kvcache.access import ReleasedBlockError, read_kv, token_slots, write_kv
from jenga.plan import MapPage, UnmapPage
from jenga.plan import MappingPlan as PagePlan
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec

import vmm
from integrations.kvcache import (
    KVCache,
    KVCacheBroken,
    LayoutError,
    PlanTranslationError,
    translate,
)
from tests.integrations.kvcache.conftest import (
    CHUNK,
    DIM,
    HEADS,
    MakeCache,
    full_spec,
    hybrid_model,
)

GROUP_FULL, GROUP_SWA = 0, 1


def fill(kv: KVCache, rid: str, start: int, stop: int, seed: int) -> dict:
    """Write seeded random K/V for positions [start, stop) into every layer; return it."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for geo in kv.geometries:
        slots = token_slots(kv, rid, geo.index, start, stop)
        for layer in geo.layer_ids:
            k = torch.randn(stop - start, HEADS, DIM, generator=gen)
            v = torch.randn(stop - start, HEADS, DIM, generator=gen)
            write_kv(kv, layer, slots, k, v)
            written[layer] = (k, v)
    return written


def check(kv: KVCache, rid: str, start: int, stop: int, written: dict, layers) -> None:
    for layer in layers:
        group = kv.group_of(layer).index
        k, v = read_kv(kv, layer, token_slots(kv, rid, group, start, stop))
        assert torch.equal(k, written[layer][0][-(stop - start) :])
        assert torch.equal(v, written[layer][1][-(stop - start) :])


def slots_mapped(kv: KVCache, group: int) -> list[int]:
    return [rng.num_mapped for rng in kv.ranges[group]]


def test_geometry_and_block_view_shapes(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=64)
    geo = kv.geometries[GROUP_FULL]
    assert (geo.chunks_per_page, geo.blocks_per_page, geo.small_page_bytes) == (1, 8, 512)
    assert (geo.tail_bytes, geo.max_pages, geo.num_ranges) == (0, 32, 2)
    assert kv.layer_view(0).shape == (32, 8, 2, 4, HEADS, DIM)
    assert kv.block_view(0).shape == (256, 2, 4, HEADS, DIM)
    assert kv.stats()["bytes.mapped.current"] == 0  # nothing mapped before an allocation
    kv.check_invariants(expensive=True)


def test_split_kv_has_two_ranges_per_layer(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=64, kv_split=True)
    geo = kv.geometries[GROUP_FULL]
    assert (geo.tensors_per_layer, geo.blocks_per_page, geo.small_page_bytes) == (2, 16, 256)
    assert [r.name for r in kv.ranges[GROUP_FULL]] == [
        "full.L0.k", "full.L0.v", "full.L2.k", "full.L2.v",
    ]  # fmt: skip
    assert kv.block_view(2, 1).shape == (16 * geo.max_pages, 4, HEADS, DIM)
    kv.add_request("r", list(range(20)))
    kv.allocate("r", 20)
    data = fill(kv, "r", 0, 20, seed=1)
    check(kv, "r", 0, 20, data, [0, 2])
    kv.check_invariants(expensive=True)


def test_tail_pages_use_page_stride_and_refuse_uniform_view(make_cache: MakeCache):
    # 3 heads x 8 x fp32 x 2 x 4 tokens = 768 B blocks: 5 per 4 KiB chunk, 256 B tail
    spec = LayerSpec(Kind.FULL, num_kv_heads=3, head_dim=DIM, dtype_bytes=4, block_size=4)
    model = ModelSpec("tail", (KVGroup("full", spec, (0,)),), max_model_len=512)
    kv = make_cache(model, budget_chunks=16, epsilon=0.1)
    geo = kv.geometries[0]
    assert (geo.blocks_per_page, geo.tail_bytes) == (5, 256)
    assert geo.block_offset(7) == 4096 + 2 * 768
    with pytest.raises(LayoutError, match="256 B tail"):
        kv.block_view(0)
    kv.add_request("r", list(range(40)))
    kv.allocate("r", 40)  # 10 blocks: pages 0 and 1
    slots = token_slots(kv, "r", 0, 0, 40)
    k = torch.arange(40 * 3 * DIM, dtype=torch.float32).reshape(40, 3, DIM)
    write_kv(kv, 0, slots, k, -k)
    # block 5 (tokens 20..23) starts at byte 4096 of the range, not at 5 * 768
    raw = kv.ranges[0][0].tensor((4096 // 4,), torch.float32, offset=4096)
    assert torch.equal(raw[: 4 * 3 * DIM], k[20:24].flatten())
    assert torch.equal(read_kv(kv, 0, slots)[1], -k)
    kv.check_invariants(expensive=True)


def test_sliding_window_pages_unmap_when_blocks_leave_the_window(make_cache: MakeCache):
    kv = make_cache(hybrid_model(window=8), budget_chunks=64)
    kv.add_request("r", list(range(64)))
    kv.allocate("r", 64)  # 16 blocks per group = 2 pages per group, 2 ranges each
    stats = kv.stats()
    assert stats["kv.bytes.mapped.sliding_window"] == 2 * 2 * CHUNK
    assert slots_mapped(kv, GROUP_SWA) == [2, 2]
    got = kv.allocate("r", 1)  # position 64 reads 57..64: blocks 0..13 leave the window
    assert got is not None and got.released[GROUP_SWA] == tuple(range(14))
    assert got.plan.ops == (UnmapPage(GROUP_SWA, 0), MapPage(GROUP_FULL, 2))
    stats = kv.stats()
    assert kv.mapped_pages == [{0, 1, 2}, {1}]
    assert stats["kv.bytes.mapped.sliding_window"] == 1 * 2 * CHUNK
    assert stats["kv.bytes.mapped.full"] == 3 * 2 * CHUNK
    assert slots_mapped(kv, GROUP_SWA) == [1, 1]
    assert stats["bytes.mapped.current"] == 8 * CHUNK
    table = kv.block_table("r", GROUP_SWA)
    assert table[:14] == [-1] * 14 and len(table) == 17
    with pytest.raises(ReleasedBlockError, match="positions"):
        token_slots(kv, "r", GROUP_SWA, 0, 4)
    # the window's chunks went straight to the full group's new page: nothing created
    assert (stats["chunks.created.current"], stats["bytes.physical.current"]) == (8, 8 * CHUNK)
    kv.free("r")
    assert kv.release_free_chunks() == 8
    assert kv.pool.stats()["bytes.physical.current"] == 0
    kv.check_invariants(expensive=True)


def test_sliding_window_memory_stays_bounded_over_a_long_decode(make_cache: MakeCache):
    kv = make_cache(hybrid_model(window=8), budget_chunks=64)
    kv.add_request("r", list(range(8)))
    kv.allocate("r", 8)
    data = fill(kv, "r", 0, 8, seed=3)
    most_swa = 0
    for pos in range(8, 300):
        kv.allocate("r", 1)
        step = fill(kv, "r", pos, pos + 1, seed=pos)
        for layer in (0, 2):
            data[layer] = tuple(
                torch.cat([a, b]) for a, b in zip(data[layer], step[layer], strict=True)
            )
        most_swa = max(most_swa, len(kv.mapped_pages[GROUP_SWA]))
    assert most_swa == 1  # 3 live blocks always fit the request's own page
    assert len(kv.mapped_pages[GROUP_FULL]) == 10  # ceil(300 / 32)
    check(kv, "r", 0, 300, data, [0, 2])
    kv.check_invariants(expensive=True)


def test_finished_request_returns_every_page_to_the_pool(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=64)
    kv.add_request("a", list(range(50)))
    kv.allocate("a", 50)
    kv.add_request("b", list(range(100, 120)))
    kv.allocate("b", 20)
    assert kv.stats()["chunks.mapped.current"] == 2 * (2 + 1) + 2 * (2 + 1)
    kv.free("a")
    assert kv.mapped_pages == [{2}, {2}]  # b's pages only
    kv.free("b")
    stats = kv.stats()
    assert (stats["chunks.mapped.current"], stats["slots.mapped.current"]) == (0, 0)
    assert stats["chunks.free.current"] == stats["chunks.created.current"] == 12
    assert stats["kv.pages.unmapped"] == stats["kv.pages.mapped"] == 6
    kv.check_invariants(expensive=True)


def test_chunks_move_from_sliding_to_full_under_pressure_with_kv_intact(make_cache: MakeCache):
    kv = make_cache(hybrid_model(window=8), budget_chunks=12)
    kv.add_request("a", list(range(64)))
    kv.allocate("a", 64)
    data = fill(kv, "a", 0, 64, seed=7)
    kv.cache("a", 64)  # every block hashed: released window blocks stay cached
    kv.append_tokens("a", [64])
    kv.allocate("a", 1)  # sliding page 0 (blocks 0..7) leaves the window: evictable
    step = fill(kv, "a", 64, 65, seed=8)
    for layer, (k, v) in step.items():
        data[layer] = (torch.cat([data[layer][0], k]), torch.cat([data[layer][1], v]))
    assert kv.allocator.usage().free_units == 0
    swa_page0 = [rng.handle(0) for rng in kv.ranges[GROUP_SWA]]
    kv.add_request("b", [999, 998, 997, 996])
    got = kv.allocate("b", 4)
    assert got is not None and got.plan.ops == (
        UnmapPage(GROUP_SWA, 0),
        MapPage(GROUP_FULL, 3, reused_units=2),
    )
    # the very chunks of sliding page 0 now back full page 3 (slot 3 of both full ranges)
    assert [rng.handle(3) for rng in kv.ranges[GROUP_FULL]] == swa_page0
    stats = kv.stats()
    assert (stats["kv.remapped_units"], stats["ops.remap"]) == (2, 2)
    assert stats["ops.create"] == 12  # nothing created or released for the move
    b_data = fill(kv, "b", 0, 4, seed=9)
    check(kv, "a", 0, 65, data, [0, 2])  # full layers: every token intact
    check(kv, "a", 57, 65, data, [1, 3])  # sliding layers: the window intact
    check(kv, "b", 0, 4, b_data, [0, 1, 2, 3])
    kv.check_invariants(expensive=True)


def test_no_room_maps_nothing(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=4)
    kv.add_request("a", list(range(32)))
    assert kv.allocate("a", 32) is not None
    kv.add_request("b", list(range(100, 140)))
    before = kv.stats()
    assert kv.allocate("b", 40) is None
    after = kv.stats()
    before.update({"alloc.calls": 2, "alloc.failures": 1})
    assert after == before
    kv.check_invariants(expensive=True)


def test_translate_rejects_reuse_beyond_unmapped_units(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=8)
    bad = PagePlan((UnmapPage(GROUP_SWA, 0), MapPage(GROUP_FULL, 1, reused_units=3)))
    with pytest.raises(PlanTranslationError, match="reuses 3 units, 2 were unmapped"):
        translate(bad, kv.geometries, kv.ranges)


def test_dtype_size_must_match_specs(make_cache: MakeCache):
    model = ModelSpec("m", (KVGroup("full", full_spec(), (0,)),), max_model_len=64)
    with pytest.raises(LayoutError, match="4-byte elements"):
        make_cache(model, dtype=torch.float16)


def test_backend_failure_marks_the_cache_broken(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=8)
    kv.add_request("a", list(range(8)))
    kv.pool.backend.inject_fault(2)  # type: ignore[attr-defined]
    with pytest.raises((vmm.BackendError, vmm.OutOfMemory), match="errno 12"):
        kv.allocate("a", 8)
    assert kv.pool.stats()["chunks.mapped.current"] == 0  # the vmm plan rolled back
    with pytest.raises(KVCacheBroken, match="inconsistent"):
        kv.allocate("a", 1)


def test_translate_keeps_chunks_of_a_page_evicted_and_mapped_again_in_place(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=8)
    full = kv.ranges[GROUP_FULL]
    same = PagePlan((UnmapPage(GROUP_FULL, 1), MapPage(GROUP_FULL, 1, reused_units=2)))
    plan, remapped = translate(same, kv.geometries, kv.ranges)
    assert (plan.ops, remapped) == ([], 2)
    two = PagePlan(
        (UnmapPage(GROUP_FULL, 3), UnmapPage(GROUP_FULL, 1), MapPage(GROUP_FULL, 1, reused_units=2))
    )
    plan, remapped = translate(two, kv.geometries, kv.ranges)
    assert [(op.kind, op.dst, op.dst_slots) for op in plan.ops] == [
        ("unmap", full[0], (3,)),
        ("unmap", full[1], (3,)),
    ]
    swa = kv.ranges[GROUP_SWA]
    move = PagePlan((UnmapPage(GROUP_SWA, 2), MapPage(GROUP_FULL, 0, reused_units=2)))
    plan, _ = translate(move, kv.geometries, kv.ranges)
    assert [(op.kind, op.src, op.src_slots, op.dst, op.dst_slots) for op in plan.ops] == [
        ("remap", swa[0], (2,), full[0], (0,)),
        ("remap", swa[1], (2,), full[1], (0,)),
    ]


@pytest.mark.parametrize("kv_split", [False, True])
def test_per_group_layout_strided_layer_views(make_cache: MakeCache, kv_split: bool):
    kv = make_cache(hybrid_model(), budget_chunks=64, layout="per_group", kv_split=kv_split)
    geo = kv.geometries[GROUP_FULL]
    names = ["full.k", "full.v"] if kv_split else ["full.kv"]
    assert [r.name for r in kv.ranges[GROUP_FULL]] == names
    # a block holds both layers: 2 x 512 B fused (2 x 256 B per tensor split)
    assert (geo.layers_per_block, geo.small_page_bytes) == (2, 1024 if not kv_split else 512)
    assert geo.blocks_per_page == (8 if kv_split else 4)
    view0, view2 = kv.block_view(0), kv.block_view(2)
    assert view0.data_ptr() + geo.layer_block_bytes == view2.data_ptr()
    assert view0.stride(0) * 4 == geo.small_page_bytes  # fp32 elements
    kv.add_request("r", list(range(20)))
    kv.allocate("r", 20)
    data = fill(kv, "r", 0, 20, seed=5)
    check(kv, "r", 0, 20, data, [0, 1, 2, 3])
    assert kv.stats()["chunks.mapped.current"] == 4  # 2 pages x 1 range or 1 page x 2
    kv.check_invariants(expensive=True)


def test_allocate_ahead_maps_on_the_worker_and_defers_plans_that_unmap(make_cache: MakeCache):
    kv = make_cache(hybrid_model(window=8), budget_chunks=64)
    kv.add_request("a", list(range(64)))
    kv.allocate("a", 64)
    kv.add_request("b", list(range(8)))
    got = kv.allocate_ahead("b", 8)  # fresh pages only: map-only, goes to the worker
    assert got is not None and got.plan.ops == (MapPage(GROUP_FULL, 2), MapPage(GROUP_SWA, 2))
    got = kv.allocate_ahead("a", 1)  # releases sliding page 0: must wait for sync
    assert got is not None and got.plan.ops == (UnmapPage(GROUP_SWA, 0), MapPage(GROUP_FULL, 3))
    assert kv.mapped_pages == [{0, 1}, {0, 1}]  # nothing applied yet
    kv.launch_ahead()
    kv.sync()
    assert kv.mapped_pages == [{0, 1, 2, 3}, {1, 2}]
    stats = kv.stats()
    assert (stats["overlap.plans.async"], stats["overlap.plans.sync"]) == (1, 1)
    assert stats["overlap.launched"] == 1
    kv.check_invariants(expensive=True)
    kv.close()


def test_importing_vmm_kvcache_does_not_import_torch():
    import subprocess
    import sys

    modules = ", ".join(
        f"integrations.kvcache{sub}" for sub in ("", ".rows", ".access", ".overlap")
    )
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
