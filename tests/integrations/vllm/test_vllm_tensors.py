"""Jenga's block ids on vLLM's *own* KV tensors: real bytes written and read back.

vLLM overlays every KV-cache group on one buffer, so a block id names the same bytes in
every group. Each step writes a value derived from (group, block tokens) into every
block a running request has fully computed, and checks that blocks written earlier
(including blocks other requests hit in the prefix cache) still hold their value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import cases, replay
from integrations.vllm.harness.side_by_side import Workload


class ContentChecker:
    """Writes and verifies per-block contents through vLLM's per-layer views."""

    def __init__(self, kv_caches: dict[str, Any], layer_names: list[list[str]], bs: int) -> None:
        self.kv_caches = kv_caches
        self.layer_names = layer_names
        self.block_size = bs
        self.written: dict[tuple[int, int], float] = {}
        self.verified = 0
        self.moved = 0  # writes to an id another group held before

    def _value(self, group: int, tokens: list[int]) -> float:
        return float(hash((group, tuple(tokens))) % 1000 + 1)  # exact in fp16

    def __call__(self, scheduler: Any, _out: Any) -> None:
        manager = scheduler.kv_cache_manager
        live: dict[int, set[int]] = {}  # block id -> groups holding it live
        todo: list[tuple[int, int, float]] = []
        for req in scheduler.running:
            rows = manager.get_blocks(req.request_id).blocks
            for g, row in enumerate(rows):
                for i, blk in enumerate(row):
                    if blk.is_null:
                        continue
                    live.setdefault(blk.block_id, set()).add(g)
                    end = (i + 1) * self.block_size
                    if end > req.num_computed_tokens:
                        continue
                    want = self._value(g, req.all_token_ids[:end])
                    if self.written.get((g, blk.block_id)) == want:
                        self._verify(g, blk.block_id, want)
                    else:
                        todo.append((g, blk.block_id, want))
        for g, block_id, want in todo:
            for other in range(len(self.layer_names)):
                if other != g and self.written.pop((other, block_id), None) is not None:
                    # the bytes are overlaid: fine only if the other group let the id go
                    assert other not in live[block_id], (
                        f"block {block_id} is live in groups {sorted(live[block_id])}: "
                        f"writing group {g} would destroy group {other}'s contents"
                    )
                    self.moved += 1
            for name in self.layer_names[g]:
                self.kv_caches[name][block_id].fill_(want)
            self.written[(g, block_id)] = want

    def _verify(self, g: int, block_id: int, want: float) -> None:
        for name in self.layer_names[g]:
            got = self.kv_caches[name][block_id]
            assert bool((got == want).all()), (
                f"group {g} block {block_id} ({name}) lost its contents: expected {want}, "
                f"found {got.flatten()[:4].tolist()}"
            )
        self.verified += 1


def _run(
    model_dir: Path, case: str, pages: str, memory_mb: int, geometry: str = "per_group"
) -> ContentChecker:
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    setup = replay.SchedulerSetup(
        max_model_len=1024,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        jenga_options={"pages": pages, "geometry": geometry},
    )
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs(case), memory_mb << 20)
    scheduler = replay.make_scheduler(config, kv_config, jenga=True)
    views = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBNHC)
    names = [list(g.layer_names) for g in kv_config.kv_cache_groups]
    checker = ContentChecker(views, names, setup.block_size)
    prompts = Workload(requests=16, output_tokens=16).prompts()
    for wave, part in (("a", prompts[:8]), ("b", prompts[8:])):
        requests = replay.make_requests(part, [16] * len(part), setup.block_size, prefix=wave)
        replay.replay(scheduler, requests, after_step=checker)
    return checker


@pytest.mark.parametrize("case", ["gemma2", "ministral"])
def test_blocks_keep_their_bytes_in_vllms_shared_buffer(model_dir: Path, case: str) -> None:
    checker = _run(model_dir, case, "vllm", 34)
    assert checker.verified > 10_000  # prefix hits and older blocks were read back
    assert checker.moved > 0  # ids went from one group to another under pressure


def test_per_group_page_ids_would_alias_in_vllms_buffer(model_dir: Path) -> None:
    """Why `pages="vllm"` exists: the VMM geometries' ids are per group, and two groups'
    block 0 are the same bytes of vLLM's overlaid buffer (per_group ids are also spread
    past vLLM's block count)."""
    with pytest.raises(AssertionError, match=r"would destroy group"):
        _run(model_dir, "gemma2", "vmm", 34, geometry="per_layer")
    with pytest.raises((AssertionError, IndexError), match=r"would destroy group|out of bounds"):
        _run(model_dir, "gemma2", "vmm", 34)
