"""vLLM's KV tensors on a shared pool: the plugin joins `vmm-pool` by name (an option)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.errors import InvalidOptions
from integrations.vllm.harness import cases, replay
from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions
from integrations.vllm.plugin import vmm_allocate_kv_cache
from vmm.shared.cli import pool_state

from tests.vmm.shared.pool_helpers import owner_process, pool_name

CHUNK = 2 << 20
MAX_LEN = 1024


def test_plugin_joins_a_shared_pool_by_name(model_dir: Path) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    name = pool_name()
    setup = replay.SchedulerSetup(max_model_len=MAX_LEN)
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("gemma2"), 48 << 20)
    options = {
        "kv_tensors": "vmm",
        "shared_pool": name,
        "tenant_name": "vllm-a",
        "tenant_min_bytes": 8 * CHUNK,
    }
    config.additional_config = {"jenga_vmm": options}
    layout = build_layout(kv_config, MAX_LEN, JengaVllmOptions.from_dict(options))
    with owner_process(name, 4 * layout.memory_bytes, CHUNK):
        cache = vmm_allocate_kv_cache(config, kv_config, KVCacheLayout.LBNHC)
        try:
            (tenant,) = pool_state(name)["tenants"]
            assert tenant["name"] == "vllm-a" and tenant["max"] == cache.pool.budget_bytes
            assert tenant["held"] == 0  # chunks are lent when blocks are mapped
            manager = JengaKVCacheManager(layout)
            (request,) = replay.make_requests([[1] * 400], [1], 16)
            assert manager.allocate_slots(request, 400) is not None
            for plan in manager.take_mapping_plans():
                cache.apply_plan(plan)
            cache.check_invariants()
            (tenant,) = pool_state(name)["tenants"]
            assert tenant["held"] >= cache.mapped_bytes() > 0
        finally:
            cache.close()
            cache.pool.close()


def test_shared_pool_needs_vmm_tensors_and_a_guaranteed_minimum() -> None:
    with pytest.raises(InvalidOptions, match="kv_tensors='vmm'"):
        JengaVllmOptions(shared_pool="x", tenant_min_bytes=CHUNK)
    with pytest.raises(InvalidOptions, match="tenant_min_bytes > 0, got 0"):
        JengaVllmOptions(shared_pool="x", kv_tensors="vmm")


def test_the_scheduler_maps_only_what_the_owner_guarantees(model_dir: Path) -> None:
    """A tenant's allocator starts at its guaranteed minimum: every plan it queues fits
    the chunks the owner must lend; more is handed over with `set_capacity`."""
    setup = replay.SchedulerSetup(max_model_len=MAX_LEN)
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("gemma2"), 48 << 20)
    options = {"kv_tensors": "vmm", "shared_pool": "x", "tenant_min_bytes": 8 * CHUNK}
    layout = build_layout(kv_config, MAX_LEN, JengaVllmOptions.from_dict(options))
    manager = JengaKVCacheManager(layout)
    assert manager.allocator.total_units == 8 < layout.total_units
    (request,) = replay.make_requests([[1] * 1000], [1], 16)
    assert manager.allocate_slots(request, 1000) is None  # beyond the guaranteed 8 chunks
    manager.set_capacity(layout.total_units)  # the owner lent the rest
    assert manager.allocate_slots(request, 1000) is not None
    manager.check_invariants(expensive=True)
