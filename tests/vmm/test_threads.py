"""Several threads on one pool: budget, refcounts and slot tables stay exact.

Before the ledger lock, two threads on one pool overshot the budget (13 chunks of 12) and
corrupted refcounts: `take` read the free heap, the backend call released the GIL, the
other thread took the same room. A tiny switch interval makes such interleavings likely."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator

import pytest

import vmm
from tests.threads import fast_switching, run_threads
from tests.vmm.vmm_helpers import HOST_GRANULARITY

THREADS = 4
STEPS = 400
BUDGET = 12


@pytest.fixture(autouse=True)
def _fast_switching() -> Iterator[None]:
    with fast_switching():
        yield


def _run_threads(work: Callable[[int], None], n: int = THREADS) -> None:
    run_threads(work, n)


def _pool(budget: int = BUDGET) -> vmm.ChunkPool:
    backend = vmm.HostBackend(HOST_GRANULARITY, capacity=1 << 28)
    return vmm.ChunkPool(backend, budget * HOST_GRANULARITY)


def test_threads_mapping_one_pool_never_overshoot_the_budget() -> None:
    pool = _pool()
    ranges = [pool.reserve(8 * HOST_GRANULARITY, name=f"r{i}") for i in range(THREADS)]
    peak = [0]

    def work(i: int) -> None:
        rng, rnd = ranges[i], random.Random(i)
        for _ in range(STEPS):
            free = [s for s in range(rng.num_slots) if rng.handle(s) is None]
            mapped = [s for s in range(rng.num_slots) if rng.handle(s) is not None]
            try:
                if mapped and (not free or rnd.random() < 0.5):
                    rng.unmap(rnd.sample(mapped, rnd.randint(1, len(mapped))))
                else:
                    rng.map(rnd.sample(free, rnd.randint(1, min(3, len(free)))))
            except vmm.OutOfMemory:
                pass
            peak[0] = max(peak[0], pool.num_created)
            pool.check_invariants()

    _run_threads(work)
    assert peak[0] <= BUDGET, f"{peak[0]} chunks created of a {BUDGET}-chunk budget"
    pool.check_invariants(expensive=True)
    pool.close()


def test_plans_and_shares_from_several_threads_keep_refcounts() -> None:
    pool = _pool(budget=64)
    src = pool.reserve(16 * HOST_GRANULARITY, name="src")
    src.map(list(range(8)))
    dsts = [pool.reserve(16 * HOST_GRANULARITY, name=f"d{i}") for i in range(THREADS)]

    def work(i: int) -> None:
        dst, rnd = dsts[i], random.Random(100 + i)
        for _ in range(STEPS // 2):
            shared = rnd.sample(range(8), 2)
            plan = vmm.MappingPlan().share(src, shared, dst, [0, 1]).map(dst, [2, 3])
            plan.apply()
            pool.check_invariants()
            vmm.MappingPlan().unmap(dst, [0, 1, 2, 3]).apply()

    _run_threads(work)
    pool.check_invariants(expensive=True)
    assert pool.stats()["chunks.shared.current"] == 0
    pool.close()


def test_mapping_worker_while_the_main_thread_reserves_and_closes() -> None:
    """The KV cache's overlap worker maps while the scheduler reserves and closes ranges."""
    pool = _pool(budget=32)
    worker_range = pool.reserve(8 * HOST_GRANULARITY, name="worker")
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while not stop.is_set():
                worker_range.map([0, 1, 2])
                worker_range.unmap([0, 1, 2])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for i in range(200):
            rng = pool.reserve(4 * HOST_GRANULARITY, name=f"main{i}")
            rng.map([0, 1])
            pool.stats()
            rng.close()
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    pool.check_invariants(expensive=True)
    pool.close()
