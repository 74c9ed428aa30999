"""vLLM's MLA, sliding-window MLA and static-sink specs on the jenga manager: each is its
own jenga kind on every tensor geometry, served beside vLLM's own manager; the specs no
kind serves are refused at start-up by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import torch
from integrations.vllm.errors import UnsupportedLayerKind
from integrations.vllm.harness import cases, replay
from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions, TensorGeometry
from jenga.specs import Kind

from integrations.vllm import compat

MAX_LEN = 1024
BLOCK = 16
PROMPT = 160
GEOMETRY_OPTIONS = {
    TensorGeometry.SHARED_SLOTS: {},
    TensorGeometry.PER_LAYER: {"kv_tensors": "vmm", "geometry": "per_layer"},
    TensorGeometry.PER_GROUP: {"kv_tensors": "vmm", "geometry": "per_group"},
    TensorGeometry.VMM_SLOTS: {"kv_tensors": "vmm", "geometry": "slots"},
}
KINDS = {
    "deepseek": {Kind.MLA},
    "deepseek-swa": {Kind.MLA, Kind.SLIDING_WINDOW_MLA},
    "deepseek-replay": {Kind.MLA, Kind.REPLAY_SLIDING_WINDOW_MLA},
    "sink": {Kind.SINK_FULL},
}


def _config(model_dir: Path, case: str, memory_mb: int, options: dict[str, Any]) -> Any:
    setup = replay.SchedulerSetup(
        max_model_len=MAX_LEN, max_num_batched_tokens=512, jenga_options=options
    )
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs(case), memory_mb << 20)
    return config, kv_config


@pytest.mark.parametrize("geometry", list(GEOMETRY_OPTIONS))
@pytest.mark.parametrize("case", cases.LATENT_CASES)
def test_each_spec_is_its_kind_with_vllms_unpadded_page(
    model_dir: Path, case: str, geometry: TensorGeometry
) -> None:
    options = GEOMETRY_OPTIONS[geometry]
    _, kv_config = _config(model_dir, case, 64, options)
    layout = build_layout(kv_config, MAX_LEN, JengaVllmOptions(**options))  # type: ignore[arg-type]
    assert layout.options.tensor_geometry is geometry
    assert {g.kind for g in layout.groups} == KINDS[case]
    for g, vgroup in zip(layout.groups, kv_config.kv_cache_groups, strict=True):
        spec = vgroup.kv_cache_spec
        assert g.page_bytes == spec.real_page_size_bytes
        if g.kind in (Kind.MLA, Kind.SLIDING_WINDOW_MLA, Kind.REPLAY_SLIDING_WINDOW_MLA):
            assert g.page_bytes == BLOCK * 576 * 2


def _two_waves(model_dir: Path, case: str, *, jenga: bool, options: dict[str, Any]) -> list[Any]:
    config, kv_config = _config(model_dir, case, 48, options)
    scheduler = replay.make_scheduler(config, kv_config, jenga=jenga)
    first = [[100 + i] * 8 + list(range(1000 + 7 * i, 1000 + 7 * i + PROMPT - 8)) for i in range(6)]
    after = None
    if jenga:
        assert isinstance(scheduler.kv_cache_manager, JengaKVCacheManager)

        def after(s: Any, _out: Any) -> None:
            s.kv_cache_manager.check_invariants(expensive=True)

    reports = []
    for prefix, prompts in (("a", first), ("b", [p + [7] * 40 for p in first])):
        requests = replay.make_requests(prompts, [24] * 6, BLOCK, prefix=prefix)
        reports.append(replay.replay(scheduler, requests, after_step=after))
    return reports


@pytest.mark.parametrize(
    "geometry", [TensorGeometry.SHARED_SLOTS, TensorGeometry.PER_GROUP, TensorGeometry.VMM_SLOTS]
)
@pytest.mark.parametrize("case", ["deepseek", "deepseek-swa", "deepseek-replay"])
def test_two_waves_hit_whole_prompts_as_vllms_manager_does(
    model_dir: Path, case: str, geometry: TensorGeometry
) -> None:
    options = GEOMETRY_OPTIONS[geometry]
    ours = _two_waves(model_dir, case, jenga=True, options=options)
    theirs = _two_waves(model_dir, case, jenga=False, options=options)
    for mine, vllm in zip(ours, theirs, strict=True):
        assert mine.output_tokens == vllm.output_tokens
        assert all(n == 24 for n in mine.output_tokens.values())
    assert ours[0].prefix_hit_tokens == theirs[0].prefix_hit_tokens == 0
    # vLLM's manager keeps sliding-window blocks sparsely (retention interval 0) and may
    # serve less of a shared prefix; jenga caches the window densely
    assert ours[1].prefix_hit_tokens == 6 * PROMPT >= theirs[1].prefix_hit_tokens
    if case != "deepseek-swa":
        assert theirs[1].prefix_hit_tokens == 6 * PROMPT


@pytest.mark.parametrize("geometry", list(GEOMETRY_OPTIONS))
def test_sink_full_attention_serves_prefix_hits_on_the_manager(
    model_dir: Path, geometry: TensorGeometry
) -> None:
    """vLLM 0.32/0.33's own Scheduler cannot be built on a sink spec (its
    ``SinkFullAttentionManager`` does not take the ``needs_kv_cache_zeroing`` its pool
    passes), so the manager is driven directly, as vLLM's scheduler drives it."""
    options = GEOMETRY_OPTIONS[geometry]
    config, kv_config = _config(model_dir, "sink", 48, options)
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        replay.make_scheduler(config, kv_config, jenga=False)
    layout = build_layout(kv_config, MAX_LEN, JengaVllmOptions(**options))  # type: ignore[arg-type]
    manager = JengaKVCacheManager(layout)
    prompt = list(range(PROMPT))
    first, second, other = replay.make_requests(
        [prompt, [*prompt, 7, 7, 7], [5] * PROMPT], [1, 1, 1], BLOCK
    )
    assert manager.allocate_slots(first, PROMPT) is not None
    manager.cache_blocks(first, PROMPT)
    manager.free(first)
    assert manager.get_computed_blocks(second)[1] == PROMPT
    assert manager.get_computed_blocks(other)[1] == 0
    manager.check_invariants(expensive=True)


def _group(spec: Any) -> Any:
    return compat.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[compat.KVCacheGroupSpec(["model.layers.0.attn"], spec)],
    )


def test_specs_no_kind_serves_are_refused_at_start_up_by_name() -> None:
    from vllm.v1 import kv_cache_interface as kvi

    attn = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
    refused = {
        kvi.SinkFullAttentionSpec(**attn, sink_len=4): (
            r"\(SinkFullAttentionSpec\): sink_len 4 must be > 0 and a multiple of block_size 16"
        ),
        kvi.MLAAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=1,
            head_size=576,
            dtype=torch.bfloat16,
            tokens_per_state=3,
        ): r"\(MLAAttentionSpec\): packed or compressed attention pages \(tokens_per_state=3\) "
        r"are not supported: only MLAAttentionSpec compresses, by an integer dividing "
        r"block_size 16",
        kvi.SlidingWindowMLASpec(
            block_size=BLOCK,
            num_kv_heads=1,
            head_size=576,
            dtype=torch.bfloat16,
            sliding_window=128,
            tokens_per_state=2,
        ): r"\(SlidingWindowMLASpec\): packed or compressed attention pages \(tokens_per_state=2\)",
    }
    for spec, message in refused.items():
        with pytest.raises(UnsupportedLayerKind, match=r"KV-cache group 0 " + message):
            build_layout(_group(spec), MAX_LEN)


@pytest.mark.parametrize("jenga", [True, False], ids=["jenga", "vllm"])
def test_a_replayed_window_takes_fresh_blocks_beside_the_shared_hit(
    model_dir: Path, jenga: bool
) -> None:
    """Bounded replay on vLLM's scheduler: a 96-token hit of a 100-token prompt is shared
    in the MLA group, the scheduler recomputes its last window (64 tokens), and the
    replayed group holds NULL below that window and fresh blocks from it on, on both
    managers alike."""
    config, kv_config = _config(model_dir, "deepseek-replay", 48, {})
    scheduler = replay.make_scheduler(config, kv_config, jenga=jenga)
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_config.kv_cache_groups]
    full, swa = kinds.index("MLAAttentionSpec"), kinds.index("SlidingWindowMLASpec")
    window = kv_config.kv_cache_groups[swa].kv_cache_spec.sliding_window
    first, second = replay.make_requests([list(range(100))] * 2, [4, 4], BLOCK)
    scheduler.add_request(first)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens[first.request_id] == 100
    scheduler.update_from_output(out, replay.fake_model_output(out, {"r0": first}, 1))
    scheduler.add_request(second)
    out = scheduler.schedule()
    new = next(r for r in out.scheduled_new_reqs if r.req_id == second.request_id)
    assert new.num_computed_tokens == new.replay_start == 96 - window
    assert out.num_scheduled_tokens[second.request_id] == 100 - (96 - window)
    manager = scheduler.kv_cache_manager
    mine = manager.get_blocks(second.request_id).blocks
    theirs = manager.get_blocks(first.request_id).blocks
    assert [b.block_id for b in mine[full][:6]] == [b.block_id for b in theirs[full][:6]]
    assert len(mine[full]) == 7 and not any(b.is_null for b in mine[full])
    skipped = (96 - window + 1) // BLOCK
    assert all(b.is_null for b in mine[swa][:skipped])
    fresh = {b.block_id for b in mine[swa][skipped:]}
    assert len(mine[swa]) == 7 and len(fresh) == 7 - skipped
    assert not any(b.is_null for b in mine[swa][skipped:])
    assert not fresh & {b.block_id for b in theirs[swa]}


def test_a_circular_buffer_holds_one_ring_block_per_request_as_vllms_manager() -> None:
    """DeepSeek-V4's compressor ring beside a full-attention group: the ring is
    `Kind.CIRCULAR_BUFFER`, one block per request claimed with its first allocation and
    kept to its end, never hit; a prefix hit of the full group claims a fresh ring. Both
    managers give the same table shapes and hit."""
    from vllm.v1 import kv_cache_interface as kvi

    from tests.integrations.vllm.test_conformance_fixes import _config, _full, _managers, _request

    ring_spec = kvi.CircularBufferSpec(
        block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0, dtype=torch.float32
    )
    config = _config(_full(), ring_spec)
    theirs, ours = _managers(config, hash_block_size=BLOCK)
    assert [g.kind for g in ours.layout.groups] == [Kind.FULL, Kind.CIRCULAR_BUFFER]
    assert ours.layout.groups[1].page_bytes == ring_spec.real_page_size_bytes == 8 * 1024 * 4
    prompt = list(range(100))
    shapes = []
    for manager in (theirs, ours):
        first = _request("a", prompt)
        assert manager.allocate_slots(first, 40) is not None
        first.num_computed_tokens = 40
        assert manager.allocate_slots(first, 60) is not None
        first.num_computed_tokens = 100
        manager.cache_blocks(first, 100)
        ring = manager.get_block_ids("a")[1]
        manager.free(first)
        second = _request("b", prompt)
        blocks, hit = manager.get_computed_blocks(second)[:2]
        assert manager.allocate_slots(second, 100 - hit, hit, blocks) is not None
        rows = manager.get_blocks("b").blocks
        shapes.append((len(ring), hit, [len(r) for r in rows], rows[1][0].is_null))
    assert shapes[0] == shapes[1] == (1, 96, [7, 1], False)
    ours.check_invariants(expensive=True)


@pytest.mark.parametrize("geometry", list(GEOMETRY_OPTIONS))
def test_compressed_mla_is_its_kind_with_vllms_unpadded_page(geometry: TensorGeometry) -> None:
    """DeepSeek-V4's compressed MLA (one 584-byte state per 2 tokens, pages padded to 576
    bytes by vLLM): `Kind.COMPRESSED_MLA` with vLLM's unpadded page, served beside vLLM's
    manager with the same hit."""
    from vllm.v1 import kv_cache_interface as kvi

    from tests.integrations.vllm.test_conformance_fixes import _config, _managers, _request

    spec = kvi.MLAAttentionSpec(
        block_size=128,
        num_kv_heads=1,
        head_size=584,
        dtype=torch.uint8,
        tokens_per_state=2,
        alignment=576,
    )
    config = _config(spec, num_blocks=256)
    options = GEOMETRY_OPTIONS[geometry]
    layout = build_layout(config, MAX_LEN, JengaVllmOptions(**options))  # type: ignore[arg-type]
    assert [g.kind for g in layout.groups] == [Kind.COMPRESSED_MLA]
    assert layout.groups[0].page_bytes == spec.real_page_size_bytes == 64 * 584
    theirs, ours = _managers(config, hash_block_size=128)
    hits = []
    for manager in (theirs, ours):
        first = _request("a", list(range(300)))
        assert manager.allocate_slots(first, 300) is not None
        first.num_computed_tokens = 300
        manager.cache_blocks(first, 300)
        manager.free(first)
        second = _request("b", list(range(300)))
        hits.append(manager.get_computed_blocks(second)[1])
    assert hits == [256, 256]
