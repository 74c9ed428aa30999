"""The CUDA driver emulator keeps the driver's documented rules (checked through the real
cuda-bindings). The backend tests on the emulator mean something only if these hold: a
rule the emulator did not enforce is a bug it could not find."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.vmm import emulator as emu_mod
from tests.vmm.emulator import (
    ACCESS_NONE,
    ACCESS_READWRITE,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    UNMAPPED,
    Emulator,
)

pytestmark = pytest.mark.emulator
G = 2 << 20


@dataclass
class Session:
    d: Any  # cuda.bindings.driver
    emu: Emulator
    prop: Any
    rw: list[Any]

    def ok(self, result: tuple[Any, ...]) -> Any:
        assert int(result[0]) == 0, f"driver call failed: {result[0]!r}"
        return result[1] if len(result) == 2 else result[1:] or None

    def code(self, result: tuple[Any, ...]) -> int:
        return int(result[0])

    def create(self, size: int = G) -> Any:
        return self.ok(self.d.cuMemCreate(size, self.prop, 0))

    def reserve(self, size: int) -> int:
        return int(self.ok(self.d.cuMemAddressReserve(size, G, 0, 0)))


@pytest.fixture
def s() -> Iterator[Session]:
    """cuInit, the primary context retained and pushed; everything checked given back."""
    from cuda.bindings import driver as d

    emu = emu_mod.loaded()
    assert emu is not None
    assert int(d.cuInit(0)[0]) == 0
    dev = d.cuDeviceGet(0)[1]
    ctx = d.cuDevicePrimaryCtxRetain(dev)[1]
    assert int(d.cuCtxPushCurrent(ctx)[0]) == 0
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    session = Session(d, emu, prop, [desc])
    yield session
    emu.fail_after(0)
    d.cuCtxPopCurrent()
    assert int(d.cuDevicePrimaryCtxRelease(dev)[0]) == 0  # the last release resets the context
    assert emu.count("sticky_error") == 0
    assert emu.live_objects()["handles"] == 0 and emu.live_objects()["reservations"] == 0


def test_map_needs_an_unmapped_reserved_range(s: Session):
    h, va = s.create(), s.reserve(2 * G)
    assert s.code(s.d.cuMemMap(va + 2 * G, G, 0, h, 0)) == CUDA_ERROR_INVALID_VALUE  # outside
    assert s.code(s.d.cuMemMap(va + 4096, G, 0, h, 0)) == CUDA_ERROR_INVALID_VALUE  # misaligned
    s.ok(s.d.cuMemMap(va, G, 0, h, 0))
    assert s.code(s.d.cuMemMap(va, G, 0, h, 0)) == CUDA_ERROR_INVALID_VALUE  # already mapped
    assert s.emu.access(va) == ACCESS_NONE  # mapped, but not accessible yet
    s.ok(s.d.cuMemUnmap(va, G))
    s.ok(s.d.cuMemRelease(h))
    s.ok(s.d.cuMemAddressFree(va, 2 * G))


def test_unmap_takes_whole_mappings_only(s: Session):
    h, va = s.create(2 * G), s.reserve(4 * G)
    s.ok(s.d.cuMemMap(va, 2 * G, 0, h, 0))
    assert s.code(s.d.cuMemUnmap(va, G)) == CUDA_ERROR_INVALID_VALUE  # half of one mapping
    assert s.code(s.d.cuMemUnmap(va, 3 * G)) == CUDA_ERROR_INVALID_VALUE  # runs past it
    s.ok(s.d.cuMemUnmap(va, 2 * G))
    assert s.emu.access(va) == UNMAPPED
    s.ok(s.d.cuMemRelease(h))
    s.ok(s.d.cuMemAddressFree(va, 4 * G))


def test_set_access_needs_a_fully_mapped_range(s: Session):
    h, va = s.create(), s.reserve(2 * G)
    s.ok(s.d.cuMemMap(va, G, 0, h, 0))
    assert s.code(s.d.cuMemSetAccess(va, 2 * G, s.rw, 1)) == CUDA_ERROR_INVALID_VALUE
    s.ok(s.d.cuMemSetAccess(va, G, s.rw, 1))
    assert s.emu.access(va) == ACCESS_READWRITE
    s.ok(s.d.cuMemUnmap(va, G))
    s.ok(s.d.cuMemMap(va, G, 0, h, 0))
    assert s.emu.access(va) == ACCESS_NONE  # a new mapping starts with no access
    s.ok(s.d.cuMemUnmap(va, G))
    s.ok(s.d.cuMemRelease(h))
    s.ok(s.d.cuMemAddressFree(va, 2 * G))


def test_release_while_mapped_frees_at_the_last_unmap(s: Session):
    h, va = s.create(), s.reserve(2 * G)
    s.ok(s.d.cuMemMap(va, G, 0, h, 0))
    s.ok(s.d.cuMemMap(va + G, G, 0, h, 0))
    s.ok(s.d.cuMemRelease(h))
    assert (s.emu.count("handles"), s.emu.count("released_mapped")) == (0, 1)
    assert s.emu.count("bytes_used") == G
    assert s.code(s.d.cuMemMap(va, G, 0, h, 0)) == CUDA_ERROR_INVALID_VALUE  # handle is gone
    s.ok(s.d.cuMemUnmap(va, G))
    assert s.emu.count("bytes_used") == G  # one mapping still holds it
    s.ok(s.d.cuMemUnmap(va + G, G))
    assert (s.emu.count("released_mapped"), s.emu.count("bytes_used")) == (0, 0)
    assert s.code(s.d.cuMemRelease(h)) == CUDA_ERROR_INVALID_VALUE  # double release
    s.ok(s.d.cuMemAddressFree(va, 2 * G))


def test_address_free_needs_the_exact_reservation_and_no_mapping(s: Session):
    h, va = s.create(), s.reserve(2 * G)
    s.ok(s.d.cuMemMap(va + G, G, 0, h, 0))
    assert s.code(s.d.cuMemAddressFree(va, G)) == CUDA_ERROR_INVALID_VALUE  # wrong size
    assert s.code(s.d.cuMemAddressFree(va, 2 * G)) == CUDA_ERROR_INVALID_VALUE  # still mapped
    s.ok(s.d.cuMemUnmap(va + G, G))
    s.ok(s.d.cuMemAddressFree(va, 2 * G))
    s.ok(s.d.cuMemRelease(h))


def test_out_of_memory_at_the_device_size(s: Session):
    total = s.emu.count("device_bytes")
    s.emu.set_device_bytes(3 * G)
    try:
        handles = [s.create() for _ in range(3)]
        assert s.code(s.d.cuMemCreate(G, s.prop, 0)) == CUDA_ERROR_OUT_OF_MEMORY
        assert tuple(int(x) for x in s.ok(s.d.cuMemGetInfo())) == (0, 3 * G)
        for h in handles:
            s.ok(s.d.cuMemRelease(h))
        assert tuple(int(x) for x in s.ok(s.d.cuMemGetInfo())) == (3 * G, 3 * G)
    finally:
        s.emu.set_device_bytes(total)


def test_stream_work_runs_at_synchronize_against_the_mappings_then(s: Session):
    h, va = s.create(), s.reserve(G)
    stream = s.ok(s.d.cuStreamCreate(1))
    s.ok(s.d.cuMemMap(va, G, 0, h, 0))
    s.ok(s.d.cuMemSetAccess(va, G, s.rw, 1))
    s.ok(s.d.cuMemsetD8Async(va, 5, G, stream))
    assert s.emu.host_view(va, 4, G).tolist() != [5] * 4  # queued, not run
    s.ok(s.d.cuStreamSynchronize(stream))
    assert s.emu.host_view(va, 4, G).tolist() == [5] * 4
    s.ok(s.d.cuMemsetD8Async(va, 0, G, stream))
    s.ok(s.d.cuMemUnmap(va, G))  # unmapped under the queued memset: it faults when it runs
    assert s.code(s.d.cuStreamSynchronize(stream)) == CUDA_ERROR_ILLEGAL_ADDRESS
    assert s.code(s.d.cuMemRelease(h)) == CUDA_ERROR_ILLEGAL_ADDRESS  # sticky
    assert s.emu.count("sticky_error") == CUDA_ERROR_ILLEGAL_ADDRESS
    assert s.emu.reset() > 0  # the context is unusable: start again from a clean driver
    ctx = s.ok(s.d.cuDevicePrimaryCtxRetain(s.d.cuDeviceGet(0)[1]))  # as the fixture did
    s.ok(s.d.cuCtxPushCurrent(ctx))


def test_context_rules(s: Session):
    ctx = s.ok(s.d.cuCtxPopCurrent())
    assert s.code(s.d.cuMemGetInfo()) == CUDA_ERROR_INVALID_CONTEXT  # no current context
    assert s.code(s.d.cuStreamCreate(0)) == CUDA_ERROR_INVALID_CONTEXT
    assert s.code(s.d.cuCtxPopCurrent()) == CUDA_ERROR_INVALID_CONTEXT  # nothing to pop
    assert int(s.ok(s.d.cuCtxGetCurrent())) == 0
    s.ok(s.d.cuCtxPushCurrent(ctx))
    assert int(s.ok(s.d.cuCtxGetCurrent())) == int(ctx)


def test_fault_injection_fails_only_the_kth_memory_call(s: Session):
    va = s.reserve(G)
    s.emu.fail_after(2, CUDA_ERROR_INVALID_VALUE)
    h = s.create()  # first memory call: fine
    assert s.code(s.d.cuMemMap(va, G, 0, h, 0)) == CUDA_ERROR_INVALID_VALUE  # second: fails
    assert s.emu.access(va) == UNMAPPED  # and did nothing
    s.ok(s.d.cuMemMap(va, G, 0, h, 0))  # one shot
    s.ok(s.d.cuMemUnmap(va, G))
    s.ok(s.d.cuMemRelease(h))
    s.ok(s.d.cuMemAddressFree(va, G))


def test_entry_points_come_through_get_proc_address(s: Session):
    err, pfn, status = s.d.cuGetProcAddress(b"cuMemMap", 10020, 0)
    assert (int(err), int(status)) == (0, 0) and int(pfn) != 0
    err, pfn, status = s.d.cuGetProcAddress(b"cuNoSuchCall", 12000, 0)
    assert (int(err), int(pfn), int(status)) == (0, 0, 1)  # SYMBOL_NOT_FOUND
    err, pfn, status = s.d.cuGetProcAddress(b"cuMemMap", 9000, 0)
    assert (int(err), int(pfn), int(status)) == (0, 0, 2)  # VERSION_NOT_SUFFICIENT
    version = int(s.ok(s.d.cuDriverGetVersion()))
    assert int(s.d.cuGetProcAddress(b"cuMemMap", version + 10, 0)[0]) == CUDA_ERROR_INVALID_VALUE
