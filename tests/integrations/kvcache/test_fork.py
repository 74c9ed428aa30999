"""KVCache.fork: samples of one prompt map its pages once; a diverging sample copies one
block per group (the one its next token writes into), never a full one."""

from __future__ import annotations

import pytest
import torch
from integrations.kvcache.access import read_kv, token_slots
from integrations.kvcache.cache import UnmappedBlockError
from jenga.requests import BlockCopy
from jenga.specs import KVGroup, ModelSpec

from integrations.kvcache import KVCache
from tests.integrations.kvcache.conftest import MakeCache, full_spec, hybrid_model
from tests.integrations.kvcache.test_cache import fill

PROMPT = 1000
SAMPLES = 4
DECODE = 20


def full_model() -> ModelSpec:
    return ModelSpec("full-tiny", (KVGroup("full", full_spec(), (0, 1)),), max_model_len=4096)


def read(kv: KVCache, rid: str, layer: int, start: int, stop: int) -> tuple:
    return read_kv(kv, layer, token_slots(kv, rid, kv.group_of(layer).index, start, stop))


def decode(kv: KVCache, rid: str, steps: int, seed: int) -> tuple[list[BlockCopy], dict]:
    """``steps`` one-token steps of ``rid``; the copies its allocations made, and its K/V."""
    copies: list[BlockCopy] = []
    data: dict[int, list] = {}
    for step in range(steps):
        start = kv.num_tokens(rid)
        got = kv.allocate(rid, 1)
        assert got is not None
        copies += got.copies
        for layer, kvs in fill(kv, rid, start, start + 1, seed * 1000 + step).items():
            data.setdefault(layer, []).append(kvs)
    return copies, data


def mapped_bytes(kv: KVCache) -> int:
    return kv.stats()["bytes.mapped.current"]


def one_request_bytes(make_cache: MakeCache, model: ModelSpec) -> int:
    kv = make_cache(model, budget_chunks=512)
    kv.add_request("r", list(range(PROMPT)))
    assert kv.allocate("r", PROMPT) is not None
    decode(kv, "r", DECODE, seed=9)
    return mapped_bytes(kv)


@pytest.mark.parametrize("model", [full_model(), hybrid_model()], ids=["full", "hybrid"])
def test_samples_of_a_1000_token_prompt_map_its_pages_once(make_cache: MakeCache, model):
    single = one_request_bytes(make_cache, model)
    kv = make_cache(model, budget_chunks=512)
    kv.add_request("p", list(range(PROMPT)))
    assert kv.allocate("p", PROMPT) is not None
    prompt_kv = fill(kv, "p", 0, PROMPT, seed=1)
    before = mapped_bytes(kv)
    kids = [f"s{i}" for i in range(SAMPLES)]
    kv.fork("p", kids)
    assert mapped_bytes(kv) == before  # a fork maps nothing
    kv.free("p")  # the samples hold the prompt now
    kv.check_invariants(expensive=True)
    generated = {}
    for i, kid in enumerate(kids):
        copies, generated[kid] = decode(kv, kid, DECODE, seed=10 + i)
        assert copies == []  # the prompt ends on a block boundary: nothing is shared-written
    kv.check_invariants(expensive=True)
    shared = mapped_bytes(kv)
    assert shared < 1.3 * single, (shared, single)
    for kid in kids:
        for layer in model.groups[0].layer_ids:  # full attention reads the whole prompt
            k, v = read(kv, kid, layer, 0, PROMPT)
            assert torch.equal(k, prompt_kv[layer][0]) and torch.equal(v, prompt_kv[layer][1])
        for layer, steps in generated[kid].items():
            keep = DECODE if layer in model.groups[0].layer_ids else 4  # a window: its last
            k, v = read(kv, kid, layer, PROMPT + DECODE - keep, PROMPT + DECODE)
            assert torch.equal(k, torch.cat([s[0] for s in steps[-keep:]]))
            assert torch.equal(v, torch.cat([s[1] for s in steps[-keep:]]))
    # the baseline: the same four samples as independent requests store the prompt 4 times
    alone = make_cache(model, budget_chunks=512)
    for i, kid in enumerate(kids):
        alone.add_request(kid, list(range(PROMPT)), use_cache=False)
        assert alone.allocate(kid, PROMPT) is not None
        decode(alone, kid, DECODE, seed=10 + i)
    assert mapped_bytes(alone) > 3.5 * single


def test_diverging_samples_copy_one_block_per_group_each(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=512)
    n = PROMPT + 2  # the last block holds 2 of 4 tokens
    kv.add_request("p", list(range(n)))
    assert kv.allocate("p", n) is not None
    prompt_kv = fill(kv, "p", 0, n, seed=1)
    kids = [f"s{i}" for i in range(SAMPLES)]
    kv.fork("p", kids)
    block_bytes = {geo.index: geo.small_page_bytes * geo.num_ranges for geo in kv.geometries}
    for i, kid in enumerate(kids):
        table = {g: kv.block_table(kid, g) for g in block_bytes}
        copied = kv.stats()["kv.cow.bytes"]
        copies, own = decode(kv, kid, 3, seed=20 + i)
        assert [(c.group, c.index) for c in copies] == [(0, n // 4), (1, n // 4)]
        assert all(c.src == table[c.group][c.index] for c in copies)
        # one block per group, all its layers
        assert kv.stats()["kv.cow.bytes"] - copied == sum(block_bytes.values())
        for layer, steps in own.items():
            k, _ = read(kv, kid, layer, n, n + 3)
            assert torch.equal(k, torch.cat([s[0] for s in steps]))
        for layer in (0, 2, 1, 3):  # the copied rows are the parent's, the others its own
            start = 0 if layer in (0, 2) else n - 6  # the window keeps the last 8 tokens
            k, v = read(kv, kid, layer, start, n)
            assert torch.equal(k, prompt_kv[layer][0][start:])
            assert torch.equal(v, prompt_kv[layer][1][start:])
    # the parent, last holder of its block, writes in place; its tokens are its own
    copies, _ = decode(kv, "p", 1, seed=99)
    assert copies == []
    k, _ = read(kv, "p", 0, 0, n)
    assert torch.equal(k, prompt_kv[0][0])
    kv.check_invariants(expensive=True)
    for rid in ("p", *kids):
        kv.free(rid)
    kv.check_invariants(expensive=True)


def test_copy_blocks_refuses_an_unmapped_block_before_moving_a_byte(make_cache: MakeCache):
    kv = make_cache(full_model(), budget_chunks=64)
    kv.add_request("p", list(range(6)))
    assert kv.allocate("p", 6) is not None
    data = fill(kv, "p", 0, 6, seed=3)
    src = kv.block_table("p", 0)[0]
    geo = kv.geometries[0]
    unmapped = geo.blocks_per_page * (max(kv.mapped_pages[0]) + 1)
    ok = BlockCopy(0, 0, src, kv.block_table("p", 0)[1])
    with pytest.raises(UnmappedBlockError, match=f"block {unmapped} is on page"):
        kv.copy_blocks([ok, BlockCopy(0, 0, src, unmapped)])
    k, _ = read(kv, "p", 0, 0, 6)
    assert torch.equal(k, data[0][0])  # the first copy did not run either


def test_beam_reorder_is_table_changes_and_one_block_copy_per_beam(make_cache: MakeCache):
    """Beams b0, b1, b2 diverge; the step keeps (b0, b2, b2): b2 forks, b1 is freed. The
    reorder maps and copies nothing; the next step copies at most one block per group
    per beam, and every beam reads its own history."""
    kv = make_cache(hybrid_model(), budget_chunks=512)
    kv.add_request("b0", list(range(PROMPT + 1)))
    assert kv.allocate("b0", PROMPT + 1) is not None
    prompt_kv = fill(kv, "b0", 0, PROMPT + 1, seed=1)
    kv.fork("b0", ["b1", "b2"])
    history = {}
    for i, beam in enumerate(("b0", "b1", "b2")):
        _, history[beam] = decode(kv, beam, 2, seed=30 + i)  # 1003 tokens: a partial block
    mapped, copied = mapped_bytes(kv), kv.stats()["kv.cow.bytes"]
    kv.fork("b2", ["b2'"])  # keep (b0, b2, b2)
    kv.free("b1")
    assert mapped_bytes(kv) <= mapped and kv.stats()["kv.cow.bytes"] == copied
    history["b2'"] = {layer: list(steps) for layer, steps in history["b2"].items()}
    block_bytes = sum(geo.small_page_bytes * geo.num_ranges for geo in kv.geometries)
    # b0's tail is its own; b2 and b2' share b2's: the first to write copies it (one block
    # per group), the last holder writes in place
    for i, (beam, cost) in enumerate((("b0", 0), ("b2", block_bytes), ("b2'", 0))):
        before = kv.stats()["kv.cow.bytes"]
        _, new = decode(kv, beam, 1, seed=40 + i)
        assert kv.stats()["kv.cow.bytes"] - before == cost
        for layer, steps in new.items():
            history[beam][layer] += steps
    n = PROMPT + 1 + 3
    for beam in ("b0", "b2", "b2'"):
        for layer in (0, 2):  # full attention: the prompt, then the beam's own tokens
            k, v = read(kv, beam, layer, 0, n)
            own_k = torch.cat([s[0] for s in history[beam][layer]])
            own_v = torch.cat([s[1] for s in history[beam][layer]])
            assert torch.equal(k, torch.cat([prompt_kv[layer][0], own_k]))
            assert torch.equal(v, torch.cat([prompt_kv[layer][1], own_v]))
    kv.check_invariants(expensive=True)
