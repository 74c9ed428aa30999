"""Failure paths of the vmm core (host backend): huge views, broken pools, ENOMEM, failed undo."""

from __future__ import annotations

import errno
import subprocess
import sys
from typing import Any

import pytest
import torch
from vmm._core import host as _h
from vmm.host import HostBackend

import vmm
from vmm import tensor as vmm_tensor

G = 64 << 10


def make_pool(budget_chunks: int = 8, reserve_ahead: int = 0, **opts: Any) -> vmm.ChunkPool:
    backend = HostBackend(granularity=G, capacity=64 * G, vma_budget=64, **opts)
    return vmm.ChunkPool(backend, budget_chunks * G, reserve_ahead=reserve_ahead)


def fail_unmaps(backend: HostBackend) -> list[int]:
    """Make every unmap of `backend` fail (EIO); returns the list of attempts."""
    attempts: list[int] = []

    def unmap(vas: Any, *, to_zero: bool = False) -> None:
        attempts.append(len(vas))
        raise vmm.BackendError("unmap failed (injected)", op="unmap", code=errno.EIO)

    backend.unmap = unmap  # type: ignore[method-assign]
    return attempts


def break_pool() -> tuple[vmm.ChunkPool, vmm.VirtualRange, vmm.VirtualRange]:
    """A pool whose plan rollback failed: map fails on its 2nd call, unmap always."""
    pool = make_pool()
    first, second = pool.reserve(4 * G, name="a"), pool.reserve(4 * G, name="b")
    first.tensor((1,), torch.float32)  # warms the dtype table: the fast path is live
    backend = pool.backend
    assert isinstance(backend, HostBackend)
    real_map, calls = backend.map, []

    def map_second_fails(vas: Any, handles: Any) -> None:
        calls.append(len(vas))
        if len(calls) == 2:
            raise vmm.BackendError("map failed (injected)", op="map", code=errno.EIO)
        real_map(vas, handles)

    backend.map = map_second_fails  # type: ignore[method-assign]
    attempts = fail_unmaps(backend)
    plan = vmm.MappingPlan().map(first, [0, 1]).map(second, [0])
    with pytest.raises(vmm.BackendError, match="rollback of a mapping plan failed 3 times"):
        plan.apply(pool)
    assert (calls, attempts) == ([2, 1], [2, 2, 2])
    assert pool.broken
    return pool, first, second


# ---- 1: view size overflow ---------------------------------------------------------------
def test_huge_view_shape_raises_range_error_instead_of_aborting():
    code = (
        "import torch, vmm\n"
        "from vmm.host import HostBackend\n"
        f"pool = vmm.ChunkPool(HostBackend(granularity={G}, capacity={64 * G}), {8 * G})\n"
        f"rng = pool.reserve({4 * G})\n"
        "for shape in [(2**62, 4), (4, 2**62), (2**40, 2**40), (0, 2**40, 2**40)]:\n"
        "    try:\n"
        "        rng.tensor(shape, torch.float32)\n"
        "        print('view')\n"
        "    except vmm.RangeError:\n"
        "        print('RangeError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.split()) == (0, ["RangeError"] * 4), out.stderr


def test_huge_strides_and_offsets_raise_range_error():
    pool = make_pool()
    rng = pool.reserve(4 * G)
    with pytest.raises(vmm.RangeError, match=r"dim 0 \(size 4, stride 4611686018427387904\)"):
        rng.tensor((4,), torch.float32, strides=(2**62,))
    with pytest.raises(vmm.RangeError, match="overflows int64"):
        rng.tensor((3, 2), torch.float32, strides=(2**61, 1))
    with pytest.raises(vmm.RangeError, match="leaves the 262144-byte range"):
        rng.tensor((4,), torch.float32, offset=2**63 - 8)
    assert rng.tensor((4,), torch.float32, offset=4 * G - 16).shape == (4,)
    pool.close()


def test_view_factory_rejects_a_non_positive_item_size():
    pool = make_pool()
    rng = pool.reserve(4 * G)
    assert rng.view_factory is not None
    with pytest.raises(_h.HostArgError, match="0 bits x 1 lanes has no positive item size"):
        rng.view_factory.capsule(4, (4,), (), 2, 0, 1)
    with pytest.raises(_h.HostArgError, match="32 bits x 0 lanes"):
        rng.view_factory.capsule(4, (4,), (), 2, 32, 0)
    pool.close()


def test_python_span_of_the_same_view_is_exact_and_out_of_range():
    # The CUDA path checks spans in Python: ints do not wrap, so the span is exact.
    assert vmm_tensor.span_bytes((2**62, 4), None, 4) == 2**66
    assert vmm_tensor.span_bytes((4,), (2**62,), 4) == (3 * 2**62 + 1) * 4


# ---- 3: closing a broken pool ---------------------------------------------------------------
def test_close_of_a_broken_pool_tears_down_through_the_backend():
    pool, first, second = break_pool()
    backend = pool.backend
    assert isinstance(backend, HostBackend)
    pool.close()
    assert (pool.closed, backend.closed, first.closed, second.closed) == (True, True, True, True)
    assert (first.num_mapped, second.num_mapped, first.slot_to_handle()) == (0, 0, {})
    assert backend.physical_bytes() == 0
    assert pool.stats()["ranges.current"] == 0
    pool.close()  # idempotent
    with pytest.raises(vmm.ClosedError):
        first.map([2])


# ---- 6: the tensor fast path checks the pool ---------------------------------------------------
def test_range_of_a_broken_pool_refuses_views():
    pool, first, _ = break_pool()
    with pytest.raises(vmm.BackendError, match="chunk pool is broken"):
        first.tensor((4,), torch.float32)
    with pytest.raises(vmm.BackendError, match="chunk pool is broken"):
        first.tensor((4,), "float32")
    pool.close()


def test_fast_path_still_reports_view_errors_as_vmm_errors():
    pool = make_pool()
    rng = pool.reserve(4 * G)
    with pytest.raises(vmm.RangeError, match="leaves the 262144-byte range"):
        rng.tensor((4 * G,), torch.float32)
    with pytest.raises(vmm.AlignmentError, match="misaligned"):
        rng.tensor((4,), torch.float32, offset=2)
    pool.close()
    with pytest.raises(vmm.ClosedError):
        rng.tensor((4,), torch.float32)


# ---- 7: ENOMEM of every op is an out-of-memory error ---------------------------------------------
def test_enomem_from_map_and_reserve_raises_out_of_memory():
    pool = make_pool(reserve_ahead=2)
    rng = pool.reserve(4 * G)
    backend = pool.backend
    assert isinstance(backend, HostBackend)
    backend.inject_fault(1, errno.ENOMEM)
    with pytest.raises(vmm.OutOfMemory, match=r"errno 12.*ENOMEM in map; the process holds \d+"):
        rng.map([0])
    assert (rng.num_mapped, pool.num_free) == (0, 2)
    backend.inject_fault(1, errno.ENOSPC)
    with pytest.raises(vmm.OutOfMemory, match=r"ENOSPC in map"):
        rng.map([0])
    backend.inject_fault(1, errno.ENOMEM)
    with pytest.raises(vmm.OutOfMemory, match=r"ENOMEM in reserve"):
        pool.reserve(4 * G)
    backend.inject_fault(1, errno.EIO)
    with pytest.raises(vmm.BackendError, match="errno 5"):
        rng.map([0])
    assert rng.map([0]) == [0]
    pool.check_invariants(expensive=True)
    pool.close()


# ---- 9: remap whose compensation fails -----------------------------------------------------------
def test_remap_whose_undo_fails_marks_the_pool_broken():
    pool = make_pool()
    src, dst = pool.reserve(4 * G, name="src"), pool.reserve(4 * G, name="dst")
    src.map([0, 1])
    assert isinstance(pool.backend, HostBackend)
    attempts = fail_unmaps(pool.backend)
    with pytest.raises(vmm.BackendError, match="remap of 2 slots into 'dst' could not be undone"):
        dst.remap_from(src, [0, 1], [2, 3])
    assert attempts == [2, 2]  # the source unmap, then the compensating one
    assert "source unmap failed" in pool.broken
    with pytest.raises(vmm.BackendError, match="chunk pool is broken"):
        dst.map([0])
    pool.close()
    assert (pool.closed, src.closed, dst.closed) == (True, True, True)


def test_remap_whose_source_unmap_fails_once_is_undone():
    pool = make_pool()
    src, dst = pool.reserve(4 * G, name="src"), pool.reserve(4 * G, name="dst")
    src.map([0, 1])
    backend = pool.backend
    assert isinstance(backend, HostBackend)
    backend.inject_fault(1, errno.EIO)  # the source unmap; the compensation succeeds
    with pytest.raises(vmm.BackendError, match="errno 5"):
        dst.remap_from(src, [0, 1], [2, 3])
    assert (src.slot_to_handle(), dst.slot_to_handle(), pool.broken) == ({0: 0, 1: 1}, {}, "")
    pool.check_invariants(expensive=True)
    pool.close()


# ---- process-wide VMA ledger, failed rollback, close always succeeds ----------------------


def test_two_pools_share_one_process_vma_budget() -> None:
    """Every host backend draws on one process-wide ledger of vm.max_map_count, so two
    pools cannot exhaust the kernel limit between them."""
    old = vmm.host.process_vma_budget()
    pools = [vmm.ChunkPool(vmm.HostBackend(G, capacity=1 << 28), 32 * G) for _ in range(2)]
    try:
        ranges = [p.reserve(16 * G, name=f"p{i}") for i, p in enumerate(pools)]
        vmm.host.set_process_vma_budget(vmm.host.process_vmas() + 8)
        ranges[0].map([0, 2, 4, 6])  # isolated slots: +2 VMAs each, the shared budget is full
        before = pools[1].stats()
        with pytest.raises(vmm.VmaBudgetExceeded) as info:
            ranges[1].map([0, 2])
        message = str(info.value)
        assert "process-wide budget" in message and "needs 3 more VMAs" in message, message
        assert pools[1].stats() == before
        ranges[0].unmap([0, 2, 4, 6])
        ranges[1].map([0, 2])  # room again once the other pool gave its VMAs back
    finally:
        vmm.host.set_process_vma_budget(old)
        for p in pools:
            p.close()
            assert p.close_errors == []


def test_failed_rollback_marks_the_pool_broken_and_close_still_succeeds() -> None:
    """A batch failing with ENOMEM whose own rollback fails too marks the pool broken:
    later calls raise BackendError naming it, and close still succeeds."""
    backend = vmm.HostBackend(G, capacity=1 << 28)
    pool = vmm.ChunkPool(backend, 16 * G, reserve_ahead=4)
    rng = pool.reserve(8 * G, name="r")
    backend.inject_fault(2, errno.ENOMEM, count=2)  # 2nd run fails, so does undoing the 1st
    with pytest.raises(vmm.BackendError) as info:
        rng.map([0, 2])
    assert "rollback failed" in str(info.value)
    assert "rollback failed" in pool.broken
    with pytest.raises(vmm.BackendError, match="broken"):
        rng.map([4])
    pool.close()
    assert pool.closed and rng.closed
    assert backend.closed
