"""A positive ``prefix_cache_retention_interval`` under memory pressure, through vLLM's
real scheduler (fake model outputs), on our manager and vLLM's at the same memory.

Gemma 2-like layers (sliding window 64 beside full attention, 16-token blocks) in 40 MiB
(160 of vLLM's blocks). Request "a" (1024 tokens) is prefilled 128 tokens a step, so its
window blocks leave the window mid-prompt; then "b" (1024 other tokens) runs through the
same pool, which cannot keep both. Then each query (a's first R + 40 tokens) asks what the
cache still serves (`get_computed_blocks`, the scheduler's own lookup).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import cases, replay

BLOCK = 16
MEMORY_MB = 40
PROMPT_TOKENS = 1024
QUERY_BOUNDARIES = (256, 512, 768, 1024)


def _scheduler(model_dir: Path, interval: int, *, jenga: bool) -> Any:
    setup = replay.SchedulerSetup(max_model_len=1536, max_num_batched_tokens=128)
    config = replay.make_vllm_config(model_dir, setup)
    config.cache_config.prefix_cache_retention_interval = interval
    specs = cases.layer_specs("gemma2", block_size=BLOCK, window=64)
    kv_config = replay.kv_cache_config_for(config, specs, MEMORY_MB << 20)
    assert kv_config.prefix_cache_retention_interval == interval
    assert kv_config.num_blocks == 160
    return replay.make_scheduler(config, kv_config, jenga=jenga)


def _hits_after_pressure(model_dir: Path, interval: int, *, jenga: bool) -> list[int]:
    scheduler = _scheduler(model_dir, interval, jenga=jenga)
    a = [i + 1 for i in range(PROMPT_TOKENS)]
    b = [i + 40_000 for i in range(PROMPT_TOKENS)]
    replay.replay(scheduler, replay.make_requests([a], [1], BLOCK, "a"))
    replay.replay(scheduler, replay.make_requests([b], [1], BLOCK, "b"))
    queries = replay.make_requests(
        [a[: r + 40] for r in QUERY_BOUNDARIES], [1] * len(QUERY_BOUNDARIES), BLOCK, "q"
    )
    return [int(scheduler.kv_cache_manager.get_computed_blocks(q)[1]) for q in queries]


def test_retention_boundaries_survive_a_later_request(model_dir: Path) -> None:
    """Interval 256: the window blocks of each boundary hit outlive b (b's window blocks
    that no boundary reads go first), so a's boundary hits are served, as on vLLM's
    manager, and the dense cache serves more past the last boundary."""
    ours = _hits_after_pressure(model_dir, 256, jenga=True)
    theirs = _hits_after_pressure(model_dir, 256, jenga=False)
    assert theirs == [256, 512, 768, 768]
    assert ours == [256, 512, 800, 896]
    assert all(mine >= vllm for mine, vllm in zip(ours, theirs, strict=True))


def test_without_retention_lru_keeps_none_of_a(model_dir: Path) -> None:
    """Interval 0 (the default): plain LRU; b evicts every window block of a on both
    managers (a's windows left early, so they are the oldest)."""
    assert _hits_after_pressure(model_dir, 0, jenga=True) == [0, 0, 0, 0]
    assert _hits_after_pressure(model_dir, 0, jenga=False) == [0, 0, 0, 0]
