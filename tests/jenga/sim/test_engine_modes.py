"""Engine options: whole-prompt admission with vLLM 0.6's watermark, separate prefill steps,
no prefix cache, block size, closed-loop turns, device memory and attention FLOPs."""

import pytest
from jenga.sim.engine import Engine, EngineConfig
from jenga.sim.hardware import GiB, MiB, get_gpu
from jenga.sim.metrics import summarize
from jenga.sim.models import ComputeShape, get_model, with_block_size
from jenga.sim.protocol import SimError
from jenga.sim.scenarios import get_scenario, make_allocator
from jenga.sim.workloads import Request, Trace, make_trace

from jenga.sim import baselines

LLAMA_BLOCK = 2 << 20  # 16 tokens x 32 layers x 4 KiB


def req(req_id, n, out, t=0.0, base=0):
    return Request(req_id, tuple(range(base, base + n)), tuple(range(7, 7 + out)), t)


def run(trace, capacity, allocator="uniform", model="llama-3.1-8b", **config):
    spec = get_model(model)
    alloc = make_allocator(allocator, spec, capacity, config.pop("prefix_cache", True))
    engine_config = EngineConfig(check_invariants_every=1, **config)
    return Engine(spec, get_gpu("h100-80gb"), alloc, engine_config).run(trace)


@pytest.mark.parametrize(
    ("prefill", "tokens", "batch"),
    [
        ("chunked", [100, 1, 1, 201, 2], [0, 1, 1, 1, 2]),  # b's prefill rides with a's decode
        ("separate", [100, 1, 1, 200, 2, 1], [0, 1, 1, 0, 2, 1]),  # a prefill-only step
    ],
)
def test_separate_prefill_steps_hold_back_decodes(prefill, tokens, batch):
    trace = Trace("t", (req("a", 100, 5), req("b", 200, 2, t=0.025, base=10**6)))
    result = run(trace, 2000 * LLAMA_BLOCK, max_num_batched_tokens=4096, prefill=prefill)
    assert result.timeline["batched_tokens"] == tokens
    assert result.timeline["decode_batch"] == batch


def test_whole_prompt_admission_keeps_the_one_percent_watermark():
    """200 blocks: a takes 150, b's whole prompt 49 more, leaving 1 block (0.5 %) free:
    vLLM 0.6 refuses b until a finishes; chunked admission takes it at once."""
    trace = Trace("t", (req("a", 150 * 16 - 8, 3), req("b", 49 * 16 - 8, 3, base=10**6)))
    chunked = run(trace, 200 * LLAMA_BLOCK, max_num_batched_tokens=8192)
    whole = run(trace, 200 * LLAMA_BLOCK, max_num_batched_tokens=8192, admission="whole-prompt")
    assert chunked.timeline["num_running"] == [2, 2, 0]
    assert chunked.timeline["batched_tokens"] == [2392 + 776, 2, 2]
    assert whole.timeline["num_running"] == [1, 1, 0, 1, 1, 0]  # b waits for a
    assert whole.timeline["batched_tokens"] == [2392, 1, 1, 776, 1, 1]


def test_whole_prompt_that_never_clears_the_watermark_is_reported():
    trace = Trace("t", (req("a", 199 * 16 - 10, 2),))  # 199 of 200 blocks
    assert len(run(trace, 200 * LLAMA_BLOCK).finish_s) == 1
    with pytest.raises(SimError, match="does not fit"):
        run(trace, 200 * LLAMA_BLOCK, admission="whole-prompt")


def test_separate_prefill_needs_a_budget_that_holds_a_prompt():
    with pytest.raises(SimError, match="must hold a whole prompt"):
        trace = Trace("t", (req("a", 5000, 2),))
        run(trace, 2000 * LLAMA_BLOCK, max_num_batched_tokens=4096, prefill="separate")


@pytest.mark.parametrize(
    ("allocator", "model"),
    [("uniform", "gemma-2-9b"), ("vllm_v1", "gemma-2-9b"), ("jenga_vmm", "gemma-2-9b")],
)
def test_no_prefix_cache_hits_nothing(allocator, model):
    shared = tuple(range(3000))
    trace = Trace(
        "t", tuple(Request(f"r{i}", shared + (10**6 + i,) * 20, (1, 2)) for i in range(3))
    )
    on = run(trace, 8 << 30, allocator, model, max_num_seqs=1)
    off = run(trace, 8 << 30, allocator, model, max_num_seqs=1, prefix_cache=False)
    assert on.hit_tokens == 2 * 2992  # two followers hit the shared 3,000, block-aligned
    assert off.hit_tokens == 0
    assert sum(off.timeline["batched_tokens"]) == 3 * (3020 + 1)


def test_block_size_option_rewrites_attention_groups_only():
    model = with_block_size(get_model("hymba-1.5b-like"), 32)
    assert {g.name: g.spec.block_size for g in model.groups} == {
        "full": 32,
        "sliding_window": 32,
        "mamba": 16,
    }
    llama = with_block_size(get_model("llama-3.1-8b"), 32)
    alloc = baselines.uniform(llama, 100 * LLAMA_BLOCK)
    engine = Engine(llama, get_gpu("h100-80gb"), alloc, EngineConfig())
    result = engine.run(Trace("t", (req("a", 100, 2),)))
    assert result.timeline["live_bytes"][0] == 4 * 32 * 32 * 4096  # ceil(100 / 32) blocks


def test_closed_loop_turn_waits_for_the_answer_plus_think_time():
    trace = make_trace(
        "multi-turn", num_clients=1, num_rounds=2, request_len=50, output_len=3, closed_loop=1
    )
    assert trace.requests[1].after == "client0-turn0"
    result = run(trace, 2000 * LLAMA_BLOCK)
    first_done, second_done = result.finish_s
    # turn 1 is admitted one think time (1 s) after turn 0 finished: a jump in time
    assert result.timeline["time_s"][3] - first_done > 1.0
    assert second_done > first_done + 1.0


def test_device_memory_and_kv_budget():
    h100 = get_gpu("h100-80gb")
    assert h100.memory_bytes == 81_559 * MiB
    weights = get_model("ministral-8b").weight_bytes
    expected = int(81_559 * MiB * 0.9) - weights - 12 * GiB
    assert h100.kv_budget_bytes(weights, 0.10, 12 * GiB) == expected
    assert get_scenario("arxiv-ministral").kv_bytes(get_model("ministral-8b")) == expected


def test_attention_flops_count_attended_pairs():
    gemma = get_model("gemma-2-9b")  # 21 full + 21 sliding (window 4,096); 16 x 256 queries
    shape = ComputeShape.of(gemma)
    assert shape.q_width == 16 * 256
    n = 5000  # full: 1 + 2 + ... + n pairs; window: 1 + ... + 4096, then 4096 each
    full = n * (n + 1) // 2
    window = 4096 * 4097 // 2 + 4096 * (n - 4096)
    assert shape.attention_flops(gemma, 0, n, 0) == 4 * 4096 * 21 * (full + window)
    # a decode token at position 9,999 attends 10,000 keys (full) and 4,096 (window)
    assert shape.attention_flops(gemma, 9999, 10000, 0) == 4 * 4096 * 21 * (10000 + 4096)


def test_full_attention_share_ignores_steps_below_ten_percent():
    from jenga.sim.engine import RunResult
    from jenga.sim.metrics import self_share_range

    result = RunResult(
        "x",
        {"live_bytes": [5, 40, 100, 60]},
        {"full": [5, 10, 50, 15], "sliding_window": [0, 30, 50, 45]},
        capacity_bytes=100,
        group_kinds={"full": "full", "sliding_window": "sliding_window"},
    )
    assert self_share_range(result) == (0.25, 0.5)  # step 0 holds 5 % of the KV: skipped


def test_separate_prefill_dynamic_share_runs_from_window_to_long():
    """Ministral, one 12K then one 100K request: while the short one runs every layer
    holds all of it (9 of 36 layers full: 25 %); the long one holds 9 x 100K beside
    27 x 32K (the paper's Fig. 16c/d: 27.8 % to 54.5 %)."""
    trace = Trace("t", (req("short", 12_000, 3), req("long", 100_000, 3, base=10**6)))
    spec = get_model("ministral-8b")
    alloc = make_allocator("jenga_vmm", spec, 16 << 30)
    config = EngineConfig(131_072, max_num_seqs=1, admission="whole-prompt", prefill="separate")
    result = Engine(spec, get_gpu("h100-80gb"), alloc, config).run(trace)
    s = summarize(result)
    assert s.self_share_min == pytest.approx(0.25, abs=0.001)
    assert s.self_share_max == pytest.approx(9 * 100_003 / (9 * 100_003 + 27 * 32_768), abs=0.01)
    assert s.waste < 0.001


def test_separate_prefill_charges_a_prefix_hit_its_whole_prompt():
    """vLLM 0.6.3 without chunked prefill charges a waiting request its whole length
    against ``max_num_batched_tokens`` (``assert num_new_tokens == num_prompt_tokens``),
    prefix hit or not: b and c, two 3,064-token questions on a's cached 3,000-token
    prefix, are admitted in two steps of 4,096 tokens, not together."""
    article = tuple(range(3000))
    trace = Trace(
        "t",
        (
            Request("a", article, (7, 8)),
            Request("b", article + tuple(range(10**6, 10**6 + 64)), (7, 8)),
            Request("c", article + tuple(range(2 * 10**6, 2 * 10**6 + 64)), (7, 8)),
        ),
    )
    result = run(trace, 2000 * LLAMA_BLOCK, max_num_batched_tokens=4096, prefill="separate")
    assert result.hit_tokens == 2 * 2992  # 187 full blocks of a's prompt
    # a's prefill; b's 72 uncached tokens alone; c's alone; then the decodes
    assert result.timeline["batched_tokens"][:3] == [3000, 72, 72]
    assert result.timeline["num_running"][:3] == [1, 2, 3]
