"""CudaBackend through the real cuda-bindings, on the CUDA driver emulator.

Every call here goes through `cuda.bindings.driver` into tests/vmm/cuda_emulator (argument
marshalling, struct fields, return tuples, CUresult codes: what the model in
cuda_driver_model.py cannot check), and each test checks both sides: the backend's tables
and what the emulated driver holds (handles, mappings, the access of every slot).
Fault injection (`Emulator.fail_after`) fails the k-th memory call of an operation for
every k, as the host suite does with syscalls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vmm.cuda import CudaBackend

import vmm
from tests.vmm import emulator as emu_mod
from tests.vmm.emulator import ACCESS_READ, ACCESS_READWRITE, POISON_BYTE, UNMAPPED, Emulator

pytestmark = [pytest.mark.cuda, pytest.mark.emulator]
G = 2 << 20
CLEAN = {"handles": 0, "released_mapped": 0, "reservations": 0, "mappings": 0, "streams": 0,
         "ctx_retains": 0, "ctx_depth": 0, "bytes_used": 0}  # fmt: skip


@pytest.fixture
def emu() -> Iterator[Emulator]:
    loaded = emu_mod.loaded()
    assert loaded is not None
    device_bytes = loaded.count("device_bytes")
    yield loaded
    loaded.fail_after(0)
    loaded.set_device_bytes(device_bytes)
    loaded.set_read_only_access(True)


@pytest.fixture
def backend(emu: Emulator) -> Iterator[CudaBackend]:
    b = CudaBackend(0)
    yield b
    b.close()
    assert emu.live_objects() == CLEAN


def observed(b: CudaBackend, emu: Emulator) -> tuple[Any, ...]:
    """The backend's tables and the emulated driver's view of every reserved slot."""
    b.check_invariants()
    assert emu.count("ctx_depth") == 0, "a call left its context pushed"
    access = {
        va: emu.access(va)
        for base, size in sorted(b._reservations.items())
        for va in range(base, base + size, b.granularity)
    }
    return (dict(b._slot_handle), set(b._zero_slots), dict(b._map_count),
            dict(b._reservations), b.stats(), emu.live_objects(), access)  # fmt: skip


def memory_calls(emu: Emulator, fn: Callable[[], Any]) -> int:
    before = emu.count("memory_calls")
    fn()
    return emu.count("memory_calls") - before


# ---- set-up, context, lifetime ---------------------------------------------------------------
def test_set_up_holds_the_zero_chunk_a_stream_and_one_retain(emu: Emulator):
    b = CudaBackend(0)
    try:
        assert (b.granularity, b.device, b.num_chunks) == (G, "cuda:0", 0)
        assert b.zero_handle is not None and b.stats() == {"bytes.physical.current": G}
        assert emu.live_objects() == CLEAN | {"handles": 1, "streams": 1, "ctx_retains": 1,
                                              "bytes_used": G}  # fmt: skip
        calls = b.driver_calls
        assert (calls["cuInit"], calls["cuDevicePrimaryCtxRetain"]) == (1, 1)
        assert calls["cuCtxPushCurrent"] == calls["cuCtxPopCurrent"] >= 1
    finally:
        b.close()
    assert emu.live_objects() == CLEAN


def test_close_is_idempotent_and_final(backend: CudaBackend, emu: Emulator):
    h = backend.create(2)
    va = backend.reserve(2 * G, zero=True)
    backend.map([va], [h[0]])
    backend.close()
    backend.close()
    assert emu.live_objects() == CLEAN
    with pytest.raises(vmm.ClosedError, match="cuda:0 is closed"):
        backend.create(1)


def test_failed_constructor_gives_everything_back_at_every_call(emu: Emulator):
    num_calls = memory_calls(emu, lambda: CudaBackend(0).close()) - 2  # close's own two
    assert num_calls >= 10  # zero chunk: create, zero fill, read-only probe
    for k in range(1, num_calls + 1):
        emu.fail_after(k)
        try:
            CudaBackend(0).close()  # a fault the constructor absorbed (a retried teardown)
        except vmm.OutOfMemory as exc:
            assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in str(exc), k
        assert emu.live_objects() == CLEAN, f"constructor leaked after failing memory call {k}"
        assert emu.count("pending_fault") == 0


def test_no_zero_chunk_when_the_device_refuses_read_only(emu: Emulator):
    emu.set_read_only_access(False)
    b = CudaBackend(0)
    try:
        assert b.zero_handle is None and emu.count("handles") == 0  # the probe gave it back
        with pytest.raises(vmm.MappingError, match="no zero chunk"):
            b.reserve(G, zero=True)
        with pytest.raises(vmm.MappingError, match="no zero chunk"):
            b.unmap([0], to_zero=True)
    finally:
        b.close()


def test_granularity_must_be_a_power_of_two_multiple_of_the_device_one(emu: Emulator):
    with pytest.raises(vmm.AlignmentError, match="granularity 3145728 must be a power of two"):
        CudaBackend(0, granularity=3 << 20)
    assert emu.live_objects() == CLEAN
    big = CudaBackend(0, granularity=2 * G)
    try:
        (h,) = big.create(1)
        va = big.reserve(4 * G)
        big.map([va + 2 * G], [h])
        access = [emu.access(va + i * G) for i in range(4)]
        assert access == [UNMAPPED, UNMAPPED, ACCESS_READWRITE, ACCESS_READWRITE]
        big.unmap([va + 2 * G])
        big.free_reservation(va, 4 * G)
        big.release([h])
    finally:
        big.close()


def test_context_pushed_only_when_not_already_current(backend: CudaBackend, emu: Emulator):
    from cuda.bindings import driver

    pushes = backend.driver_calls["cuCtxPushCurrent"]
    backend.create(1)
    assert backend.driver_calls["cuCtxPushCurrent"] == pushes + 1
    (err,) = driver.cuCtxPushCurrent(backend._ctx)  # torch's threads: primary context current
    assert int(err) == 0
    try:
        backend.create(1)
        assert backend.driver_calls["cuCtxPushCurrent"] == pushes + 1
        assert emu.count("ctx_depth") == 1
    finally:
        err, _ = driver.cuCtxPopCurrent()
        assert int(err) == 0


def test_other_threads_push_their_own_context(backend: CudaBackend, emu: Emulator):
    made: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            made.extend(backend.create(2))
            assert emu.count("ctx_depth") == 0  # this thread's stack, popped again
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(made)) == 8
    assert emu.count("handles") == 9  # and the zero chunk
    backend.release(made)


# ---- the contract ----------------------------------------------------------------------------
@pytest.mark.parametrize("zero_fill", [True, False])
def test_create_zero_fills_what_the_driver_leaves_dirty(emu: Emulator, zero_fill: bool):
    b = CudaBackend(0, zero_fill=zero_fill)
    try:
        h = b.create(2)
        va = b.reserve(2 * G)
        b.map([va, va + G], h)
        data = emu.host_view(va, 2 * G, G)
        ends = [int(data[0]), int(data[G - 1]), int(data[G]), int(data[2 * G - 1])]
        if zero_fill:
            assert ends == [0] * 4 and int(data.sum()) == 0
        else:  # the emulator's new memory is dirty, so the zeros above are the backend's
            assert ends == [POISON_BYTE] * 4
        b.unmap([va, va + G])
        b.free_reservation(va, 2 * G)
        b.release(h)
    finally:
        b.close()


def test_map_sets_access_once_per_run(backend: CudaBackend, emu: Emulator):
    h = backend.create(3)
    va = backend.reserve(4 * G)
    before = backend.driver_calls["cuMemSetAccess"]
    backend.map([va + 3 * G, va, va + G], [h[2], h[0], h[1]])
    assert backend.driver_calls["cuMemSetAccess"] - before == 2  # runs [0, 1] and [3]
    assert [emu.access(va + i * G) for i in range(4)] == [ACCESS_READWRITE, ACCESS_READWRITE,
                                                           UNMAPPED, ACCESS_READWRITE]  # fmt: skip
    backend.unmap([va, va + G, va + 3 * G])
    assert emu.count("mappings") == 0
    backend.free_reservation(va, 4 * G)
    backend.release(h)


def test_zero_backed_slots_map_the_zero_chunk_read_only(backend: CudaBackend, emu: Emulator):
    va = backend.reserve(3 * G, zero=True)
    assert [emu.access(va + i * G) for i in range(3)] == [ACCESS_READ] * 3
    assert int(emu.host_view(va, 3 * G, G).sum()) == 0
    (h,) = backend.create(1)
    backend.map([va + G], [h])
    assert emu.access(va + G) == ACCESS_READWRITE
    emu.host_view(va + G, G, G, write=True).fill_(9)
    backend.unmap([va + G], to_zero=True)
    assert emu.access(va + G) == ACCESS_READ and int(emu.host_view(va + G, G, G).sum()) == 0
    assert backend.num_zero_slots == 3 and emu.count("mappings") == 3
    backend.free_reservation(va, 3 * G)
    assert (emu.count("mappings"), emu.count("reservations")) == (0, 0)
    backend.release([h])


def test_a_chunk_mapped_twice_shows_writes_at_both_addresses(backend: CudaBackend, emu: Emulator):
    (h,) = backend.create(1)
    a, b = backend.reserve(G), backend.reserve(2 * G)
    backend.map([a, b + G], [h, h])
    emu.host_view(a, 16, G, write=True)[:] = 7
    assert emu.host_view(b + G, 16, G).tolist() == [7] * 16
    with pytest.raises(vmm.MappingError, match="still mapped at 2 slot"):
        backend.release([h])
    backend.unmap([a])
    assert emu.host_view(b + G, 16, G).tolist() == [7] * 16  # the other mapping keeps it
    backend.unmap([b + G])
    backend.release([h])
    backend.free_reservation(a, G)
    backend.free_reservation(b, 2 * G)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda b, va, h: b.map([va + 1], [h]), vmm.AlignmentError, "not a multiple of 2097152"),
        (lambda b, va, h: b.map([va + 8 * G], [h]), vmm.RangeError, "not inside any reservation"),
        (lambda b, va, h: b.map([va, va], [h, h]), vmm.MappingError, "names a slot twice"),
        (lambda b, va, h: b.map([va], [12345]), vmm.MappingError, "handle 12345 is not a live"),
        (lambda b, va, h: b.unmap([va]), vmm.MappingError, "is not mapped"),
        (lambda b, va, h: b.reserve(G + 1), vmm.AlignmentError, "2097153 must be a positive"),
        (lambda b, va, h: b.free_reservation(va, G), vmm.RangeError, "no such reservation"),
        (lambda b, va, h: b.release([h, h]), vmm.MappingError, "duplicate handles"),
    ],
)
def test_bad_input_raises_before_any_driver_call(
    backend: CudaBackend, emu: Emulator, call: Any, error: type, match: str
):
    (h,) = backend.create(1)
    va = backend.reserve(2 * G)
    before = observed(backend, emu)
    calls = emu.count("memory_calls")
    with pytest.raises(error, match=match):
        call(backend, va, h)
    assert (emu.count("memory_calls"), observed(backend, emu)) == (calls, before)
    backend.free_reservation(va, 2 * G)
    backend.release([h])


def test_out_of_memory_at_the_device_size(emu: Emulator):
    emu.set_device_bytes(8 * G)
    b = CudaBackend(0)
    try:
        before = observed(b, emu)
        oom = r"cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)"
        with pytest.raises(vmm.OutOfMemory, match=oom) as e:
            b.create(10)  # 8 fit, less the zero chunk
        assert "create of 10 chunks of 2097152 bytes failed after 7 (all released)" in str(e.value)
        assert (e.value.needed, e.value.free, e.value.total) == (10 * G, 7 * G, 8 * G)
        assert observed(b, emu) == before
        assert len(b.create(7)) == 7  # all of it, once
    finally:
        b.close()


ERROR_NAMES = [(1, "CUDA_ERROR_INVALID_VALUE"), (801, "CUDA_ERROR_NOT_SUPPORTED"),
               (999, "CUDA_ERROR_UNKNOWN")]  # fmt: skip


@pytest.mark.parametrize(("code", "name"), ERROR_NAMES)
def test_driver_errors_become_backend_errors_naming_call_and_code(
    backend: CudaBackend, emu: Emulator, code: int, name: str
):
    (h,) = backend.create(1)
    va = backend.reserve(G)
    emu.fail_after(1, code)
    with pytest.raises(vmm.BackendError, match=rf"cuMemMap failed: {name} \({code}\)") as e:
        backend.map([va], [h])
    assert (e.value.op, e.value.code) == ("cuMemMap", code)
    backend.map([va], [h])
    backend.unmap([va])
    backend.free_reservation(va, G)
    backend.release([h])


def test_release_failure_part_way_says_how_far(backend: CudaBackend, emu: Emulator):
    h = backend.create(3)
    emu.fail_after(2, 1)
    with pytest.raises(vmm.BackendError, match=r"INVALID_VALUE \(1\) \(after releasing 1 of 3"):
        backend.release(h)
    assert emu.count("handles") == 3  # the zero chunk and the two not released
    backend.check_invariants()
    backend.release(h[1:])
