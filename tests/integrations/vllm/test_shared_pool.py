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
    options = {"kv_tensors": "vmm", "shared_pool": name, "tenant_name": "vllm-a"}
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


def test_shared_pool_needs_vmm_tensors() -> None:
    with pytest.raises(InvalidOptions, match="kv_tensors='vmm'"):
        JengaVllmOptions(shared_pool="x")
