"""A model of the CUDA driver's VMM API, for testing `CudaBackend` where no GPU exists.

It enforces the rules the driver documents for the calls `CudaBackend` makes (cuMemMap
only into reserved, unmapped VA; cuMemSetAccess only over fully mapped VA; cuMemUnmap
only of whole mappings; cuMemAddressFree of exactly a reservation; cuMemsetD8Async only
through read-write access) and returns CUresult codes the way cuda-python does
(`(code, *outputs)`). It is a test double for a component that cannot run here; the
`cuda`-marked tests run the same backend on the real driver when a GPU is present.

`fail_at(k, code)` makes the k-th VMM call from now return `code` (one shot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

SUCCESS = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
NOT_SUPPORTED = 801
_NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
          801: "CUDA_ERROR_NOT_SUPPORTED"}  # fmt: skip
PROT_NONE, PROT_READ, PROT_READWRITE = 0, 1, 3
_VMM_CALLS = {"cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree",
              "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemsetD8Async"}  # fmt: skip


class _Location:
    def __init__(self) -> None:
        self.type = 0
        self.id = 0


class _Prop:
    def __init__(self) -> None:
        self.type = 0
        self.location = _Location()
        self.requestedHandleTypes = 0


class _AccessDesc:
    def __init__(self) -> None:
        self.location = _Location()
        self.flags = 0


@dataclass
class _Handle:
    size: int
    zeroed: bool = False  # cuMemCreate gives no guarantee: dirty until memset


@dataclass
class DriverModel:
    """State: live handles, reservations, mappings (va -> (size, handle)), access per page."""

    granularity: int = 2 << 20
    capacity_bytes: int = 64 << 20
    read_only_ok: bool = True
    handles: dict[int, _Handle] = field(default_factory=dict)
    reservations: dict[int, int] = field(default_factory=dict)
    mappings: dict[int, tuple[int, int]] = field(default_factory=dict)
    access: dict[int, int] = field(default_factory=dict)  # page va -> PROT_*
    ctx_stack: list[int] = field(default_factory=list)
    retained: int = 0
    calls: list[str] = field(default_factory=list)
    _next_handle: int = 0x1000
    _next_va: int = 1 << 40
    _fail_in: int = 0
    _fail_code: int = 0

    def __post_init__(self) -> None:
        enum = SimpleNamespace
        self.CUmemAllocationType = enum(CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = enum(CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAllocationHandleType = enum(CU_MEM_HANDLE_TYPE_NONE=0)
        self.CUmemAllocationGranularity_flags = enum(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
        self.CUmemAccess_flags = enum(
            CU_MEM_ACCESS_FLAGS_PROT_NONE=PROT_NONE,
            CU_MEM_ACCESS_FLAGS_PROT_READ=PROT_READ,
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE=PROT_READWRITE,
        )
        self.CUdevice_attribute = enum(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)
        self.CUmemAllocationProp = _Prop
        self.CUmemAccessDesc = _AccessDesc

    # ---- test controls --------------------------------------------------------------
    def fail_at(self, k: int, code: int = OUT_OF_MEMORY) -> None:
        self._fail_in, self._fail_code = k, code

    def _fault(self, name: str) -> int:
        self.calls.append(name)
        if name in _VMM_CALLS and self._fail_in > 0:
            self._fail_in -= 1
            if self._fail_in == 0:
                return self._fail_code
        return SUCCESS

    def snapshot(self) -> tuple[Any, ...]:
        zeroed = {h: v.zeroed for h, v in self.handles.items()}
        return (zeroed, dict(self.reservations), dict(self.mappings), dict(self.access))

    def slot(self, va: int) -> tuple[int | None, int]:
        """(handle mapped at page va or None, access)."""
        for start, (size, handle) in self.mappings.items():
            if start <= va < start + size:
                return handle, self.access.get(va, PROT_NONE)
        return None, PROT_NONE

    # ---- context / device -----------------------------------------------------------
    def cuInit(self, flags: int) -> tuple[int]:
        return (self._fault("cuInit"),)

    def cuDeviceGetCount(self) -> tuple[int, int]:
        return (SUCCESS, 1)

    def cuDeviceGet(self, ordinal: int) -> tuple[int, int]:
        return (SUCCESS, ordinal) if ordinal == 0 else (INVALID_VALUE, 0)

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple[int, int]:
        return (SUCCESS, 1)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[int, int]:
        self.retained += 1
        return (SUCCESS, 0xC0)

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[int]:
        self.retained -= 1
        return (SUCCESS,)

    def cuCtxGetCurrent(self) -> tuple[int, int]:
        return (SUCCESS, self.ctx_stack[-1] if self.ctx_stack else 0)

    def cuCtxPushCurrent(self, ctx: int) -> tuple[int]:
        self.calls.append("cuCtxPushCurrent")
        self.ctx_stack.append(ctx)
        return (SUCCESS,)

    def cuCtxPopCurrent(self) -> tuple[int, int]:
        self.calls.append("cuCtxPopCurrent")
        return (SUCCESS, self.ctx_stack.pop())

    def cuStreamCreate(self, flags: int) -> tuple[int, int]:
        return (SUCCESS, 0x5)

    def cuStreamDestroy(self, stream: int) -> tuple[int]:
        return (SUCCESS,)

    def cuStreamSynchronize(self, stream: int) -> tuple[int]:
        return (SUCCESS,)

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:
        return (SUCCESS, _NAMES.get(int(err), "CUDA_ERROR_UNKNOWN").encode())

    def cuMemGetInfo(self) -> tuple[int, int, int]:
        used = sum(h.size for h in self.handles.values())
        return (SUCCESS, self.capacity_bytes - used, self.capacity_bytes)

    def cuMemGetAllocationGranularity(self, prop: Any, option: int) -> tuple[int, int]:
        return (SUCCESS, self.granularity)

    # ---- VMM ------------------------------------------------------------------------
    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[int, int]:
        if err := self._fault("cuMemCreate"):
            return (err, 0)
        used = sum(h.size for h in self.handles.values())
        if size % self.granularity or prop.location.type != 1:
            return (INVALID_VALUE, 0)
        if used + size > self.capacity_bytes:
            return (OUT_OF_MEMORY, 0)
        self._next_handle += 1
        self.handles[self._next_handle] = _Handle(size)
        return (SUCCESS, self._next_handle)

    def cuMemRelease(self, handle: int) -> tuple[int]:
        if err := self._fault("cuMemRelease"):
            return (err,)
        if handle not in self.handles or any(h == handle for _, h in self.mappings.values()):
            return (INVALID_VALUE,)  # (the real driver defers; CudaBackend never does this)
        del self.handles[handle]
        return (SUCCESS,)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple[int, int]:
        if err := self._fault("cuMemAddressReserve"):
            return (err, 0)
        align = max(align, self.granularity)
        va = -(-self._next_va // align) * align
        self._next_va = va + size + self.granularity  # a guard gap between reservations
        self.reservations[va] = size
        return (SUCCESS, va)

    def cuMemAddressFree(self, va: int, size: int) -> tuple[int]:
        if err := self._fault("cuMemAddressFree"):
            return (err,)
        if self.reservations.get(va) != size:
            return (INVALID_VALUE,)
        if any(va <= m < va + size for m in self.mappings):
            return (INVALID_VALUE,)
        del self.reservations[va]
        return (SUCCESS,)

    def _reserved(self, va: int, size: int) -> bool:
        return any(b <= va and va + size <= b + s for b, s in self.reservations.items())

    def cuMemMap(self, va: int, size: int, offset: int, handle: int, flags: int) -> tuple[int]:
        if err := self._fault("cuMemMap"):
            return (err,)
        h = self.handles.get(handle)
        if h is None or offset != 0 or size != h.size or not self._reserved(va, size):
            return (INVALID_VALUE,)
        if any(m < va + size and va < m + s for m, (s, _) in self.mappings.items()):
            return (INVALID_VALUE,)
        self.mappings[va] = (size, handle)
        return (SUCCESS,)

    def cuMemUnmap(self, va: int, size: int) -> tuple[int]:
        if err := self._fault("cuMemUnmap"):
            return (err,)
        covered, pos = [], va
        while pos < va + size:  # must be a sequence of whole mappings
            if pos not in self.mappings:
                return (INVALID_VALUE,)
            covered.append(pos)
            pos += self.mappings[pos][0]
        if pos != va + size:
            return (INVALID_VALUE,)
        for m in covered:
            del self.mappings[m]
        for page in range(va, va + size, self.granularity):
            self.access.pop(page, None)
        return (SUCCESS,)

    def cuMemSetAccess(self, va: int, size: int, desc: list[Any], count: int) -> tuple[int]:
        if err := self._fault("cuMemSetAccess"):
            return (err,)
        flags = desc[0].flags
        if count != 1 or (flags == PROT_READ and not self.read_only_ok):
            return (NOT_SUPPORTED if flags == PROT_READ else INVALID_VALUE,)
        pages = range(va, va + size, self.granularity)
        if any(self.slot(p)[0] is None for p in pages):
            return (INVALID_VALUE,)
        for p in pages:
            self.access[p] = flags
        return (SUCCESS,)

    def cuMemsetD8Async(self, va: int, value: int, n: int, stream: int) -> tuple[int]:
        if err := self._fault("cuMemsetD8Async"):
            return (err,)
        pages = range(va, va + n, self.granularity)
        if any(self.slot(p)[1] != PROT_READWRITE for p in pages):
            return (INVALID_VALUE,)
        for p in pages:
            handle = self.slot(p)[0]
            assert handle is not None
            self.handles[handle].zeroed = value == 0
        return (SUCCESS,)
