"""The vLLM manager's capacity moves at run time: `JengaKVCacheManager.set_capacity` grows
or shrinks the allocator's units (evicting cached pages, refusing below what live requests
hold with nothing changed), and on VMM tensors the worker's pool follows through the plan
queue."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.errors import JengaVllmError
from integrations.vllm.harness import replay
from integrations.vllm.manager import JengaKVCacheManager
from jenga.errors import CapacityInUse

import vmm
from tests.integrations.vllm.test_kv_tensors import CHUNK, _setup


def _sync(manager: Any, cache: Any) -> None:
    for plan in manager.take_mapping_plans():
        cache.apply_plan(plan)
    manager.check_invariants(expensive=True)
    cache.check_invariants()


@pytest.fixture
def on_vmm(model_dir: Path) -> Any:
    from integrations.vllm.kv_tensors import VmmKVCache
    from vllm.v1.kv_cache_layout import KVCacheLayout

    _, kv_config, layout = _setup(model_dir, "gemma2", 48)
    pool = vmm.ChunkPool(vmm.HostBackend(CHUNK, capacity=128 << 20), layout.memory_bytes)
    cache = VmmKVCache(kv_config, layout, pool, KVCacheLayout.LBNHC)
    yield JengaKVCacheManager(layout), cache, layout
    cache.close()
    pool.close()


def test_shrinking_evicts_cached_pages_and_the_worker_pool_follows(on_vmm: Any) -> None:
    manager, cache, layout = on_vmm
    old, live = replay.make_requests([[1] * 400, [2] * 400], [1, 1], 16)
    assert manager.allocate_slots(old, 400) is not None
    old.num_computed_tokens = 400  # its prefill ran: every full block can be cached
    manager.cache_blocks(old, 400)
    manager.free(old)
    _sync(manager, cache)
    cached = cache.pool.num_mapped
    assert cached == manager.allocator.stats()["units.evictable.current"] > 0
    page = max(g.units_per_large_page for g in manager.allocator.config.groups)
    assert cached > page
    manager.set_capacity(page)  # every page but what fits in one large page is evicted
    _sync(manager, cache)
    assert manager.allocator.total_units == page and cache.pool.budget_bytes == page * CHUNK
    assert cache.pool.num_mapped <= page
    manager.set_capacity(layout.total_units)  # grow back: the worker's budget first
    _sync(manager, cache)
    assert cache.pool.budget_bytes == layout.total_units * CHUNK
    assert manager.allocate_slots(live, 400) is not None
    _sync(manager, cache)
    held = cache.pool.num_mapped - manager.allocator.stats()["units.evictable.current"]
    before = (cache.pool.num_mapped, cache.pool.budget_bytes, manager.allocator.usage())
    with pytest.raises(CapacityInUse, match=f"{held} of them by live requests"):
        manager.set_capacity(held - 1)
    assert manager.take_mapping_plans() == []  # nothing changed, nothing queued
    assert (cache.pool.num_mapped, cache.pool.budget_bytes, manager.allocator.usage()) == before


def test_a_capacity_beyond_the_layout_is_refused(on_vmm: Any) -> None:
    manager, _, layout = on_vmm
    with pytest.raises(JengaVllmError, match=f"outside \\(0, {layout.total_units}\\]"):
        manager.set_capacity(layout.total_units + 1)
    assert manager.allocator.total_units == layout.total_units
