"""`KVCache.set_capacity`: the pool's budget and the allocator's units move together while
requests run — grow under load, shrink by evicting cached pages, refuse below what live
requests hold with nothing changed."""

from __future__ import annotations

import pytest
from jenga.errors import CapacityInUse

from integrations.kvcache import KVCache, LayoutError
from tests.integrations.kvcache.conftest import CHUNK, MakeCache, hybrid_model
from tests.integrations.kvcache.test_cache import check, fill


def _capacity(kv: KVCache) -> tuple[int, int, int]:
    return kv.pool.budget_bytes, kv.allocator.total_units, kv.capacity_bytes


def _admit(kv: KVCache, rid: str, n: int) -> bool:
    kv.add_request(rid, [hash((rid, i)) % 1000 for i in range(n)])
    return kv.allocate(rid, n) is not None


def test_growing_under_load_lets_a_refused_request_in_and_keeps_the_running_ones_bytes(
    make_cache: MakeCache,
) -> None:
    kv = make_cache(hybrid_model(), budget_chunks=8, max_bytes=32 * CHUNK)
    assert _capacity(kv) == (8 * CHUNK, 8, 8 * CHUNK)
    assert _admit(kv, "a", 64)
    written = fill(kv, "a", 0, 64, seed=1)
    assert not _admit(kv, "b", 64)  # no room at 8 chunks
    assert kv.set_capacity(16 * CHUNK) == 0
    assert _capacity(kv) == (16 * CHUNK, 16, 16 * CHUNK)
    assert kv.allocate("b", 64) is not None
    check(kv, "a", 0, 64, written, layers=(0, 2))
    kv.check_invariants(expensive=True)


def test_shrinking_evicts_cached_pages_and_lowers_both_owners(make_cache: MakeCache) -> None:
    kv = make_cache(hybrid_model(), budget_chunks=16)
    assert _admit(kv, "old", 64)
    kv.cache("old", 64)
    kv.free("old")
    assert _admit(kv, "live", 32)
    mapped = kv.pool.num_mapped
    live = mapped - kv.allocator.stats()["units.evictable.current"]
    evicted = kv.set_capacity(live * CHUNK)
    assert evicted == mapped - live > 0
    assert _capacity(kv) == (live * CHUNK, live, live * CHUNK)
    assert kv.pool.num_mapped == kv.allocator.usage().used_units == live
    assert kv.stats()["units.evictable.current"] == 0
    kv.check_invariants(expensive=True)


def test_shrinking_below_what_live_requests_hold_changes_nothing(make_cache: MakeCache) -> None:
    kv = make_cache(hybrid_model(), budget_chunks=16)
    assert _admit(kv, "live", 64)
    written = fill(kv, "live", 0, 64, seed=2)
    before = (_capacity(kv), kv.pool.num_mapped, [set(p) for p in kv.mapped_pages])
    held = kv.pool.num_mapped
    with pytest.raises(CapacityInUse, match=f"{held} of them by live requests"):
        kv.set_capacity((held - 1) * CHUNK)
    assert (_capacity(kv), kv.pool.num_mapped, [set(p) for p in kv.mapped_pages]) == before
    check(kv, "live", 0, 64, written, layers=(0, 1, 2, 3))
    kv.check_invariants(expensive=True)


def test_growing_past_the_reserved_ranges_is_refused(make_cache: MakeCache) -> None:
    kv = make_cache(hybrid_model(), budget_chunks=8)  # ranges reserved for 8 chunks
    with pytest.raises(LayoutError, match=f"capacity {9 * CHUNK} B is above the {8 * CHUNK} B"):
        kv.set_capacity(9 * CHUNK)
    assert _capacity(kv) == (8 * CHUNK, 8, 8 * CHUNK)


def test_releasing_free_chunks_keeps_the_capacity(make_cache: MakeCache) -> None:
    kv = make_cache(hybrid_model(), budget_chunks=8)
    assert _admit(kv, "a", 64)
    kv.free("a")
    released = kv.release_free_chunks()
    assert released > 0 and kv.pool.num_created == kv.pool.num_mapped
    assert _capacity(kv) == (8 * CHUNK, 8, 8 * CHUNK)
    assert _admit(kv, "b", 64)  # chunks are created again on demand
