"""vLLM's HiSparse configs are refused at start-up as a whole, naming every group.

HiSparse keeps a sparse-MLA model's KV in a host block pool with GPU resident and hot
pages as a write-back cache of it; its source and indexer groups carry ordinary attention
specs, told apart only by their role and ``host_resident``. These tests build the groups
as vLLM lays them out (and as vLLM's own core tests build them) and check that every
entry point refuses them before any block is numbered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import torch
from integrations.vllm.drop_in import jenga_kv_cache_manager
from integrations.vllm.errors import UnsupportedLayerKind
from integrations.vllm.harness import replay
from integrations.vllm.layout import build_layout
from integrations.vllm.scheduler import JengaScheduler

from integrations.vllm import compat

BLOCK = 16
MAX_LEN = 256
HOST_BLOCKS = 24
SOURCE = r"0 \(FullAttentionSpec, role hisparse_source, host-resident\)"
INDEXER = r"1 \(FullAttentionSpec, role hisparse_indexer\)"


def _groups(*, resident_and_hot: bool) -> list[Any]:
    """The source (host-resident) and indexer groups, then the resident and hot groups."""
    from vllm.v1 import kv_cache_interface as kvi

    spec = kvi.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    groups = [
        kvi.KVCacheGroupSpec(
            ["source"],
            spec,
            role=kvi.KVCacheGroupRole.HISPARSE_SOURCE,
            host_resident=True,
        ),
        kvi.KVCacheGroupSpec(["indexer"], spec, role=kvi.KVCacheGroupRole.HISPARSE_INDEXER),
    ]
    if resident_and_hot:
        page = spec.page_size_bytes
        groups += [
            kvi.KVCacheGroupSpec(
                ["resident"],
                kvi.HiSparseResidentSpec(block_size=BLOCK, page_size=page),
                enable_kv_transfer=False,
            ),
            kvi.KVCacheGroupSpec(
                ["hot"],
                kvi.HiSparseHotSpec(block_size=BLOCK, page_size=page, blocks_per_request=2),
                enable_kv_transfer=False,
            ),
        ]
    return groups


def _config(*, resident_and_hot: bool = True, host_blocks: int | None = HOST_BLOCKS) -> Any:
    return compat.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=_groups(resident_and_hot=resident_and_hot),
        hisparse_host_num_blocks=host_blocks,
    )


def test_a_hisparse_config_is_refused_naming_every_group() -> None:
    message = (
        rf"\AHiSparse KV-cache groups \[{SOURCE}, {INDEXER}, 2 \(HiSparseResidentSpec\), "
        rf"3 \(HiSparseHotSpec\)\] \(hisparse_host_num_blocks={HOST_BLOCKS}\) are not "
        r"supported: HiSparse keeps the sparse-MLA source KV in a host block pool"
    )
    with pytest.raises(UnsupportedLayerKind, match=message):
        build_layout(_config(), MAX_LEN)
    # vLLM's own core tests build the manager directly: the drop-in refuses it alike
    with pytest.raises(UnsupportedLayerKind, match=message):
        jenga_kv_cache_manager(_config(), MAX_LEN, hash_block_size=BLOCK)


def test_a_host_resident_source_group_is_refused_without_hisparse_specs() -> None:
    """The source and indexer groups carry a plain `FullAttentionSpec`: without the check
    on roles and ``host_resident`` they would be served as GPU groups, their blocks
    numbered in the GPU pool while vLLM's worker reads the source from the host pool."""
    message = (
        rf"\AHiSparse KV-cache groups \[{SOURCE}, {INDEXER}\] "
        rf"\(hisparse_host_num_blocks={HOST_BLOCKS}\) are not supported"
    )
    with pytest.raises(UnsupportedLayerKind, match=message):
        build_layout(_config(resident_and_hot=False), MAX_LEN)
    # a host pool with no HiSparse group left is refused too
    with pytest.raises(UnsupportedLayerKind, match=r"\[\] \(hisparse_host_num_blocks=8\)"):
        build_layout(_with_groups(_config(), [], host_blocks=8), MAX_LEN)


def _with_groups(config: Any, keep: list[int], *, host_blocks: int | None) -> Any:
    """``config`` with only its groups ``keep``, then a plain full-attention group."""
    from vllm.v1 import kv_cache_interface as kvi

    plain = kvi.KVCacheGroupSpec(["plain"], config.kv_cache_groups[1].kv_cache_spec)
    groups = [config.kv_cache_groups[i] for i in keep] + [plain]
    return compat.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        hisparse_host_num_blocks=host_blocks,
    )


def test_a_lone_hisparse_spec_is_refused_by_name() -> None:
    from vllm.v1 import kv_cache_interface as kvi

    for spec in (
        kvi.HiSparseHotSpec(block_size=BLOCK, page_size=4096, blocks_per_request=4),
        kvi.HiSparseResidentSpec(block_size=BLOCK, page_size=4096),
    ):
        name = type(spec).__name__
        config = compat.KVCacheConfig(
            num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[kvi.KVCacheGroupSpec(["x"], spec)]
        )
        with pytest.raises(
            UnsupportedLayerKind,
            match=rf"\AHiSparse KV-cache groups \[0 \({name}\)\] \(hisparse_host_num_blocks=None\)",
        ):
            build_layout(config, MAX_LEN)


def test_plain_groups_are_not_taken_for_hisparse() -> None:
    """A config with no HiSparse group, role or host pool builds as before."""
    layout = build_layout(_with_groups(_config(), [], host_blocks=None), MAX_LEN)
    assert [g.layer_names for g in layout.groups] == [("plain",)]


def test_vllm_scheduler_on_a_hisparse_config_is_refused_before_vllms_manager(
    model_dir: Path,
) -> None:
    """vLLM's own `Scheduler` builds on the config (its manager binds the host pool);
    `JengaScheduler` refuses it before vLLM's construction runs, so no manager exists."""
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=MAX_LEN))
    vllm_scheduler = replay.make_scheduler(config, _config(), jenga=False)
    managers = vllm_scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [type(m).__name__ for m in managers] == [
        "HiSparseSourceManager",
        "FullAttentionManager",
        "HiSparseResidentManager",
        "HiSparseHotManager",
    ]
    scheduler = JengaScheduler.__new__(JengaScheduler)
    with pytest.raises(UnsupportedLayerKind, match=rf"\AHiSparse KV-cache groups \[{SOURCE}"):
        scheduler.__init__(  # type: ignore[misc]
            vllm_config=config,
            kv_cache_config=_config(),
            structured_output_manager=compat.structured_output_manager(config),
            block_size=BLOCK,
            log_stats=True,
        )
    assert not hasattr(scheduler, "kv_cache_manager")
