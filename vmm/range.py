"""Virtual range: one reserved address span whose slots are mapped to chunks on demand.

Rationale
---------
A KV cache wants one contiguous tensor per layer, sized for the worst case, yet only the
part in use should cost memory. Reserving the maximum once and mapping granularity-sized
slots to physical chunks gives both: the tensor's address never changes (CUDA graphs,
kernels see a plain buffer) while the pool decides which slots are backed.

Approach
--------
::

    va ──► | slot 0 | slot 1 | slot 2 | slot 3 | ...     (granularity bytes each)
             h=7      -1       h=8      h=7               slot -> handle (-1: unmapped)
             └──────── chunk 7 mapped twice (shared) ───┘

`_slot_to_handle` is a flat list (fast index, no hashing). Every state-changing method is
atomic on its own: it validates first, then makes one batched backend call, then updates
the tables; a failing backend call (all-or-nothing by contract) leaves nothing to undo.
`MappingPlan` composes these methods (`map_new` and `mapped_handles` are public for it)
and undoes them in reverse on failure.

The pool's chunk accounting is the `ChunkLedger` at `pool.ledger` (`vmm.ledger`): a
range takes chunks from it, reports what it mapped and unmapped, and registers itself
there while open; it never touches the ledger's tables.

Invariants (`check_invariants`): `num_mapped` equals the slots whose handle is not -1;
every mapped handle has a pool refcount >= 1; a closed range maps nothing.

Limitations
-----------
A slot is mapped to a whole chunk; a zero-backed range reads zeros from unmapped slots
but writing there faults (SIGSEGV on host), as on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vmm import tensor as _tensor
from vmm.checks import as_index
from vmm.errors import BackendError, ClosedError, MappingError, RangeError
from vmm.ledger import PoolHandle, locked

if TYPE_CHECKING:
    import torch

    from vmm.backend import ViewFactory


class VirtualRange:
    """A reserved VA span of `size` bytes, cut into `num_slots` granularity-sized slots.

    Create with `ChunkPool.reserve`. Slot methods take sequences of slot indices and are
    all-or-nothing.
    """

    def __init__(self, pool: PoolHandle, size: int, *, zero_backed: bool, name: str) -> None:
        backend = pool.backend
        if zero_backed and backend.zero_handle is None:
            raise MappingError(f"backend {backend.name!r} has no zero chunk for zero_backed")
        gran = pool.granularity
        self.pool = pool
        self._ledger = ledger = pool.ledger
        self._lock = ledger.lock
        self.granularity = gran
        self.size = size
        self.name = name
        self.zero_backed = zero_backed
        self.va = backend.reserve(size, zero=zero_backed)  # checks size
        self.num_slots = size // gran
        self.num_mapped = 0
        self._slot_to_handle: list[int] = [-1] * self.num_slots
        self._closed = False
        self._views = backend.view_factory(self.va, size)
        self.device = backend.device
        ledger.add_range(self)

    def __repr__(self) -> str:
        return (
            f"VirtualRange({self.name!r}, va={self.va:#x}, size={self.size}, "
            f"mapped={self.num_mapped}/{self.num_slots})"
        )

    # ---- queries ----------------------------------------------------------------------
    @locked
    def handle(self, slot: int) -> int | None:
        """The chunk mapped at `slot`, or None."""
        self._check_slots((slot,), "handle")
        handle = self._slot_to_handle[slot]
        return None if handle < 0 else handle

    @locked
    def slot_to_handle(self) -> dict[int, int]:
        """Every mapped slot and its chunk."""
        return {s: h for s, h in enumerate(self._slot_to_handle) if h >= 0}

    @property
    def num_views(self) -> int | None:
        """Live DLPack tensors over this range, or None where views are not counted (a
        closed range, a backend without a view factory).

        Closing a range with live views is allowed: on host they keep the addresses
        reserved, but their slots are no longer backed, so using one then faults."""
        holders = getattr(self._views, "holders", None)
        if holders is None:
            return None
        return int(holders) - 2  # minus this range's factory and the backend's table

    @property
    def view_factory(self) -> ViewFactory | None:
        """The backend's DLPack factory over this range (None once closed, or where the
        backend has none)."""
        return self._views

    @locked
    def address(self, slot: int) -> int:
        """Virtual address of `slot`."""
        self._check_slots((slot,), "address")
        return self.va + slot * self.granularity

    # ---- validation -------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise ClosedError if this range or its pool is closed, BackendError if the pool
        is broken."""
        ledger = self._ledger
        if self._closed or ledger.closed:
            what = "pool" if ledger.closed else "range"
            raise ClosedError(f"virtual range {self.name!r} used after its {what} was closed")
        if ledger.broken:
            ledger.check_usable()

    def _check_slots(self, slots: Sequence[int], op: str) -> None:
        self.check_open()
        n = self.num_slots
        for slot in slots:
            if type(slot) is not int:
                as_index(slot, f"{op}: slot")  # numpy ints pass, floats and bools do not
            if not 0 <= slot < n:
                raise RangeError(f"{op}: slot {slot} is outside range {self.name!r} of {n} slots")

    def _validate(self, slots: Sequence[int], mapped: bool, op: str) -> list[int]:
        """Check that the range is open and every slot exists, is listed once and is mapped
        (or not, per `mapped`); return the slots' addresses. One pass: this is the hot path."""
        ledger = self._ledger
        if self._closed or ledger.closed or ledger.broken:
            self.check_open()
        table, n, va, gran = self._slot_to_handle, self.num_slots, self.va, self.granularity
        vas = []
        for slot in slots:
            if type(slot) is not int:
                as_index(slot, f"{op}: slot")  # numpy ints pass, floats and bools do not
            if not 0 <= slot < n:
                raise RangeError(f"{op}: slot {slot} is outside range {self.name!r} of {n} slots")
            if (table[slot] >= 0) is not mapped:
                state = f"mapped to chunk {table[slot]}" if table[slot] >= 0 else "unmapped"
                raise MappingError(f"{op}: slot {slot} of range {self.name!r} is {state}")
            vas.append(va + slot * gran)
        if len(vas) > 1 and len(set(slots)) != len(vas):
            raise MappingError(f"{op}: a slot is listed twice in {list(slots)}")
        return vas

    # ---- atomic slot operations -------------------------------------------------------
    @locked
    def map(self, slots: Sequence[int]) -> list[int]:
        """Map a free (or new) chunk at each slot; returns the handles, in slot order."""
        handles, _ = self.map_new(slots)
        return handles

    @locked
    def map_new(self, slots: Sequence[int]) -> tuple[list[int], int]:
        """`map`, also returning how many of the handles were created for it (the last
        ones): a plan's rollback releases those."""
        vas = self._validate(slots, False, "map")
        ledger = self._ledger
        handles, num_created = ledger.take(len(vas))
        try:
            self.pool.backend.map(vas, handles)
        except BaseException as exc:
            self._note_failure(exc)
            ledger.untake(handles, num_created)
            raise
        self._set(slots, handles)
        ledger.retain_taken(handles)
        return handles, num_created

    @locked
    def map_handles(self, slots: Sequence[int], handles: Sequence[int]) -> None:
        """Map chunks that already exist (mapped elsewhere, or free) at `slots`."""
        vas = self._validate(slots, False, "map")
        if len(handles) != len(slots):
            raise MappingError(f"map: {len(slots)} slots but {len(handles)} handles")
        ledger = self._ledger
        for handle in handles:
            if not ledger.owns(handle):
                raise MappingError(f"map: handle {handle} is no chunk of this pool")
        try:
            self.pool.backend.map(vas, handles)
        except BaseException as exc:
            self._note_failure(exc)
            raise
        self._set(slots, handles)
        ledger.retain(handles)

    @locked
    def unmap(self, slots: Sequence[int]) -> list[int]:
        """Unmap the chunks at `slots` (they become free once mapped nowhere); returns them.

        A zero-backed range backs the slots with the zero chunk again."""
        vas = self._validate(slots, True, "unmap")
        table = self._slot_to_handle
        handles = [table[slot] for slot in slots]
        try:
            self.pool.backend.unmap(vas, to_zero=self.zero_backed)
        except BaseException as exc:
            self._note_failure(exc)
            raise
        for slot in slots:
            table[slot] = -1
        self.num_mapped -= len(vas)
        self._ledger.drop(handles)
        return handles

    @locked
    def share_from(self, src: VirtualRange, src_slots: Sequence[int], slots: Sequence[int]) -> None:
        """Map the chunks at `src_slots` of `src` also at `slots` of this range (no copy)."""
        self._check_same_pool(src, "share")
        handles = src.mapped_handles(src_slots, "share")
        self.map_handles(slots, handles)
        self._ledger.count("ops.share", len(slots))

    @locked
    def remap_from(self, src: VirtualRange, src_slots: Sequence[int], slots: Sequence[int]) -> None:
        """Move the chunks at `src_slots` of `src` to `slots` of this range (no copy)."""
        self._check_same_pool(src, "remap")
        handles = src.mapped_handles(src_slots, "remap")
        self.map_handles(slots, handles)
        try:
            src.unmap(src_slots)
        except BaseException as exc:
            self._undo_remap_target(slots, exc)
            raise
        self._ledger.count("ops.remap", len(slots))

    def _note_failure(self, exc: BaseException) -> None:
        """A backend call failed: if its own rollback failed too (the backend's slots no
        longer match the tables), mark the pool broken, so every later call says so."""
        if isinstance(exc, BackendError) and exc.op == "rollback" and not self._ledger.broken:
            self._ledger.mark_broken(f"range {self.name!r}: {exc}")

    def _check_same_pool(self, src: VirtualRange, op: str) -> None:
        if src._ledger is not self._ledger:
            raise MappingError(f"{op}: range {src.name!r} belongs to another pool")

    def _undo_remap_target(self, slots: Sequence[int], cause: BaseException) -> None:
        """Compensate a remap whose source unmap failed; if that fails too the chunks are
        mapped at both ends, so the pool is marked broken (as a failed plan rollback does)."""
        try:
            self.unmap(slots)
        except Exception as exc:
            raise self._ledger.mark_broken(
                f"remap of {len(slots)} slots into {self.name!r} could not be undone after the "
                f"source unmap failed ({cause}): {exc}"
            ) from exc

    @locked
    def mapped_handles(self, slots: Sequence[int], op: str = "handles") -> list[int]:
        """The chunks at `slots`, each of which must be mapped (`op` names the caller in
        errors)."""
        self._validate(slots, True, op)
        table = self._slot_to_handle
        return [table[slot] for slot in slots]

    def _set(self, slots: Sequence[int], handles: Sequence[int]) -> None:
        table = self._slot_to_handle
        for slot, handle in zip(slots, handles):  # noqa: B905 - lengths checked by callers
            table[slot] = handle
        self.num_mapped += len(slots)

    # ---- tensors ----------------------------------------------------------------------
    def tensor(
        self,
        shape: Sequence[int] | int,
        dtype: torch.dtype | str,
        offset: int = 0,
        strides: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """A zero-copy tensor over the range at byte `offset` (strides in elements).

        Any sub-span may be viewed, mapped or not: the tensor sees slots as they are mapped
        later (reading an unmapped, non-zero-backed slot faults). The tensor keeps the
        address range reserved while it lives. Raises RangeError past the range."""
        views, info, ledger = self._views, _tensor.DTYPES.get(dtype), self._ledger
        if (
            views is not None
            and info is not None
            and info[3] is None
            and type(shape) is tuple
            and not (ledger.broken or ledger.closed)
        ):
            try:  # fast path (~1.5 µs): C++ capsule, torch adopts it; errors take the slow one
                capsule = views.capsule(offset, shape, strides or (), info[0], info[1], 1)
            except (_tensor.HostError, TypeError, OverflowError):
                pass  # the slow path checks the arguments and raises the matching vmm error
            else:
                return _tensor.adopt_capsule(capsule)
        self.check_open()
        return _tensor.view(self, shape, dtype, offset, strides)

    # ---- checks and lifetime ----------------------------------------------------------
    @locked
    def check_invariants(self, *, expensive: bool = False) -> None:
        """Raise AssertionError if the slot table is inconsistent (expensive: walk it)."""
        assert 0 <= self.num_mapped <= self.num_slots, f"num_mapped {self.num_mapped}"
        if self._closed:
            assert self.num_mapped == 0, "a closed range still maps chunks"
        if not expensive:
            return
        mapped = [h for h in self._slot_to_handle if h >= 0]
        assert len(mapped) == self.num_mapped, f"{len(mapped)} mapped != {self.num_mapped}"
        ledger = self._ledger
        for handle in mapped:
            assert ledger.refcount(handle) >= 1, f"mapped handle {handle} has no refcount"
        backend_slots: Any = getattr(self.pool.backend, "slot_table", None)
        if backend_slots is not None and not self._closed:
            assert backend_slots(self.va, self.size) == self._slot_to_handle, "backend disagrees"

    @property
    def closed(self) -> bool:
        return self._closed

    @locked
    def close(self) -> None:
        """Unmap every slot (chunks go back to the pool) and free the reservation.

        Idempotent. Tensors still viewing the range keep its addresses reserved (host) but
        must not be used: their slots are no longer backed. Once the pool is closed this
        makes no backend call (the pool's backend tore everything down): the range only
        forgets its slots."""
        if self._closed:
            return
        if self._ledger.closed:
            self._forget()
            return
        mapped = [s for s, h in enumerate(self._slot_to_handle) if h >= 0]
        if mapped:
            self.unmap(mapped)
        self.pool.backend.free_reservation(self.va, self.size)
        self._closed = True
        self._views = None
        self._ledger.remove_range(self)

    def _forget(self) -> None:
        """Mark closed without backend calls."""
        self._slot_to_handle = [-1] * self.num_slots
        self.num_mapped = 0
        self._closed = True
        self._views = None

    def __enter__(self) -> VirtualRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
