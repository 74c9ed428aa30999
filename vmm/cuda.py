"""CUDA backend: the backend contract on the CUDA driver's virtual memory management API.

Rationale
---------
The driver's VMM calls (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`,
`cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`) are exactly the contract of
`vmm.backend`, so this backend is a thin, checked translation of it. It runs inside
torch's context: torch uses each device's *primary* context, which this backend retains,
so tensors over our mappings are ordinary device memory to torch's kernels.

Approach
--------
    handle       int value of a `CUmemGenericAllocationHandle` of `granularity` bytes
                 (pinned device memory on `device`, no shareable handle type)
    reserve      cuMemAddressReserve(size, alignment=max(granularity, 2 MiB))
    map          cuMemMap per slot (one handle = one slot), then cuMemSetAccess(READWRITE)
                 once per run of adjacent slots of one reservation
    unmap        cuMemUnmap per slot (the driver cannot unmap part of one mapping);
                 `to_zero` then maps the zero chunk there with cuMemSetAccess(READ)
    zero chunk   one handle, zero-filled, mapped read-only wherever a slot is zero-backed;
                 probed at start-up, `zero_handle` is None if the device refuses PROT_READ
    zero fill    `create` maps its new handles at a scratch reservation and clears them
                 with one cuMemsetD8Async on a private stream (`zero_fill=False` skips it)

Every public call validates first (raising before any driver call), then runs its driver
calls with an undo log; a failing call undoes the calls before it in reverse order and
raises the `vmm.errors` exception naming the driver call and its CUresult code.

Scratch mappings (the zero fill, the read-only probe) are always torn down: never while
their memset may still run, and a teardown call that fails is tried once more before the
failure is raised naming what stays held. `close` forgets each object as soon as its
driver call succeeded, so a close that failed part-way resumes when called again.

Limitations
-----------
One device per instance. Unmapping does not synchronise: the caller must make sure no
kernel still reads a slot it unmaps (engines unmap between steps). `release` cannot undo
a `cuMemRelease` that already succeeded, so a driver failure part-way through a release
batch leaves the handles before it released (reported in the error). Written against the
documented driver API and run through the real cuda-bindings on the test suite's CUDA
driver emulator (docs/vmm.md), not yet on a GPU (docs/vmm-bench.md).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vmm.backend import Backend
from vmm.cuda_driver import Driver, load_driver
from vmm.errors import (
    AlignmentError,
    BackendError,
    ClosedError,
    MappingError,
    OutOfMemory,
    RangeError,
)

_TWO_MIB = 2 << 20
_VMM_SUPPORTED_ATTR = "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
_Undo = list[Callable[[], object]]


def _current_torch_device() -> int:
    """torch's current CUDA device when torch is loaded and sees one, else 0."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    return 0


def _runs(keyed: Sequence[tuple[int, int]], granularity: int) -> list[tuple[int, int]]:
    """(start, num_slots) of each maximal run of adjacent slots of one reservation.

    `keyed` is sorted (reservation base, slot va) pairs; runs never cross reservations.
    """
    out: list[tuple[int, int]] = []
    prev_base = -1
    for base, va in keyed:
        if base == prev_base and out[-1][0] + out[-1][1] * granularity == va:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((va, 1))
        prev_base = base
    return out


class CudaBackend(Backend):
    """`vmm.backend.Backend` on one CUDA device through cuda-python.

    Args:
        device: CUDA ordinal; None = torch's current device (0 without torch/CUDA).
        granularity: chunk size, a power-of-two multiple of the device's minimum
            allocation granularity (default: that minimum, 2 MiB on current GPUs).
        zero_chunk: create the shared read-only zero chunk (if the device allows it).
        zero_fill: `create` clears new chunks (the contract says they read as zeros).
        driver: an initialised `vmm.cuda_driver.Driver` (default: `load_driver()`).

    Invariants (checked by `check_invariants`):
      * every key of `_slot_handle` (mapped read-write) and every member of `_zero_slots`
        lies in exactly one reservation, and no slot is in both;
      * `_map_count[h]` = number of slots mapping handle h; every handle there is live.
    """

    name = "cuda"

    def __init__(
        self,
        device: int | None = None,
        *,
        granularity: int | None = None,
        zero_chunk: bool = True,
        zero_fill: bool = True,
        driver: Driver | None = None,
    ):
        self._drv: Driver = load_driver() if driver is None else driver
        self._ordinal = _current_torch_device() if device is None else int(device)
        self.device = f"cuda:{self._ordinal}"
        self._zero_fill = zero_fill
        self._lock = threading.RLock()
        self._closed = False
        self._reservations: dict[int, int] = {}  # base va -> size
        self._bases: list[int] = []  # sorted keys of _reservations
        self._map_count: dict[int, int] = {}  # live handle -> slots mapping it
        self._handle_obj: dict[int, Any] = {}  # live handle -> driver handle object
        self._slot_handle: dict[int, int] = {}  # read-write mapped slot va -> handle
        self._zero_slots: set[int] = set()
        self._stream: Any = None
        self._zero: int | None = None
        self._dev = self._drv.call("cuDeviceGet", self._ordinal)
        self._require_vmm_support()
        self._ctx = self._drv.call("cuDevicePrimaryCtxRetain", self._dev)
        try:
            self._set_up(granularity, zero_chunk)
        except BaseException:
            self._abandon_set_up()
            raise

    # ---- set-up -------------------------------------------------------------------
    def _set_up(self, granularity: int | None, zero_chunk: bool) -> None:
        self._prop = self._allocation_prop()
        self._granularity = self._choose_granularity(granularity)
        self._rw = self._access_desc("CU_MEM_ACCESS_FLAGS_PROT_READWRITE")
        self._ro = self._access_desc("CU_MEM_ACCESS_FLAGS_PROT_READ")
        with self._context():
            self._stream = self._drv.call("cuStreamCreate", 1)  # CU_STREAM_NON_BLOCKING
            if zero_chunk:
                self._zero = self._probe_zero_chunk()

    def _abandon_set_up(self) -> None:
        """Best-effort undo of a failed constructor: handles, stream, context retain."""
        try:
            with _ContextGuard(self):
                self._release_quietly(list(self._map_count))
                if self._stream is not None:
                    self._drv.call("cuStreamDestroy", self._stream)
        except Exception:
            pass
        self._closed = True
        self._drv.call("cuDevicePrimaryCtxRelease", self._dev)

    def _require_vmm_support(self) -> None:
        from vmm.errors import BackendUnavailable

        attr = getattr(self._drv.mod.CUdevice_attribute, _VMM_SUPPORTED_ATTR)
        if not int(self._drv.call("cuDeviceGetAttribute", attr, self._dev)):
            raise BackendUnavailable(f"device {self._ordinal} does not support CUDA VMM")

    def _allocation_prop(self) -> Any:
        mod = self._drv.mod
        prop = mod.CUmemAllocationProp()
        prop.type = mod.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = mod.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._ordinal
        prop.requestedHandleTypes = mod.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        return prop

    def _access_desc(self, flag: str) -> list[Any]:
        mod = self._drv.mod
        desc = mod.CUmemAccessDesc()
        desc.location.type = mod.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self._ordinal
        desc.flags = getattr(mod.CUmemAccess_flags, flag)
        return [desc]

    def _choose_granularity(self, wanted: int | None) -> int:
        option = self._drv.mod.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        minimum = int(self._drv.call("cuMemGetAllocationGranularity", self._prop, option))
        if wanted is None:
            return minimum
        if wanted <= 0 or wanted % minimum or wanted & (wanted - 1):
            raise AlignmentError(
                f"granularity {wanted} must be a power of two and a multiple of the "
                f"device granularity {minimum}"
            )
        return wanted

    def _probe_zero_chunk(self) -> int | None:
        """Create the zero chunk and check the device accepts a read-only mapping of it."""
        (handle,) = self._create_unlocked(1, zero_fill=True)
        if self._read_only_mapping_works(handle):
            return handle
        self._release_unlocked([handle])
        return None

    def _read_only_mapping_works(self, handle: int) -> bool:
        """Map `handle` at a scratch reservation and ask for read-only access: a refusal
        (BackendError from cuMemSetAccess) means False; any other failure is raised."""
        g = self._granularity
        va = int(self._drv.call("cuMemAddressReserve", g, _TWO_MIB, 0, 0))
        num_mapped = 0
        try:
            self._drv.call("cuMemMap", va, g, 0, handle, 0)
            num_mapped = 1
            self._drv.call("cuMemSetAccess", va, g, self._ro, 1)
        except BackendError as exc:
            if exc.op != "cuMemSetAccess":
                raise
            return False
        finally:
            self._tear_down_scratch(va, g, num_mapped)
        return True

    # ---- context ------------------------------------------------------------------
    def _context(self) -> _ContextGuard:
        if self._closed:
            raise ClosedError(f"cuda backend on {self.device} is closed")
        return _ContextGuard(self)

    @property
    def driver(self) -> Driver:
        """The driver this backend calls (vmm-bench switches on its `timings`)."""
        return self._drv

    # ---- contract -----------------------------------------------------------------
    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def zero_handle(self) -> int | None:
        return self._zero

    def create(self, count: int) -> list[int]:
        if count < 1:
            raise ValueError(f"create needs count >= 1, got {count}")
        with self._context():
            return self._create_unlocked(count, zero_fill=self._zero_fill)

    def _create_unlocked(self, count: int, *, zero_fill: bool) -> list[int]:
        made: list[int] = []
        try:
            for _ in range(count):
                obj = self._drv.call("cuMemCreate", self._granularity, self._prop, 0)
                made.append(int(obj))
                self._handle_obj[int(obj)] = obj
                self._map_count[int(obj)] = 0
            if zero_fill:
                self._zero_fill_handles(made)
        except OutOfMemory as exc:
            num_made = len(made)
            self._release_quietly(made)
            free, total = self._drv.mem_info()
            raise OutOfMemory(
                f"create of {count} chunks of {self._granularity} bytes failed after "
                f"{num_made} (all released): {exc}; device now has {free} bytes free of {total}",
                needed=count * self._granularity,
                free=free,
                total=total,
            ) from exc
        except BaseException:
            self._release_quietly(made)
            raise
        return made

    def _zero_fill_handles(self, handles: Sequence[int]) -> None:
        """Map `handles` side by side at a scratch reservation and clear them in one memset.

        The memset is asynchronous: if waiting for it fails, it may still be running, so
        the scratch mapping is not torn down before one more wait succeeds (unmapping under
        running work is what makes a GPU fault)."""
        g = self._granularity
        size = g * len(handles)
        va = int(self._drv.call("cuMemAddressReserve", size, _TWO_MIB, 0, 0))
        num_mapped = 0
        queued = False
        try:
            for i, h in enumerate(handles):
                self._drv.call("cuMemMap", va + i * g, g, 0, h, 0)
                num_mapped += 1
            self._drv.call("cuMemSetAccess", va, size, self._rw, 1)
            self._drv.call("cuMemsetD8Async", va, 0, size, self._stream)
            queued = True
            self._drv.call("cuStreamSynchronize", self._stream)
            queued = False
        finally:
            if queued:  # raises (keeping the scratch mapping) if the memset cannot be awaited
                self._drv.call("cuStreamSynchronize", self._stream)
            self._tear_down_scratch(va, size, num_mapped)

    def _tear_down_scratch(self, va: int, size: int, num_mapped: int) -> None:
        """Unmap the first `num_mapped` slots of the scratch reservation [va, va + size) and
        free it. A failed step is tried once more (a driver call that fails does nothing,
        so a transient failure then leaves nothing behind); a second failure is raised
        with what stays held."""
        g = self._granularity
        for i in range(num_mapped):
            self._call_twice(
                f"scratch slot {i} of {num_mapped} at {va + i * g:#x} stays mapped",
                "cuMemUnmap", va + i * g, g,
            )  # fmt: skip
        self._call_twice(f"scratch reservation {va:#x} of {size} bytes stays reserved",
                         "cuMemAddressFree", va, size)  # fmt: skip

    def _call_twice(self, leaked: str, name: str, *args: Any) -> None:
        try:
            self._drv.call(name, *args)
        except (BackendError, OutOfMemory):
            try:
                self._drv.call(name, *args)
            except (BackendError, OutOfMemory) as exc:
                raise BackendError(
                    f"{exc} (failed twice; {leaked})", op=name, code=getattr(exc, "code", 0)
                ) from exc

    def release(self, handles: Sequence[int]) -> None:
        with self._context():
            for h in handles:
                self._check_live(h, "release")
                if self._map_count[h]:
                    raise MappingError(
                        f"release of handle {h}: still mapped at {self._map_count[h]} slot(s)"
                    )
                if h == self._zero:
                    raise MappingError(f"release of handle {h}: it is the zero chunk")
            if len(set(handles)) != len(handles):
                raise MappingError(f"release: duplicate handles in {list(handles)}")
            self._release_unlocked(handles)

    def _release_unlocked(self, handles: Sequence[int]) -> None:
        for i, h in enumerate(handles):
            try:
                self._drv.call("cuMemRelease", h)
            except BackendError as exc:
                raise BackendError(
                    f"{exc} (after releasing {i} of {len(handles)} handles)",
                    op=exc.op,
                    code=exc.code,
                ) from exc
            del self._map_count[h]
            del self._handle_obj[h]

    def _release_quietly(self, handles: Sequence[int]) -> None:
        for h in handles:
            with contextlib.suppress(Exception):
                self._drv.call("cuMemRelease", h)
            self._map_count.pop(h, None)
            self._handle_obj.pop(h, None)

    def reserve(self, size: int, *, zero: bool = False) -> int:
        g = self._granularity
        if size <= 0 or size % g:
            raise AlignmentError(f"reserve size {size} must be a positive multiple of {g}")
        if zero and self._zero is None:
            raise MappingError("reserve(zero=True): this backend has no zero chunk")
        with self._context():
            va = int(self._drv.call("cuMemAddressReserve", size, max(g, _TWO_MIB), 0, 0))
            self._reservations[va] = size
            bisect.insort(self._bases, va)
            undo: _Undo = []
            try:
                if zero:
                    self._map_zero(list(range(va, va + size, g)), undo)
            except BaseException:
                self._roll_back(undo)
                self._forget_reservation(va)
                self._drv.call("cuMemAddressFree", va, size)
                raise
            return va

    def _forget_reservation(self, va: int) -> None:
        del self._reservations[va]
        self._bases.remove(va)

    def free_reservation(self, va: int, size: int) -> None:
        with self._context():
            if self._reservations.get(va) != size:
                raise RangeError(f"free_reservation({va:#x}, {size}): no such reservation")
            slots = range(va, va + size, self._granularity)
            busy = sum(1 for s in slots if s in self._slot_handle)
            if busy:
                raise MappingError(f"free_reservation({va:#x}): {busy} slot(s) still mapped")
            zeros = [s for s in slots if s in self._zero_slots]
            undo: _Undo = []
            try:
                self._unmap_slots(zeros, undo)
                self._drv.call("cuMemAddressFree", va, size)
            except BaseException:
                self._roll_back(undo)
                raise
            self._zero_slots.difference_update(zeros)
            if self._zero is not None:
                self._map_count[self._zero] -= len(zeros)
            self._forget_reservation(va)

    def map(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        if len(vas) != len(handles):
            raise ValueError(f"map: {len(vas)} addresses but {len(handles)} handles")
        with self._context():
            self._check_targets(vas, "map", want_mapped=False)
            for h in handles:
                self._check_live(h, "map")
            undo: _Undo = []
            try:
                zeros = [va for va in vas if va in self._zero_slots]
                self._unmap_slots(zeros, undo)
                self._map_handles(vas, handles, undo)
            except BaseException:
                self._roll_back(undo)
                raise
            self._commit_map(vas, handles, zeros)

    def unmap(self, vas: Sequence[int], *, to_zero: bool = False) -> None:
        if to_zero and self._zero is None:
            raise MappingError("unmap(to_zero=True): this backend has no zero chunk")
        with self._context():
            self._check_targets(vas, "unmap", want_mapped=True)
            handles = [self._slot_handle[va] for va in vas]
            undo: _Undo = []
            try:
                self._unmap_slots(vas, undo)
                if to_zero:
                    self._map_zero(vas, undo)
            except BaseException:
                self._roll_back(undo)
                raise
            self._commit_unmap(vas, handles)

    def stats(self) -> dict[str, int]:
        """Gauges under the `vmm.stats` scheme: `bytes.physical.current` is the device
        memory this backend holds in live handles (the zero chunk included)."""
        return {"bytes.physical.current": len(self._map_count) * self._granularity}

    # ---- cuda only ----------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        """Live chunks from `create` (the zero chunk excluded); ChunkPool checks it."""
        return len(self._map_count) - (self._zero is not None)

    @property
    def num_zero_slots(self) -> int:
        """Slots backed by the read-only zero chunk."""
        return len(self._zero_slots)

    @property
    def driver_calls(self) -> dict[str, int]:
        """Driver calls made so far, by name (cumulative, rollbacks included)."""
        return dict(self._drv.num_calls)

    def close(self) -> None:
        """Unmap, free and release everything, then drop the context retain. Idempotent;
        if a driver call fails, what was torn down before it is forgotten and the error
        raised, so calling close again resumes where it stopped."""
        with self._lock:
            if self._closed:
                return
            with _ContextGuard(self):
                self._tear_down_unlocked()
            self._closed = True
            self._drv.call("cuDevicePrimaryCtxRelease", self._dev)

    def _tear_down_unlocked(self) -> None:
        g = self._granularity
        for va in sorted(self._slot_handle):
            self._drv.call("cuMemUnmap", va, g)
            self._map_count[self._slot_handle.pop(va)] -= 1
        for va in sorted(self._zero_slots):
            self._drv.call("cuMemUnmap", va, g)
            self._zero_slots.discard(va)
            self._map_count[self._zero] -= 1  # type: ignore[index]
        for va in list(self._bases):
            self._drv.call("cuMemAddressFree", va, self._reservations[va])
            self._forget_reservation(va)
        self._zero = None  # released with the chunks below
        self._release_unlocked(list(self._map_count))
        if self._stream is not None:
            self._drv.call("cuStreamDestroy", self._stream)
            self._stream = None

    # ---- validation ---------------------------------------------------------------
    def _check_live(self, handle: int, op: str) -> None:
        if handle not in self._map_count:
            raise MappingError(f"{op}: handle {handle} is not a live chunk of this backend")

    def _reservation_of(self, va: int) -> int:
        i = bisect.bisect_right(self._bases, va) - 1
        if i < 0 or va >= self._bases[i] + self._reservations[self._bases[i]]:
            raise RangeError(f"address {va:#x} is not inside any reservation")
        return self._bases[i]

    def _check_targets(self, vas: Sequence[int], op: str, *, want_mapped: bool) -> None:
        g = self._granularity
        if len(set(vas)) != len(vas):
            raise MappingError(f"{op}: the batch names a slot twice")
        for va in vas:
            if va % g:
                raise AlignmentError(f"{op}: address {va:#x} is not a multiple of {g}")
            self._reservation_of(va)
            if (va in self._slot_handle) != want_mapped:
                state = "already mapped" if not want_mapped else "not mapped"
                raise MappingError(f"{op}: slot {va:#x} is {state}")

    # ---- driver steps with undo ---------------------------------------------------
    def _map_handles(self, vas: Sequence[int], handles: Sequence[int], undo: _Undo) -> None:
        g = self._granularity
        for va, h in zip(vas, handles, strict=True):
            self._drv.call("cuMemMap", va, g, 0, h, 0)
            undo.append(functools.partial(self._drv.call, "cuMemUnmap", va, g))
        self._set_access(vas, self._rw)

    def _map_zero(self, vas: Sequence[int], undo: _Undo) -> None:
        assert self._zero is not None
        self._map_handles_ro(vas, undo)
        self._zero_slots.update(vas)
        self._map_count[self._zero] += len(vas)

        def forget() -> None:
            self._zero_slots.difference_update(vas)
            self._map_count[self._zero] -= len(vas)  # type: ignore[index]

        undo.append(forget)

    def _map_handles_ro(self, vas: Sequence[int], undo: _Undo) -> None:
        g = self._granularity
        for va in vas:
            self._drv.call("cuMemMap", va, g, 0, self._zero, 0)
            undo.append(functools.partial(self._drv.call, "cuMemUnmap", va, g))
        self._set_access(vas, self._ro)

    def _set_access(self, vas: Sequence[int], desc: list[Any]) -> None:
        g = self._granularity
        keyed = sorted((self._reservation_of(va), va) for va in vas)
        for start, num_slots in _runs(keyed, g):
            self._drv.call("cuMemSetAccess", start, num_slots * g, desc, 1)

    def _unmap_slots(self, vas: Sequence[int], undo: _Undo) -> None:
        g = self._granularity
        for va in vas:
            self._drv.call("cuMemUnmap", va, g)
            h = self._slot_handle.get(va, self._zero)
            desc = self._ro if va in self._zero_slots else self._rw

            def remap(va: int = va, h: int | None = h, desc: list[Any] = desc) -> None:
                self._drv.call("cuMemMap", va, g, 0, h, 0)
                self._drv.call("cuMemSetAccess", va, g, desc, 1)

            undo.append(remap)

    def _roll_back(self, undo: _Undo) -> None:
        for step in reversed(undo):
            try:
                step()
            except Exception as exc:
                raise BackendError(
                    f"rollback failed ({exc}); backend state on {self.device} is undefined",
                    op="rollback",
                ) from exc

    def _commit_map(self, vas: Sequence[int], handles: Sequence[int], zeros: list[int]) -> None:
        for va, h in zip(vas, handles, strict=True):
            self._slot_handle[va] = h
            self._map_count[h] += 1
        self._zero_slots.difference_update(zeros)
        if self._zero is not None:
            self._map_count[self._zero] -= len(zeros)

    def _commit_unmap(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        for va, h in zip(vas, handles, strict=True):
            del self._slot_handle[va]
            self._map_count[h] -= 1
        # With to_zero, _map_zero has already recorded and counted the zero slots.

    # ---- checks -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the slot/handle tables disagree (cheap, O(slots))."""
        assert not (set(self._slot_handle) & self._zero_slots), "slot both mapped and zero"
        counts: dict[int, int] = dict.fromkeys(self._map_count, 0)
        for va, h in self._slot_handle.items():
            self._reservation_of(va)
            counts[h] += 1
        for va in self._zero_slots:
            self._reservation_of(va)
        if self._zero is not None:
            counts[self._zero] = len(self._zero_slots)
        assert counts == self._map_count, f"map counts {self._map_count} != {counts}"


class _ContextGuard:
    """Holds the backend lock and makes its primary context current for one call.

    If the calling thread already has the context current (torch's threads do), nothing is
    pushed; otherwise it is pushed on entry and popped on exit.
    """

    def __init__(self, backend: CudaBackend):
        self._b = backend
        self._pushed = False

    def __enter__(self) -> None:
        self._b._lock.acquire()
        try:
            drv = self._b._drv
            if int(drv.call("cuCtxGetCurrent")) != int(self._b._ctx):
                drv.call("cuCtxPushCurrent", self._b._ctx)
                self._pushed = True
        except BaseException:
            self._b._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self._pushed:
                self._b._drv.call("cuCtxPopCurrent")
        finally:
            self._b._lock.release()
