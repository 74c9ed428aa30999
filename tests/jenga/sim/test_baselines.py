"""Baseline paged allocators: exact prefix hits, eviction order, all-or-nothing, invariants."""

import pytest
from jenga.sim.models import get_model
from jenga.sim.protocol import RequestState, SimError
from jenga.sim.workloads import Request

from jenga.sim import baselines

MIB = 1 << 20
LLAMA_BLOCK = 16 * 32 * 2 * 8 * 128 * 2  # 16 tokens x 32 layers x K+V x 8 heads x 128 x bf16


def state(req_id: str, prompt: range | tuple[int, ...], output: int = 4) -> RequestState:
    return RequestState(Request(req_id, tuple(prompt), tuple(range(10**6, 10**6 + output))))


def run_prefill(alloc, s: RequestState) -> int:
    hit = alloc.admit(s)
    assert alloc.allocate(s, len(s.tokens))
    s.num_computed = len(s.tokens)
    alloc.check_invariants()
    return hit


def test_uniform_block_cost_is_two_mib_for_llama_8b():
    assert LLAMA_BLOCK == 2 * MIB
    alloc = baselines.uniform(get_model("llama-3.1-8b"), 10 * LLAMA_BLOCK)
    a = state("a", range(40))
    assert run_prefill(alloc, a) == 0
    snap = alloc.snapshot()
    assert (snap.live_bytes, snap.cached_bytes) == (3 * LLAMA_BLOCK, 0)
    alloc.release(a)
    snap = alloc.snapshot()
    assert (snap.live_bytes, snap.cached_bytes) == (0, 2 * LLAMA_BLOCK)  # partial block freed
    alloc.check_invariants()


def test_uniform_prefix_hits_are_whole_blocks():
    alloc = baselines.uniform(get_model("llama-3.1-8b"), 10 * LLAMA_BLOCK)
    a = state("a", range(40))
    run_prefill(alloc, a)
    alloc.release(a)
    assert run_prefill(alloc, state("b", (*range(40), *range(100, 110)))) == 32
    assert run_prefill(alloc, state("c", (*range(16), 7, 7, 7))) == 16
    assert run_prefill(alloc, state("d", range(32))) == 16  # one token is always computed
    assert run_prefill(alloc, state("e", range(1, 40))) == 0


def test_uniform_evicts_lru_tail_first():
    alloc = baselines.uniform(get_model("llama-3.1-8b"), 4 * LLAMA_BLOCK)
    a = state("a", range(48))
    run_prefill(alloc, a)  # 3 blocks
    alloc.release(a)
    filler = state("f", range(500, 548))
    run_prefill(alloc, filler)  # 3 blocks: 1 free + evicts a's blocks 2 and 1 (tail first)
    alloc.release(filler)
    assert run_prefill(alloc, state("a2", range(48))) == 16


def test_allocate_is_all_or_nothing():
    alloc = baselines.uniform(get_model("llama-3.1-8b"), 4 * LLAMA_BLOCK)
    a = state("a", range(48))
    run_prefill(alloc, a)
    b = state("b", range(200, 248))
    assert alloc.admit(b) == 0
    before = alloc.snapshot()
    assert not alloc.allocate(b, 48)  # needs 3 blocks, 1 free, nothing evictable
    assert alloc.snapshot() == before
    assert alloc.allocate(b, 16)
    alloc.check_invariants()


def test_unknown_and_double_operations_raise():
    alloc = baselines.uniform(get_model("llama-3.1-8b"), 4 * LLAMA_BLOCK)
    a = state("a", range(8))
    with pytest.raises(SimError, match="unknown request a"):
        alloc.allocate(a, 8)
    alloc.admit(a)
    with pytest.raises(SimError, match="admitted twice"):
        alloc.admit(a)
    alloc.release(a)
    with pytest.raises(SimError, match="release of unknown request a"):
        alloc.release(a)


def test_hybrid_releases_blocks_that_left_the_window():
    gemma = get_model("gemma-2-9b")
    alloc = baselines.vllm_hybrid(gemma, 4 << 30)
    per_layer_block = 16 * 2 * 8 * 256 * 2
    s = state("a", range(6000))
    run_prefill(alloc, s)
    assert alloc.allocate(s, 6000)  # refresh: blocks wholly before 6000 - 4096 leave
    live = alloc.snapshot().group_live_bytes
    assert live["full"] == 375 * 21 * per_layer_block
    assert live["sliding_window"] == (375 - 1904 // 16) * 21 * per_layer_block
    alloc.check_invariants()


def test_hybrid_sliding_window_hit_needs_only_the_window():
    gemma = get_model("gemma-2-9b")
    alloc = baselines.vllm_hybrid(gemma, 4 << 30)
    a = state("a", range(6000))
    run_prefill(alloc, a)
    alloc.release(a)
    # Drop the oldest cached sliding-window blocks by hand: the hit must not need them.
    window_start_block = (4800 - 4096) // 16
    lru = alloc._lru[0]
    victims = [b for b in lru if alloc._blocks[b].group == 0][:window_start_block]
    for block_id in victims:
        lru.move_to_end(block_id, last=False)
    for _ in victims:
        alloc._evict_one(0)
    alloc.check_invariants()
    assert run_prefill(alloc, state("b", (*range(4800), 1, 2, 3))) == 4800


def test_static_partition_pools_hold_equal_blocks():
    gemma = get_model("gemma-2-9b")
    alloc = baselines.static_partition(gemma, 10 << 30)
    caps = alloc.config.pool_capacity
    costs = [g.block_cost for g in alloc.config.groups]
    assert caps[0] // costs[0] == caps[1] // costs[1]
    assert sum(caps) <= 10 << 30


def test_mamba_models_are_rejected_with_a_reason():
    with pytest.raises(SimError, match="Mamba"):
        baselines.uniform(get_model("jamba-1.5-mini"), 1 << 34)


def llava_state(req_id: str, image_key: int, text: tuple[int, ...]) -> RequestState:
    from jenga.sim.workloads import image_ids

    image = image_ids(image_key, 100)
    prompt = image + text
    return RequestState(Request(req_id, prompt, (5, 6), image_tokens=100))


def test_llava_text_layers_store_the_image_positions():
    model = get_model("llava-onevision-7b")
    alloc = baselines.vllm_hybrid(model, 1 << 30)
    assert [g.role for g in alloc.config.groups] == ["all", "image"]
    s = llava_state("a", 1, tuple(range(40)))
    run_prefill(alloc, s)
    full, vision = alloc.config.groups
    live = alloc.snapshot().group_live_bytes
    assert live[full.name] == -(-140 // full.tokens_per_block) * full.block_cost
    assert live[vision.name] == -(-100 // vision.tokens_per_block) * vision.block_cost


def test_llava_hit_needs_no_vision_embedding_after_the_image():
    model = get_model("llava-onevision-7b")
    alloc = baselines.vllm_hybrid(model, 1 << 30)
    a = llava_state("a", 1, tuple(range(200)))
    run_prefill(alloc, a)
    assert alloc.allocate(a, len(a.tokens))  # prompt done: the embeddings are released
    alloc.release(a)
    full = alloc.config.groups[0]
    for block_id in list(alloc._lru[0]):
        if alloc._blocks[block_id].group == 1:
            alloc._lru[0].move_to_end(block_id, last=False)
    while any(alloc._blocks[b].group == 1 for b in alloc._lru[0]):
        alloc._evict_one(0)  # drop every cached vision-embedding block
    b = llava_state("b", 1, (*range(200), 9))
    expected = (300 // full.tokens_per_block) * full.tokens_per_block
    assert run_prefill(alloc, b) == expected
    assert run_prefill(alloc, llava_state("c", 2, tuple(range(200)))) == 0  # other image


def test_page_shapes_for_a_draft_target_pair():
    pair = get_model("llama-3.1-8b+llama-3.2-1b")  # target 64 KiB pages, draft 32 KiB
    hybrid = baselines.vllm_hybrid(pair, 1 << 30).config.groups
    assert [(g.tokens_per_block, g.block_cost) for g in hybrid] == [
        (16, 32 * 64 * 1024),
        (32, 16 * 64 * 1024),
    ]
    uni = baselines.uniform(pair, 1 << 30).config.groups
    assert [(g.tokens_per_block, g.block_cost) for g in uni] == [(16, 16 * (32 * 4096 + 16 * 2048))]
