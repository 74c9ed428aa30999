"""vllm_v1: vLLM 0.32's page-size unification, group padding, retention and hits, exactly."""

import pytest
from jenga.sim.engine import Engine, EngineConfig
from jenga.sim.hardware import get_gpu
from jenga.sim.models import NEMOTRON_NANO_9B_V2, get_model, mamba2_state_bytes
from jenga.sim.protocol import RequestState, SimError
from jenga.sim.scenarios import make_allocator
from jenga.sim.vllm_v1 import VllmV1Allocator, attention_block_size, v1_layout
from jenga.sim.workloads import Request, Trace, make_trace

CHECKED = EngineConfig(max_num_seqs=1, check_invariants_every=1)


def hits_of(name, model_name, trace, kv_bytes=40 << 30, config=CHECKED):
    """The hit length of every admission, in order."""
    model = get_model(model_name)
    alloc = make_allocator(name, model, kv_bytes)
    hits = []
    admit = alloc.admit

    def record(state):
        hits.append(admit(state))
        return hits[-1]

    alloc.admit = record
    Engine(model, get_gpu("h100-80gb"), alloc, config).run(trace)
    return hits


def test_nemotron_state_is_vllms_mamba2_shape():
    # conv: 3 x (128 x 80 + 2 x 8 x 128) bf16; ssm: 128 x 80 x 128 fp32
    assert mamba2_state_bytes(NEMOTRON_NANO_9B_V2) == 3 * 12288 * 2 + 128 * 80 * 128 * 4
    assert mamba2_state_bytes(NEMOTRON_NANO_9B_V2) == 5_316_608


def test_nemotron_layout_raises_the_attention_block_to_1312_tokens():
    layout = v1_layout(get_model("nemotron-nano-9b-v2"), 40 << 30)
    # 16 x ceil(5,316,608 / (16 x 4,096)) = 16 x 82
    assert attention_block_size(get_model("nemotron-nano-9b-v2")) == 1312
    assert layout.page_bytes == 1312 * 4096  # the Mamba state padded up to it (+1.1 %)
    assert layout.group_size == 4  # 4 attention layers, 27 Mamba layers
    assert [(b.name, b.block_size, b.mult) for b in layout.buckets] == [
        ("mamba", 1312, 7),
        ("full", 1312, 1),
    ]
    assert layout.padding_layers == 1  # 27 Mamba layers in 7 groups of 4
    assert layout.num_blocks == (40 << 30) // (4 * 1312 * 4096)
    assert layout.scheduler_block_size == 1312


def test_user_block_size_sets_the_kernel_alignment():
    # --block-size 64: 64 x ceil(5,316,608 / (64 x 4,096)) = 64 x 21
    assert attention_block_size(get_model("nemotron-nano-9b-v2"), 64) == 1344


@pytest.mark.parametrize(
    ("model", "group_size", "buckets"),
    [
        ("ministral-8b", 9, [("full", 16, 1), ("sliding_window", 16, 3)]),
        ("gemma-3-12b", 8, [("sliding_window", 16, 5), ("full", 16, 1)]),
        ("gemma-2-9b", 21, [("sliding_window", 16, 1), ("full", 16, 1)]),
        ("jamba-1.5-mini", 4, [("mamba", 144, 7), ("full", 144, 1)]),
    ],
)
def test_group_size_is_the_smallest_kind(model, group_size, buckets):
    layout = v1_layout(get_model(model), 40 << 30)
    assert layout.group_size == group_size
    assert [(b.name, b.block_size, b.mult) for b in layout.buckets] == buckets


def test_unsupported_kinds_say_so():
    with pytest.raises(SimError, match="not modelled"):
        VllmV1Allocator(get_model("llama-3.2-11b-vision"), 8 << 30)


def test_mamba_states_are_kept_only_at_replay_boundaries():
    """A chat: each turn quotes the last. vLLM keeps a Mamba state only where the previous
    *prompt* ended (floored to 1,312 tokens); Jenga keeps one every 512 tokens."""
    trace = make_trace(
        "multi-turn", num_clients=1, num_rounds=6, request_len=200, output_len=600, closed_loop=1
    )
    assert [r.prompt_len for r in trace.requests] == [700, 1500, 2300, 3100, 3900, 4700]
    assert hits_of("vllm_v1", "nemotron-nano-9b-v2", trace) == [0, 0, 1312, 1312, 2624, 2624]
    assert hits_of("jenga_vmm_group", "nemotron-nano-9b-v2", trace) == [
        0,
        1024,
        2048,
        2560,
        3584,
        4096,
    ]


def test_sliding_window_sibling_misses_once_then_hits_at_the_junction():
    """Four questions on one 6,000-token article (Gemma 2, window 4,096), one at a time:
    the first question's window blocks are retained only at its own prompt's end, so the
    second misses and pins the article's end as a junction; the third hits."""
    article = tuple(range(1000, 7000))
    trace = Trace(
        "siblings",
        tuple(
            Request(f"q{i}", article + tuple(range(10**6 + 100 * i, 10**6 + 100 * i + 40)), (1, 2))
            for i in range(4)
        ),
    )
    assert hits_of("vllm_v1", "gemma-2-9b", trace, 8 << 30) == [0, 0, 6000, 6000]
    assert hits_of("vllm_hybrid", "gemma-2-9b", trace, 8 << 30) == [0, 6000, 6000, 6000]
    assert hits_of("jenga_vmm", "gemma-2-9b", trace, 8 << 30) == [0, 6000, 6000, 6000]


def test_a_request_holds_one_state_block_per_mamba_group_and_padding_counts():
    model = get_model("nemotron-nano-9b-v2")
    alloc = VllmV1Allocator(model, 40 << 30)
    s = RequestState(Request("r", tuple(range(2000)), (1,)))
    assert alloc.admit(s) == 0
    assert alloc.allocate(s, 2000)
    unit = 4 * 1312 * 4096
    # full: 2 blocks of 1,312 tokens; Mamba, in each of its 7 groups: the running state
    # and a checkpoint block for the replay boundary (1,999 floored to 1,312) the chunk crosses
    assert alloc.snapshot().group_live_bytes == {"mamba": 2 * 7 * unit, "full": 2 * unit}
    s.num_computed = 2000
    alloc.trim(s)  # past the checkpoint: it is cached, the request keeps one state
    assert alloc.snapshot().group_live_bytes == {"mamba": 7 * unit, "full": 2 * unit}
    assert alloc.snapshot().cached_bytes == 7 * unit  # the state at 1,312, in 7 groups
    alloc.check_invariants()


def test_free_queue_reuses_unhashed_blocks_first_then_the_oldest_cached():
    """vLLM's one free queue: blocks without a hash go to its head, cached blocks to its
    tail in the order freed (a request's tail first), so a prefix survives longest."""
    model = get_model("llama-3.1-8b")
    alloc = VllmV1Allocator(model, 11 * 32 * 16 * 4096)  # 11 blocks, one is the null block

    def run(req_id, tokens):
        s = RequestState(Request(req_id, tuple(tokens), (1,)))
        alloc.admit(s)
        assert alloc.allocate(s, len(tokens))
        s.num_computed = len(tokens)
        return s

    alloc.release(run("a", range(64)))  # queue: 6 unused | a3 a2 a1 a0 (cached)
    alloc.release(run("b", range(500, 540)))  # b's partial block to the head, b1 b0 to the tail
    c = run("c", range(900, 980))  # 5 blocks: b's partial, 3 unused, then a3 (evicted)
    alloc.check_invariants()
    probe = RequestState(Request("probe", (*range(64), 7), (1,)))
    assert alloc.admit(probe) == 48  # a0-a2 survive
    probe_b = RequestState(Request("probe_b", (*range(500, 540), 7), (1,)))
    assert alloc.admit(probe_b) == 32  # b's two full blocks survive too
    alloc.release(c)
    alloc.release(probe)
    alloc.release(probe_b)
    alloc.check_invariants()
