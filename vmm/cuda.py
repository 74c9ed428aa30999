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

    tables       per slot va: its handle; per reservation: how many slots are mapped and
                 which are zero-backed, so `free_reservation` reads two entries, never
                 its slots; every address is checked against the sorted bases (the last
                 base <= va, and va before that reservation's end) before any table
    views        a C++ DLPack factory per reservation (device type kDLCUDA), made on
                 first use and retired when the reservation is freed

Every public call validates first (raising before any driver call), then runs its driver
calls with an undo log; a failing call undoes the calls before it in reverse order and
raises the `vmm.errors` exception naming the driver call and its CUresult code. Mapping or
unmapping one slot (the per-step path of engines) takes a path of its own with the same
checks and rollback but no batch lists; the context check calls the driver directly.

Scratch mappings (the zero fill, the read-only probe; `vmm.cuda_scratch`) are always torn
down: never while their memset may still run, and a teardown call that fails is tried once
more before the failure is raised naming what stays held. `close` forgets each object as
soon as its driver call succeeded, so a close that failed part-way resumes when called
again.

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
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vmm import cuda_scratch
from vmm._core import host as _host
from vmm.backend import Backend, SharedChunks, ViewFactory
from vmm.cuda_driver import Driver, load_driver
from vmm.errors import (
    AlignmentError,
    BackendError,
    ClosedError,
    MappingError,
    OutOfMemory,
    RangeError,
)

_TWO_MIB = cuda_scratch.TWO_MIB
_DL_CUDA = 2  # DLPack's kDLCUDA device type
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
      * every key of `_slot_handle` (mapped read-write) and every zero-backed slot (in
        `_res_zeros` under its reservation's base) lies in exactly one reservation, and no
        slot is in both; `_res_mapped[base]` counts the read-write slots of each;
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
        shareable: bool = False,
    ):
        self._drv: Driver = load_driver() if driver is None else driver
        self._ordinal = _current_torch_device() if device is None else int(device)
        self.device = f"cuda:{self._ordinal}"
        self._zero_fill = zero_fill
        self._shareable = shareable  # chunks exportable as POSIX fds (vmm.shared)
        self._lock = threading.RLock()
        self._closed = False
        self._reservations: dict[int, int] = {}  # base va -> size
        self._bases: list[int] = []  # sorted keys of _reservations
        self._map_count: dict[int, int] = {}  # live handle -> slots mapping it
        self._handle_obj: dict[int, Any] = {}  # live handle -> driver handle object
        self._slot_handle: dict[int, int] = {}  # read-write mapped slot va -> handle
        # Per reservation (base va): its read-write mapped slots and its zero-backed slot
        # vas, so freeing a reservation never scans its slots.
        self._res_mapped: dict[int, int] = {}
        self._res_zeros: dict[int, set[int]] = {}
        self._views: dict[int, Any] = {}  # base va -> DLPack view factory (made on demand)
        self._stream: Any = None
        self._zero: int | None = None
        self._dev = self._drv.call("cuDeviceGet", self._ordinal)
        self._require_vmm_support()
        self._ctx = self._drv.call("cuDevicePrimaryCtxRetain", self._dev)
        self._ctx_id = int(self._ctx)
        self._get_current = self._drv.mod.cuCtxGetCurrent
        try:
            self._set_up(granularity, zero_chunk)
        except BaseException:
            self._abandon_set_up()
            raise

    # ---- set-up -------------------------------------------------------------------
    def _set_up(self, granularity: int | None, zero_chunk: bool) -> None:
        self._prop = self._allocation_prop(self._shareable)
        self._granularity = self._choose_granularity(granularity)
        self._align = max(self._granularity, _TWO_MIB)  # of every reservation
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

    def _allocation_prop(self, shareable: bool = False) -> Any:
        mod = self._drv.mod
        prop = mod.CUmemAllocationProp()
        prop.type = mod.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = mod.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._ordinal
        kind = "CU_MEM_HANDLE_TYPE_" + ("POSIX_FILE_DESCRIPTOR" if shareable else "NONE")
        prop.requestedHandleTypes = getattr(mod.CUmemAllocationHandleType, kind)
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
        if cuda_scratch.read_only_mapping_works(self._drv, self._granularity, handle, self._ro):
            return handle
        self._release_unlocked([handle])
        return None

    # ---- context ------------------------------------------------------------------
    def _context(self) -> _ContextGuard:
        if self._closed:
            raise ClosedError(f"cuda backend on {self.device} is closed")
        return _ContextGuard(self)

    def _enter(self, closed_ok: bool = False) -> bool:
        """`_context()` without the guard object (the per-op calls): take the lock and make
        the context current; returns whether it was pushed, for `_leave`. `closed_ok`:
        also on a closed backend (close itself, a failed constructor)."""
        if self._closed and not closed_ok:
            raise ClosedError(f"cuda backend on {self.device} is closed")
        self._lock.acquire()
        try:
            drv = self._drv
            drv.num_calls["cuCtxGetCurrent"] = drv.num_calls.get("cuCtxGetCurrent", 0) + 1
            err, current = self._get_current()  # the hot path's one extra call: no wrapper
            if err:
                raise drv.error("cuCtxGetCurrent", err)
            if int(current) != self._ctx_id:
                drv.call("cuCtxPushCurrent", self._ctx)
                return True
        except BaseException:
            self._lock.release()
            raise
        return False

    def _leave(self, pushed: bool) -> None:
        try:
            if pushed:
                self._drv.call("cuCtxPopCurrent")
        finally:
            self._lock.release()

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
        pushed = self._enter()
        try:
            return self._create_unlocked(count, zero_fill=self._zero_fill)
        finally:
            self._leave(pushed)

    def _create_unlocked(self, count: int, *, zero_fill: bool) -> list[int]:
        made: list[int] = []
        call, g, prop = self._drv.call, self._granularity, self._prop
        handle_obj, map_count = self._handle_obj, self._map_count
        try:
            for _ in range(count):
                obj = call("cuMemCreate", g, prop, 0)
                handle = int(obj)
                made.append(handle)
                handle_obj[handle] = obj
                map_count[handle] = 0
            if zero_fill:
                cuda_scratch.zero_fill(self._drv, g, made, self._rw, self._stream)
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

    def release(self, handles: Sequence[int]) -> None:
        pushed = self._enter()
        try:
            map_count = self._map_count
            for h in handles:
                mapped = map_count.get(h)
                if mapped is None:
                    self._check_live(h, "release")
                if mapped:
                    raise MappingError(f"release of handle {h}: still mapped at {mapped} slot(s)")
                if h == self._zero:
                    raise MappingError(f"release of handle {h}: it is the zero chunk")
            if len(handles) > 1 and len(set(handles)) != len(handles):
                raise MappingError(f"release: duplicate handles in {list(handles)}")
            self._release_unlocked(handles)
        finally:
            self._leave(pushed)

    def _release_unlocked(self, handles: Sequence[int]) -> None:
        call, map_count, handle_obj = self._drv.call, self._map_count, self._handle_obj
        for i, h in enumerate(handles):
            try:
                call("cuMemRelease", h)
            except BackendError as exc:
                raise BackendError(
                    f"{exc} (after releasing {i} of {len(handles)} handles)",
                    op=exc.op,
                    code=exc.code,
                ) from exc
            del map_count[h]
            del handle_obj[h]

    def _release_quietly(self, handles: Sequence[int]) -> None:
        for h in handles:
            with contextlib.suppress(Exception):
                self._drv.call("cuMemRelease", h)
            self._map_count.pop(h, None)
            self._handle_obj.pop(h, None)

    # ---- sharing between processes (written against the driver docs; not run: no GPU) ----
    def export_handles(self, handles: Sequence[int]) -> SharedChunks:
        """One POSIX fd per chunk (`cuMemExportToShareableHandle`); needs `shareable=True`.
        The fds are new: the caller sends and closes them."""
        if not self._shareable:
            raise BackendError("export needs CudaBackend(shareable=True)", op="export")
        kind = self._drv.mod.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fds: list[int] = []
        with self._context():
            try:
                for h in handles:
                    self._check_live(h, "export")
                    fds.append(int(self._drv.call("cuMemExportToShareableHandle", h, kind, 0)))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        return SharedChunks(tuple(fds), tuple((i, 0) for i in range(len(fds))))

    def import_handles(self, shared: SharedChunks) -> list[int]:
        """`cuMemImportFromShareableHandle` per chunk (offsets must be 0); all or nothing.
        `release` of an imported handle drops this process's reference (`cuMemRelease`)."""
        bad = [off for _, off in shared.where if off]
        if bad:
            raise AlignmentError(f"import: CUDA chunks are whole allocations, offset {bad[0]}")
        kind = self._drv.mod.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        made: list[int] = []
        with self._context():
            try:
                for i, _ in shared.where:
                    obj = self._drv.call("cuMemImportFromShareableHandle", shared.fds[i], kind)
                    made.append(int(obj))
                    self._handle_obj[int(obj)] = obj
                    self._map_count[int(obj)] = 0
            except BaseException:
                self._release_quietly(made)
                raise
        return made

    def reserve(self, size: int, *, zero: bool = False) -> int:
        g = self._granularity
        if size <= 0 or size % g:
            raise AlignmentError(f"reserve size {size} must be a positive multiple of {g}")
        if zero and self._zero is None:
            raise MappingError("reserve(zero=True): this backend has no zero chunk")
        pushed = self._enter()
        try:
            va = int(self._drv.call("cuMemAddressReserve", size, self._align, 0, 0))
            self._reservations[va] = size
            bisect.insort(self._bases, va)
            self._res_mapped[va] = 0
            self._res_zeros[va] = set()
            if zero:
                self._zero_back_new(va, size)
            return va
        finally:
            self._leave(pushed)

    def _zero_back_new(self, va: int, size: int) -> None:
        """Map the zero chunk at every slot of the new reservation; on failure undo that,
        forget the reservation and free it."""
        undo: _Undo = []
        try:
            num_slots = size // self._granularity
            self._map_zero(list(range(va, va + size, self._granularity)), [va] * num_slots, undo)
        except BaseException:
            self._roll_back(undo)
            self._forget_reservation(va)
            self._drv.call("cuMemAddressFree", va, size)
            raise

    def _forget_reservation(self, va: int) -> None:
        del self._reservations[va]
        self._bases.remove(va)
        del self._res_mapped[va]
        del self._res_zeros[va]
        factory = self._views.pop(va, None)
        if factory is not None:
            factory.retire()  # later capsules from it raise ClosedError

    def free_reservation(self, va: int, size: int) -> None:
        pushed = self._enter()
        try:
            if self._reservations.get(va) != size:
                raise RangeError(f"free_reservation({va:#x}, {size}): no such reservation")
            busy = self._res_mapped[va]
            if busy:
                raise MappingError(f"free_reservation({va:#x}): {busy} slot(s) still mapped")
            if self._res_zeros[va]:
                self._free_zero_backed(va, size)
            else:
                self._drv.call("cuMemAddressFree", va, size)
            self._forget_reservation(va)
        finally:
            self._leave(pushed)

    def _free_zero_backed(self, va: int, size: int) -> None:
        """Unmap the zero chunk from the reservation's zero-backed slots, then free it; a
        failure maps them back."""
        zeros = sorted(self._res_zeros[va])
        undo: _Undo = []
        try:
            self._unmap_slots(zeros, [va] * len(zeros), undo)
            self._drv.call("cuMemAddressFree", va, size)
        except BaseException:
            self._roll_back(undo)
            raise
        self._map_count[self._zero] -= len(zeros)  # type: ignore[index]

    def map(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        if len(vas) != len(handles):
            raise ValueError(f"map: {len(vas)} addresses but {len(handles)} handles")
        if len(vas) == 1 and self._map_one(vas[0], handles[0]):
            return
        pushed = self._enter()
        try:
            bases = self._check_targets(vas, "map", want_mapped=False)
            map_count = self._map_count
            for h in handles:
                if h not in map_count or h == self._zero:
                    self._check_live(h, "map")
                    raise MappingError(f"map: handle {h} is the read-only zero chunk")
            res_zeros = self._res_zeros
            zeros = [(va, b) for va, b in zip(vas, bases, strict=True) if va in res_zeros[b]]
            undo: _Undo = []
            try:
                if zeros:
                    self._unmap_slots([z[0] for z in zeros], [z[1] for z in zeros], undo)
                self._map_handles(vas, handles, bases, undo)
            except BaseException:
                self._roll_back(undo)
                raise
            self._commit_map(vas, handles, bases, zeros)
        finally:
            self._leave(pushed)

    def unmap(self, vas: Sequence[int], *, to_zero: bool = False) -> None:
        if to_zero and self._zero is None:
            raise MappingError("unmap(to_zero=True): this backend has no zero chunk")
        if len(vas) == 1 and not to_zero and self._unmap_one(vas[0]):
            return
        pushed = self._enter()
        try:
            bases = self._check_targets(vas, "unmap", want_mapped=True)
            slot_handle = self._slot_handle
            handles = [slot_handle[va] for va in vas]
            undo: _Undo = []
            try:
                self._unmap_slots(vas, bases, undo)
                if to_zero:
                    self._map_zero(vas, bases, undo)
            except BaseException:
                self._roll_back(undo)
                raise
            self._commit_unmap(vas, handles, bases)
        finally:
            self._leave(pushed)

    # The one-slot paths run under the lock but make no context current: cuMemMap,
    # cuMemSetAccess and cuMemUnmap act on the process's unified address space and the device
    # named in the access descriptor, not on a context (the driver documents no
    # CUDA_ERROR_INVALID_CONTEXT for them), and the context check is a driver call of its own
    # on every op. The batch paths and everything that touches streams keep `_enter`.
    def _map_one(self, va: int, handle: int) -> bool:
        """`map` of one slot that is not zero-backed, without the batch's lists and undo
        log (the per-slot path of engines); False leaves the slot to the batch path."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"cuda backend on {self.device} is closed")
            base = self._slot_base(va, "map", want_mapped=False)
            if handle not in self._map_count or handle == self._zero or va in self._res_zeros[base]:
                return False  # the batch path refuses the handle or unmaps the zero chunk first
            call, g = self._drv.call, self._granularity
            call("cuMemMap", va, g, 0, handle, 0)
            try:
                call("cuMemSetAccess", va, g, self._rw, 1)
            except BaseException:
                self._roll_back([functools.partial(call, "cuMemUnmap", va, g)])
                raise
            self._slot_handle[va] = handle
            self._map_count[handle] += 1
            self._res_mapped[base] += 1
            return True

    def _unmap_one(self, va: int) -> bool:
        """`unmap` of one read-write slot (not to zero): one cuMemUnmap, nothing to undo."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"cuda backend on {self.device} is closed")
            base = self._slot_base(va, "unmap", want_mapped=True)
            self._drv.call("cuMemUnmap", va, self._granularity)
            self._map_count[self._slot_handle.pop(va)] -= 1
            self._res_mapped[base] -= 1
            return True

    def view_factory(self, va: int, size: int) -> ViewFactory | None:
        """DLPack capsules of CUDA device memory over the reservation at `va` (one factory
        per reservation, made on first use; retired when the reservation is freed)."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"cuda backend on {self.device} is closed")
            if self._reservations.get(va) != size:
                raise RangeError(f"view_factory({va:#x}, {size}): no such reservation")
            factory = self._views.get(va)
            if factory is None:
                factory = _host.device_view_factory(va, size, _DL_CUDA, self._ordinal)
                self._views[va] = factory
            shared: ViewFactory = factory.share()
            return shared

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
        return sum(len(zeros) for zeros in self._res_zeros.values())

    @property
    def _zero_slots(self) -> set[int]:
        """Every zero-backed slot va (checks and tests; the ops use `_res_zeros`)."""
        return set().union(*self._res_zeros.values())

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
            self._res_mapped[self._reservation_of(va)] -= 1
        for zeros in self._res_zeros.values():
            for va in sorted(zeros):
                self._drv.call("cuMemUnmap", va, g)
                zeros.discard(va)
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
        bases = self._bases
        i = bisect.bisect_right(bases, va) - 1
        if i < 0 or va >= bases[i] + self._reservations[bases[i]]:
            raise RangeError(f"address {va:#x} is not inside any reservation")
        return bases[i]

    def _check_targets(self, vas: Sequence[int], op: str, *, want_mapped: bool) -> list[int]:
        """Check every slot address of a batch before any table or driver call; returns the
        base of each one's reservation."""
        if len(vas) > 1 and len(set(vas)) != len(vas):
            raise MappingError(f"{op}: the batch names a slot twice")
        return [self._slot_base(va, op, want_mapped) for va in vas]

    def _slot_base(self, va: int, op: str, want_mapped: bool) -> int:
        """The base of the reservation holding slot `va`, checked: aligned, inside one
        reservation (the last base <= va, and before its end), mapped or not as wanted."""
        g = self._granularity
        if va % g:
            raise AlignmentError(f"{op}: address {va:#x} is not a multiple of {g}")
        bases = self._bases
        i = bisect.bisect_right(bases, va) - 1
        if i < 0 or va - bases[i] >= self._reservations[bases[i]]:
            raise RangeError(f"address {va:#x} is not inside any reservation")
        if (va in self._slot_handle) != want_mapped:
            state = "already mapped" if not want_mapped else "not mapped"
            raise MappingError(f"{op}: slot {va:#x} is {state}")
        return bases[i]

    # ---- driver steps with undo ---------------------------------------------------
    def _map_handles(
        self, vas: Sequence[int], handles: Sequence[int], bases: Sequence[int], undo: _Undo
    ) -> None:
        g, call = self._granularity, self._drv.call
        for va, h in zip(vas, handles, strict=True):
            call("cuMemMap", va, g, 0, h, 0)
            undo.append(functools.partial(call, "cuMemUnmap", va, g))
        self._set_access(vas, bases, self._rw)

    def _map_zero(self, vas: Sequence[int], bases: Sequence[int], undo: _Undo) -> None:
        assert self._zero is not None
        self._map_handles_ro(vas, bases, undo)
        res_zeros = self._res_zeros
        for va, base in zip(vas, bases, strict=True):
            res_zeros[base].add(va)
        self._map_count[self._zero] += len(vas)

        def forget() -> None:
            for va, base in zip(vas, bases, strict=True):
                res_zeros[base].discard(va)
            self._map_count[self._zero] -= len(vas)  # type: ignore[index]

        undo.append(forget)

    def _map_handles_ro(self, vas: Sequence[int], bases: Sequence[int], undo: _Undo) -> None:
        g, call = self._granularity, self._drv.call
        for va in vas:
            call("cuMemMap", va, g, 0, self._zero, 0)
            undo.append(functools.partial(call, "cuMemUnmap", va, g))
        self._set_access(vas, bases, self._ro)

    def _set_access(self, vas: Sequence[int], bases: Sequence[int], desc: list[Any]) -> None:
        g = self._granularity
        if len(vas) == 1:
            self._drv.call("cuMemSetAccess", vas[0], g, desc, 1)
            return
        for start, num_slots in _runs(sorted(zip(bases, vas, strict=True)), g):
            self._drv.call("cuMemSetAccess", start, num_slots * g, desc, 1)

    def _unmap_slots(self, vas: Sequence[int], bases: Sequence[int], undo: _Undo) -> None:
        call, slot_handle, res_zeros = self._drv.call, self._slot_handle, self._res_zeros
        g = self._granularity
        for va, base in zip(vas, bases, strict=True):
            call("cuMemUnmap", va, g)
            zero_backed = va in res_zeros[base]
            h = self._zero if zero_backed else slot_handle[va]
            undo.append(
                functools.partial(self._remap, va, h, self._ro if zero_backed else self._rw)
            )

    def _remap(self, va: int, handle: int | None, desc: list[Any]) -> None:
        """Undo of one `cuMemUnmap`: map `handle` at `va` again with its access."""
        self._drv.call("cuMemMap", va, self._granularity, 0, handle, 0)
        self._drv.call("cuMemSetAccess", va, self._granularity, desc, 1)

    def _roll_back(self, undo: _Undo) -> None:
        for step in reversed(undo):
            try:
                step()
            except Exception as exc:
                raise BackendError(
                    f"rollback failed ({exc}); backend state on {self.device} is undefined",
                    op="rollback",
                ) from exc

    def _commit_map(
        self,
        vas: Sequence[int],
        handles: Sequence[int],
        bases: Sequence[int],
        zeros: list[tuple[int, int]],
    ) -> None:
        slot_handle, map_count, res_mapped = self._slot_handle, self._map_count, self._res_mapped
        for va, h, base in zip(vas, handles, bases, strict=True):
            slot_handle[va] = h
            map_count[h] += 1
            res_mapped[base] += 1
        if zeros:
            for va, base in zeros:
                self._res_zeros[base].discard(va)
            self._map_count[self._zero] -= len(zeros)  # type: ignore[index]

    def _commit_unmap(
        self, vas: Sequence[int], handles: Sequence[int], bases: Sequence[int]
    ) -> None:
        slot_handle, map_count, res_mapped = self._slot_handle, self._map_count, self._res_mapped
        for va, h, base in zip(vas, handles, bases, strict=True):
            del slot_handle[va]
            map_count[h] -= 1
            res_mapped[base] -= 1
        # With to_zero, _map_zero has already recorded and counted the zero slots.

    # ---- checks -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the slot/handle tables disagree (cheap, O(slots))."""
        assert not (set(self._slot_handle) & self._zero_slots), "slot both mapped and zero"
        counts: dict[int, int] = dict.fromkeys(self._map_count, 0)
        mapped: dict[int, int] = dict.fromkeys(self._reservations, 0)
        for va, h in self._slot_handle.items():
            mapped[self._reservation_of(va)] += 1
            counts[h] += 1
        assert mapped == self._res_mapped, f"mapped per reservation {self._res_mapped} != {mapped}"
        for base, zeros in self._res_zeros.items():
            assert all(self._reservation_of(va) == base for va in zeros), "zero slot misfiled"
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
        self._pushed = self._b._enter(closed_ok=True)

    def __exit__(self, *exc: object) -> None:
        self._b._leave(self._pushed)
