"""Mapping plans: all-or-nothing under bad input, OOM, the VMA budget and injected syscall
faults at every k; state is compared in full (stats, free set, refcounts, slot tables, the
backend's own slot tables)."""

from __future__ import annotations

import errno

import pytest
import torch
from vmm.host import HostBackend

import vmm
from tests.vmm.vmm_helpers import HOST_GRANULARITY, check, data_view, snapshot


def setup(pool: vmm.ChunkPool) -> list[vmm.VirtualRange]:
    """Three ranges with mapped, shared and zero-backed slots, and one free chunk."""
    gran = pool.granularity
    a = pool.reserve(8 * gran, name="a")
    b = pool.reserve(8 * gran, name="b")
    z = pool.reserve(8 * gran, name="z", zero_backed=True)
    a.map([0, 1, 2, 3])
    b.map([0, 5])
    z.share_from(a, [1], [4])
    b.unmap([5])  # one free chunk to reuse
    for i, rng in enumerate((a, b)):
        data_view(rng, (gran // 4,), torch.int32, write=True).fill_(100 + i)
    return [a, b, z]


def big_plan(ranges: list[vmm.VirtualRange]) -> vmm.MappingPlan:
    a, b, z = ranges
    return (
        vmm.MappingPlan()
        .unmap(a, [3])
        .map(b, [1, 2, 3])  # reuses two free chunks, creates one
        .remap(a, [0], z, [0])
        .share(a, [2], b, [7])
        .map(z, [6, 7])
        .unmap(z, [4])
    )


def test_plan_applies_in_order_and_returns_handles(make_pool):
    pool = make_pool(16)
    ranges = setup(pool)
    a, b, z = ranges
    results = big_plan(ranges).apply()
    assert len(results) == 6
    assert z.handle(0) == results[2][0] and a.handle(0) is None
    assert b.handle(7) == a.handle(2)
    assert int(data_view(z, (1,), torch.int32)[0]) == 100  # remapped data came along
    stats = pool.stats()
    assert (stats["plans.applied"], stats["ops.remap"], stats["ops.share"]) == (1, 1, 2)
    check(pool)


def test_bad_op_mid_plan_rolls_everything_back(make_pool):
    pool = make_pool(16)
    ranges = setup(pool)
    a = ranges[0]
    before = snapshot(pool, ranges)
    plan = big_plan(ranges).map(a, [1])  # slot 1 is mapped: fails after six good ops
    with pytest.raises(vmm.MappingError, match="slot 1 of range 'a' is mapped"):
        plan.apply()
    assert snapshot(pool, ranges) == before
    assert pool.stats()["plans.rolled_back"] == 1
    assert int(data_view(a, (1,), torch.int32)[0]) == 100
    check(pool)


def test_out_of_memory_mid_plan_rolls_back(make_pool):
    pool = make_pool(7)
    ranges = setup(pool)
    before = snapshot(pool, ranges)
    plan = big_plan(ranges)  # its fifth op needs 2 chunks more than the budget of 7 allows
    with pytest.raises(vmm.OutOfMemory, match=r"needs 2 chunks, pool has 0 free of 7 \("):
        plan.apply()
    assert snapshot(pool, ranges) == before
    check(pool)


def test_vma_budget_mid_plan_rolls_back():
    # setup costs 7 VMAs; the plan's ops take it to 7, 9, 11, 12, 13 (the last op fails)
    pool = vmm.ChunkPool(HostBackend(granularity=HOST_GRANULARITY, vma_budget=12), 16 << 16)
    ranges = setup(pool)
    assert pool.stats()["vmas.current"] == 7
    before = snapshot(pool, ranges)
    plan = big_plan(ranges)
    expected = r"map of 2 slots needs 1 more VMAs, 12 of budget 12"
    with pytest.raises(vmm.VmaBudgetExceeded, match=expected):
        plan.apply()
    assert snapshot(pool, ranges) == before
    check(pool)
    pool.close()


def test_every_failing_syscall_leaves_state_identical():
    def fresh() -> tuple[vmm.ChunkPool, list[vmm.VirtualRange]]:
        backend = HostBackend(granularity=HOST_GRANULARITY, capacity=1 << 24)
        pool = vmm.ChunkPool(backend, 16 * HOST_GRANULARITY)
        return pool, setup(pool)

    pool, ranges = fresh()
    backend = pool.backend
    assert isinstance(backend, HostBackend)
    start = backend.syscalls
    big_plan(ranges).apply()
    calls = backend.syscalls - start
    done = snapshot(pool, ranges)
    pool.close()
    assert calls >= 8
    for k in range(1, calls + 1):
        pool, ranges = fresh()
        backend = pool.backend
        assert isinstance(backend, HostBackend)
        before = snapshot(pool, ranges)
        backend.inject_fault(k, errno.ENOMEM)
        with pytest.raises((vmm.BackendError, vmm.OutOfMemory)) as err:
            big_plan(ranges).apply()
        assert "errno 12" in str(err.value), k
        assert snapshot(pool, ranges) == before, f"state differs after a fault at syscall {k}"
        assert pool.stats()["plans.rolled_back"] == 1
        check(pool)
        assert int(ranges[0].tensor((1,), torch.int32)[0]) == 100
        big_plan(ranges).apply()  # the same plan then goes through
        after = snapshot(pool, ranges)
        after["stats"]["plans.applied"] = done["stats"]["plans.applied"]
        assert after == done, k
        pool.close()


def test_plan_refuses_ranges_of_two_pools(make_pool):
    p1, p2 = make_pool(2), make_pool(2)
    r1, r2 = p1.reserve(p1.granularity), p2.reserve(p2.granularity)
    r1.map([0])
    with pytest.raises(vmm.MappingError, match="another pool"):
        vmm.MappingPlan().unmap(r1, [0]).map(r2, [0]).apply()
    assert r1.handle(0) == 0 or p1.backend.name != "host"
    with pytest.raises(vmm.MappingError, match="2 source slots, 1 targets"):
        vmm.MappingPlan().remap(r1, [0, 1], r2, [0])
    assert vmm.MappingPlan().apply() == []
