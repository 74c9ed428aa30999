"""KV tensors on VMM ranges (host backend), per_layer geometry: real vLLM KVCacheConfig →
one range per layer → vLLM views (the per_group geometry: test_group_ranges.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import cases, replay
from integrations.vllm.kv_tensors import UnsupportedLayout, VmmKVCache
from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions

import vmm

CHUNK = 2 << 20
MAX_LEN = 1024


def _setup(model_dir: Path, case: str, memory_mb: int) -> tuple[Any, Any, Any]:
    setup = replay.SchedulerSetup(max_model_len=MAX_LEN)
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs(case), memory_mb << 20)
    options = JengaVllmOptions(kv_tensors="vmm", geometry="per_layer")
    layout = build_layout(kv_config, MAX_LEN, options)
    return config, kv_config, layout


@pytest.fixture
def gemma2(model_dir: Path) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    _, kv_config, layout = _setup(model_dir, "gemma2", 48)
    backend = vmm.HostBackend(CHUNK, capacity=128 << 20)
    pool = vmm.ChunkPool(backend, budget_bytes=layout.memory_bytes)
    cache = VmmKVCache(kv_config, layout, pool, KVCacheLayout.LBNHC)
    yield kv_config, layout, cache, backend
    cache.close()
    pool.close()


def test_views_have_vllms_shapes_and_alias_the_ranges(gemma2: Any) -> None:
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv_config, layout, cache, _ = gemma2
    theirs = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBNHC)
    assert set(cache.kv_caches) == set(theirs)
    for g in layout.groups:
        for name in g.layer_names:
            ours, ref = cache.kv_caches[name], theirs[name]
            assert ours.shape[1:] == ref.shape[1:] and ours.dtype == ref.dtype
            assert ours.shape[0] == g.capacity + 1
            assert ours.stride() == ref.stride()
            rng = cache.ranges[name]
            assert ours.data_ptr() == rng.va
            assert ours[5].data_ptr() == rng.va + 5 * g.page_bytes


def test_blocks_map_with_plans_and_survive_other_mapping_changes(gemma2: Any) -> None:
    import torch

    _, layout, cache, backend = gemma2
    manager = JengaKVCacheManager(layout)
    assert backend.physical_bytes() == 0 and cache.mapped_bytes() == 0

    requests = replay.make_requests([[i + 1] * 400 for i in range(3)], [1] * 3, 16)
    assert manager.allocate_slots(requests[0], 400) is not None
    for plan in manager.take_mapping_plans():
        cache.apply_plan(plan)
    cache.check_invariants()
    bytes_a = cache.mapped_bytes()
    assert bytes_a == backend.physical_bytes() > 0

    full_group = layout.groups[1]
    block = manager.get_block_ids(requests[0].request_id)[1][-1]
    name = full_group.layer_names[0]
    view = cache.kv_caches[name]
    offset = block * full_group.page_bytes
    raw = cache.ranges[name].tensor((full_group.page_bytes // 2,), torch.float16, offset=offset)
    view[block].fill_(1.5)  # the view and the range are the same bytes
    assert bool(raw.eq(1.5).all())
    raw.fill_(-2.0)
    assert bool(view[block].eq(-2.0).all())

    # Other requests map more pages, then finish: their pages are unmapped again.
    for req in requests[1:]:
        assert manager.allocate_slots(req, 400) is not None
    for plan in manager.take_mapping_plans():
        cache.apply_plan(plan)
    assert cache.mapped_bytes() > bytes_a
    assert bool(view[block].eq(-2.0).all())  # request 0's block kept its data
    for req in requests[1:]:
        manager.free(req)
    manager.free(requests[0])
    assert manager.reset_prefix_cache()
    for plan in manager.take_mapping_plans():
        cache.apply_plan(plan)
    cache.check_invariants()
    assert cache.mapped_bytes() == 0


def test_data_survives_unmapping_of_other_pages(gemma2: Any) -> None:
    import torch

    _, layout, cache, _ = gemma2
    g = layout.groups[1]
    per_page = g.pages.blocks_per_large_page
    assert cache.ensure_mapped([[], [0, per_page, 2 * per_page]]) == 3
    name = g.layer_names[0]
    view = cache.kv_caches[name]
    view[per_page].fill_(3.5)
    from jenga.plan import MappingPlan, UnmapPage

    cache.apply_plan(MappingPlan((UnmapPage(1, 0), UnmapPage(1, 2))))
    assert cache.ensure_mapped([[], [0]]) == 1
    assert torch.all(view[per_page] == 3.5)
    cache.check_invariants()


def test_unmapped_blocks_cost_no_physical_memory(gemma2: Any) -> None:
    _, layout, cache, backend = gemma2
    g = layout.groups[0]
    assert backend.physical_bytes() == 0
    cache.ensure_mapped([[g.capacity - 1], []])  # the last page only
    layers = len(g.layer_names)
    assert backend.physical_bytes() == layers * g.pages.chunks_per_range * CHUNK
    assert cache.ensure_mapped([[g.capacity, g.capacity - 2], []]) == 0  # null id, same page


def test_tail_pages_are_refused(model_dir: Path) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    _, kv_config, layout = _setup(model_dir, "jamba", 256)
    pool = vmm.ChunkPool(vmm.HostBackend(CHUNK, capacity=8 << 20), budget_bytes=8 << 20)
    with pytest.raises(UnsupportedLayout, match=r"tail"):
        VmmKVCache(kv_config, layout, pool, KVCacheLayout.LBNHC)
    with pytest.raises(UnsupportedLayout, match=r"layer-compact"):
        VmmKVCache(kv_config, layout, pool, KVCacheLayout.BLNHC)
    slots = build_layout(kv_config, MAX_LEN, JengaVllmOptions())
    with pytest.raises(UnsupportedLayout, match=r"pages='vllm'.*need pages='vmm'"):
        VmmKVCache(kv_config, slots, pool, KVCacheLayout.LBNHC)
    pool.close()


def test_a_worker_in_another_process_follows_maps_and_unmaps(model_dir: Path) -> None:
    """Plans ride on the pickled `SchedulerOutput`: the worker's committed memory follows
    the allocator (unmaps included), not the high-water mark."""
    import pickle

    from integrations.vllm.harness.side_by_side import Workload
    from vllm.v1.kv_cache_layout import KVCacheLayout

    setup = replay.SchedulerSetup(
        max_model_len=MAX_LEN,
        max_num_batched_tokens=1024,
        jenga_options={"kv_tensors": "vmm", "geometry": "per_layer"},
    )
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("gemma2"), 48 << 20)
    scheduler = replay.make_scheduler(config, kv_config, jenga=True)
    manager = scheduler.kv_cache_manager
    backend = vmm.HostBackend(CHUNK, capacity=128 << 20)
    pool = vmm.ChunkPool(backend, budget_bytes=manager.layout.memory_bytes)
    cache = VmmKVCache(kv_config, manager.layout, pool, KVCacheLayout.LBNHC)
    seen = {"ops": 0, "unmaps": 0, "peak": 0}

    def worker(_scheduler: Any, out: Any) -> None:
        shipped = pickle.loads(pickle.dumps(out))  # what a worker process receives
        seen["unmaps"] += sum(p.num_unmaps for p in shipped.jenga_vmm_plans)
        seen["ops"] += cache.apply_scheduler_output(shipped)
        seen["peak"] = max(seen["peak"], cache.mapped_bytes())
        cache.check_invariants()

    prompts = Workload(requests=24, output_tokens=32).prompts()
    requests = replay.make_requests(prompts, [32] * len(prompts), setup.block_size)
    replay.replay(scheduler, requests, after_step=worker)
    for plan in manager.take_mapping_plans():  # the frees of the last step
        cache.apply_plan(plan)
    usage = manager.allocator.usage()
    assert seen["unmaps"] > 0 and seen["ops"] > seen["unmaps"]
    assert [len(p) for p in cache.mapped_pages] == list(usage.mapped_pages)
    assert cache.mapped_bytes() == usage.used_units * CHUNK
    # the pool keeps chunks it created in its free heap (vmm.ChunkPool): at most the peak
    assert seen["peak"] <= backend.physical_bytes() <= manager.layout.memory_bytes
    assert seen["peak"] <= manager.layout.memory_bytes
    cache.close()
    pool.close()
