"""The "slots" VMM geometry: vLLM's block slots over one VMM range mapped chunk by chunk
(scheduler side, chunk counts, the worker's range on the host backend, "auto")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.errors import InvalidOptions, JengaVllmError
from integrations.vllm.harness import cases, replay
from integrations.vllm.harness.side_by_side import Workload
from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions, TensorGeometry
from integrations.vllm.slot_chunks import slot_cap
from integrations.vllm.slot_tensors import SlotVmmKVCache
from jenga.plan import MapPage, MappingPlan, UnmapPage

import vmm
from tests.integrations.vllm.test_group_ranges import BytesChecker

CHUNK = 2 << 20
MAX_LEN = 1024


def _kv_config(model_dir: Path, case: str, memory: int) -> Any:
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=MAX_LEN))
    return replay.kv_cache_config_for(config, cases.layer_specs(case), memory)


def _layout(model_dir: Path, case: str, memory: int, **options: Any) -> Any:
    opts = JengaVllmOptions(kv_tensors="vmm", **options)
    return build_layout(_kv_config(model_dir, case, memory), MAX_LEN, opts)


def test_auto_is_the_default_and_is_resolved_from_the_config(model_dir: Path) -> None:
    options = JengaVllmOptions(kv_tensors="vmm")
    assert options.geometry is TensorGeometry.AUTO
    with pytest.raises(InvalidOptions, match="geometry='auto' is resolved"):
        _ = options.tensor_geometry
    # every group's block (2 layers x 64 KiB) is vLLM's 128 KiB slot: no padding
    uniform = _layout(model_dir, "ministral", 128 << 20)
    assert uniform.options.tensor_geometry is TensorGeometry.VMM_SLOTS
    assert uniform.options.geometry is TensorGeometry.VMM_SLOTS
    assert options.resolve(False).geometry is TensorGeometry.PER_GROUP
    assert options.resolve(True).geometry is TensorGeometry.VMM_SLOTS
    # explicit geometries are kept
    per_group = _layout(model_dir, "ministral", 128 << 20, geometry="per_group")
    assert per_group.options.tensor_geometry is TensorGeometry.PER_GROUP
    # vLLM's own tensors are shared slots whatever the geometry says
    assert JengaVllmOptions().tensor_geometry is TensorGeometry.SHARED_SLOTS


def test_auto_picks_per_group_where_vllm_pads_a_page(model_dir: Path) -> None:
    """Jamba's stand-in: one page size for all groups only because vLLM pads the Mamba
    state (or raises the attention block) to it; auto keeps per_group there."""
    kv = _kv_config(model_dir, "jamba", 256 << 20)
    slot = max(int(t.size) for t in kv.kv_cache_tensors) // kv.num_blocks
    layout = build_layout(kv, MAX_LEN, JengaVllmOptions(kv_tensors="vmm"))
    unpadded = [g.page_bytes * len(g.layer_names) for g in layout.groups]
    assert any(b != slot for b in unpadded)
    assert layout.options.tensor_geometry is TensorGeometry.PER_GROUP


def test_slots_with_a_shared_pool_are_refused_and_auto_picks_per_group() -> None:
    pool = {"kv_tensors": "vmm", "shared_pool": "p", "tenant_min_bytes": CHUNK}
    with pytest.raises(InvalidOptions, match=r"geometry='slots'.*shared_pool 'p'"):
        JengaVllmOptions(geometry="slots", **pool)  # type: ignore[arg-type]
    auto = JengaVllmOptions(**pool)  # type: ignore[arg-type]
    assert auto.resolve(True).geometry is TensorGeometry.PER_GROUP


def test_the_slot_cap_keeps_every_slots_chunks_within_vllms_bytes(model_dir: Path) -> None:
    # aligned: each layer region (num_blocks x 64 KiB) is whole chunks, nothing is lost
    layout = _layout(model_dir, "ministral", 128 << 20)
    chunks = layout.slot_chunks
    kv = _kv_config(model_dir, "ministral", 128 << 20)
    assert layout.total_units + 1 == kv.num_blocks
    assert chunks.footprint(kv.num_blocks) * CHUNK == layout.memory_bytes
    assert len(chunks.chunks(5)) == 2  # one chunk in each of the 2 layer regions
    assert chunks.chunks(5) == chunks.chunks(31) != chunks.chunks(32)  # 32 slots a chunk
    # misaligned: 100 MiB + 3 blocks; the regions end inside a chunk
    odd = _kv_config(model_dir, "ministral", (100 << 20) + 3 * (128 << 10))
    layout = build_layout(odd, MAX_LEN, JengaVllmOptions(kv_tensors="vmm"))
    cap = layout.total_units + 1
    limit = layout.memory_bytes // CHUNK
    assert cap < odd.num_blocks
    assert layout.slot_chunks.footprint(cap) <= limit < layout.slot_chunks.footprint(cap + 1)
    assert odd.num_blocks - cap < 2 * (CHUNK // (64 << 10) + 1)  # the documented bound
    assert slot_cap(layout.slot_chunks, odd.num_blocks) == cap


def test_the_slot_cap_refuses_a_buffer_without_two_slots(model_dir: Path) -> None:
    kv = _kv_config(model_dir, "ministral", 128 << 20)
    layout = build_layout(kv, MAX_LEN, JengaVllmOptions(kv_tensors="vmm"))
    with pytest.raises(JengaVllmError, match=r"needs 2 block slots.*vLLM has 1 block"):
        slot_cap(layout.slot_chunks, 1)


def test_the_manager_counts_the_chunks_its_mapped_slots_touch(model_dir: Path) -> None:
    layout = _layout(model_dir, "ministral", 64 << 20)
    manager = JengaKVCacheManager(layout)
    assert manager.shares_block_ids
    assert manager.committed_bytes == 2 * CHUNK  # the null slot's chunk in each layer region
    requests = replay.make_requests([[i + 1] * 600 for i in range(3)], [1] * 3, 16)
    for r in requests:
        assert manager.allocate_slots(r, 600) is not None
    manager.check_invariants()
    used = {b for r in requests for row in manager.get_block_ids(r.request_id) for b in row}
    want = {c for s in used | {0} for c in layout.slot_chunks.chunks(s)}
    assert manager.committed_bytes == len(want) * CHUNK <= layout.memory_bytes
    for r in requests:
        manager.free(r)
    manager.check_invariants()  # freed blocks stay cached: their chunks stay mapped
    assert manager.committed_bytes == len(want) * CHUNK
    assert manager.reset_prefix_cache()
    assert manager.committed_bytes == 2 * CHUNK


@pytest.fixture
def slot_cache(model_dir: Path) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kv = _kv_config(model_dir, "ministral", 64 << 20)
    layout = build_layout(kv, MAX_LEN, JengaVllmOptions(kv_tensors="vmm"))
    backend = vmm.HostBackend(CHUNK, capacity=128 << 20)
    pool = vmm.ChunkPool(backend, budget_bytes=layout.memory_bytes)
    cache = SlotVmmKVCache(kv, layout, pool, KVCacheLayout.LBNHC)
    yield kv, layout, cache, backend
    cache.close()
    pool.close()


def test_views_are_vllms_own_over_the_range(slot_cache: Any) -> None:
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv, _, cache, _ = slot_cache
    theirs = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBNHC)
    assert set(cache.kv_caches) == set(theirs)
    base = next(iter(theirs.values())).untyped_storage().data_ptr()
    for name, ref in theirs.items():
        ours = cache.kv_caches[name]
        assert ours.shape == ref.shape and ours.stride() == ref.stride()
        assert ours.dtype == ref.dtype
        assert ours.data_ptr() - cache.range.va == ref.data_ptr() - base


def _layer_of(kv: Any, group: int) -> str:
    return str(kv.kv_cache_groups[group].layer_names[0])


def test_a_slot_freed_by_one_group_is_the_same_bytes_in_another(slot_cache: Any) -> None:
    import torch

    kv, _, cache, backend = slot_cache
    assert cache.mapped_bytes() == 2 * CHUNK  # the null slot's chunks
    cache.apply_plan(MappingPlan([MapPage(0, 7)]))
    slot = cache.slots.ids(0, [7])[0]
    view0 = cache.kv_caches[_layer_of(kv, 0)][slot]
    written = torch.arange(view0.numel(), dtype=torch.int32).reshape(view0.shape).to(view0.dtype)
    view0.copy_(written)
    # group 0 frees the page, group 3 (full attention) takes the slot just freed
    cache.apply_plan(MappingPlan([UnmapPage(0, 7), MapPage(3, 2)]))
    assert cache.slots.ids(3, [2]) == [slot]
    view3 = cache.kv_caches[_layer_of(kv, 3)][slot]
    assert view3.data_ptr() == view0.data_ptr()
    assert torch.equal(view3, written)
    cache.check_invariants()
    assert backend.physical_bytes() >= cache.mapped_bytes()


def test_unmapped_chunks_are_really_unmapped_and_committed_fits(slot_cache: Any) -> None:
    _, layout, cache, _ = slot_cache
    pages = layout.total_units  # every slot but the null one
    cache.apply_plan(MappingPlan([MapPage(p % 4, p) for p in range(pages)]))
    cache.check_invariants()
    assert cache.mapped_bytes() == layout.memory_bytes  # all of vLLM's bytes, no more
    region = layout.memory_bytes // 2  # 2 layer regions
    far = (region - CHUNK) // CHUNK  # the last chunk of region 0: slots of the last 32 pages
    cache.apply_plan(MappingPlan([UnmapPage(p % 4, p) for p in range(pages - 32, pages)]))
    handles = cache.range.slot_to_handle()
    assert handles.get(far, -1) < 0 and handles.get(2 * far + 1, -1) < 0
    assert cache.mapped_bytes() == layout.memory_bytes - 2 * CHUNK
    cache.check_invariants()
    cache.apply_plan(MappingPlan.unmap_all())
    assert cache.mapped_bytes() == 2 * CHUNK
    cache.check_invariants()


def test_a_bad_plan_changes_nothing(slot_cache: Any) -> None:
    from integrations.vllm.slots import SlotError

    _, _, cache, _ = slot_cache
    cache.apply_plan(MappingPlan([MapPage(1, 0)]))
    before = (cache.slots.state(), cache.mapped_bytes(), bytes(cache.chunks.refs))
    with pytest.raises(SlotError, match="group 2 page 9 is not mapped"):
        cache.apply_plan(MappingPlan([MapPage(0, 1), UnmapPage(2, 9)]))
    assert (cache.slots.state(), cache.mapped_bytes(), bytes(cache.chunks.refs)) == before
    cache.check_invariants()


def test_the_worker_follows_the_managers_plans(slot_cache: Any) -> None:
    """Allocations, frees and the evictions they force: after every step the worker's
    replica gives each page the manager's slot and maps exactly the manager's chunks."""
    _, layout, cache, _ = slot_cache
    manager = JengaKVCacheManager(layout)
    requests = replay.make_requests([[i + 1] * 500 for i in range(5)], [1] * 5, 16)
    unmaps = 0

    def follow() -> None:
        nonlocal unmaps
        for plan in manager.take_mapping_plans():
            unmaps += sum(isinstance(op, UnmapPage) for op in plan.ops)
            cache.apply_plan(plan)
        cache.check_invariants()
        manager.check_invariants()
        assert cache.slots.state() == manager._block_ids.slots.state()
        assert cache.mapped_bytes() == manager.committed_bytes
        assert cache.mapped_bytes() <= layout.memory_bytes

    for r in requests[:3]:  # 128 of the 511 slots each
        assert manager.allocate_slots(r, 500) is not None
        follow()
    for r in requests[:2]:
        manager.free(r)
        follow()
    for r in requests[3:]:  # more than the free slots: cached blocks are evicted
        assert manager.allocate_slots(r, 500) is not None
        follow()
    assert unmaps > 0


class SlotBytesChecker(BytesChecker):
    """`BytesChecker` on the slots geometry: an unmapped page forgets its slot's bytes
    (the slot, not a per-group id, is what vLLM's views index)."""

    def _forget(self, group: int, page: int) -> None:
        self.unmapped_pages += 1
        table = self.cache.slots.slot_of[group]
        slot = table[page] if page < len(table) else 0
        self.written.pop((group, slot), None)


@pytest.mark.parametrize(("case", "memory_mb"), [("gemma2", 34), ("ministral", 40)])
def test_bytes_survive_a_real_scheduler_run_on_the_slots_range(
    model_dir: Path, case: str, memory_mb: int
) -> None:
    """Every step of vLLM's scheduler (two waves, the second hitting the first's prefix,
    memory tight enough to evict): the worker replays the plans, every computed block is
    written through vLLM's views and read back later; slots move between groups while
    chunks other mapped slots touch stay mapped, so nothing written is lost."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    setup = replay.SchedulerSetup(
        max_model_len=MAX_LEN,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        jenga_options={"kv_tensors": "vmm"},
    )
    config = replay.make_vllm_config(model_dir, setup)
    kv = replay.kv_cache_config_for(config, cases.layer_specs(case), memory_mb << 20)
    scheduler = replay.make_scheduler(config, kv, jenga=True)
    layout = scheduler.kv_cache_manager.layout
    assert layout.options.tensor_geometry is TensorGeometry.VMM_SLOTS
    backend = vmm.HostBackend(CHUNK, capacity=(layout.memory_bytes // CHUNK + 8) * CHUNK)
    pool = vmm.ChunkPool(backend, budget_bytes=layout.memory_bytes)
    cache = SlotVmmKVCache(kv, layout, pool, KVCacheLayout.LBNHC)
    checker = SlotBytesChecker(cache, layout, setup.block_size)
    prompts = Workload(requests=16, output_tokens=16).prompts()
    for wave, part in (("a", prompts[:8]), ("b", prompts[8:])):
        batch = replay.make_requests(part, [16] * len(part), setup.block_size, prefix=wave)
        report = replay.replay(scheduler, batch, after_step=checker)
    assert report.prefix_hit_tokens > 0
    assert checker.verified > 1000
    assert checker.unmapped_pages > 0  # slots were evicted and reused
    assert checker.peak <= layout.memory_bytes
    assert cache.mapped_bytes() == scheduler.kv_cache_manager.committed_bytes
    cache.close()
    pool.close()


def test_a_capacity_change_reaches_the_worker_as_slot_evictions(slot_cache: Any) -> None:
    """`set_capacity` counts slots here: a shrink evicts cached slots (the worker unmaps
    the chunks only they touched) and the worker's pool keeps the cap's budget."""
    _, layout, cache, _ = slot_cache
    manager = JengaKVCacheManager(layout)
    requests = replay.make_requests([[i + 1] * 500 for i in range(3)], [1] * 3, 16)
    for r in requests:
        assert manager.allocate_slots(r, 500) is not None
    for r in requests[:2]:
        manager.free(r)  # 256 cached slots
    for plan in manager.take_mapping_plans():
        cache.apply_plan(plan)
    before, budget = cache.mapped_bytes(), cache.pool.budget_bytes
    manager.set_capacity(200)  # below held + cached: cached slots are evicted
    for plan in manager.take_mapping_plans():
        cache.apply_plan(plan)
    cache.check_invariants()
    assert cache.slots.state() == manager._block_ids.slots.state()
    assert cache.mapped_bytes() == manager.committed_bytes < before
    assert cache.pool.budget_bytes == budget
