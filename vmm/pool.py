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

    ChunkPool (user API: budget, reserve, apply, stats, close)
      ├── backend      the device's chunks and address space (owned, closed here)
      └── ledger       ChunkLedger: free heap, refcounts, budget, counters,
                       closed/broken state, open ranges (`vmm.ledger`)
    VirtualRange / MappingPlan ──► pool.ledger (the only writers of the accounting)

The pool is the user's handle; every table lives in its `ChunkLedger`, whose design note
says how chunks move between free and mapped. Ranges are created by `reserve` and
register with the ledger; plans apply through their ranges' public methods.

Invariants (`check_invariants`): the ledger's (created <= budget; free and mapped are
disjoint and cover every created chunk; refcounts match the open ranges' slots) and the
backend agrees on the chunk count.

Thread safety: every public method of the pool, of its ranges and of its plans holds the
ledger's lock for the whole call (`vmm.ledger.locked`), so several threads may share a
pool (a mapping worker beside the scheduler); tensors over a range are plain memory and
are not guarded. Arguments are checked strictly (`vmm.checks`) before anything changes.

Limitations
-----------
The lock serializes calls on one pool (the backend call included).
Reused chunks keep their old contents (like `torch.empty`); freshly created ones are zero.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vmm.backend import Backend
from vmm.checks import MAX_BYTES, as_index
from vmm.errors import BudgetError, InputError
from vmm.ledger import ChunkLedger, locked
from vmm.range import VirtualRange

if TYPE_CHECKING:
    from vmm.plan import MappingPlan

_log = logging.getLogger(__name__)


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
        budget_chunks = self._chunks_of_budget(budget_bytes)
        self.reserve_ahead = as_index(reserve_ahead, "reserve_ahead")
        #: the chunk accounting ranges and plans update (see `vmm.ledger`)
        self.ledger = ChunkLedger(backend, budget_chunks)
        self._lock = self.ledger.lock
        #: what `close()` could not release cleanly (empty after a clean close)
        self.close_errors: list[str] = []
        self.top_up()

    # ---- budget ---------------------------------------------------------------------
    def _chunks_of_budget(self, budget_bytes: int) -> int:
        try:
            budget_bytes = as_index(budget_bytes, "budget_bytes", low=-MAX_BYTES)
        except InputError as exc:
            raise BudgetError(str(exc)) from None
        if budget_bytes < 0 or budget_bytes % self.granularity:
            raise BudgetError(
                f"budget {budget_bytes} bytes is not a non-negative multiple of the "
                f"{self.granularity}-byte granularity"
            )
        return budget_bytes // self.granularity

    @property
    def budget_bytes(self) -> int:
        return self.ledger.budget_chunks * self.granularity

    @property
    def num_free(self) -> int:
        """Created chunks mapped nowhere (ready handles)."""
        return self.ledger.num_free

    @property
    def num_created(self) -> int:
        return self.ledger.num_created

    @property
    def num_mapped(self) -> int:
        """Chunks mapped at one slot or more."""
        return self.ledger.num_mapped

    @locked
    def set_budget(self, budget_bytes: int) -> None:
        """Grow or shrink the budget at run time.

        Shrinking releases free chunks (highest handles first) until the created chunks fit;
        it refuses, changing nothing, when the chunks in use alone exceed the new budget.
        """
        self.ledger.check_usable()
        self.ledger.set_budget_chunks(self._chunks_of_budget(budget_bytes))
        self.top_up()

    @locked
    def release_free(self) -> int:
        """Release every free (created, unmapped) chunk to the backend; the budget stays.
        Returns how many were released."""
        self.ledger.check_usable()
        count = self.ledger.num_free
        if count:
            self.ledger.release_free(count)
        return count

    @locked
    def top_up(self) -> int:
        """Create chunks until `reserve_ahead` are free (within budget); returns how many."""
        self.ledger.check_usable()
        return self.ledger.top_up(self.reserve_ahead)

    # ---- ranges and plans -----------------------------------------------------------
    @locked
    def reserve(self, size: int, *, zero_backed: bool = False, name: str = "") -> VirtualRange:
        """Reserve a virtual range of `size` bytes (a granularity multiple); no physical cost.

        With `zero_backed`, unmapped slots read as zeros (writes still fault)."""
        self.ledger.check_usable()
        size = as_index(size, "reserve size", low=1)
        return VirtualRange(self, size, zero_backed=zero_backed, name=str(name))

    @locked
    def apply(self, plan: MappingPlan) -> list[list[int]]:
        """Apply `plan` atomically (see `MappingPlan.apply`)."""
        return plan.apply(self)

    # ---- accounting -----------------------------------------------------------------
    @locked
    def stats(self) -> dict[str, int]:
        """Every key of the `vmm.stats` scheme."""
        gran, ledger = self.granularity, self.ledger
        ranges = ledger.open_ranges()
        out = {
            "chunks.budget": ledger.budget_chunks,
            "chunks.created.current": ledger.num_created,
            "chunks.free.current": ledger.num_free,
            "chunks.mapped.current": ledger.num_mapped,
            "chunks.shared.current": ledger.num_shared,
            "slots.mapped.current": sum(r.num_mapped for r in ranges),
            "ranges.current": len(ranges),
            "bytes.budget": ledger.budget_chunks * gran,
            "bytes.created.current": ledger.num_created * gran,
            "bytes.mapped.current": ledger.num_mapped * gran,
            "bytes.reserved.current": sum(r.size for r in ranges),
        }
        out.update(ledger.counters())
        if not ledger.closed:
            out.update(self.backend.stats())
        return out

    @locked
    def check_invariants(self, *, expensive: bool = False) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent.

        Cheap tier: O(1) counts. Expensive tier: walks every free chunk and every slot of
        every open range (and asks each range to check itself)."""
        ledger = self.ledger
        ledger.check_invariants(expensive=expensive)
        if not expensive:
            return
        created = ledger.num_created
        backend_chunks = getattr(self.backend, "num_chunks", None)
        if backend_chunks is not None and not ledger.closed:
            assert backend_chunks == created, f"backend has {backend_chunks} chunks, pool {created}"

    # ---- lifetime -------------------------------------------------------------------
    @property
    @locked
    def closed(self) -> bool:
        return self.ledger.closed

    @property
    def broken(self) -> str:
        """Why the pool can no longer be trusted (a rollback failed), or "" if it can."""
        return self.ledger.broken

    def close(self) -> None:
        """Close every range, release every chunk, close the backend. Idempotent; never
        raises.

        A broken pool (failed rollback) is not unmapped range by range, since its tables
        cannot be trusted: the backend's close tears everything down (unmaps, releases,
        frees every reservation) and the ranges are marked closed. An orderly close that
        fails part-way (ENOMEM at the kernel's map limit) takes the same path. What could
        not be released is listed in `close_errors` (and logged), not raised."""
        ledger = self.ledger
        if ledger.closed:
            return
        if not ledger.broken:
            try:
                for rng in ledger.open_ranges():
                    rng.close()
                if ledger.num_free:
                    ledger.release_free(ledger.num_free)
            except Exception as exc:  # e.g. ENOMEM at vm.max_map_count: tear down instead
                self.close_errors.append(f"orderly close failed: {exc}")
                ledger.mark_broken(f"close() could not unmap range by range: {exc}")
        ledger.mark_closed()
        try:
            self.backend.close()
        except Exception as exc:  # what the backend could not release is reported, not raised
            self.close_errors.append(f"backend close failed: {exc}")
        if ledger.broken:
            ledger.abandon()
        if self.close_errors:
            _log.warning("chunk pool closed with errors: %s", "; ".join(self.close_errors))

    def __enter__(self) -> ChunkPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
