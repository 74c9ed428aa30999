"""Clear errors (version, layer kinds, features, options) and the opt-in plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.errors import (
    InvalidOptions,
    JengaVllmError,
    UnsupportedLayerKind,
)
from integrations.vllm.harness import cases, replay
from integrations.vllm.layout import build_layout
from integrations.vllm.options import JengaVllmOptions, TensorGeometry
from integrations.vllm.version import UnsupportedVllmVersion, check_vllm_version

import vmm


def test_version_check_names_the_supported_version() -> None:
    assert check_vllm_version() in ("0.32.0", "0.33.0")
    with pytest.raises(
        UnsupportedVllmVersion, match=r"supports vLLM 0\.32\.0, 0\.33\.0; found 0\.31\.2"
    ):
        check_vllm_version("0.31.2")


def test_an_unsupported_spec_is_refused_with_the_supported_list(model_dir: Path) -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    class ExoticAttentionSpec(FullAttentionSpec):
        """A spec class vLLM might add later: refused by name, never taken for its base."""

    spec = ExoticAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["x"], spec)]
    )
    with pytest.raises(UnsupportedLayerKind) as info:
        build_layout(config, 1024)
    message = str(info.value)
    assert "ExoticAttentionSpec is not supported" in message
    assert (
        "FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec, "
        "CrossAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec, SinkFullAttentionSpec"
        in message
    )


def test_routed_experts_connector_is_rebuilt_on_our_manager(model_dir: Path) -> None:
    """vLLM 0.33 builds its auxiliary-output connector on the manager's ``block_pool``
    (vLLM's own manager, dropped by the swap): `JengaScheduler` rebuilds it on ours.
    0.32's connector keeps its own state and stays as vLLM built it."""
    from integrations.vllm import compat

    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=256))
    config.aux_output_config.enable_return_routed_experts = True
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("llama"), 16 << 20)
    scheduler = replay.make_scheduler(config, kv_config, jenga=True)
    connector = scheduler.aux_output_connector
    assert connector is not None
    if compat.AT_LEAST_0_33:
        assert connector._block_pool is scheduler.kv_cache_manager.block_pool
        assert connector._hash_block_size == 16


def test_options_are_checked() -> None:
    with pytest.raises(InvalidOptions, match=r"unknown jenga_vmm option\(s\) \['chunk'\]"):
        JengaVllmOptions.from_dict({"chunk": 1})
    with pytest.raises(InvalidOptions, match=r"epsilon must be in \[0, 1\), got 1.5"):
        JengaVllmOptions(epsilon=1.5)
    with pytest.raises(InvalidOptions, match=r"order must be one of"):
        JengaVllmOptions(order="lifo")
    assert JengaVllmOptions.from_dict({"order": "paper"}).order == "paper"
    with pytest.raises(InvalidOptions, match=r"kv_tensors='vmm' needs pages='vmm'"):
        JengaVllmOptions(kv_tensors="vmm", pages="vllm")
    assert JengaVllmOptions().tensor_geometry is TensorGeometry.SHARED_SLOTS
    per_group = JengaVllmOptions(kv_tensors="vmm", geometry="per_group")
    assert per_group.tensor_geometry is TensorGeometry.PER_GROUP


def test_option_strings_become_the_tensor_geometry() -> None:
    """The config boundary takes the option strings; everything past it sees the enum."""
    per_layer = JengaVllmOptions.from_dict({"kv_tensors": "vmm", "geometry": "per_layer"})
    assert per_layer.geometry is TensorGeometry.PER_LAYER
    assert per_layer.tensor_geometry is TensorGeometry.PER_LAYER
    per_group = JengaVllmOptions(pages="vmm", geometry="per_group")
    assert per_group.tensor_geometry is TensorGeometry.PER_GROUP
    slots = JengaVllmOptions.from_dict({"pages": "vmm", "geometry": "slots"})
    assert slots.tensor_geometry is TensorGeometry.VMM_SLOTS
    assert slots.tensor_geometry.slot_ids and not slots.tensor_geometry.on_vmm_ranges
    shared = JengaVllmOptions(pages="vllm", geometry="per_layer")
    assert shared.tensor_geometry is TensorGeometry.SHARED_SLOTS
    assert not shared.tensor_geometry.on_vmm_ranges and per_layer.tensor_geometry.on_vmm_ranges
    with pytest.raises(
        InvalidOptions,
        match=r"geometry must be one of \('auto', 'slots', 'per_group', 'per_layer'\), "
        r"got 'shared_slots'",
    ):
        JengaVllmOptions(geometry="shared_slots")


@pytest.mark.parametrize(
    ("geometry", "epsilon", "mib", "chunks"),
    [("per_group", 0.05, 64, 64), ("per_layer", None, 64, 58), ("per_group", None, 14, 8)],
)
def test_a_pool_without_room_for_one_page_per_group_is_refused(
    model_dir: Path, geometry: str, epsilon: float | None, mib: int, chunks: int
) -> None:
    """jamba: 7 Mamba groups of 2 layers x 280 KiB and one attention group. per_group
    with epsilon 5 %: a Mamba page is 9 chunks (32 states at a 288 KiB stride), 7 x 9 + 1
    = 64; per_layer: a Mamba page is 4 chunks per layer range (29 states), 7 x 2 x 4 +
    2 x 1 = 58. per_group with the default epsilon widens it (up to 50 %) until one page
    per group fits: 1-chunk pages of 2 states, 7 x 1 + 1 = 8, more than 14 MiB holds
    (vLLM's own check wants 128-token requests to fit there)."""
    length = 256 if mib >= 64 else 128
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=length))
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("jamba"), mib << 20)
    options = JengaVllmOptions(pages="vmm", geometry=geometry, epsilon=epsilon)
    with pytest.raises(JengaVllmError, match=rf"needs a large page in each group: {chunks} chunks"):
        build_layout(kv_config, length, options)


def test_plugin_is_inert_unless_opted_in(model_dir: Path) -> None:
    from integrations.vllm.plugin import register, vmm_allocate_kv_cache, wants_vmm_tensors
    from integrations.vllm.slot_tensors import SlotVmmKVCache
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import gpu_model_runner

    register()
    register()  # idempotent
    runner = gpu_model_runner.GPUModelRunner
    assert getattr(runner.initialize_kv_cache_tensors, "_jenga_vmm_wrapped", False)
    assert getattr(runner.execute_model, "_jenga_vmm_wrapped", False)

    setup = replay.SchedulerSetup(max_model_len=512)
    plain = replay.make_vllm_config(model_dir, setup)
    assert not wants_vmm_tensors(plain)
    opted = replay.make_vllm_config(
        model_dir, replay.SchedulerSetup(max_model_len=512, jenga_options={"kv_tensors": "vmm"})
    )
    assert wants_vmm_tensors(opted)
    kv_config = replay.kv_cache_config_for(opted, cases.layer_specs("llama"), 16 << 20)
    cache = vmm_allocate_kv_cache(
        opted, kv_config, KVCacheLayout.LBNHC, backend=vmm.HostBackend(2 << 20)
    )
    assert set(cache.kv_caches) == set(cases.layer_specs("llama"))
    # llama's one group fills vLLM's slot: the default geometry is "slots", whose range
    # maps only the null slot's chunks (one per layer region) before any plan
    assert isinstance(cache, SlotVmmKVCache)
    assert cache.mapped_bytes() == len(cache.slot_chunks.chunks(0)) * (2 << 20) == 4 * (2 << 20)
    cache.close()
    cache.pool.close()


def test_the_default_order_is_lru_fair_pinned_on_per_group_vmm_pages_only() -> None:
    """`order=None`: pinned (with `pinned_lru_fair`) on per_group VMM pages, compact on
    vLLM's tensors, VMM slots and per_layer ranges; an explicit order wins."""
    assert JengaVllmOptions(kv_tensors="vmm", geometry="per_group").allocation_order == "pinned"
    assert JengaVllmOptions(kv_tensors="vmm", geometry="slots").allocation_order == "compact"
    assert JengaVllmOptions().allocation_order == "compact"
    assert JengaVllmOptions(kv_tensors="vmm", geometry="per_layer").allocation_order == "compact"
    assert JengaVllmOptions(kv_tensors="vmm", order="compact").allocation_order == "compact"
    from integrations.vllm.layout import _rules

    rules = _rules(JengaVllmOptions(kv_tensors="vmm", geometry="per_group"))
    assert (rules.order.value, rules.pinned_lru_fair) == ("pinned", True)
    assert not _rules(JengaVllmOptions()).pinned_lru_fair
