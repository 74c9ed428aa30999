"""Multi-turn chats on one shared chunk pool, with and without `VmmCache`'s host tier.

Each conversation keeps its cache and hands it back to ``generate()`` with the extended
prompt (only the new turn is prefilled). Four conversations of two turns each, turns
interleaved (every first turn, then every second turn), on a pool that holds about one
and a half of them: with the tier, idle conversations go to host memory and come back for
their next turn, and every turn's tokens and logits equal (bitwise) those of the same
turns on a pool large enough for all. Tiny random-weight Llama / Mistral (window 8);
4 KiB chunks, one 16-token block of one layer each.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integrations.hf.tier import CacheDropped  # noqa: E402

import vmm  # noqa: E402
from integrations.hf import VmmCache, cache_kwargs  # noqa: E402
from tests.integrations.hf.test_vmm_cache import tiny_model  # noqa: E402

CHUNK = 4096
PROMPTS = (20, 17, 23, 14)  # first-turn prompt lengths
USER = (10, 12, 9, 11)  # second-turn user tokens
NEW = 8  # tokens generated per turn


def pool_of(chunks: int, device: str = "host") -> vmm.ChunkPool:
    if device == "host":
        return vmm.ChunkPool(vmm.get_backend("host", granularity=CHUNK), chunks * CHUNK)
    backend = vmm.get_backend("cuda")
    return vmm.ChunkPool(backend, chunks * backend.granularity)


def turn(model, ids: torch.Tensor, cache: VmmCache) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache),
        return_dict_in_generate=True, max_new_tokens=NEW, do_sample=False, output_logits=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def prompts(device: str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    first = [torch.randint(1, 128, (1, n), generator=gen).to(device) for n in PROMPTS]
    second = [torch.randint(1, 128, (1, n), generator=gen).to(device) for n in USER]
    return first, second


def chat(model, caches: list[VmmCache], device: str = "cpu") -> list[list[tuple]]:
    """Every conversation's first turn, then every second turn: (tokens, logits) each."""
    first, second = prompts(device)
    results: list[list[tuple]] = [[] for _ in caches]
    for i, cache in enumerate(caches):
        results[i].append(turn(model, first[i], cache))
        cache.end_turn()
    for i, cache in enumerate(caches):
        ids = torch.cat([results[i][0][0], second[i]], dim=1)
        results[i].append(turn(model, ids, cache))
        cache.end_turn()
    return results


def assert_same(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    for conv, (g, w) in enumerate(zip(got, want, strict=True)):
        for t, ((gs, gl), (ws, wl)) in enumerate(zip(g, w, strict=True)):
            assert torch.equal(gs, ws), f"conversation {conv} turn {t}: tokens differ"
            assert torch.equal(gl, wl), f"conversation {conv} turn {t}: logits differ"


def check_shared(pool: vmm.ChunkPool, caches: list[VmmCache]) -> None:
    """The pool maps exactly the units the caches' allocators use (no chunk leaked)."""
    opened = [c for c in caches if c.store.is_open]
    for cache in opened:
        cache.kv.allocator.check_invariants(True)
    assert pool.num_mapped == sum(c.kv.allocator.usage().used_units for c in opened)
    pool.check_invariants(expensive=True)


def run(model_name: str, chunks: int, device: str = "host", **tier) -> tuple[list, dict]:
    model = tiny_model(model_name).to("cpu" if device == "host" else "cuda")
    pool = pool_of(chunks, device)
    caches = [
        VmmCache(model.config, pool=pool, name=f"conversation {i}", **tier)
        for i in range(len(PROMPTS))
    ]
    try:
        results = chat(model, caches, "cpu" if device == "host" else "cuda")
        stats = caches[0].tier_stats()
        stats["own_reloads"] = [c.tier_stats().get("cache.reloads", 0) for c in caches]
        check_shared(pool, caches)
        return results, stats
    finally:
        for cache in caches:
            cache.close()
        pool.close()


@pytest.mark.parametrize("model_name", ["llama", "mistral"])
@pytest.mark.parametrize("policy", ["lru", "score"])
def test_offloaded_conversations_continue_exactly_as_on_an_unbounded_pool(model_name, policy):
    want, _ = run(model_name, 256)
    got, stats = run(model_name, 10, tier_bytes=1 << 20, tier_policy=policy)
    assert_same(got, want)
    assert stats["tier.offloads"] > 0 and stats["tier.reloads"] > 0, stats
    assert stats["tier.reload.bytes"] > 0 and stats["tier.offload.bytes"] > 0, stats
    assert stats["tier.dropped"] == 0, stats
    assert sum(stats["own_reloads"]) == stats["tier.reloads"]


def test_without_a_tier_the_shared_pool_refuses_cleanly():
    """Same chats, no tier: the pool runs out, the forward that needs more chunks raises
    OutOfMemory before allocating (no cache broken, the pool maps exactly what the
    allocators use), and once a conversation closes the refused turn runs exactly."""
    want, _ = run("llama", 256)
    model = tiny_model("llama")
    pool = pool_of(10)
    caches = [VmmCache(model.config, pool=pool) for _ in range(3)]
    first, _ = prompts()
    try:
        turn(model, first[0], caches[0])
        turn(model, first[1], caches[1])
        mapped = pool.num_mapped
        with pytest.raises(vmm.OutOfMemory) as err:
            turn(model, first[2], caches[2])
        check_shared(pool, caches)
        assert pool.num_mapped == mapped
        assert "chunks of the shared pool free" in str(err.value)
        caches[0].close()
        again = turn(model, first[2], caches[2])
        assert torch.equal(again[0], want[2][0][0]) and torch.equal(again[1], want[2][0][1])
    finally:
        for cache in caches:
            cache.close()
        pool.close()


def test_a_full_host_tier_drops_the_policy_victim_and_its_next_use_names_it():
    """A host tier that holds one first-turn conversation: offloading a second one drops
    the least recently used; every second turn then either continues exactly as on an
    unbounded pool or raises `CacheDropped` naming its conversation, never other tokens."""
    want, _ = run("llama", 256)
    model = tiny_model("llama")
    pool = pool_of(10)
    caches = [
        VmmCache(model.config, pool=pool, name=f"conversation {i}", tier_bytes=4 * CHUNK)
        for i in range(len(PROMPTS))
    ]
    first, second = prompts()
    try:
        got = [turn(model, first[i], cache) for i, cache in enumerate(caches)]
        assert caches[0].tier_stats()["tier.dropped"] == 1  # conversation 0, at the 4th
        dropped, exact = [], []
        for i, cache in enumerate(caches):
            assert torch.equal(got[i][0], want[i][0][0])
            try:
                again = turn(model, torch.cat([got[i][0], second[i]], dim=1), cache)
            except CacheDropped as e:
                assert f"conversation {i}: its K/V was dropped" in str(e)
                dropped.append(i)
                continue
            assert torch.equal(again[0], want[i][1][0]) and torch.equal(again[1], want[i][1][1])
            exact.append(i)
        stats = caches[0].tier_stats()
        assert dropped[0] == 0 and exact, (dropped, exact)
        assert stats["tier.reloads"] >= 1 and stats["tier.dropped"] >= len(dropped), stats
        check_shared(pool, caches)
    finally:
        for cache in caches:
            cache.close()
        pool.close()


@pytest.mark.parametrize("policy, victim", [("lru", 0), ("score", 1)])
def test_the_policy_picks_the_conversation_that_leaves(policy, victim):
    """Conversation 0's turn runs first and stays open (score 2), conversation 1's turn
    then completes (`end_turn`: score 0); conversation 2 needs room for one: LRU offloads
    the least recently used (0), CaR's score policy the smallest score (1)."""
    model = tiny_model("llama")
    pool = pool_of(10)
    caches = [VmmCache(model.config, pool=pool, tier_bytes=1 << 20, tier_policy=policy)
              for _ in range(3)]  # fmt: skip
    first, _ = prompts()
    try:
        turn(model, first[0], caches[0])
        turn(model, first[1], caches[1])
        caches[1].end_turn()
        turn(model, first[2], caches[2])
        on_host = [c.tier_stats()["cache.on_host"] for c in caches]
        assert on_host == [int(i == victim) for i in range(3)]
        assert caches[0].tier_stats()["tier.offloads"] == 1
    finally:
        for cache in caches:
            cache.close()
        pool.close()


def test_a_failed_reload_keeps_the_host_copy_and_a_retry_is_exact(monkeypatch):
    """A copy back to the GPU fails (injected) during conversation 0's second turn: the
    error reaches the caller, what the reload allocated is freed, the conversation stays
    on the host, and the retried turn equals the unbounded pool's."""
    want, _ = run("llama", 256)
    model = tiny_model("llama")
    pool = pool_of(10)
    caches = [VmmCache(model.config, pool=pool, tier_bytes=1 << 20) for _ in PROMPTS]
    first, second = prompts()
    try:
        got = [turn(model, first[i], cache) for i, cache in enumerate(caches)]
        assert caches[0].tier_stats()["cache.on_host"] == 1
        tier = caches[0].tier
        real_copy = tier._copy_block

        def fail_back(*args, to_host, **kwargs):
            if not to_host:
                raise OSError("injected copy failure")
            return real_copy(*args, to_host=to_host, **kwargs)

        monkeypatch.setattr(tier, "_copy_block", fail_back)
        ids = torch.cat([got[0][0], second[0]], dim=1)
        with pytest.raises(OSError, match="injected"):
            turn(model, ids, caches[0])
        assert caches[0].tier_stats()["cache.on_host"] == 1
        assert caches[0].kv.allocator.usage().used_units == 0
        check_shared(pool, caches)
        monkeypatch.setattr(tier, "_copy_block", real_copy)
        again = turn(model, ids, caches[0])
        assert torch.equal(again[0], want[0][1][0]) and torch.equal(again[1], want[0][1][1])
        assert caches[0].tier_stats()["cache.reloads"] == 1
    finally:
        for cache in caches:
            cache.close()
        pool.close()


@pytest.mark.cuda
@pytest.mark.gpu
def test_offloaded_conversations_continue_exactly_on_cuda():
    """A CUDA pool of 4 chunks of 2 MiB: each conversation maps one large page (a chunk per
    layer), so two fit; the others wait in page-locked host memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch CUDA tensors")
    want, _ = run("llama", 256, "cuda")
    got, stats = run("llama", 4, "cuda", tier_bytes=1 << 20)
    assert_same(got, want)
    assert stats["tier.offloads"] > 0 and stats["tier.reloads"] > 0, stats
    assert stats["tier.dropped"] == 0, stats
