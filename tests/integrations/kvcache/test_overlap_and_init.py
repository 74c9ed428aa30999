"""KVCache overlap launches (queued plans are never dropped) and rollback of a failed init."""

from __future__ import annotations

import threading

import pytest
import torch
from vmm.host import HostBackend

import vmm
from integrations.kvcache import KVCache, KVCacheConfig
from tests.integrations.kvcache.conftest import CHUNK, MakeCache, hybrid_model


def test_launch_ahead_waits_for_a_running_job_instead_of_dropping_plans(make_cache: MakeCache):
    kv = make_cache(hybrid_model(window=8), budget_chunks=64)
    kv.add_request("a", list(range(8)))
    kv.allocate_ahead("a", 8)
    kv.launch_ahead()  # starts the worker
    kv.sync()
    worker = kv._worker
    assert worker is not None
    release = threading.Event()
    worker.launch(lambda: release.wait())  # a job still running when the next batch comes
    kv.add_request("b", list(range(8)))
    got = kv.allocate_ahead("b", 8)
    assert got is not None and len(got.plan.ops) == 2
    timer = threading.Timer(0.05, release.set)
    timer.start()
    try:
        kv.launch_ahead()  # waits for the stalled job, then launches "b"'s plan
        kv.sync()
    finally:
        release.set()
        timer.join()
    assert kv.mapped_pages == [{0, 1}, {0, 1}]
    stats = kv.stats()
    assert (stats["overlap.plans.async"], stats["overlap.launched"]) == (2, 3)
    assert stats["overlap.stalls"] >= 1
    assert stats["chunks.mapped.current"] == kv.allocator.usage().used_units
    kv.check_invariants(expensive=True)


def test_sync_applies_queued_plans_while_a_job_is_still_running(make_cache: MakeCache):
    kv = make_cache(hybrid_model(window=8), budget_chunks=64)
    kv.add_request("a", list(range(8)))
    kv.allocate_ahead("a", 8)
    kv.launch_ahead()
    kv.sync()
    assert kv._worker is not None
    release = threading.Event()
    kv._worker.launch(lambda: release.wait())
    kv.add_request("b", list(range(8)))
    kv.allocate_ahead("b", 8)
    timer = threading.Timer(0.05, release.set)
    timer.start()
    try:
        kv.sync()  # no launch_ahead: sync hands the queued plan over itself
    finally:
        release.set()
        timer.join()
    assert kv.mapped_pages == [{0, 1}, {0, 1}]
    assert kv.stats()["chunks.mapped.current"] == kv.allocator.usage().used_units
    kv.check_invariants(expensive=True)


def test_failed_reserve_in_init_releases_the_ranges_reserved_before_it():
    backend = HostBackend(granularity=CHUNK, capacity=64 << 20, vma_budget=3)
    pool = vmm.ChunkPool(backend, 64 * CHUNK)
    with pytest.raises(vmm.VmaBudgetExceeded, match="reserve needs 1 VMA, 3 of budget 3"):
        KVCache(hybrid_model(), pool, KVCacheConfig(dtype=torch.float32))  # 4 ranges
    stats = pool.stats()
    assert (stats["ranges.current"], stats["bytes.reserved.current"], stats["vmas.current"]) == (
        0,
        0,
        0,
    )
    pool.check_invariants(expensive=True)
    pool.close()
