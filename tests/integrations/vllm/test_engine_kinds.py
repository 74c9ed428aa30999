"""vLLM's real `EngineCore` (only the executor is ours) with speculative decoding on and
with an MLA model, on the jenga scheduler and manager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import engine, replay
from jenga.specs import Kind

from integrations.vllm import compat
from tests.integrations.vllm.test_activation import engine_request

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
NGRAM["prompt_lookup_min"] = 1


def _core(model_dir: Path, case: str, kv_tensors: str, *, jenga: bool = True, **setup: Any) -> Any:
    """vLLM's `EngineCore` on our manager, or (``jenga=False``) on vLLM's own."""
    return engine.host_engine_core(model_dir, case, jenga=jenga, kv_tensors=kv_tensors, **setup)


def test_a_baseline_engine_given_the_key_is_refused(model_dir: Path) -> None:
    """With the plugin loaded, the ``jenga_vmm`` key alone makes vLLM's engine build our
    scheduler: `expect_manager` refuses such an engine as a vLLM baseline, so a
    comparison with vLLM's manager cannot run ours twice."""
    compat.load_general_plugins()  # as vLLM's EngineArgs and EngineCore do
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=1024))
    assert "jenga_vmm" in config.additional_config
    executor = engine.host_executor_class("llama", 48 << 20)
    core = compat.engine_core_class()(config, executor, log_stats=True)
    try:
        refused = r"manager\.JengaKVCacheManager; expected vllm\.v1\.core\.kv_cache_manager\."
        with pytest.raises(RuntimeError, match=refused + r"KVCacheManager \(jenga=False\)"):
            replay.expect_manager(core.scheduler, jenga=False)
        replay.expect_manager(core.scheduler, jenga=True)
    finally:
        core.model_executor.shutdown()


def _serve(core: Any, n: int, after_step: Any = None) -> set[str]:
    """Three requests sharing a 96-token prefix, stepped until all finish; the prefix-hit
    tokens vLLM's scheduler reported (its ``PrefixCacheStats.hits``) go to ``core.hits``."""
    for i in range(n):
        request = engine_request(f"r{i}", [7] * 100 + [i + 1] * 50)
        core.add_request(*core.preprocess_add_request(request))
    finished: set[str] = set()
    core.hits = 0
    for _ in range(80):
        outputs, executed = core.step()
        core.post_step(executed)  # the engine loop's drafts hand-off (speculation on)
        for batch in outputs.values():
            finished.update(o.request_id for o in batch.outputs if o.finished)
            stats = batch.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                core.hits += stats.prefix_cache_stats.hits
        if after_step is not None:
            after_step(core)
        if len(finished) == n:
            break
    return finished


@pytest.mark.parametrize("kv_tensors", ["torch", "vmm"])
def test_ngram_speculation_verifies_drafts_in_held_slots(model_dir: Path, kv_tensors: str) -> None:
    """n-gram drafts are scheduled as tokens of the next step (no draft KV, no lookahead
    slots past them in these vLLM versions); the worker accepts them all, so requests
    grow by 1 + 3 tokens a step, each step's slots allocated by the jenga manager."""
    core = _core(model_dir, "gemma2", kv_tensors, speculative=NGRAM)
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    assert type(manager).__name__ == "JengaKVCacheManager"
    assert scheduler.num_spec_tokens == 3 and scheduler.num_lookahead_tokens == 0
    assert not manager.speculative.use_eagle
    assert manager.allocator.config.hit_proof is None
    held: list[int] = []

    def holds_every_token(core: Any) -> None:
        for request in core.scheduler.running:
            rid = request.request_id
            assert manager.allocator.num_tokens(rid) >= request.num_computed_tokens
            held.append(request.num_computed_tokens)

    finished = _serve(core, 3, holds_every_token)
    assert finished == {"r0", "r1", "r2"}
    worker = core.model_executor.worker
    assert worker.accepted_drafts >= 3 * 3  # each request verified drafts at least once
    assert manager.stats()["prefix.hit_tokens"] >= 2 * 96
    manager.check_invariants(expensive=True)
    core.model_executor.shutdown()


@pytest.mark.parametrize("kv_tensors", ["torch", "vmm"])
def test_eagle_hits_and_draft_slots_are_vllms(
    model_dir: Path, tmp_path: Path, kv_tensors: str
) -> None:
    """EAGLE (a draft model read through vLLM's config) with 2 lookahead slots. 0.32's
    scheduler asks for the block drop (the 96 shared tokens lose their last block: 80
    each); 0.33's hashes each block with the token after it instead (lookahead hashes
    prove the boundary: no drop, 96 each). The hits equal those of vLLM's own manager in
    the same engine."""
    drops = not compat.AT_LEAST_0_33
    expected = 2 * (80 if drops else 96)
    draft = replay.write_tiny_model(tmp_path / "draft")
    eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}
    hits = []
    for jenga in (True, False):
        core = _core(model_dir, "llama", kv_tensors, jenga=jenga, speculative=eagle)
        scheduler = core.scheduler
        assert scheduler.num_lookahead_tokens == 2 and scheduler.use_eagle
        assert scheduler.use_eagle_block_drop is drops
        assert (getattr(scheduler, "num_hash_lookahead_tokens", 0) > 0) is not drops
        manager = scheduler.kv_cache_manager
        ahead: list[int] = []

        def held_ahead(core: Any, manager: Any = manager, ahead: list[int] = ahead) -> None:
            for request in core.scheduler.running:
                held = manager.allocator.num_tokens(request.request_id)
                ahead.append(held - request.num_computed_tokens)

        if jenga:
            assert type(manager).__name__ == "JengaKVCacheManager"
            assert (manager.allocator.config.hit_proof is not None) is drops
        assert _serve(core, 3, held_ahead if jenga else None) == {"r0", "r1", "r2"}
        hits.append(core.hits)
        if jenga:
            assert max(ahead) >= 2  # the draft's lookahead slots were held
            assert manager.stats()["prefix.hit_tokens"] == expected
            manager.check_invariants(expensive=True)
        core.model_executor.shutdown()
    assert hits == [expected, expected]


@pytest.mark.parametrize("kv_tensors", ["torch", "vmm"])
def test_an_mla_model_starts_and_serves_prefix_hits(model_dir: Path, kv_tensors: str) -> None:
    core = _core(model_dir, "deepseek-swa", kv_tensors)
    manager = core.scheduler.kv_cache_manager
    assert type(manager).__name__ == "JengaKVCacheManager"
    assert {g.kind for g in manager.layout.groups} == {Kind.MLA, Kind.SLIDING_WINDOW_MLA}
    for g in manager.layout.groups:
        assert g.page_bytes == 16 * 576 * 2  # one bf16 latent of 576 per token
    assert _serve(core, 3) == {"r0", "r1", "r2"}
    assert manager.stats()["prefix.hit_tokens"] >= 2 * 96
    worker = core.model_executor.worker
    if kv_tensors == "vmm":
        assert worker.kv_cache is not None and worker.kv_cache.mapped_bytes() > 0
    manager.check_invariants(expensive=True)
    core.model_executor.shutdown()


@pytest.mark.parametrize("kv_tensors", ["torch", "vmm"])
def test_a_bounded_replay_model_serves_the_hits_vllms_manager_serves(
    model_dir: Path, kv_tensors: str
) -> None:
    """DeepSeek-V4-style MLA with bounded-replay sliding-window MLA layers: the engine
    recomputes each hit's last window; both managers serve the same hits."""
    hits = []
    for jenga in (True, False):
        core = _core(model_dir, "deepseek-replay", kv_tensors, jenga=jenga)
        manager = core.scheduler.kv_cache_manager
        assert core.scheduler.prefix_replay_tokens == 64  # the case's window
        if jenga:
            kinds = {g.kind for g in manager.layout.groups}
            assert kinds == {Kind.MLA, Kind.REPLAY_SLIDING_WINDOW_MLA}
        assert _serve(core, 3) == {"r0", "r1", "r2"}
        hits.append(core.hits)
        if jenga:
            manager.check_invariants(expensive=True)
        core.model_executor.shutdown()
    assert hits[0] == hits[1] >= 2 * 96
