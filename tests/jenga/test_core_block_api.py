"""`jenga._core.Core`'s one-call block API: ``allocate_blocks`` (a list, or ids written to
a caller's int32 table with ``out=``) and ``release`` of a list, tuple or int32 buffer;
``record_plan=False``; ``memory_bytes``. Semantics, bad input (specific exception with the
numbers, nothing changed) and agreement with ``allocate()`` on a twin core."""

from __future__ import annotations

import array
import random

import numpy as np
import pytest

from jenga import _core

FREE, USED, CACHED = 0, 1, 2


def snapshot(core: _core.Core) -> tuple[object, ...]:
    groups = range(core.num_groups)
    return (
        core.free_units,
        [core.group_counts(g) for g in groups],
        [core.eviction_order(g) for g in groups],
        core.page_eviction_order(),
    )


def test_allocate_blocks_returns_used_ids_and_release_frees_them() -> None:
    core = _core.Core([4], [1], 8)
    got = core.allocate_blocks(0, 6, 7, 1)
    assert isinstance(got, list) and len(set(got)) == 6
    assert all(core.block_info(0, b)[:2] == (USED, 1) for b in got)
    assert core.group_counts(0) == (2, 0, 2, 6)  # two pages of 4: 6 used, 2 free
    assert core.free_units == 6
    core.release(0, got, 2)
    assert core.group_counts(0) == (0, 0, 0, 0)
    assert core.free_units == 8
    core.check_invariants(True)


def test_out_table_receives_the_ids_and_the_count_is_returned() -> None:
    core = _core.Core([4], [1], 8)
    table = np.full(8, -7, np.int32)
    assert core.allocate_blocks(0, 5, 1, 1, out=table) == 5
    assert len(set(table[:5].tolist())) == 5 and (table[5:] == -7).all()
    core.release(0, table[:5], 2)  # a numpy int32 view, read as a buffer
    ids = array.array("i", [0, 0, 0])
    assert core.allocate_blocks(0, 3, 1, 3, out=ids) == 3
    core.release(0, ids, 4)
    assert core.free_units == 8
    core.check_invariants(True)


def test_no_room_is_none_and_changes_nothing() -> None:
    core = _core.Core([4], [1], 2)
    held = core.allocate_blocks(0, 5, 1, 1)
    before = snapshot(core)
    table = np.full(4, -7, np.int32)
    assert core.allocate_blocks(0, 4, 2, 2) is None
    assert core.allocate_blocks(0, 4, 2, 2, out=table) is None
    assert snapshot(core) == before and (table == -7).all()
    assert core.counters()["alloc.failures"] == 2
    core.release(0, held, 3)


def test_bad_allocate_input_raises_with_the_numbers_and_changes_nothing() -> None:
    core = _core.Core([4], [1], 8)
    before = snapshot(core)
    with pytest.raises(ValueError, match="block count must be >= 0, got -1"):
        core.allocate_blocks(0, -1, 1, 1)
    with pytest.raises(IndexError, match=r"group 3 out of range \[0, 1\)"):
        core.allocate_blocks(3, 1, 1, 1)
    with pytest.raises(ValueError, match="out holds 2 block ids, 3 requested"):
        core.allocate_blocks(0, 3, 1, 1, out=np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="writable, C-contiguous 1-D int32"):
        core.allocate_blocks(0, 1, 1, 1, out=np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="writable, C-contiguous 1-D int32"):
        core.allocate_blocks(0, 1, 1, 1, out=np.zeros(8, np.int32)[::2])
    with pytest.raises(ValueError, match="clock value"):
        core.allocate_blocks(0, 1, 1, 2**62)
    assert snapshot(core) == before
    # the next call after a failed one still serves (the reused count vector was reset)
    assert len(core.allocate_blocks(0, 2, 1, 1)) == 2


def test_bad_release_input_raises_with_the_numbers_and_releases_nothing() -> None:
    core = _core.Core([4], [1], 8)
    held = core.allocate_blocks(0, 3, 1, 1)
    free = next(b for b in range(4) if b not in held)
    before = snapshot(core)
    with pytest.raises(ValueError, match=f"block {free} is not in use"):
        core.release(0, [held[0], free], 2)
    with pytest.raises(ValueError, match=f"block {held[1]} is not in use"):
        core.release(0, (held[1], held[1]), 2)  # listed twice, one reference
    with pytest.raises(ValueError, match=r"blocks\[1\] = 4294967296 is not an int32"):
        core.release(0, [held[0], 2**32], 2)
    with pytest.raises(TypeError):
        core.release(0, [held[0], "1"], 2)
    with pytest.raises(ValueError, match="blocks must be 1-D, got 2"):
        core.release(0, np.array([held[:2]], np.int32), 2)
    assert snapshot(core) == before
    core.release(0, np.array(held, np.int64), 2)  # any integer array: converted
    assert core.free_units == 8


def test_record_plan_false_keeps_no_plan() -> None:
    kept = _core.Core([4], [1], 8)
    none = _core.Core([4], [1], 8, record_plan=False)
    assert kept.record_plan and not none.record_plan
    for core in (kept, none):
        core.release(0, core.allocate_blocks(0, 6, 1, 1), 2)
    assert [op[0] for op in kept.drain_plan()] == [0, 0, 1, 1]  # two maps, two unmaps
    assert none.drain_plan() == []
    assert snapshot(kept) == snapshot(none)


@pytest.mark.parametrize("seed", range(4))
def test_block_api_agrees_with_allocate_on_a_twin_core(seed: int) -> None:
    """Same ids, same eviction orders: the one-group call and the deferred page refresh
    of release() change nothing but the cost."""
    rnd = random.Random(seed)
    fast, ref = _core.Core([4, 2], [1, 1], 24), _core.Core([4, 2], [1, 1], 24)
    held: list[tuple[int, list[int]]] = []
    for now in range(1, 400):
        if held and rnd.random() < 0.45:
            g, blocks = held.pop(rnd.randrange(len(held)))
            fast.release(g, blocks, now)
            releases: list[list[int]] = [[], []]
            releases[g] = blocks
            assert ref.allocate(-1, [0, 0], now, releases) == [[], []]
            continue
        g, n, owner = rnd.randrange(2), rnd.randint(0, 6), rnd.randrange(5)
        got = fast.allocate_blocks(g, n, owner, now)
        counts = [0, 0]
        counts[g] = n
        want = ref.allocate(owner, counts, now)
        assert got == (None if want is None else want[g])
        if got:
            ids = np.array([[rnd.getrandbits(63), now] for _ in got], np.uint64)
            for core in (fast, ref):
                core.commit(g, got, ids, list(range(1, len(got) + 1)))
            held.append((g, got))
        assert snapshot(fast) == snapshot(ref)
    fast.check_invariants(True)


def test_memory_bytes_per_cached_block_stays_under_200() -> None:
    core = _core.Core([32], [1], 128, record_plan=False)
    empty = core.memory_bytes()
    rng = np.random.default_rng(1)
    for owner in range(128):
        blocks = core.allocate_blocks(0, 32, owner, owner)
        ids = rng.integers(0, 2**63, size=(32, 2), dtype=np.uint64)
        core.commit_run(0, np.asarray(blocks, np.int32), ids, 32, 16)
        core.release(0, blocks, owner)
    cached = core.group_counts(0)[1]
    assert cached == 128 * 32
    assert empty < core.memory_bytes() <= 200 * cached
