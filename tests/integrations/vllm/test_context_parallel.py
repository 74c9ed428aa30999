"""Decode context parallelism on the jenga manager: vLLM's real `EngineCore` (only the
executor is ours) with ``decode_context_parallel_size`` set, and the settings still refused.

Under decode context parallelism vLLM's manager gives a sharded group blocks of
``block_size * dcp`` tokens (each rank holds ``block_size`` of them); hits, block tables
and the engine's effective attention block size follow that size, and replicated groups
(Mamba, a draft with ``dcp_sharded=False``) keep their own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.drop_in import jenga_kv_cache_manager
from integrations.vllm.errors import UnsupportedFeature
from integrations.vllm.harness import cases, engine, offload, replay
from integrations.vllm.layout import build_layout

from integrations.vllm import compat
from tests.integrations.vllm.test_activation import engine_request

PREFIX = 112  # 7 blocks of 16 tokens, 3 blocks (96 tokens) of 16 x 2


def _core(model_dir: Path, case: str, kv_tensors: str, dcp: int, *, jenga: bool = True) -> Any:
    def configure(config: Any) -> None:  # as vLLM's own DCP tests set it
        config.parallel_config.decode_context_parallel_size = dcp

    return engine.host_engine_core(
        model_dir, case, jenga=jenga, kv_tensors=kv_tensors, configure=configure
    )


def _serve(core: Any, n: int) -> tuple[set[str], int, dict[str, tuple[tuple[int, ...], int]]]:
    """``n`` requests sharing a ``PREFIX``-token prefix, stepped until all finish: (the
    finished ids, the prefix-hit tokens vLLM's scheduler reported and, on the jenga
    manager, each running request's blocks per group and the tokens the allocator held
    for it after its last step)."""
    for i in range(n):
        request = engine_request(f"r{i}", [7] * PREFIX + [i + 1] * 40)
        core.add_request(*core.preprocess_add_request(request))
    finished: set[str] = set()
    hits = 0
    held: dict[str, tuple[tuple[int, ...], int]] = {}
    manager = core.scheduler.kv_cache_manager
    for _ in range(80):
        outputs, _executed = core.step()
        for request in core.scheduler.running:
            if hasattr(manager, "allocator"):  # the jenga manager: the tokens it holds
                rid = request.request_id
                rows = tuple(len(row) for row in manager.get_block_ids(rid))
                held[rid] = (rows, manager.allocator.num_tokens(rid))
        for batch in outputs.values():
            finished.update(o.request_id for o in batch.outputs if o.finished)
            stats = batch.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                hits += stats.prefix_cache_stats.hits
        if len(finished) == n:
            break
    return finished, hits, held


@pytest.mark.parametrize(
    ("case", "hits"), [("llama", 2 * 96), ("deepseek", 2 * 96), ("jamba", None)]
)
@pytest.mark.parametrize("kv_tensors", ["torch", "vmm"])
def test_engine_core_with_dcp_hits_and_allocates_sharded_blocks(
    model_dir: Path, case: str, hits: int | None, kv_tensors: str
) -> None:
    """dcp=2 on a full-attention, an MLA and a Mamba hybrid model: an attention block is 32
    tokens (one rank's page still 16 tokens' bytes), a Mamba group keeps 16, the engine's
    effective attention block size is 32, and a request holds ceil(tokens / block) blocks
    per group. The prefix-hit tokens equal those of vLLM's manager in the same engine:
    whole 32-token blocks (96 of the 112 shared tokens, where 16-token blocks would give
    112) on the attention models."""
    reported = []
    for jenga in (True, False):
        core = _core(model_dir, case, kv_tensors, 2, jenga=jenga)
        scheduler = core.scheduler
        manager = scheduler.kv_cache_manager
        assert type(manager).__name__ == ("JengaKVCacheManager" if jenga else "KVCacheManager")
        assert scheduler.block_size == 32 and scheduler.dcp_world_size == 2
        assert core.vllm_config.cache_config.effective_attention_block_size == 32
        views = manager.coordinator.single_type_managers
        sizes = [16 if type(v.kv_cache_spec).__name__ == "MambaSpec" else 32 for v in views]
        assert [v.block_size for v in views] == sizes
        finished, hit_tokens, held = _serve(core, 3)
        assert finished == {"r0", "r1", "r2"}
        reported.append(hit_tokens)
        if jenga:
            _check_jenga_side(core, manager, sizes, held, kv_tensors)
        core.model_executor.shutdown()
    assert reported[0] == reported[1] > 0
    if hits is not None:
        assert reported[0] == hits


def _check_jenga_side(
    core: Any,
    manager: Any,
    sizes: list[int],
    held: dict[str, tuple[tuple[int, ...], int]],
    kv_tensors: str,
) -> None:
    """Block sizes, one rank's pages, the coordinator view and each request's tables."""
    groups = manager.layout.groups
    assert [g.block_size for g in groups] == sizes
    assert [g.dcp_world_size for g in groups] == [size // 16 for size in sizes]
    single = build_layout(core.scheduler.kv_cache_config, 1024, manager.layout.options)
    assert [g.page_bytes for g in groups] == [g.page_bytes for g in single.groups]
    views = manager.coordinator.single_type_managers
    assert [v.dcp_world_size for v in views] == [size // 16 for size in sizes]
    assert set(held) == {"r0", "r1", "r2"}
    for rows, tokens in held.values():
        assert list(rows) == [-(-tokens // size) for size in sizes]
    manager.check_invariants(expensive=True)
    if kv_tensors == "vmm":
        worker = core.model_executor.worker
        assert worker.kv_cache is not None and worker.kv_cache.mapped_bytes() > 0


def test_scheduler_refuses_dcp_over_a_sliding_window_group(model_dir: Path) -> None:
    """Gemma 2's sliding-window groups are sharded by default and no manager serves them
    under decode context parallelism: vLLM's engine stops on an assertion while planning
    the KV cache; a scheduler given such a config (vLLM's own manager would assert too)
    is refused by the jenga scheduler by name before vLLM builds its manager."""
    setup = replay.SchedulerSetup(max_model_len=1024)
    config = replay.make_vllm_config(model_dir, setup)
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(AssertionError, match="DCP not support sliding window"):
        _core(model_dir, "gemma2", "torch", 2, jenga=False)
    kv_config = _config(_gemma2_groups())
    with pytest.raises(UnsupportedFeature, match=r"dcp_world_size=2\) with KV-cache group 1 "):
        replay.make_scheduler(config, kv_config, jenga=True)


def _gemma2_groups() -> dict[str, Any]:
    """One full-attention and one sliding-window spec of the gemma2 case."""
    by_kind: dict[str, Any] = {}
    for spec in cases.layer_specs("gemma2", block_size=16).values():
        by_kind.setdefault(type(spec).__name__, spec)
    return {"full": by_kind["FullAttentionSpec"], "window": by_kind["SlidingWindowSpec"]}


def _config(specs: dict[str, Any]) -> Any:
    groups = [compat.KVCacheGroupSpec([name], spec) for name, spec in specs.items()]
    return compat.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_replicated_groups_keep_their_block_under_dcp() -> None:
    """A draft with ``dcp_sharded=False`` keeps 16-token blocks beside a sharded target of
    64 (dcp=4): 65 tokens take 2 target blocks and 5 draft blocks."""
    spec = next(iter(cases.layer_specs("llama", block_size=16).values()))
    draft = dataclasses.replace(spec, dcp_sharded=False)
    manager = jenga_kv_cache_manager(
        _config({"target": spec, "draft": draft}), 1024, dcp_world_size=4, hash_block_size=16
    )
    assert [g.block_size for g in manager.layout.groups] == [64, 16]
    assert manager.coordinator.group_block_sizes == (64, 16)
    (request,) = replay.make_requests([[1] * 65], [4], 16)
    blocks = manager.allocate_slots(request, 65)
    assert blocks is not None and [len(g) for g in blocks.blocks] == [2, 5]
    manager.check_invariants(expensive=True)


@pytest.mark.parametrize(
    ("dcp", "pcp", "match"),
    [
        (0, 1, r"dcp_world_size=0"),
        (1, -1, r"pcp_world_size=-1"),
        (2, 1, r"decode context parallelism \(dcp_world_size=2\) with KV-cache group 1 \(Sl"),
        (1, 2, r"prefill context parallelism \(pcp_world_size=2\) with KV-cache group 1 \(Sl"),
    ],
)
def test_context_parallel_settings_vllm_refuses_are_refused_by_name(
    dcp: int, pcp: int, match: str
) -> None:
    """A world size below 1, and a sharded sliding-window group under decode or prefill
    context parallelism (vLLM's manager asserts on both groups) are `UnsupportedFeature`."""
    config = _config(_gemma2_groups())
    with pytest.raises(UnsupportedFeature, match=match):
        jenga_kv_cache_manager(config, 1024, dcp_world_size=dcp, pcp_world_size=pcp)


@pytest.mark.parametrize("jenga", [True, False], ids=["jenga", "vllm"])
def test_offloading_connector_under_dcp_loads_whole_sharded_blocks(
    model_dir: Path, jenga: bool
) -> None:
    """vLLM's CPU offloading connector with dcp=2 (32-token blocks, offloaded 32 at a
    time): three documents that no longer fit on the GPU come back from the CPU tier,
    every whole 32-token block of each 266-token prompt (256 tokens), as on vLLM's manager."""

    def configure(config: Any) -> None:
        config.parallel_config.decode_context_parallel_size = 2
        config.kv_transfer_config = offload.offloading_config(64 << 20, 32)

    # about 25 blocks of 32 tokens (each rank's page holds 16): 3 documents do not fit
    executor = offload.offload_executor_class("llama", 7 << 19)
    core = replay.engine_core(
        model_dir,
        executor,
        jenga=jenga,
        configure=configure,
        max_model_len=400,
        max_num_batched_tokens=512,
    )
    try:
        manager = core.scheduler.kv_cache_manager
        docs = [[100 + d] * 16 + list(range(1000 * d, 1000 * d + 250)) for d in range(3)]
        cached = offload.run_prefix_workload(core, docs + docs, max_steps=200)
        assert cached == [(0, 0)] * 3 + [(0, 256)] * 3  # (GPU hit, CPU load) per request
        worker = core.model_executor.worker
        assert worker.num_stores > 0 and worker.num_loads > 0
        if jenga:
            manager.check_invariants(expensive=True)
            assert not manager._requests and not manager._connector.live_parked
    finally:
        core.model_executor.shutdown()
