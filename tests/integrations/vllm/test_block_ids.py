"""One block-id strategy per tensor geometry: how the manager's vLLM block ids are made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.block_ids import (
    RangeBlockIds,
    SlotBlockIds,
    SpreadBlockIds,
    VmmSlotBlockIds,
    new_block_ids,
)
from integrations.vllm.harness import cases, replay
from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions, TensorGeometry
from jenga.allocator import NULL_BLOCK

MAX_LEN = 1024
BLOCK = 16
GEOMETRIES = {
    TensorGeometry.SHARED_SLOTS: ({}, SlotBlockIds),
    TensorGeometry.PER_LAYER: ({"kv_tensors": "vmm", "geometry": "per_layer"}, RangeBlockIds),
    TensorGeometry.PER_GROUP: ({"kv_tensors": "vmm", "geometry": "per_group"}, SpreadBlockIds),
    TensorGeometry.VMM_SLOTS: ({"kv_tensors": "vmm", "geometry": "slots"}, VmmSlotBlockIds),
}


def _manager(model_dir: Path, geometry: TensorGeometry) -> JengaKVCacheManager:
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=MAX_LEN))
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("gemma2"), 48 << 20)
    options = JengaVllmOptions(**GEOMETRIES[geometry][0])  # type: ignore[arg-type]
    layout = build_layout(kv_config, MAX_LEN, options)
    assert layout.options.tensor_geometry is geometry
    return JengaKVCacheManager(layout)


def _run_two(manager: JengaKVCacheManager) -> list[Any]:
    requests = replay.make_requests([[5] * 40, [9] * 70], [1, 1], BLOCK)
    for request in requests:
        assert manager.allocate_slots(request, request.num_tokens) is not None
    return requests


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_the_layout_geometry_picks_its_strategy(model_dir: Path, geometry: TensorGeometry) -> None:
    manager = _manager(model_dir, geometry)
    strategy = new_block_ids(manager.layout)
    assert type(strategy) is GEOMETRIES[geometry][1]
    assert manager.shares_block_ids is geometry.slot_ids


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_vllm_ids_follow_the_geometry(model_dir: Path, geometry: TensorGeometry) -> None:
    """Shared slots (on vLLM's tensors or VMM): ids unique across groups and requests,
    never the null slot 0; per layer: the allocator's ids; per group: page ``q`` spread
    to start at ``q*M``. Every id names its allocator block back (`is_cached_block` reads
    the block it names)."""
    manager = _manager(model_dir, geometry)
    requests = _run_two(manager)
    seen: list[int] = []
    for request in requests:
        rid = request.request_id
        for g, (ids, group) in enumerate(
            zip(manager.get_block_ids(rid), manager.layout.groups, strict=True)
        ):
            table = manager.allocator.block_table(rid, g)
            assert len(ids) == len(table) > 0
            live = [(v, b) for v, b in zip(ids, table, strict=True) if b != NULL_BLOCK]
            complete = request.num_tokens // group.block_size  # committed at allocation
            if geometry.slot_ids:
                seen += [v for v, _ in live]
            elif geometry is TensorGeometry.PER_LAYER:
                assert [v for v, _ in live] == [b for _, b in live]
            else:
                assert group.placement is not None
                per_page, ids_per_page = (
                    group.placement.blocks_per_page,
                    group.placement.ids_per_page,
                )
                assert [v for v, _ in live] == [
                    b // per_page * ids_per_page + b % per_page for _, b in live
                ]
            for i, (v, b) in enumerate(zip(ids, table, strict=True)):
                if b != NULL_BLOCK:
                    assert manager.is_cached_block(g, v) is (i < complete)
    if geometry.slot_ids:
        assert len(seen) == len(set(seen)) and 0 not in seen
    manager.check_invariants(expensive=True)


def test_a_reset_forgets_every_slot(model_dir: Path) -> None:
    manager = _manager(model_dir, TensorGeometry.SHARED_SLOTS)
    requests = _run_two(manager)
    for request in requests:
        manager.free(request)
    assert manager.reset_prefix_cache()
    manager.check_invariants(expensive=True)  # no slot mapped, the allocator empty
    (first,) = replay.make_requests([[3] * 20], [1], BLOCK)
    blocks = manager.allocate_slots(first, first.num_tokens)
    assert blocks is not None
    ids = sorted(v for row in blocks.get_block_ids() for v in row)
    assert ids == list(range(1, 1 + len(ids)))  # the lowest slots first, as when new
