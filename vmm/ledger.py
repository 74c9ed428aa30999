"""Chunk ledger: the one owner of a pool's chunk accounting.

Rationale
---------
A chunk pool, its virtual ranges and its mapping plans all move chunks between "free"
and "mapped", bump event counters and must stop when the pool is closed or broken. When
each of them edited the pool's tables directly, the invariant `created == free + mapped`
was kept by code spread over three files. The ledger holds every table and every rule
about them; ranges and plans call its methods, and nothing else writes its state.

Approach
--------
::

    created chunks = free (min-heap, refcount 0)  +  mapped (refcount >= 1)
                     ^ taken lowest-first             ^ refcount = slots mapping it

    ChunkPool ──owns──► ChunkLedger ◄──calls── VirtualRange ◄──calls── MappingPlan
        (user API)        (tables)               (slot tables)           (undo log)

* `free` is a min-heap of handles: taking the lowest first hands adjacent slots adjacent
  host memfd offsets, so their mappings merge into one VMA.
* `refcount[h]` counts the slots (in any range) that map h; a chunk mapped at two
  addresses (a shared prefix) has refcount 2 and returns to `free` when both unmap.
* Chunks move only through `take` / `untake` / `retain` / `retain_taken` / `drop` /
  `forget_created`, each of which keeps `created == free + mapped` (the chunks of one
  in-flight call aside: taken, not yet retained).
* Event counters (the `ops.*` / `plans.*` keys of `vmm.stats`) are bumped by the movement
  methods themselves, or by `count` for events that move no chunk (share, remap).
* The open ranges are registered here too: the refcounts are checked against them.
* `closed` and `broken` are plain attributes, read on every slot operation (a property
  would cost a call on the hot path); only `mark_closed` / `mark_broken` set them.

Invariants (`check_invariants`): created <= budget; free and mapped are disjoint and
cover every created chunk; every refcount equals the number of slots mapping the chunk
over all open ranges.

Thread safety: `lock` (an `RLock`) is held across every public call of the pool, its
ranges and its plans (the `locked` decorator), so the ledger's own methods, only called
from inside those, take no lock themselves.

Limitations
-----------
One lock per pool: calls on one pool are serialized (the backend call included); two
pools run in parallel. A range sees its ledger through `ChunkPool.ledger`; the
ledger knows ranges only through the few methods named in `OpenRange`, and ranges and
plans know their pool only through `PoolHandle`.
"""

from __future__ import annotations

import functools
import heapq
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from vmm.backend import Backend
from vmm.errors import BackendError, BudgetError, ClosedError, OutOfMemory
from vmm.stats import new_counters

_F = TypeVar("_F", bound=Callable[..., Any])


def locked(method: _F) -> _F:
    """Run `method` holding `self._lock` (the ledger's re-entrant lock): a public call on a
    pool, range or plan is one critical section, so two threads never interleave inside
    the tables."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class OpenRange(Protocol):
    """What the ledger needs of a registered range (`vmm.range.VirtualRange`)."""

    size: int
    num_mapped: int

    def slot_to_handle(self) -> dict[int, int]: ...

    def check_invariants(self, *, expensive: bool = False) -> None: ...

    def close(self) -> None: ...


class PoolHandle(Protocol):
    """What a range and a plan need of their pool (`vmm.pool.ChunkPool`): its backend,
    granularity and ledger. Ranges and plans name the pool by this protocol, so neither
    imports `vmm.pool` (which imports them)."""

    @property
    def backend(self) -> Backend: ...

    @property
    def granularity(self) -> int: ...

    @property
    def ledger(self) -> ChunkLedger: ...


class ChunkLedger:
    """Free heap, refcounts, created count, budget, counters and lifetime of one pool.

    Args:
        backend: creates and releases the chunks (the pool owns and closes it).
        budget_chunks: most chunks that may exist.
    """

    def __init__(self, backend: Backend, budget_chunks: int) -> None:
        self.backend = backend
        self.granularity = backend.granularity
        self._budget_chunks = budget_chunks
        self._free: list[int] = []  # min-heap of ready handles
        self._refcount: dict[int, int] = {}  # mapped handle -> slots mapping it
        self._num_created = 0
        self._ranges: dict[int, OpenRange] = {}  # id -> open range
        self._counters = new_counters()
        #: held across every public call of the pool, its ranges and its plans (re-entrant:
        #: a plan calls range methods, a range calls ledger methods)
        self.lock = threading.RLock()
        #: True once the pool is closed (set by `mark_closed`)
        self.closed = False
        #: why the pool can no longer be trusted (a failed rollback), or "" (`mark_broken`)
        self.broken = ""

    # ---- queries ----------------------------------------------------------------------
    @property
    def budget_chunks(self) -> int:
        return self._budget_chunks

    @property
    def num_created(self) -> int:
        return self._num_created

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_mapped(self) -> int:
        return len(self._refcount)

    @property
    def num_shared(self) -> int:
        """Chunks mapped at two slots or more."""
        return sum(1 for count in self._refcount.values() if count > 1)

    def free_handles(self) -> list[int]:
        """The free chunks, lowest first."""
        return sorted(self._free)

    def refcount(self, handle: int) -> int:
        """Slots mapping `handle` (0 for a free chunk or a handle of no chunk)."""
        return self._refcount.get(handle, 0)

    def refcounts(self) -> dict[int, int]:
        """Every mapped chunk and the number of slots mapping it (a copy)."""
        return dict(self._refcount)

    def owns(self, handle: int) -> bool:
        """Whether `handle` is a chunk of this pool (mapped or free)."""
        return handle in self._refcount or handle in self._free

    def counters(self) -> dict[str, int]:
        """The event counters (a copy; `restore_counters` takes one back)."""
        return dict(self._counters)

    # ---- lifetime ---------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise ClosedError after close, BackendError once broken."""
        if self.closed:
            raise ClosedError("chunk pool used after close()")
        if self.broken:
            raise BackendError(f"chunk pool is broken: {self.broken}", op="broken")

    def mark_broken(self, reason: str) -> BackendError:
        """Record that the tables can no longer be vouched for; every later call raises.
        Returns the error for the caller to raise."""
        self.broken = reason
        return BackendError(reason, op="rollback")

    def mark_closed(self) -> None:
        self.closed = True

    def abandon(self) -> None:
        """After the backend tore everything down (closing a broken pool): mark every range
        closed without backend calls and empty the tables."""
        for rng in self._ranges.values():
            rng.close()  # the ledger is closed: the range forgets its slots, no calls
        self._ranges.clear()
        self._free.clear()
        self._refcount.clear()
        self._num_created = 0

    # ---- ranges -----------------------------------------------------------------------
    def add_range(self, rng: OpenRange) -> None:
        self._ranges[id(rng)] = rng

    def remove_range(self, rng: OpenRange) -> None:
        del self._ranges[id(rng)]

    def open_ranges(self) -> list[OpenRange]:
        return list(self._ranges.values())

    # ---- budget -----------------------------------------------------------------------
    def set_budget_chunks(self, new_chunks: int) -> None:
        """Grow or shrink the budget; shrinking releases free chunks (highest first) until
        the created ones fit. Refuses, changing nothing, below the chunks in use."""
        in_use = len(self._refcount)
        if in_use > new_chunks:
            gran = self.granularity
            raise BudgetError(
                f"budget {new_chunks * gran} bytes ({new_chunks} chunks) is below the "
                f"{in_use} chunks ({in_use * gran} bytes) in use"
            )
        excess = self._num_created - new_chunks
        if excess > 0:
            self.release_free(excess)
        self._budget_chunks = new_chunks

    def release_free(self, count: int) -> None:
        """Release the `count` highest free chunks to the backend."""
        victims = heapq.nlargest(count, self._free)
        self.backend.release(victims)
        gone = set(victims)
        self._free = [h for h in self._free if h not in gone]
        heapq.heapify(self._free)
        self._num_created -= count
        self._counters["ops.release"] += count

    def top_up(self, reserve_ahead: int) -> int:
        """Create chunks until `reserve_ahead` are free (within budget); returns how many."""
        want = min(reserve_ahead - len(self._free), self._budget_chunks - self._num_created)
        if want <= 0:
            return 0
        for handle in self.backend.create(want):
            heapq.heappush(self._free, handle)
        self._num_created += want
        self._counters["ops.create"] += want
        return want

    # ---- chunk movement ---------------------------------------------------------------
    def take(self, count: int) -> tuple[list[int], int]:
        """Take `count` chunks: free ones lowest first, then new ones. Returns (handles,
        how many were created, the last ones); the caller maps them and calls
        `retain_taken`, or gives them back with `untake`."""
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

    def untake(self, handles: Sequence[int], num_created: int) -> None:
        """Undo `take`: release the chunks it created, return the others to free."""
        reused = len(handles) - num_created
        if num_created:
            self.backend.release(handles[reused:])
            self._num_created -= num_created
            self._counters["ops.create"] -= num_created
        for handle in handles[:reused]:
            heapq.heappush(self._free, handle)

    def retain_taken(self, handles: Sequence[int]) -> None:
        """Handles fresh from `take` were mapped, one slot each (counts `ops.map`)."""
        refcount = self._refcount
        for handle in handles:
            refcount[handle] = refcount.get(handle, 0) + 1
        self._counters["ops.map"] += len(handles)

    def retain(self, handles: Sequence[int]) -> None:
        """Existing handles were mapped at one more slot each; a free one leaves the free
        heap (counts `ops.map`)."""
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
        self._counters["ops.map"] += len(handles)

    def drop(self, handles: Sequence[int]) -> None:
        """One slot fewer maps each handle; at zero it becomes free, not released (lazy
        release). Counts `ops.unmap`."""
        refcount = self._refcount
        free = self._free
        for handle in handles:
            count = refcount[handle] - 1
            if count:
                refcount[handle] = count
            else:
                del refcount[handle]
                heapq.heappush(free, handle)
        self._counters["ops.unmap"] += len(handles)

    def forget_created(self, handles: Sequence[int]) -> None:
        """Rollback helper: release free `handles` that an undone op had created."""
        gone = set(handles)
        self._free = [h for h in self._free if h not in gone]
        heapq.heapify(self._free)
        self.backend.release(list(handles))
        self._num_created -= len(handles)
        self._counters["ops.create"] -= len(handles)

    # ---- counters ---------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        """Add `n` to the event counter `key` (one of `vmm.stats.COUNTER_KEYS`)."""
        self._counters[key] += n

    def restore_counters(self, snapshot: dict[str, int]) -> None:
        """Put back counters taken by `counters()` (a rolled-back plan counts nothing)."""
        self._counters = dict(snapshot)

    # ---- checks -----------------------------------------------------------------------
    def check_invariants(self, *, expensive: bool = False) -> None:
        """Raise AssertionError if the tables are inconsistent (see the module note).

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


def _heap_edges(n: int) -> list[tuple[int, int]]:
    return [(i, c) for i in range(n) for c in (2 * i + 1, 2 * i + 2) if c < n]
