"""Chunk pool: the physical chunks of one backend under a byte budget.

Rationale
---------
Creating a physical chunk is the slow VMM call (cuMemCreate ~200 µs per 2 MiB on an
A100, against ~1.5 µs for cuMemMap), so chunks are created ahead of need and reused
after unmap instead of being released (vTensor's pSet, "lazy release"). The budget is a
run-time knob: shrinking it hands free chunks back to the device / OS at once.

Approach
--------
::

    created chunks = free (ready heap, refcount 0)  +  mapped (refcount >= 1)
                     ^ reused lowest-first            ^ refcount = slots mapping it

* `free` is a min-heap of handles: taking the lowest first hands adjacent slots
  adjacent host memfd offsets, so their mappings merge into one VMA.
* `refcount[h]` counts the slots (in any range) that map h; a chunk mapped at two
  addresses (a shared prefix) has refcount 2 and returns to `free` when both unmap.
* Only `VirtualRange` and `MappingPlan` move chunks between the two sets, through the
  `_take` / `_untake` / `_retain` / `_drop` helpers, each of which keeps
  `created == free + mapped` (the chunks of one in-flight call aside).

Invariants (`check_invariants`): created <= budget; free and mapped are disjoint and
cover every created chunk; every refcount equals the number of slots mapping the chunk
over all open ranges; the backend agrees on the chunk count.

Limitations
-----------
Single-threaded: callers serialize calls on one pool (the engine's scheduler step does).
Reused chunks keep their old contents (like `torch.empty`); freshly created ones are zero.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vmm.backend import Backend
from vmm.errors import BackendError, BudgetError, ClosedError, OutOfMemory
from vmm.stats import new_counters

if TYPE_CHECKING:
    from vmm.plan import MappingPlan
    from vmm.range import VirtualRange


class ChunkPool:
    """Physical chunks of `backend` under a byte budget; owns the backend (closes it).

    Args:
        backend: the backend whose chunks this pool manages.
        budget_bytes: most bytes of chunks that may exist, a multiple of the granularity.
        reserve_ahead: chunks to keep created and free ahead of need (`top_up`).
    """

    def __init__(self, backend: Backend, budget_bytes: int, *, reserve_ahead: int = 0) -> None:
        self.backend = backend
        self.granularity = backend.granularity
        self._budget_chunks = self._chunks_of_budget(budget_bytes)
        if reserve_ahead < 0:
            raise ValueError(f"reserve_ahead must be >= 0, got {reserve_ahead}")
        self.reserve_ahead = reserve_ahead
        self._free: list[int] = []  # min-heap of ready handles
        self._refcount: dict[int, int] = {}  # mapped handle -> slots mapping it
        self._num_created = 0
        self._ranges: dict[int, VirtualRange] = {}  # id -> open range
        self._counters = new_counters()
        self._closed = False
        self._broken = ""  # why the pool can no longer be trusted (failed rollback), or ""
        self.top_up()

    # ---- budget ---------------------------------------------------------------------
    def _chunks_of_budget(self, budget_bytes: int) -> int:
        if budget_bytes < 0 or budget_bytes % self.granularity:
            raise BudgetError(
                f"budget {budget_bytes} bytes is not a non-negative multiple of the "
                f"{self.granularity}-byte granularity"
            )
        return budget_bytes // self.granularity

    @property
    def budget_bytes(self) -> int:
        return self._budget_chunks * self.granularity

    @property
    def num_free(self) -> int:
        """Created chunks mapped nowhere (ready handles)."""
        return len(self._free)

    @property
    def num_created(self) -> int:
        return self._num_created

    @property
    def num_mapped(self) -> int:
        """Chunks mapped at one slot or more."""
        return len(self._refcount)

    def set_budget(self, budget_bytes: int) -> None:
        """Grow or shrink the budget at run time.

        Shrinking releases free chunks (highest handles first) until the created chunks fit;
        it refuses, changing nothing, when the chunks in use alone exceed the new budget.
        """
        self._check_open()
        new_chunks = self._chunks_of_budget(budget_bytes)
        in_use = len(self._refcount)
        if in_use > new_chunks:
            raise BudgetError(
                f"budget {budget_bytes} bytes ({new_chunks} chunks) is below the {in_use} "
                f"chunks ({in_use * self.granularity} bytes) in use"
            )
        excess = self._num_created - new_chunks
        if excess > 0:
            self._release_free(excess)
        self._budget_chunks = new_chunks
        self.top_up()

    def _release_free(self, count: int) -> None:
        """Release the `count` highest free chunks to the backend."""
        victims = heapq.nlargest(count, self._free)
        self.backend.release(victims)
        gone = set(victims)
        self._free = [h for h in self._free if h not in gone]
        heapq.heapify(self._free)
        self._num_created -= count
        self._counters["ops.release"] += count

    def top_up(self) -> int:
        """Create chunks until `reserve_ahead` are free (within budget); returns how many."""
        self._check_open()
        want = min(self.reserve_ahead - len(self._free), self._budget_chunks - self._num_created)
        if want <= 0:
            return 0
        for handle in self.backend.create(want):
            heapq.heappush(self._free, handle)
        self._num_created += want
        self._counters["ops.create"] += want
        return want

    # ---- chunk movement (used by VirtualRange / MappingPlan) --------------------------
    def _take(self, count: int) -> tuple[list[int], int]:
        """Take `count` chunks: free ones lowest first, then new ones. Returns (handles,
        how many were created); the caller maps them or gives them back with `_untake`."""
        free = self._free
        num_new = count - len(free)
        if num_new > 0:
            room = self._budget_chunks - self._num_created
            if num_new > room:
                raise OutOfMemory(
                    f"needs {count} chunks, pool has {len(free) + room} free of "
                    f"{self._budget_chunks} ({self._budget_chunks * self.granularity} bytes)",
                    needed=count,
                    free=len(free) + room,
                    total=self._budget_chunks,
                )
            new = self.backend.create(num_new)
            self._num_created += num_new
            self._counters["ops.create"] += num_new
            taken = [heapq.heappop(free) for _ in range(len(free))]
            return taken + new, num_new
        if count == 1:
            return [heapq.heappop(free)], 0
        return [heapq.heappop(free) for _ in range(count)], 0

    def _untake(self, handles: Sequence[int], num_created: int) -> None:
        """Undo `_take`: release the chunks it created, return the others to free."""
        reused = len(handles) - num_created
        if num_created:
            self.backend.release(handles[reused:])
            self._num_created -= num_created
            self._counters["ops.create"] -= num_created
        for handle in handles[:reused]:
            heapq.heappush(self._free, handle)

    def _retain(self, handles: Sequence[int]) -> None:
        """One more slot maps each handle (a free one leaves the free heap)."""
        refcount = self._refcount
        revived = False
        for handle in handles:
            count = refcount.get(handle, 0)
            if count == 0:
                revived = True
            refcount[handle] = count + 1
        if revived:  # only on rollback paths: a handle unmapped earlier is mapped again
            mapped = set(handles)
            self._free = [h for h in self._free if h not in mapped]
            heapq.heapify(self._free)

    def _retain_taken(self, handles: Sequence[int]) -> None:
        """`_retain` for handles fresh from `_take` (in no set yet)."""
        refcount = self._refcount
        for handle in handles:
            refcount[handle] = refcount.get(handle, 0) + 1

    def _drop(self, handles: Sequence[int]) -> None:
        """One slot fewer maps each handle; at zero it becomes free (lazy release)."""
        refcount = self._refcount
        free = self._free
        for handle in handles:
            count = refcount[handle] - 1
            if count:
                refcount[handle] = count
            else:
                del refcount[handle]
                heapq.heappush(free, handle)

    def _forget_created(self, handles: Sequence[int]) -> None:
        """Rollback helper: release free `handles` that an undone op had created."""
        gone = set(handles)
        self._free = [h for h in self._free if h not in gone]
        heapq.heapify(self._free)
        self.backend.release(list(handles))
        self._num_created -= len(handles)
        self._counters["ops.create"] -= len(handles)

    # ---- ranges and plans -----------------------------------------------------------
    def reserve(self, size: int, *, zero_backed: bool = False, name: str = "") -> VirtualRange:
        """Reserve a virtual range of `size` bytes (a granularity multiple); no physical cost.

        With `zero_backed`, unmapped slots read as zeros (writes still fault)."""
        from vmm.range import VirtualRange

        self._check_open()
        return VirtualRange(self, size, zero_backed=zero_backed, name=name)

    def apply(self, plan: MappingPlan) -> list[list[int]]:
        """Apply `plan` atomically (see `MappingPlan.apply`)."""
        return plan.apply(self)

    # ---- accounting -----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Every key of the `vmm.stats` scheme."""
        gran = self.granularity
        shared = sum(1 for count in self._refcount.values() if count > 1)
        ranges = list(self._ranges.values())
        out = {
            "chunks.budget": self._budget_chunks,
            "chunks.created.current": self._num_created,
            "chunks.free.current": len(self._free),
            "chunks.mapped.current": len(self._refcount),
            "chunks.shared.current": shared,
            "slots.mapped.current": sum(r.num_mapped for r in ranges),
            "ranges.current": len(ranges),
            "bytes.budget": self._budget_chunks * gran,
            "bytes.created.current": self._num_created * gran,
            "bytes.mapped.current": len(self._refcount) * gran,
            "bytes.reserved.current": sum(r.size for r in ranges),
        }
        out.update(self._counters)
        if not self._closed:
            out.update(self.backend.stats())
        return out

    def check_invariants(self, *, expensive: bool = False) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent.

        Cheap tier: O(1) counts. Expensive tier: walks every free chunk and every slot of
        every open range (and asks each range to check itself)."""
        created, free, mapped = self._num_created, len(self._free), len(self._refcount)
        assert created == free + mapped, f"created {created} != free {free} + mapped {mapped}"
        assert created <= self._budget_chunks, f"created {created} > budget {self._budget_chunks}"
        if not expensive:
            return
        assert len(set(self._free)) == free, "a handle is free twice"
        assert not set(self._free) & self._refcount.keys(), "a handle is free and mapped"
        assert all(self._free[i] <= self._free[j] for i, j in _heap_edges(free)), "heap broken"
        mapped_at: dict[int, int] = {}
        for rng in self._ranges.values():
            rng.check_invariants(expensive=True)
            for handle in rng.slot_to_handle().values():
                mapped_at[handle] = mapped_at.get(handle, 0) + 1
        assert mapped_at == self._refcount, f"refcounts {self._refcount} != slots {mapped_at}"
        backend_chunks = getattr(self.backend, "num_chunks", None)
        if backend_chunks is not None and not self._closed:
            assert backend_chunks == created, f"backend has {backend_chunks} chunks, pool {created}"

    # ---- lifetime -------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("chunk pool used after close()")
        if self._broken:
            raise BackendError(f"chunk pool is broken: {self._broken}", op="broken")

    def close(self) -> None:
        """Close every range, release every chunk, close the backend. Idempotent.

        A broken pool (failed rollback) is not unmapped range by range, since its tables
        cannot be trusted: the backend's close tears everything down (unmaps, releases,
        frees every reservation) and the ranges are marked closed."""
        if self._closed:
            return
        if self._broken:
            self._close_broken()
            return
        for rng in list(self._ranges.values()):
            rng.close()
        if self._free:
            self._release_free(len(self._free))
        self._closed = True
        self.backend.close()

    def _close_broken(self) -> None:
        self._closed = True
        try:
            self.backend.close()
        finally:
            for rng in self._ranges.values():
                rng._forget()
            self._ranges.clear()
            self._free.clear()
            self._refcount.clear()
            self._num_created = 0

    def __enter__(self) -> ChunkPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _heap_edges(n: int) -> list[tuple[int, int]]:
    return [(i, c) for i in range(n) for c in (2 * i + 1, 2 * i + 2) if c < n]
