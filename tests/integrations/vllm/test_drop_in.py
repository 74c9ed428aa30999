"""`jenga_kv_cache_manager`: vLLM's `KVCacheManager` call, our manager, clear refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.drop_in import jenga_kv_cache_manager
from integrations.vllm.harness import cases, replay
from integrations.vllm.manager import JengaKVCacheManager


def _kv_config(model_dir: Path) -> Any:
    setup = replay.SchedulerSetup(max_model_len=512, max_num_batched_tokens=512)
    config = replay.make_vllm_config(model_dir, setup)
    return replay.kv_cache_config_for(config, cases.layer_specs("llama"), 16 << 20)


def test_vllm_keyword_arguments_build_a_working_jenga_manager(model_dir: Path) -> None:
    kv_config = _kv_config(model_dir)
    manager = jenga_kv_cache_manager(
        kv_config,
        max_model_len=512,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
        log_stats=True,
        watermark=0.0,
    )
    assert isinstance(manager, JengaKVCacheManager)
    (first,) = replay.make_requests([list(range(100, 164))], [4], 16, prefix="a")
    assert manager.get_computed_blocks(first)[1] == 0
    blocks = manager.allocate_slots(first, 64)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 4
    manager.free(first)
    (second,) = replay.make_requests([[*range(100, 164), 7]], [4], 16, prefix="b")
    assert manager.get_computed_blocks(second)[1] == 64  # the freed prompt stays cached


def test_speculative_arguments_reach_the_manager(model_dir: Path) -> None:
    """EAGLE's block drop is the allocator's hit proof (one group: below the prompt's last
    token); multi-module MTP's re-prefilled tail is checked against the block as vLLM's
    coordinator checks it."""
    manager = jenga_kv_cache_manager(
        _kv_config(model_dir), 512, use_eagle=True, num_prefill_lookahead=2
    )
    assert manager.speculative.use_eagle and manager.speculative.num_reprefillable_tokens == 1
    proof = manager.allocator.config.hit_proof
    assert proof is not None and (proof.steps, proof.to_prompt_end) == (1, False)
    assert jenga_kv_cache_manager(_kv_config(model_dir), 512).allocator.config.hit_proof is None
    with pytest.raises(
        ValueError, match=r"scheduler_block_size \(=16\) >= num_speculative_tokens \(=17\)"
    ):
        jenga_kv_cache_manager(_kv_config(model_dir), 512, use_eagle=True, num_prefill_lookahead=17)


@pytest.mark.parametrize(
    ("kwargs", "block_size"), [({"dcp_world_size": 2}, 32), ({"pcp_world_size": 4}, 16)]
)
def test_context_parallel_sizes_are_served_as_vllms_manager_serves_them(
    model_dir: Path, kwargs: dict[str, Any], block_size: int
) -> None:
    """Decode context parallelism scales a full-attention block by its world size;
    prefill context parallelism leaves the manager's blocks as they are (vLLM's rules)."""
    manager = jenga_kv_cache_manager(_kv_config(model_dir), 512, **kwargs)
    assert [g.block_size for g in manager.layout.groups] == [block_size]
