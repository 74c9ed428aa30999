"""The engine loop: chunked prefill, decode, preemption by recompute, prefix hits."""

import pytest
from jenga.sim.engine import Engine, EngineConfig
from jenga.sim.hardware import get_gpu
from jenga.sim.metrics import summarize
from jenga.sim.models import get_model
from jenga.sim.protocol import SimError
from jenga.sim.workloads import Request, Trace, make_trace

from jenga.sim import baselines

LLAMA_BLOCK = 2 << 20
CHECKED = EngineConfig(check_invariants_every=1)


def run(trace, capacity, config=CHECKED, allocator="uniform", model="llama-3.1-8b"):
    spec = get_model(model)
    alloc = getattr(baselines, allocator)(spec, capacity)
    return Engine(spec, get_gpu("h100-80gb"), alloc, config).run(trace)


def req(req_id, prompt, output_len):
    return Request(req_id, tuple(prompt), tuple(range(7, 7 + output_len)))


def test_chunked_prefill_then_decode():
    result = run(Trace("t", (req("a", range(20_000), 3),)), 2000 * LLAMA_BLOCK)
    tl = result.timeline
    assert tl["batched_tokens"] == [8192, 8192, 3616, 1, 1]
    assert tl["decode_batch"] == [0, 0, 0, 1, 1]
    assert tl["num_running"] == [1, 1, 1, 1, 0]


def test_every_token_computed_once_without_preemption():
    trace = make_trace("random", num_requests=30, input_len=300, output_len=20, range_ratio=0.5)
    result = run(trace, 10_000 * LLAMA_BLOCK)
    expected = sum(r.prompt_len + r.output_len - 1 for r in trace.requests)
    assert sum(result.timeline["batched_tokens"]) == expected
    assert result.num_preemptions == 0
    assert len(result.finish_s) == 30


def test_preemption_by_recompute_finishes_everything():
    trace = make_trace("random", num_requests=12, input_len=200, output_len=60)
    result = run(trace, 40 * LLAMA_BLOCK)  # 640 tokens: three requests at most
    assert result.num_preemptions > 0
    assert len(result.finish_s) == 12
    no_preempt = sum(r.prompt_len + r.output_len - 1 for r in trace.requests)
    assert sum(result.timeline["batched_tokens"]) > no_preempt  # recompute costs tokens
    assert max(result.timeline["live_bytes"]) <= 40 * LLAMA_BLOCK


def test_prefix_hit_rate_counts_first_admissions():
    shared = tuple(range(64))
    trace = Trace(
        "t", (req("a", (*shared, *range(100, 116)), 2), req("b", (*shared, *range(200, 216)), 2))
    )
    result = run(trace, 100 * LLAMA_BLOCK, EngineConfig(max_num_seqs=1, check_invariants_every=1))
    assert (result.hit_tokens, result.prompt_tokens) == (64, 160)
    assert summarize(result).hit_rate == 0.4


def test_request_that_can_never_fit_raises_with_sizes():
    with pytest.raises(SimError, match=r"request big \(5000 tokens.*does not fit in 0\.02 GiB"):
        run(Trace("t", (req("big", range(5000), 2),)), 10 * LLAMA_BLOCK)


def test_poisson_arrivals_gate_admission():
    trace = make_trace("random", rate=0.5, num_requests=4, input_len=32, output_len=2)
    result = run(trace, 100 * LLAMA_BLOCK)
    arrivals = [r.arrival_s for r in trace.requests]
    assert all(f >= a for f, a in zip(sorted(result.finish_s), arrivals, strict=True))
    assert result.timeline["time_s"][-1] > arrivals[-1]


def test_hybrid_fits_more_gemma_requests_than_uniform():
    trace = make_trace("random", num_requests=16, input_len=7000, output_len=32)
    capacity = 8 << 30
    uni = summarize(run(trace, capacity, EngineConfig(), "uniform", "gemma-2-9b"))
    hyb = summarize(run(trace, capacity, EngineConfig(), "vllm_hybrid", "gemma-2-9b"))
    assert hyb.avg_decode_batch > uni.avg_decode_batch
    assert hyb.waste < 0.01 < 0.2 < uni.waste


@pytest.mark.parametrize("allocator", ["uniform", "vllm_hybrid"])
def test_runs_are_deterministic(allocator):
    trace = make_trace(
        "articles-questions",
        num_articles=4,
        questions_per_article=3,
        article_len=3000,
        question_len=32,
        output_len=8,
    )
    first = run(trace, 2 << 30, EngineConfig(), allocator, "gemma-2-9b")
    second = run(trace, 2 << 30, EngineConfig(), allocator, "gemma-2-9b")
    first.timeline.pop("alloc_cpu_s")
    second.timeline.pop("alloc_cpu_s")
    assert first.timeline == second.timeline
    assert first.hit_tokens == second.hit_tokens > 0
