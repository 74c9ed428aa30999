"""Property tests: random traces through every allocator, invariants after every step."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jenga.sim.engine import Engine, EngineConfig
from jenga.sim.hardware import get_gpu
from jenga.sim.models import get_model
from jenga.sim.protocol import RequestState, SimError
from jenga.sim.scenarios import ALLOCATORS, make_allocator
from jenga.sim.workloads import Request, Trace

from jenga.sim import baselines

MODELS = [
    "gemma-2-9b",
    "llama-3.2-11b-vision",
    "llama-3.1-8b+llama-3.2-1b",
    "llava-onevision-7b",
    "nemotron-nano-9b-v2",
]
# a baseline that does not model a layer kind says so at construction (a legal outcome)
NOT_MODELLED = ("not modelled", "do not model", "does not fit")


@st.composite
def traces(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    prefixes = [tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 600))) for _ in range(3)]
    requests = []
    for i in range(draw(st.integers(1, 8))):
        image = draw(st.sampled_from([0, 0, 300]))
        image_part = tuple(range(10**6, 10**6 + image))
        text = prefixes[rng.randrange(3)] + tuple(
            rng.randrange(1000) for _ in range(rng.randrange(1, 300))
        )
        out = tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 30)))
        requests.append(Request(f"r{i}", image_part + text, out, rng.uniform(0, 0.05), image))
    return Trace("prop", tuple(sorted(requests, key=lambda r: r.arrival_s)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=traces(),
    model_name=st.sampled_from(MODELS),
    allocator=st.sampled_from(sorted(ALLOCATORS)),
    kv_mib=st.integers(160, 1200),
    budget=st.sampled_from([64, 512, 4096]),
    modes=st.sampled_from(
        [("chunked", "chunked"), ("whole-prompt", "chunked"), ("whole-prompt", "separate")]
    ),
)
def test_every_request_finishes_and_invariants_hold(
    trace, model_name, allocator, kv_mib, budget, modes
):
    model = get_model(model_name)
    try:
        alloc = make_allocator(allocator, model, kv_mib << 20)
    except SimError as exc:
        assert any(why in str(exc) for why in NOT_MODELLED), exc
        return
    admission, prefill = modes
    config = EngineConfig(
        max_num_batched_tokens=budget if prefill == "chunked" else 4096,
        check_invariants_every=1,
        admission=admission,
        prefill=prefill,
    )
    engine = Engine(model, get_gpu("h100-80gb"), alloc, config)
    try:
        result = engine.run(trace)
    except Exception as exc:  # a request too large for this budget is a legal outcome
        assert "does not fit" in str(exc), exc
        return
    assert len(result.finish_s) == len(trace.requests)
    assert max(result.timeline["live_bytes"]) <= result.capacity_bytes
    # every request computes at least one prompt token and each generated token but the
    # last (a preempted request may later hit a prefix another request cached meanwhile)
    minimum = sum(r.output_len for r in trace.requests)
    assert sum(result.timeline["batched_tokens"]) >= minimum
    if result.num_preemptions == 0:
        exact = sum(r.prompt_len + r.output_len - 1 for r in trace.requests) - result.hit_tokens
        assert sum(result.timeline["batched_tokens"]) == exact
    snap = alloc.snapshot()
    assert snap.live_bytes == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity_blocks=st.integers(2, 12))
def test_failed_allocation_changes_nothing(seed, capacity_blocks):
    rng = random.Random(seed)
    alloc = baselines.vllm_hybrid(get_model("gemma-2-9b"), capacity_blocks * 42 * 131072)
    live: list[RequestState] = []
    for i in range(30):
        if live and rng.random() < 0.3:
            alloc.release(live.pop(rng.randrange(len(live))))
        else:
            prompt = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 120)))
            s = RequestState(Request(f"q{i}", prompt, (1,)))
            alloc.admit(s)
            before = alloc.snapshot()
            if alloc.allocate(s, len(s.tokens)):
                s.num_computed = len(s.tokens)
                live.append(s)
            else:
                assert alloc.snapshot() == before
                alloc.release(s)
        alloc.check_invariants()
