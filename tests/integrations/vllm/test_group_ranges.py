"""The per_group VMM geometry (host backend): one range per KV-cache group, vLLM's own
views over it, real bytes written and read back while pages are mapped, evicted,
remapped and unmapped under vLLM's real scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import cases, replay
from integrations.vllm.harness.side_by_side import Workload
from integrations.vllm.kv_tensors import UnsupportedLayout, VmmKVCache
from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions
from jenga.plan import UnmapPage

import vmm

CHUNK = 2 << 20
MAX_LEN = 1024


def _layout(model_dir: Path, case: str, memory_mb: int, **options: Any) -> tuple[Any, Any]:
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=MAX_LEN))
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs(case), memory_mb << 20)
    opts = JengaVllmOptions(kv_tensors="vmm", **{"geometry": "per_group", **options})
    return kv_config, build_layout(kv_config, MAX_LEN, opts)


def _cache(kv_config: Any, layout: Any, layout_name: str = "LBNHC") -> tuple[Any, Any, Any]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    backend = vmm.HostBackend(CHUNK, capacity=(layout.memory_bytes // CHUNK + 8) * CHUNK)
    pool = vmm.ChunkPool(backend, budget_bytes=layout.total_units * CHUNK)
    return VmmKVCache(kv_config, layout, pool, KVCacheLayout[layout_name]), pool, backend


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
def test_views_are_vllms_over_one_range_per_group(model_dir: Path, kv_layout: str) -> None:
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv_config, layout = _layout(model_dir, "ministral", 48)
    cache, pool, _ = _cache(kv_config, layout, kv_layout)
    theirs = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[kv_layout])
    assert len(cache.ranges) == len(layout.groups)
    for g in layout.groups:
        place = g.placement
        assert place is not None and place.stride == g.page_bytes  # dense attention page
        (rng,) = cache.group_ranges[g.index]
        for index, name in enumerate(g.layer_names):
            ours, ref = cache.kv_caches[name], theirs[name]
            assert ours.shape[1:] == ref.shape[1:] and ours.dtype == ref.dtype
            assert ours.shape[0] == g.capacity + 1
            assert ours.stride()[1:] == ref.stride()[1:]  # vLLM's in-block layout
            assert ours.stride(0) * ours.element_size() == place.stride
            for block in (0, place.blocks_per_page - 1, place.blocks_per_page, 5 * 7 + 3):
                v = g.vllm_id(block)
                want = rng.va + index * place.layer_stride + v * place.stride
                assert ours[v].data_ptr() == want
    cache.close()
    pool.close()


def test_unmapped_blocks_cost_no_physical_memory_and_one_page_is_k_chunks(
    model_dir: Path,
) -> None:
    kv_config, layout = _layout(model_dir, "gemma2", 48)
    cache, pool, backend = _cache(kv_config, layout)
    g = layout.groups[0]
    assert backend.physical_bytes() == 0
    last = g.vllm_id(g.pages.blocks_per_large_page * (cache.geometries[0].max_pages - 1))
    assert cache.ensure_mapped([[last], []]) == 1
    # per_group: one page is k chunks, whatever the layer count (per_layer: k per layer)
    assert backend.physical_bytes() == g.pages.chunks_per_range * CHUNK
    assert cache.ensure_mapped([[g.capacity, last + 1], []]) == 0  # null id, same page
    per_layer = build_layout(
        kv_config, MAX_LEN, JengaVllmOptions(kv_tensors="vmm", geometry="per_layer")
    )
    assert per_layer.groups[0].pages.units_per_large_page == 4 * g.pages.units_per_large_page
    cache.close()
    pool.close()


def test_per_layer_tail_and_head_outer_layouts_are_refused(model_dir: Path) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kv_config, layout = _layout(model_dir, "jamba", 256, geometry="per_layer")
    pool = vmm.ChunkPool(vmm.HostBackend(CHUNK, capacity=8 << 20), budget_bytes=8 << 20)
    with pytest.raises(UnsupportedLayout, match=r"tail.*geometry='per_group'"):
        VmmKVCache(kv_config, layout, pool, KVCacheLayout.LBNHC)
    _, grouped = _layout(model_dir, "jamba", 256)
    with pytest.raises(UnsupportedLayout, match=r"LHBNC keeps heads outside blocks"):
        VmmKVCache(kv_config, grouped, pool, KVCacheLayout.LHBNC)
    pool.close()


class BytesChecker:
    """``after_step``: apply the step's plans to the VMM cache, forget the contents of
    unmapped pages, then write a value derived from (group, tokens) into every block a
    running request has fully computed, through vLLM's per-layer views, and verify blocks
    written before (older blocks, prefix hits of other requests)."""

    def __init__(self, cache: VmmKVCache, layout: Any, block_size: int) -> None:
        self.cache, self.layout, self.block_size = cache, layout, block_size
        self.written: dict[tuple[int, int], int] = {}
        self.verified = self.unmapped_pages = self.peak = 0

    def __call__(self, scheduler: Any, out: Any) -> None:
        for plan in out.jenga_vmm_plans:
            for op in plan.ops:
                if isinstance(op, UnmapPage):
                    self._forget(op.group, op.page)
        self.cache.apply_scheduler_output(out)
        self.cache.check_invariants()
        self.peak = max(self.peak, self.cache.mapped_bytes())
        manager = scheduler.kv_cache_manager
        for req in scheduler.running:
            for g, row in enumerate(manager.get_blocks(req.request_id).blocks):
                for i, blk in enumerate(row):
                    end = (i + 1) * self.block_size
                    if blk.is_null or end > req.num_computed_tokens:
                        continue
                    self._check(g, blk.block_id, req.all_token_ids[:end])

    def _forget(self, group: int, page: int) -> None:
        self.unmapped_pages += 1
        place = self.layout.groups[group].placement
        first = page * place.ids_per_page
        for v in range(first, first + place.blocks_per_page):
            self.written.pop((group, v), None)

    def _check(self, g: int, v: int, tokens: list[int]) -> None:
        """Layer l of the block holds ``(base + 7*l) % 120 + 1``: exact in fp16 and int8
        (Mamba views are raw bytes), and distinct per layer, so layers that aliased one
        another's bytes would fail."""
        base = hash((g, tuple(tokens))) % 1000
        names = self.layout.groups[g].layer_names
        values = [float((base + 7 * layer) % 120 + 1) for layer in range(len(names))]
        if self.written.get((g, v)) == base:
            for name, want in zip(names, values, strict=True):
                got = self.cache.kv_caches[name][v]
                assert bool((got == want).all()), (
                    f"group {g} block {v} ({name}) lost its bytes: expected {want}, "
                    f"found {got.flatten()[:4].tolist()}"
                )
            self.verified += 1
            return
        for name, want in zip(names, values, strict=True):
            self.cache.kv_caches[name][v].fill_(want)
        self.written[(g, v)] = base


@pytest.mark.parametrize(("case", "memory_mb"), [("gemma2", 34), ("jamba", 160)])
def test_bytes_survive_other_blocks_remaps_and_evictions(
    model_dir: Path, case: str, memory_mb: int
) -> None:
    setup = replay.SchedulerSetup(
        max_model_len=MAX_LEN,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        jenga_options={"kv_tensors": "vmm", "geometry": "per_group"},
    )
    config = replay.make_vllm_config(model_dir, setup)
    specs = cases.layer_specs(case)
    kv_config = replay.kv_cache_config_for(config, specs, memory_mb << 20)
    scheduler = replay.make_scheduler(config, kv_config, jenga=True)
    manager: JengaKVCacheManager = scheduler.kv_cache_manager
    assert manager.layout.options.geometry == "per_group"
    checker = _replay_two_waves(scheduler, kv_config, setup.block_size, requests=16)
    assert checker.peak <= manager.layout.memory_bytes


def _replay_two_waves(scheduler: Any, kv_config: Any, block_size: int, requests: int) -> Any:
    """Two waves of prompts (the second sharing the first's system prompt), every step's
    live blocks written and read back through vLLM's views over the manager's VMM ranges."""
    layout = scheduler.kv_cache_manager.layout
    cache, pool, backend = _cache(kv_config, layout)
    checker = BytesChecker(cache, layout, block_size)
    prompts = Workload(requests=requests, output_tokens=16).prompts()
    half = requests // 2
    for wave, part in (("a", prompts[:half]), ("b", prompts[half:])):
        batch = replay.make_requests(part, [16] * len(part), block_size, prefix=wave)
        report = replay.replay(scheduler, batch, after_step=checker)
    assert report.prefix_hit_tokens > 0
    assert checker.verified > 1000  # older blocks and other requests' prefix hits read back
    assert checker.unmapped_pages > 0  # pages were evicted / freed and their chunks reused
    assert backend.physical_bytes() <= layout.memory_bytes
    cache.close()
    pool.close()
    return checker


def _twenty_one_layer_groups() -> dict[str, Any]:
    """42 layers, sliding / full alternating (Gemma 2 9B's grouping: 21 layers a group)
    with 16 KiB per layer block, so a group's block (336 KiB) divides no chunk count
    below 21: the exact page is 21 chunks holding 128 blocks, one chunk per layer, like
    Gemma 2 9B's at 40 GiB (16 blocks of 128 KiB per layer)."""
    import torch
    from integrations.vllm.compat import FullAttentionSpec, SlidingWindowSpec

    attn = {"block_size": 16, "num_kv_heads": 4, "head_size": 32, "dtype": torch.float16}
    full, sliding = FullAttentionSpec(**attn), SlidingWindowSpec(**attn, sliding_window=64)
    return {f"model.layers.{i}.self_attn.attn": full if i % 2 else sliding for i in range(42)}


def test_bytes_survive_on_exact_one_chunk_per_layer_pages(model_dir: Path) -> None:
    """The large-pool geometry (least waste: Gemma 2 9B takes 21-chunk pages holding 16
    blocks at 40 GiB) with real bytes: each layer's run of a page is exactly one chunk, so
    every block of a page touches all 21 chunks; values written through vLLM's views stay
    put while pages are evicted and remapped between the two groups."""
    setup = replay.SchedulerSetup(
        max_model_len=MAX_LEN,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        # compact order: whole pages evicted and remapped between the groups (the default
        # pinned order reuses blocks in place here; the test above covers it)
        jenga_options={
            "kv_tensors": "vmm",
            "geometry": "per_group",
            "epsilon": 0.0,
            "order": "compact",
        },
    )
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, _twenty_one_layer_groups(), 126 << 20)
    scheduler = replay.make_scheduler(config, kv_config, jenga=True)
    manager: JengaKVCacheManager = scheduler.kv_cache_manager
    places = [g.placement for g in manager.layout.groups]
    assert [(p.num_layers, p.chunks_per_page, p.tail_bytes) for p in places] == [(21, 21, 0)] * 2
    assert all(p.layer_stride == CHUNK for p in places)
    _replay_two_waves(scheduler, kv_config, setup.block_size, requests=32)
