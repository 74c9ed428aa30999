"""vLLM's CPU offloading connector over the jenga manager, through vLLM's `EngineCore`
(the model executor replaced; `integrations.vllm.harness.offload`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import offload, replay

BLOCK = 16
GPU_BYTES = 7 << 20  # llama case: about 25 blocks of 16 tokens (1.4 documents)
CPU_BYTES = 64 << 20


def _core(model_dir: Path, *, jenga: bool, cpu_bytes: int = CPU_BYTES) -> Any:
    def configure(config: Any) -> None:
        config.kv_transfer_config = offload.offloading_config(cpu_bytes, BLOCK)

    executor = offload.offload_executor_class("llama", GPU_BYTES)
    return replay.engine_core(
        model_dir,
        executor,
        jenga=jenga,
        configure=configure,
        max_model_len=400,
        max_num_batched_tokens=512,
    )


def _prompts() -> list[list[int]]:
    """Three long documents, each asked twice after the other two pushed it off the GPU."""
    docs = [[100 + d] * 16 + list(range(1000 * d, 1000 * d + 250)) for d in range(3)]
    return docs + docs


@pytest.mark.parametrize("jenga", [True, False], ids=["jenga", "vllm"])
def test_offloaded_prefixes_come_back_from_the_cpu_tier(model_dir: Path, jenga: bool) -> None:
    core = _core(model_dir, jenga=jenga)
    try:
        manager = core.scheduler.kv_cache_manager
        assert (type(manager).__name__ == "JengaKVCacheManager") is jenga
        cached = offload.run_prefix_workload(core, _prompts(), max_steps=200)
        worker = core.model_executor.worker
        assert worker.num_stores > 0 and worker.num_loads > 0
        # (GPU hit, CPU load) per request. First sight: nothing; second: every whole
        # block of the prompt, loaded back from CPU memory (the GPU held 1.4 documents,
        # and two others came in between)
        assert cached[:3] == [(0, 0)] * 3
        assert cached[3:] == [(0, 266 // BLOCK * BLOCK)] * 3
        if jenga:
            manager.check_invariants(expensive=True)
            assert not manager._requests and not manager._connector.live_parked
    finally:
        core.model_executor.shutdown()
