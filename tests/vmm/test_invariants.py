"""check_invariants catches corruption; host-only knobs (collapse, no zero chunk, faults in
budget changes) behave."""

from __future__ import annotations

import errno

import pytest
import torch
from vmm.host import HostBackend
from vmm.tensor import span_bytes

import vmm
from tests.vmm.vmm_helpers import HOST_GRANULARITY, check


def small_pool(**opts: object) -> vmm.ChunkPool:
    backend = HostBackend(HOST_GRANULARITY, capacity=1 << 24, collapse=bool(opts.get("collapse")))
    return vmm.ChunkPool(backend, 8 * HOST_GRANULARITY)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p, r: p.ledger._free.append(p.ledger._free[0]), "created 3 != free 2"),
        (lambda p, r: p.ledger._refcount.__setitem__(1, 2), r"refcounts .* != slots"),
        (lambda p, r: r._slot_to_handle.__setitem__(5, 0), r"mapped != 2"),
        (lambda p, r: setattr(p.ledger, "_budget_chunks", 2), "created 3 > budget 2"),
    ],
)
def test_check_invariants_catches_corruption(corrupt, message):
    pool = small_pool()
    rng = pool.reserve(8 * HOST_GRANULARITY)
    rng.map([0, 1, 2])
    rng.unmap([2])
    check(pool)
    corrupt(pool, rng)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants(expensive=True)
    pool.ledger._free, pool.ledger._refcount, pool.ledger._budget_chunks = [2], {0: 1, 1: 1}, 8
    rng._slot_to_handle[5] = -1
    check(pool)
    pool.close()


def test_range_table_must_match_the_backend():
    pool = small_pool()
    rng = pool.reserve(4 * HOST_GRANULARITY)
    rng.map([1])
    rng._slot_to_handle[1], rng._slot_to_handle[2] = -1, 0
    with pytest.raises(AssertionError, match="backend disagrees"):
        rng.check_invariants(expensive=True)
    rng._slot_to_handle[1], rng._slot_to_handle[2] = 0, -1
    pool.close()


def test_budget_shrink_fails_cleanly_under_a_fault():
    pool = small_pool()
    rng = pool.reserve(8 * HOST_GRANULARITY)
    rng.map([0, 1, 2, 3])
    rng.unmap([1, 3])
    before = pool.stats()
    backend = pool.backend
    assert isinstance(backend, HostBackend)
    backend.inject_fault(1, errno.EIO)
    with pytest.raises(vmm.BackendError, match=r"PUNCH_HOLE.*errno 5") as err:
        pool.set_budget(2 * HOST_GRANULARITY)
    assert (err.value.op, err.value.code) == ("release", errno.EIO)
    assert pool.stats() == before
    check(pool)
    pool.set_budget(2 * HOST_GRANULARITY)
    assert pool.stats()["chunks.created.current"] == 2
    pool.close()


def test_collapse_is_best_effort():
    pool = small_pool(collapse=True)
    rng = pool.reserve(8 * HOST_GRANULARITY)
    rng.map([0, 1])
    rng.tensor((4,), torch.int64).fill_(9)
    assert rng.tensor((4,), torch.int64).tolist() == [9, 9, 9, 9]
    pool.close()


class NoZeroBackend(HostBackend):
    @property
    def zero_handle(self) -> int | None:
        return None


def test_zero_backed_needs_a_zero_chunk():
    pool = vmm.ChunkPool(NoZeroBackend(granularity=HOST_GRANULARITY), HOST_GRANULARITY)
    with pytest.raises(vmm.MappingError, match="backend 'host' has no zero chunk"):
        pool.reserve(HOST_GRANULARITY, zero_backed=True)
    pool.close()


def test_span_bytes_of_the_cuda_path():
    assert span_bytes((2, 3), None, 4) == 24
    assert span_bytes((2, 3), (5, 1), 2) == (5 + 2 + 1) * 2
    assert span_bytes((0, 3), (5, 1), 2) == 0
    with pytest.raises(vmm.AlignmentError, match="2 dims but 1 strides"):
        span_bytes((2, 3), (1,), 2)
