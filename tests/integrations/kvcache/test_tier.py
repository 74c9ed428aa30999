"""The host tier: blocks leaving the GPU are offloaded, a prefix hit on them reloads them,
and nothing is lost or served stale (host backend: the copies are memcpy)."""

from __future__ import annotations

import threading

import pytest
import torch
from integrations.kvcache.access import read_kv, token_slots, write_kv
from integrations.kvcache.tier import HostTierConfig, ReloadFailed, host_memory_bytes
from jenga.errors import InvalidSize
from jenga.specs import KVGroup, ModelSpec
from jenga.tier import Tier

import vmm
from integrations.kvcache import KVCache, KVCacheConfig

from .conftest import CHUNK, DIM, HEADS, MakeCache, full_spec, hybrid_model

# one block of one layer: 512 B; a chunk holds 8 blocks; a large page is 1 chunk per layer
POOL_CHUNKS = 4  # 2 layers -> 2 large pages -> 16 blocks (64 tokens)


def model() -> ModelSpec:
    return ModelSpec("full-2", (KVGroup("full", full_spec(), (0, 1)),), max_model_len=4096)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected(tokens: list[int], layer: int) -> torch.Tensor:
    """K (and V + 0.5) of every position: a function of the token, its position, the layer."""
    base = torch.tensor(tokens, dtype=torch.float32) + 1000 * layer
    base = base + torch.arange(len(tokens), dtype=torch.float32) / 64
    return base[:, None, None].expand(len(tokens), HEADS, DIM)


def run(kv: KVCache, rid: str, tokens: list[int], free: bool = True) -> int:
    """Admit, compute (write K/V of) and cache a request; returns its prefix hit."""
    hit = kv.add_request(rid, tokens)
    assert kv.allocate(rid, len(tokens) - hit) is not None
    for layer in (0, 1):
        slots = token_slots(kv, rid, 0, hit, len(tokens))
        want = expected(tokens, layer)[hit:]
        write_kv(kv, layer, slots, want, want + 0.5)
    kv.cache(rid, len(tokens))
    if free:
        kv.free(rid)
    return hit


def check_served(kv: KVCache, rid: str, tokens: list[int], upto: int) -> None:
    for layer in (0, 1):
        keys, values = read_kv(kv, layer, token_slots(kv, rid, 0, 0, upto))
        want = expected(tokens, layer)[:upto]
        assert torch.equal(keys, want)
        assert torch.equal(values, want + 0.5)


def tiered(make_cache: MakeCache, **tier: object) -> KVCache:
    tier.setdefault("size_bytes", 1 << 20)
    return make_cache(model(), POOL_CHUNKS, tier=HostTierConfig(**tier))  # type: ignore[arg-type]


def keys_of(kv: KVCache, tokens: list[int]) -> list:
    assert kv.tier is not None
    return kv.tier.keys(tokens)[1][0]


def reload(kv: KVCache, tokens: list[int]) -> int:
    """Reload ``tokens``' host blocks, admit ``"again"`` on them; returns its hit."""
    assert kv.tier is not None
    job = kv.tier.start_reload(tokens)
    assert job is not None
    assert kv.tier.finish_reload(job)
    hit = kv.add_request("again", tokens)
    kv.tier.release(job)
    return hit


def test_evicted_blocks_are_offloaded_and_a_hit_reloads_them(make_cache: MakeCache):
    kv = tiered(make_cache)
    a, b = prompt(1, 33), prompt(2, 60)
    run(kv, "a", a)
    assert all(kv.tier.tier_of(k) is Tier.GPU for k in keys_of(kv, a))  # type: ignore[union-attr]
    run(kv, "b", b)  # 15 blocks of 16: a's 8 cached blocks leave the GPU
    stats = kv.stats()
    assert stats["blocks.evicted"] >= 7
    assert stats["tier.offload.evicted"] == stats["blocks.evicted"]
    assert kv.add_request("probe", a) == 0  # the GPU alone has nothing of a
    kv.free("probe")
    assert {kv.tier.tier_of(k) for k in keys_of(kv, a)} == {Tier.HOST}  # type: ignore[union-attr]
    assert reload(kv, a) == 32
    check_served(kv, "again", a, 32)
    stats = kv.stats()
    assert stats["tier.reload.tokens"] == 32 and stats["tier.reload.failed"] == 0
    kv.check_invariants(expensive=True)


def test_without_the_tier_an_evicted_prefix_is_recomputed(make_cache: MakeCache):
    kv = make_cache(model(), POOL_CHUNKS)
    a = prompt(1, 33)
    run(kv, "a", a)
    run(kv, "b", prompt(2, 60))
    assert run(kv, "a2", a) == 0
    assert kv.tier is None


def test_a_block_evicted_while_its_offload_is_queued_is_copied_before_it_is_reused(
    make_cache: MakeCache,
):
    kv = tiered(make_cache, high_water=0.25)
    assert kv.tier is not None
    a = prompt(1, 33)
    run(kv, "a", a)
    gate = threading.Event()
    kv.tier._thread.submit(gate.wait)  # type: ignore[union-attr]  # holds the copy thread
    try:
        assert kv.tier.background() == 8  # above 25 % used: a's blocks start to offload
        assert {kv.tier.tier_of(k) for k in keys_of(kv, a)} == {Tier.IN_FLIGHT}
        run(kv, "b", prompt(2, 60))  # evicts a's blocks and overwrites them while queued
    finally:
        gate.set()
    assert kv.stats()["tier.offload.taken_over"] >= 7
    kv.tier.poll(wait=True)
    assert reload(kv, a) == 32
    check_served(kv, "again", a, 32)  # a's data, not b's
    kv.check_invariants(expensive=True)


def test_a_hit_on_blocks_mid_offload_is_served_and_the_offload_completes(
    make_cache: MakeCache,
):
    kv = tiered(make_cache, high_water=0.25)
    assert kv.tier is not None
    a = prompt(1, 33)
    run(kv, "a", a)
    gate = threading.Event()
    kv.tier._thread.submit(gate.wait)  # type: ignore[union-attr]
    try:
        kv.tier.background()
        assert run(kv, "a2", a, free=False) == 32  # the GPU copy serves, the offload runs on
        check_served(kv, "a2", a, 33)
    finally:
        gate.set()
    kv.free("a2")
    kv.tier.poll(wait=True)
    assert {kv.tier.tier_of(k) for k in keys_of(kv, a)} == {Tier.BOTH}
    run(kv, "b", prompt(2, 60))
    assert kv.stats()["tier.offload.evicted"] == 0  # already on the host: nothing to copy
    assert reload(kv, a) == 32
    check_served(kv, "again", a, 32)


def test_a_failed_reload_commits_nothing_and_the_request_recomputes(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
):
    kv = tiered(make_cache)
    assert kv.tier is not None
    a = prompt(1, 33)
    run(kv, "a", a)
    run(kv, "b", prompt(2, 60))
    real = kv.tier._load_unit
    calls = []

    def failing(g: int, i: int, pairs: list) -> None:
        calls.append(i)
        if i == 1:  # layer 1's copy fails after layer 0's landed
            raise OSError("injected copy failure")
        real(g, i, pairs)

    monkeypatch.setattr(kv.tier, "_load_unit", failing)
    job = kv.tier.start_reload(a)
    assert job is not None
    assert not kv.tier.finish_reload(job)
    assert calls == [0, 1]
    assert kv.stats()["tier.reload.failed"] == 1
    assert run(kv, "a2", a) == 0  # nothing half-loaded is hit: recomputed
    check_served_after_free = kv.add_request("a3", a)  # a2 cached it on the GPU
    assert check_served_after_free == 32
    check_served(kv, "a3", a, 32)
    kv.free("a3")
    assert all(kv.tier.table.get(k).pins == 0 for k in keys_of(kv, a))  # type: ignore[union-attr]
    monkeypatch.setattr(kv.tier, "_load_unit", real)
    run(kv, "c", prompt(3, 60))  # a leaves the GPU again; its host copy is still good
    assert reload(kv, a) == 32
    check_served(kv, "again", a, 32)
    kv.check_invariants(expensive=True)


def test_a_full_host_tier_replaces_lru_and_never_serves_a_replaced_block(make_cache: MakeCache):
    kv = tiered(make_cache, size_bytes=8 * 1024)  # 8 slots of 1 KiB: one request's blocks
    assert kv.tier is not None and kv.tier.table.num_slots == 8
    a, b, c = prompt(1, 33), prompt(2, 33), prompt(3, 60)
    run(kv, "a", a)
    run(kv, "b", b)
    run(kv, "c", c)  # a then b leave the GPU; b's blocks replace a's on the host
    assert kv.stats()["tier.host.evicted"] >= 7
    assert kv.tier.host_extension(a) == (0, 0)
    assert kv.tier.start_reload(a) is None
    assert reload(kv, b) == 32
    check_served(kv, "again", b, 32)


def test_sliding_window_groups_reload_too(make_cache: MakeCache):
    kv = make_cache(hybrid_model(window=8), 8, tier=HostTierConfig(1 << 20))
    assert kv.tier is not None
    a = prompt(1, 33)
    hit = kv.add_request("a", a)
    assert kv.allocate("a", len(a) - hit) is not None
    for layer in range(4):
        slots = token_slots(kv, "a", kv.group_of(layer).index, 0, len(a))
        write_kv(kv, layer, slots, expected(a, layer), expected(a, layer) + 0.5)
    kv.cache("a", 33)
    kv.free("a")
    kv.evict_cached(8)
    assert kv.add_request("probe", a) == 0
    kv.free("probe")
    assert reload(kv, a) == 32
    for layer in range(4):
        g = kv.group_of(layer).index
        start = 0 if g == 0 else 24  # the window group holds the last blocks only
        keys, _ = read_kv(kv, layer, token_slots(kv, "again", g, start, 32))
        assert torch.equal(keys, expected(a, layer)[start:32])


@pytest.mark.parametrize(
    "tier, message",
    [
        (dict(size_bytes=0), "size_bytes must be an int > 0, got 0"),
        (dict(size_bytes=-5), "got -5"),
        (
            dict(size_bytes=host_memory_bytes() + 1),
            f"larger than host memory ({host_memory_bytes()} B)",
        ),
        (dict(size_bytes=1 << 20, high_water=0), "high-water mark must be in (0, 1], got 0"),
        (dict(size_bytes=1 << 20, high_water=1.5), "got 1.5"),
        (dict(size_bytes=1 << 20, high_water=-0.1), "got -0.1"),
        (dict(size_bytes=1 << 20, policy="mru"), "one of ['lru', 'score'], got 'mru'"),
    ],
)
def test_bad_tier_settings_are_refused_at_construction(tier: dict, message: str):
    with pytest.raises(InvalidSize) as err:
        HostTierConfig(**tier)
    assert message in str(err.value)


def test_a_tier_smaller_than_one_block_is_refused_and_the_cache_is_closed():
    backend = vmm.get_backend("host", granularity=CHUNK, capacity=64 << 20)
    pool = vmm.ChunkPool(backend, POOL_CHUNKS * CHUNK)
    try:
        config = KVCacheConfig(dtype=torch.float32, tier=HostTierConfig(1000))
        with pytest.raises(InvalidSize, match=r"a host tier of 1000 B holds no block: .* 1024 B"):
            KVCache(model(), pool, config)
        assert pool.stats()["ranges.current"] == 0
    finally:
        pool.close()


@pytest.mark.cuda
@pytest.mark.gpu
def test_offload_and_reload_on_cuda_with_pinned_host_memory():
    """A CUDA pool (2 MiB chunks): the copies run on the tier's own stream into page-locked
    host memory; evicted blocks come back equal, a background offload lands on both tiers."""
    backend = vmm.get_backend("cuda")
    pool = vmm.ChunkPool(backend, 2 * backend.granularity)
    tier = HostTierConfig(1 << 20, high_water=0.01)
    kv = KVCache(model(), pool, KVCacheConfig(dtype=torch.float32, tier=tier))
    try:
        assert kv.tier is not None and kv.tier.buffer.is_pinned()
        a = prompt(1, 33)
        hit = kv.add_request("a", a)
        assert kv.allocate("a", len(a) - hit) is not None
        for layer in (0, 1):
            want = expected(a, layer).cuda()
            write_kv(kv, layer, token_slots(kv, "a", 0, 0, 33), want, want + 0.5)
        kv.cache("a", 33)
        kv.free("a")
        assert kv.tier.background() == 8
        kv.tier.poll(wait=True)
        assert {kv.tier.tier_of(k) for k in keys_of(kv, a)} == {Tier.BOTH}
        kv.evict_cached(kv.allocator.total_units)
        assert {kv.tier.tier_of(k) for k in keys_of(kv, a)} == {Tier.HOST}
        assert reload(kv, a) == 32
        for layer in (0, 1):
            keys, values = read_kv(kv, layer, token_slots(kv, "again", 0, 0, 32))
            want = expected(a, layer)[:32]
            assert torch.equal(keys.cpu(), want) and torch.equal(values.cpu(), want + 0.5)
        kv.free("again")
        kv.check_invariants(expensive=True)
    finally:
        kv.close()
        pool.close()


@pytest.mark.parametrize("policy", ["lru", "score"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_never_serves_stale_kv(make_cache: MakeCache, policy: str, seed: int):
    """Requests from a few prefix families with random tails, on a small pool and a small
    tier (both replace), background offloads and whole-cache evictions in between: every
    prefix served, from the GPU or reloaded from the host, holds exactly its tokens' K/V."""
    kv = tiered(make_cache, size_bytes=12 * 1024, policy=policy, high_water=0.5)
    assert kv.tier is not None
    gen = torch.Generator().manual_seed(seed)
    families = [prompt(100 + seed * 10 + f, 24) for f in range(3)]
    reloaded = 0
    for step in range(40):
        f = int(torch.randint(0, 3, (1,), generator=gen))
        tail = torch.randint(0, 1000, (int(torch.randint(1, 20, (1,), generator=gen)),),
                             generator=gen).tolist()  # fmt: skip
        tokens = families[f][: int(torch.randint(8, 25, (1,), generator=gen))] + tail
        job = kv.tier.start_reload(tokens)
        if job is not None:
            assert kv.tier.finish_reload(job)
            reloaded += 1
        rid = f"r{step}"
        hit = kv.add_request(rid, tokens)
        if job is not None:
            assert hit >= job.tokens
            kv.tier.release(job)
        if hit:
            check_served(kv, rid, tokens, hit)
        if kv.allocate(rid, len(tokens) - hit) is None:
            kv.free(rid)
            continue
        for layer in (0, 1):
            want = expected(tokens, layer)[hit:]
            write_kv(kv, layer, token_slots(kv, rid, 0, hit, len(tokens)), want, want + 0.5)
        kv.cache(rid, len(tokens))
        kv.free(rid)
        kv.tier.background()
        if step % 7 == 6:
            kv.evict_cached(kv.allocator.total_units)
        kv.check_invariants(expensive=True)
    kv.tier.poll(wait=True)
    stats = kv.stats()
    assert reloaded > 0 and stats["tier.host.evicted"] > 0
    assert stats["tier.reload.failed"] == 0


def pushed_off(make_cache: MakeCache) -> tuple[KVCache, list[int]]:
    """A tiered cache whose first request's 8 blocks were pushed off the GPU to the host."""
    kv = tiered(make_cache)
    a = prompt(1, 33)
    run(kv, "a", a)
    run(kv, "b", prompt(2, 60))
    return kv, a


def test_an_open_reload_serves_layer_0_while_layer_1_still_copies(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
):
    kv, a = pushed_off(make_cache)
    assert kv.tier is not None
    hold = threading.Event()
    real = kv.tier._load_unit

    def load(g: int, i: int, pairs: list) -> None:
        if i == 1:
            assert hold.wait(timeout=20)
        real(g, i, pairs)

    monkeypatch.setattr(kv.tier, "_load_unit", load)
    job = kv.tier.start_reload(a)
    assert job is not None
    kv.tier.open_reload(job)
    assert kv.add_request("again", a) == 32  # admitted on blocks whose copies still run
    kv.tier.wait_layer(0)
    keys, values = read_kv(kv, 0, token_slots(kv, "again", 0, 0, 32))
    assert torch.equal(keys, expected(a, 0)[:32]) and torch.equal(values, keys + 0.5)
    assert not job.done()  # layer 1's copy has not landed: layer 0 was served before it
    hold.set()
    kv.tier.wait_layer(1)
    check_served(kv, "again", a, 32)
    assert kv.tier.settle() == [] and kv.tier.open_reloads() == []
    stats = kv.stats()
    assert stats["tier.reload.opened"] == 1 and stats["tier.reload.tokens"] == 32
    assert all(kv.tier.table.get(k).pins == 0 for k in keys_of(kv, a))  # type: ignore[union-attr]
    kv.free("again")
    kv.check_invariants(expensive=True)


def test_a_failed_open_reload_is_raised_at_its_layer_and_its_blocks_leave_the_cache(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
):
    kv, a = pushed_off(make_cache)
    assert kv.tier is not None
    real = kv.tier._load_unit

    def load(g: int, i: int, pairs: list) -> None:
        if i == 1:
            raise OSError("injected copy failure")
        real(g, i, pairs)

    monkeypatch.setattr(kv.tier, "_load_unit", load)
    job = kv.tier.start_reload(a)
    assert job is not None
    kv.tier.open_reload(job)
    assert kv.add_request("again", a) == 32
    kv.tier.wait_layer(0)  # layer 0 landed
    with pytest.raises(ReloadFailed, match="reload of 32 tokens from the host failed"):
        kv.tier.wait_layer(1)
    dropped = kv.tier.fail_open(job)
    assert sorted(dropped[0]) == sorted(kv.block_table("again", 0)[:8])
    assert kv.tier.open_reloads() == [] and kv.stats()["tier.reload.failed"] == 1
    kv.free("again")  # its blocks lost their identity: freed, not cached
    assert kv.add_request("probe", a) == 0  # nothing half-loaded is hit
    kv.free("probe")
    monkeypatch.setattr(kv.tier, "_load_unit", real)
    assert reload(kv, a) == 32  # the host copy is intact
    check_served(kv, "again", a, 32)
    kv.check_invariants(expensive=True)
