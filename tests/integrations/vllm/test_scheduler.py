"""vLLM 0.32's real Scheduler driven with fake model outputs, on the jenga manager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import cases, replay
from integrations.vllm.manager import NULL_BLOCK, JengaKVCacheManager

BLOCK = 16
PROMPT = 160  # 10 blocks
SUFFIX = 40
MAX_TOKENS = 24


def _scheduler(model_dir: Path, case: str, memory_mb: int, **setup_args: Any) -> Any:
    setup = replay.SchedulerSetup(max_model_len=1024, max_num_batched_tokens=512, **setup_args)
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs(case), memory_mb << 20)
    return replay.make_scheduler(config, kv_config, jenga=True)


def _check_after_step(scheduler: Any, _out: Any) -> None:
    scheduler.kv_cache_manager.check_invariants(expensive=True)


def _first_wave(n: int) -> list[list[int]]:
    return [[100 + i] * 8 + list(range(1000 + 7 * i, 1000 + 7 * i + PROMPT - 8)) for i in range(n)]


@pytest.mark.parametrize("case", cases.CASES)
def test_two_waves_finish_and_second_wave_hits_whole_prompts(model_dir: Path, case: str) -> None:
    scheduler = _scheduler(model_dir, case, 256)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, JengaKVCacheManager)
    first = _first_wave(4)
    wave1 = replay.make_requests(first, [MAX_TOKENS] * 4, BLOCK, prefix="a")
    report1 = replay.replay(scheduler, wave1, after_step=_check_after_step)
    assert report1.output_tokens == {f"a{i}": MAX_TOKENS for i in range(4)}
    assert report1.prefix_hit_tokens == 0
    assert manager.allocator.usage().used_blocks == (0,) * len(manager.layout.groups)

    # Same prompts plus a new suffix: every group can serve the first 160 tokens
    # (full: all blocks; sliding: the window's blocks; Mamba: the state at 160).
    second = [p + [7] * SUFFIX for p in first]
    wave2 = replay.make_requests(second, [MAX_TOKENS] * 4, BLOCK, prefix="b")
    report2 = replay.replay(scheduler, wave2, after_step=_check_after_step)
    assert report2.output_tokens == {f"b{i}": MAX_TOKENS for i in range(4)}
    assert report2.prefix_hit_tokens == 4 * PROMPT
    assert report2.preemptions == 0
    manager.check_invariants(expensive=True)


@pytest.mark.parametrize("case", ["llama", "ministral", "jamba"])
def test_preemption_when_memory_runs_out(model_dir: Path, case: str) -> None:
    memory = {"llama": 24, "ministral": 22, "jamba": 128}[case]
    scheduler = _scheduler(model_dir, case, memory)
    prompts = [[i + 1] * 300 for i in range(12)]
    requests = replay.make_requests(prompts, [64] * 12, BLOCK)
    report = replay.replay(scheduler, requests, after_step=_check_after_step)
    assert report.preemptions > 0
    assert report.output_tokens == {f"r{i}": 64 for i in range(12)}
    assert scheduler.kv_cache_manager.stats()["requests.rejected"] > 0


def test_async_scheduler_finishes_every_request(model_dir: Path) -> None:
    scheduler = _scheduler(model_dir, "gemma2", 64, async_scheduling=True)
    assert type(scheduler).__name__ == "JengaAsyncScheduler"
    prompts = [[i + 1] * 100 for i in range(6)]
    requests = replay.make_requests(prompts, [20] * 6, BLOCK)
    report = replay.replay(scheduler, requests, after_step=_check_after_step)
    assert report.output_tokens == {f"r{i}": 20 for i in range(6)}


def test_block_tables_use_the_group_null_block_out_of_window(model_dir: Path) -> None:
    scheduler = _scheduler(model_dir, "gemma2", 64)
    manager = scheduler.kv_cache_manager
    (request,) = replay.make_requests([[5] * 200], [1], BLOCK)
    blocks = manager.allocate_slots(request, 200)
    assert blocks is not None
    request.num_computed_tokens = 200
    assert manager.allocate_slots(request, 1) is not None
    sliding, full = manager.get_blocks(request.request_id).blocks
    null_id = manager.layout.groups[0].null_block_id
    # window 64 at position 200 reads tokens 137..200: blocks 8..12 stay, 0..7 released.
    assert [b.block_id for b in sliding[:8]] == [null_id] * 8
    assert all(b.is_null for b in sliding[:8]) and not any(b.is_null for b in sliding[8:])
    assert len(sliding) == len(full) == 13 and not any(b.is_null for b in full)
    manager.free(request)
    assert manager.usage == 0.0


def test_prompt_images_hit_only_the_same_image(model_dir: Path) -> None:
    """LLaVA-style placeholders in the prompt hash by the image's identifier."""
    from integrations.vllm.harness import encdec

    manager = _scheduler(model_dir, "llama", 64).kv_cache_manager
    prompt = [[3] * 100]

    def request(clip: str, rid: str) -> Any:
        (req,) = encdec.make_encoder_requests(
            prompt, [clip], [4], BLOCK, encoder_tokens=40, offset=20, prefix=rid
        )  # placeholders at 20..59
        return req

    first = request("cat.png", "a")
    assert manager.allocate_slots(first, 100) is not None
    manager.cache_blocks(first, 100)
    manager.free(first)
    assert manager.get_computed_blocks(request("cat.png", "b"))[1] == 96
    assert manager.get_computed_blocks(request("dog.png", "c"))[1] == 16  # text before it


def test_encoder_tokens_without_a_cross_attention_group_are_refused(model_dir: Path) -> None:
    from integrations.vllm.errors import JengaVllmError

    manager = _scheduler(model_dir, "llama", 64).kv_cache_manager
    (request,) = replay.make_requests([[5] * 40], [1], BLOCK)
    with pytest.raises(JengaVllmError, match=r"r0.*: 30 encoder tokens, but .*no cross-attention"):
        manager.allocate_slots(request, 40, num_encoder_tokens=30)
    assert manager.usage == 0.0


def test_async_window_releases_wait_for_the_in_flight_step(model_dir: Path) -> None:
    """vLLM's AsyncScheduler schedules step 2 before step 1's output is processed: the
    sliding blocks that leave the window with step 1's tokens stay held by the request
    (step 1 still reads them) until its output is processed, then are released."""
    scheduler = _scheduler(model_dir, "gemma2", 64, async_scheduling=True)
    manager = scheduler.kv_cache_manager
    (request,) = replay.make_requests([[5] * 200], [8], BLOCK)
    scheduler.add_request(request)
    by_id = {request.request_id: request}
    step1 = scheduler.schedule()  # the 200-token prompt, in flight
    assert step1.num_scheduled_tokens == {"r0": 200}
    step2 = scheduler.schedule()  # decode of position 200, before step 1's output
    assert step2.num_scheduled_tokens == {"r0": 1}
    sliding = manager.allocator.block_table("r0", 0)
    # window 64 at position 200 leaves blocks 0..7 behind, but step 1 still reads them
    assert NULL_BLOCK not in sliding
    assert [manager.allocator._core.block_info(0, b)[0] for b in sliding[:8]] == [1] * 8
    scheduler.update_from_output(step1, replay.fake_model_output(step1, by_id, 1))
    step3 = scheduler.schedule()  # step 1 processed: its 200 tokens are safe to release
    assert step3.num_scheduled_tokens == {"r0": 1}
    after = manager.allocator.block_table("r0", 0)
    assert after[:8] == [NULL_BLOCK] * 8 and after[8:] == sliding[8 : len(after)]
    assert [manager.allocator._core.block_info(0, b)[0] for b in sliding[:8]] == [2] * 8
    manager.check_invariants(expensive=True)


@pytest.mark.parametrize("case", ["llama", "jamba"])
def test_each_admission_looks_its_prefix_up_once(model_dir: Path, case: str) -> None:
    """`get_computed_blocks` hashes and matches the prompt; the admission that follows
    adopts that lookup instead of matching again (one `_match` per lookup)."""
    scheduler = _scheduler(model_dir, case, 256)
    manager = scheduler.kv_cache_manager
    calls = {"match": 0, "lookup": 0}
    allocator_match = manager.allocator._match
    lookup = manager.get_computed_blocks

    def counted_match(req: Any, *args: Any) -> Any:
        calls["match"] += 1
        return allocator_match(req, *args)

    def counted_lookup(*args: Any, **kwargs: Any) -> Any:
        calls["lookup"] += 1
        return lookup(*args, **kwargs)

    manager.allocator._match = counted_match  # type: ignore[method-assign]
    manager.get_computed_blocks = counted_lookup  # type: ignore[method-assign]
    first = _first_wave(4)
    second = [p + [7] * SUFFIX for p in first]
    for prefix, prompts in (("a", first), ("b", second)):
        wave = replay.make_requests(prompts, [MAX_TOKENS] * 4, BLOCK, prefix=prefix)
        replay.replay(scheduler, wave, after_step=_check_after_step)
    assert calls["lookup"] >= 8
    assert calls["match"] == calls["lookup"]
    assert manager.counters["prefix.hit_tokens"] == 4 * PROMPT
