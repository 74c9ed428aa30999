"""vLLM's real `EngineCore` (only the executor is ours) returning routed experts
(``enable_return_routed_experts``) on the jenga scheduler and manager, beside vLLM's own.

0.33's scheduler-side auxiliary-output connector is built on the KV-cache manager: it caps
prefix hits at the blocks whose rows it keeps, and keeps a finished request's rows while
the manager's ``block_pool`` says their blocks are cached. 0.32's keeps its own state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import engine

from integrations.vllm import compat
from tests.integrations.vllm.test_activation import engine_request

SHARED = [7] * 100


def _core(model_dir: Path, case: str, kv_tensors: str, *, jenga: bool) -> Any:
    def configure(config: Any) -> None:
        # set after construction: vLLM's config check wants a MoE model on its V2 model
        # runner, and the executor here is ours
        config.aux_output_config.enable_return_routed_experts = True

    return engine.host_engine_core(
        model_dir, case, jenga=jenga, kv_tensors=kv_tensors, configure=configure
    )


def _serve_in_turn(core: Any, n: int) -> tuple[dict[str, np.ndarray], int]:
    """Requests sharing a 100-token prefix, each served to the end before the next is
    added; per request its routed-experts rows (the steps' outputs joined), and the
    prefix-hit tokens vLLM's scheduler reported."""
    rows: dict[str, list[np.ndarray]] = {}
    hits = 0
    for i in range(n):
        rid = f"r{i}"
        core.add_request(*core.preprocess_add_request(engine_request(rid, SHARED + [i + 1] * 50)))
        for _ in range(40):
            outputs, executed = core.step()
            core.post_step(executed)
            finished = False
            for batch in outputs.values():
                for out in batch.outputs:
                    if out.routed_experts is not None:
                        rows.setdefault(out.request_id, []).append(out.routed_experts)
                    finished |= out.finished
                stats = batch.scheduler_stats
                if stats is not None and stats.prefix_cache_stats is not None:
                    hits += stats.prefix_cache_stats.hits
            if finished:
                break
        else:
            raise AssertionError(f"request {rid} did not finish in 40 steps")
    return {rid: np.concatenate(parts) for rid, parts in rows.items()}, hits


@pytest.mark.parametrize(("case", "kv_tensors"), [("llama", "torch"), ("gemma2", "vmm")])
def test_routed_experts_are_returned_and_prefix_hits_kept(
    model_dir: Path, case: str, kv_tensors: str
) -> None:
    """Every request gets one row per token up to its last (prompt and output: 150 + 5
    tokens, 154 rows), the rows of its positions; the second and third requests hit the
    shared prefix (96 tokens: 0.33's connector keeps the first request's rows because
    our ``block_pool`` finds its blocks cached). On Llama the hits equal vLLM's own
    manager's; on Gemma 2 vLLM's manager (sparse sliding-window retention at the default
    interval) serves the second request no hit and the third 96 tokens, jenga's dense
    cache 96 tokens to each."""
    results = []
    for jenga in (True, False):
        core = _core(model_dir, case, kv_tensors, jenga=jenga)
        scheduler = core.scheduler
        manager = scheduler.kv_cache_manager
        assert scheduler.aux_output_connector is not None
        if jenga:
            assert type(manager).__name__ == "JengaKVCacheManager"
        rows, hits = _serve_in_turn(core, 3)
        assert sorted(rows) == ["r0", "r1", "r2"]
        for got in rows.values():
            np.testing.assert_array_equal(got, engine.routed_row(np.arange(154)))
        if jenga:
            assert manager.stats()["prefix.hit_tokens"] == hits
            manager.check_invariants(expensive=True)
        results.append(hits)
        core.model_executor.shutdown()
    expected = {"llama": [2 * 96, 2 * 96], "gemma2": [2 * 96, 96]}  # [jenga, vLLM]
    assert results == expected[case]


@pytest.mark.skipif(not compat.AT_LEAST_0_33, reason="0.32's connector reads no manager")
def test_the_connector_finds_cached_blocks_through_our_block_pool(model_dir: Path) -> None:
    """0.33: the connector vLLM built on its own manager is rebuilt on ours; it reads the
    hash block size off our ``block_pool`` and asks each group's ``block_pool`` in our
    coordinator view for cached blocks by vLLM hash: a finished request's blocks are
    found until the prefix cache is reset."""
    core = _core(model_dir, "llama", "torch", jenga=True)
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    assert manager.block_pool.hash_block_size == 16
    assert scheduler.aux_output_connector._block_pool is manager.block_pool
    pool = manager.coordinator.single_type_managers[0].block_pool
    _serve_in_turn(core, 1)
    request, _ = core.preprocess_add_request(engine_request("probe", SHARED + [1] * 50))
    hashes = request.block_hashes  # the engine's hasher: r0's prompt, never added
    assert len(hashes) == 9
    for block_hash in hashes:
        found = pool.get_cached_block(block_hash, [0])
        assert found is not None and len(found) == 1
        assert manager.is_cached_block(0, found[0].block_id)
    assert pool.get_cached_block(b"\1" * 32, [0]) is None
    assert scheduler.reset_prefix_cache()
    assert all(pool.get_cached_block(h, [0]) is None for h in hashes)
    core.model_executor.shutdown()
