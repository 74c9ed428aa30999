"""ChunkPool on every backend: budget, reuse, refcounts, OOM numbers, run-time resizing."""

from __future__ import annotations

import pytest

import vmm
from tests.vmm.vmm_helpers import check


def test_map_takes_chunks_and_unmap_keeps_them_ready(make_pool):
    pool = make_pool(8)
    rng = pool.reserve(8 * pool.granularity, name="k")
    handles = rng.map([0, 1, 2])
    if pool.backend.name == "host":
        assert handles == [0, 1, 2]  # lowest memfd offsets first
    check(pool)
    handles = rng.unmap([1])
    stats = pool.stats()
    assert (stats["chunks.created.current"], stats["chunks.free.current"]) == (3, 1)
    assert (stats["chunks.mapped.current"], stats["ops.map"], stats["ops.unmap"]) == (2, 3, 1)
    assert rng.map([5]) == handles  # the ready chunk is reused, nothing created
    assert pool.stats()["ops.create"] == 3
    check(pool)


def test_out_of_memory_carries_needed_free_total(make_pool):
    pool = make_pool(4)
    rng = pool.reserve(8 * pool.granularity)
    rng.map([0, 1, 2])
    before = pool.stats()
    with pytest.raises(vmm.OutOfMemory, match=r"needs 2 chunks, pool has 1 free of 4") as err:
        rng.map([3, 4])
    assert (err.value.needed, err.value.free, err.value.total) == (2, 1, 4)
    assert pool.stats() == before
    assert rng.slot_to_handle().keys() == {0, 1, 2}
    check(pool)


def test_shared_chunk_is_refcounted(make_pool):
    pool = make_pool(4)
    a = pool.reserve(4 * pool.granularity, name="a")
    b = pool.reserve(4 * pool.granularity, name="b")
    (h,) = a.map([0])
    b.share_from(a, [0], [3])
    assert pool.ledger.refcounts()[h] == 2
    assert pool.stats()["chunks.shared.current"] == 1
    a.unmap([0])
    assert pool.ledger.refcounts()[h] == 1 and pool.num_free == 0
    b.unmap([3])
    assert h not in pool.ledger.refcounts() and pool.num_free == 1
    check(pool)


def test_budget_grows_and_shrinks_at_run_time(make_pool):
    pool = make_pool(4, reserve_ahead=4)
    gran = pool.granularity
    assert pool.stats()["chunks.free.current"] == 4  # created ahead of need
    rng = pool.reserve(8 * gran)
    rng.map([0, 1])
    with pytest.raises(vmm.BudgetError, match=r"below the 2 chunks .* in use"):
        pool.set_budget(1 * gran)
    assert pool.budget_bytes == 4 * gran
    pool.set_budget(2 * gran)  # releases the two free chunks
    stats = pool.stats()
    assert (stats["chunks.created.current"], stats["ops.release"]) == (2, 2)
    with pytest.raises(vmm.OutOfMemory):
        rng.map([2])
    pool.set_budget(6 * gran)  # grows and tops up to reserve_ahead
    assert pool.stats()["chunks.free.current"] == 4
    rng.map([2, 3, 4, 5])
    assert pool.stats()["chunks.created.current"] == 6
    with pytest.raises(vmm.BudgetError, match="not a non-negative multiple"):
        pool.set_budget(gran + 1)
    check(pool)


def test_range_and_pool_use_after_close(make_pool):
    pool = make_pool(4)
    rng = pool.reserve(4 * pool.granularity)
    rng.map([0])
    rng.close()
    rng.close()  # idempotent
    assert pool.stats()["chunks.free.current"] == 1
    with pytest.raises(vmm.ClosedError, match="after its range was closed"):
        rng.map([1])
    other = pool.reserve(4 * pool.granularity)
    pool.close()
    with pytest.raises(vmm.ClosedError, match="after its pool was closed"):
        other.unmap([0])
    with pytest.raises(vmm.ClosedError, match="pool used after close"):
        pool.reserve(pool.granularity)
    with pytest.raises(vmm.ClosedError):
        pool.set_budget(0)


def test_bad_slots_are_refused_with_numbers(make_pool):
    pool = make_pool(4)
    rng = pool.reserve(4 * pool.granularity, name="swa")
    with pytest.raises(vmm.RangeError, match=r"slot 4 is outside range 'swa' of 4 slots"):
        rng.map([4])
    with pytest.raises(vmm.MappingError, match="listed twice"):
        rng.map([1, 1])
    rng.map([1])
    with pytest.raises(vmm.MappingError, match=r"slot 1 of range 'swa' is mapped to chunk"):
        rng.map([0, 1])
    with pytest.raises(vmm.MappingError, match=r"slot 2 of range 'swa' is unmapped"):
        rng.unmap([2])
    with pytest.raises(vmm.AlignmentError, match="positive multiple"):
        pool.reserve(pool.granularity + 4096)
    assert pool.stats()["chunks.created.current"] == 1
    check(pool)
