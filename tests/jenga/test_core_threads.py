"""Several threads on one `jenga._core.Core`: the bindings drop the GIL, so before the
core's API mutex two threads interleaved inside its tables (ASan: heap-use-after-free in
the shared undo log; segfaults in 2 of 4 runs). Each call is now one critical section."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest

from jenga import _core
from tests.threads import fast_switching, run_threads

THREADS = 4
STEPS = 1000
TOTAL = 256


@pytest.fixture(autouse=True)
def _fast_switching() -> Iterator[None]:
    with fast_switching():
        yield


def test_threads_allocating_and_releasing_on_one_core_keep_its_invariants() -> None:
    core = _core.Core([16, 8], [1, 1], TOTAL)
    clock = iter(range(1, 10**9))

    def work(owner: int) -> None:
        rnd = random.Random(owner)
        held: list[list[int]] = [[], []]
        for _ in range(STEPS):
            if rnd.random() < 0.55:
                counts = [rnd.randint(0, 96), rnd.randint(0, 48)]
                got = core.allocate(owner, counts, next(clock))
                if got is not None:
                    for g, blocks in enumerate(got):
                        held[g].extend(blocks)
                        hashes = [rnd.getrandbits(63) for _ in blocks]  # cached on release
                        core.commit(g, blocks, hashes, [1] * len(blocks))
            else:
                for g in (0, 1):
                    if held[g]:
                        core.release(g, np.array(held[g], dtype=np.int32), next(clock))
                        held[g] = []
            core.drain_plan()
            core.counters()
        for g in (0, 1):
            core.release(g, np.array(held[g], dtype=np.int32), next(clock))

    run_threads(work, THREADS)
    core.check_invariants(True)
    assert core.free_units == TOTAL - sum(n for n, *_ in (core.group_counts(g) for g in (0, 1)))


def test_gil_holding_block_calls_beside_gil_releasing_ones_neither_deadlock_nor_corrupt() -> None:
    """`allocate_blocks` / `release` on few blocks wait for the API mutex with the GIL
    held; the mutex's holders (GIL released) never wait for the GIL, so this finishes."""
    core = _core.Core([16, 8], [1, 1], TOTAL)
    clock = iter(range(1, 10**9))

    def work(owner: int) -> None:
        rnd = random.Random(owner)
        held: list[list[int]] = [[], []]
        for _ in range(STEPS):
            g = rnd.randrange(2)
            if rnd.random() < 0.55:
                if owner % 2:
                    got = core.allocate_blocks(g, rnd.randint(0, 40), owner, next(clock))
                else:
                    counts = [0, 0]
                    counts[g] = rnd.randint(0, 40)
                    both = core.allocate(owner, counts, next(clock))
                    got = None if both is None else both[g]
                held[g].extend(got or [])
            elif held[g]:
                core.release(g, held[g], next(clock))
                held[g] = []
        for g in (0, 1):
            core.release(g, held[g], next(clock))

    run_threads(work, THREADS)
    core.check_invariants(True)
    assert core.free_units == TOTAL
