"""Experiment (not the allocator's behaviour): out-of-window blocks cached as the oldest.

Runs `jenga-sim` with `JengaAllocator.allocate` wrapped so that blocks leaving a
sliding window (or chunk) enter the prefix cache with last access 0 instead of the
current time, before the normal allocation. Used in docs/reproduction.md to test the
hypothesis that recent requests' out-of-window blocks, newer than older articles'
blocks, keep Jenga's cached article as large as uniform paging's under LRU.
Not all-or-nothing (the early release stays if the allocation then fails): an experiment.

    .venv/bin/python benchmarks/sim_window_release_experiment.py --scenario articles-gemma \
        --max-num-seqs 1 --sweep-kv-gib 4,8,12,16,24 --allocators uniform,jenga_vmm
"""

from __future__ import annotations

import sys
from collections.abc import Hashable

import jenga.allocator as alloc_mod
from jenga.sim.cli import main

_original = alloc_mod.JengaAllocator.allocate


def _allocate_releasing_old(
    self: alloc_mod.JengaAllocator, request_id: Hashable, num_new_tokens: int
) -> alloc_mod.Allocation | None:
    req = self._request(request_id)
    for g, policy in enumerate(self.policies):
        table = req.tables[g]
        first = min(policy.first_live_block(req.num_tokens, req.images), len(table))
        if first > req.first_live[g]:
            self._core.release(g, table.view(req.first_live[g], first), 0)
            table.view(req.first_live[g], first)[:] = alloc_mod.NULL_BLOCK
            req.first_live[g] = first
    return _original(self, request_id, num_new_tokens)


if __name__ == "__main__":
    alloc_mod.JengaAllocator.allocate = _allocate_releasing_old  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
