"""CudaBackend: bookkeeping and rollback on a model of the driver (any machine), argument
marshalling against cuda-python itself (when installed), and the real driver (`cuda`)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vmm._core import host as _host
from vmm.cuda import CudaBackend
from vmm.cuda_driver import Driver, load_driver

import vmm
from tests.vmm import emulator
from tests.vmm.cuda_driver_model import PROT_READ, PROT_READWRITE, DriverModel

G = 2 << 20


@pytest.fixture
def model() -> DriverModel:
    return DriverModel(granularity=G, capacity_bytes=32 * G)


@pytest.fixture
def backend(model: DriverModel) -> Iterator[CudaBackend]:
    b = CudaBackend(0, driver=load_driver(model))  # type: ignore[arg-type]
    yield b
    b.close()
    assert (model.handles, model.reservations, model.mappings) == ({}, {}, {})
    assert model.retained == 0


def state(b: CudaBackend, model: DriverModel) -> tuple[Any, ...]:
    b.check_invariants()
    assert model.ctx_stack == []  # every call popped what it pushed
    return (dict(b._slot_handle), set(b._zero_slots), dict(b._map_count),
            dict(b._reservations), list(b._bases), b.stats(), model.snapshot())  # fmt: skip


def vmm_calls(model: DriverModel, fn: Callable[[], Any]) -> int:
    before = len(model.calls)
    fn()
    from tests.vmm.cuda_driver_model import _VMM_CALLS

    return sum(1 for c in model.calls[before:] if c in _VMM_CALLS)


# ---- contract on the model ----------------------------------------------------------------
def test_create_zero_fills_through_a_scratch_mapping(backend: CudaBackend, model: DriverModel):
    handles = backend.create(3)
    assert len(set(handles)) == 3
    assert all(model.handles[h].zeroed for h in handles)
    assert model.mappings == {} and model.reservations == {}  # scratch VA given back
    assert backend.granularity == G and backend.device == "cuda:0"
    assert backend.num_chunks == 3
    assert backend.stats() == {"bytes.physical.current": 4 * G}  # and the zero chunk


def test_map_sets_access_once_per_run(backend: CudaBackend, model: DriverModel):
    h = backend.create(3)
    va = backend.reserve(4 * G)
    assert va % G == 0
    before = model.calls.count("cuMemSetAccess")
    backend.map([va + 3 * G, va, va + G], [h[2], h[0], h[1]])
    assert model.calls.count("cuMemSetAccess") - before == 2  # runs [0, 1] and [3]
    assert [model.slot(va + i * G) for i in range(4)] == [
        (h[0], PROT_READWRITE), (h[1], PROT_READWRITE), (None, 0), (h[2], PROT_READWRITE)
    ]  # fmt: skip
    backend.unmap([va, va + G, va + 3 * G])
    assert model.mappings == {}
    backend.free_reservation(va, 4 * G)
    backend.release(h)


def test_zero_backed_slots_read_only(backend: CudaBackend, model: DriverModel):
    zero = backend.zero_handle
    assert zero is not None
    va = backend.reserve(3 * G, zero=True)
    assert [model.slot(va + i * G) for i in range(3)] == [(zero, PROT_READ)] * 3
    (h,) = backend.create(1)
    backend.map([va + G], [h])
    assert model.slot(va + G) == (h, PROT_READWRITE)
    backend.unmap([va + G], to_zero=True)
    assert model.slot(va + G) == (zero, PROT_READ)
    assert backend.num_zero_slots == 3
    backend.free_reservation(va, 3 * G)
    assert model.mappings == {}
    backend.check_invariants()


def test_sharing_and_release_rules(backend: CudaBackend, model: DriverModel):
    (h,) = backend.create(1)
    va = backend.reserve(2 * G)
    backend.map([va, va + G], [h, h])
    assert backend._map_count[h] == 2
    with pytest.raises(vmm.MappingError, match="still mapped at 2 slot"):
        backend.release([h])
    backend.unmap([va])
    backend.unmap([va + G])
    backend.release([h])
    assert h not in model.handles


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
        (lambda b, va, h: b.create(0), ValueError, "count >= 1, got 0"),
    ],
)
def test_bad_input_raises_before_any_driver_call(
    backend: CudaBackend, model: DriverModel, call: Any, error: type, match: str
):
    (h,) = backend.create(1)
    va = backend.reserve(2 * G)
    before = state(backend, model)
    calls = len(model.calls)
    with pytest.raises(error, match=match):
        call(backend, va, h)
    assert state(backend, model) == before
    assert [c for c in model.calls[calls:] if c.startswith("cuMem")] == []


def test_map_over_mapped_slot(backend: CudaBackend):
    h = backend.create(2)
    va = backend.reserve(G)
    backend.map([va], [h[0]])
    with pytest.raises(vmm.MappingError, match="is already mapped"):
        backend.map([va], [h[1]])


def test_out_of_memory_names_free_and_total(backend: CudaBackend, model: DriverModel):
    before = state(backend, model)
    with pytest.raises(vmm.OutOfMemory, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY") as e:
        backend.create(40)  # 32 chunks fit, less the zero chunk
    assert "create of 40 chunks of 2097152 bytes failed after 31 (all released)" in str(e.value)
    assert (e.value.needed, e.value.free, e.value.total) == (40 * G, 31 * G, 32 * G)
    assert state(backend, model) == before


# ---- rollback at every failing driver call -----------------------------------------------
def _scenario_map(b: CudaBackend) -> Callable[[], Any]:
    va = b.reserve(4 * G, zero=True)
    h = b.create(3)
    return lambda: b.map([va, va + G, va + 3 * G], h)


def _scenario_unmap_to_zero(b: CudaBackend) -> Callable[[], Any]:
    va = b.reserve(3 * G)
    h = b.create(3)
    b.map([va, va + G, va + 2 * G], h)
    return lambda: b.unmap([va + 2 * G, va], to_zero=True)


def _scenario_reserve_zero(b: CudaBackend) -> Callable[[], Any]:
    return lambda: b.reserve(3 * G, zero=True)


def _scenario_free_zero_reservation(b: CudaBackend) -> Callable[[], Any]:
    va = b.reserve(3 * G, zero=True)
    return lambda: b.free_reservation(va, 3 * G)


def _scenario_create(b: CudaBackend) -> Callable[[], Any]:
    return lambda: b.create(3)


SCENARIOS = {
    "map": (_scenario_map, None),
    "unmap_to_zero": (_scenario_unmap_to_zero, None),
    "reserve_zero": (_scenario_reserve_zero, None),
    "free_zero_reservation": (_scenario_free_zero_reservation, None),
    # create's last 4 calls tear the scratch mapping down after the memset; a failure there
    # is tried again, so the create succeeds (test_cuda_emulated_faults.py injects those)
    "create": (_scenario_create, 4),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_rollback_at_every_driver_call(name: str):
    make, tail = SCENARIOS[name]
    probe_model = DriverModel(granularity=G, capacity_bytes=32 * G)
    probe = CudaBackend(0, driver=load_driver(probe_model))  # type: ignore[arg-type]
    num_calls = vmm_calls(probe_model, make(probe))
    probe.close()
    assert num_calls >= 4
    for k in range(1, num_calls + 1 - (tail or 0)):
        model = DriverModel(granularity=G, capacity_bytes=32 * G)
        b = CudaBackend(0, driver=load_driver(model))  # type: ignore[arg-type]
        op = make(b)
        before = state(b, model)
        model.fail_at(k)
        with pytest.raises(vmm.OutOfMemory):
            op()
        assert state(b, model) == before, f"{name}: state changed after failing call {k}"
        op()  # the same call succeeds once the fault is gone
        b.check_invariants()
        b.close()
        assert (model.handles, model.reservations, model.mappings) == ({}, {}, {})


def _one_slot_op(b: CudaBackend, op: str) -> Callable[[], Any]:
    va = b.reserve(2 * G)
    (h,) = b.create(1)
    if op == "map":
        return lambda: b.map([va + G], [h])
    b.map([va + G], [h])
    return lambda: b.unmap([va + G])


@pytest.mark.parametrize("op", ["map", "unmap"])
def test_one_slot_ops_roll_back_at_every_driver_call(op: str):
    """map/unmap of one slot take a path of their own (no batch lists): same rollback."""
    probe_model = DriverModel(granularity=G, capacity_bytes=32 * G)
    probe = CudaBackend(0, driver=load_driver(probe_model))  # type: ignore[arg-type]
    num_calls = vmm_calls(probe_model, _one_slot_op(probe, op))
    probe.close()
    assert num_calls == (2 if op == "map" else 1)  # cuMemMap + cuMemSetAccess / cuMemUnmap
    for k in range(1, num_calls + 1):
        model = DriverModel(granularity=G, capacity_bytes=32 * G)
        b = CudaBackend(0, driver=load_driver(model))  # type: ignore[arg-type]
        run = _one_slot_op(b, op)
        before = state(b, model)
        model.fail_at(k)
        with pytest.raises(vmm.OutOfMemory):
            run()
        assert state(b, model) == before, f"{op}: state changed after failing call {k}"
        run()
        b.check_invariants()
        b.close()


def test_map_refuses_the_zero_chunk(backend: CudaBackend, model: DriverModel):
    """The zero chunk is shared read-only by every zero-backed slot: mapping it read-write
    would let one writer change what every zero-backed slot reads."""
    va = backend.reserve(2 * G)
    (h,) = backend.create(1)
    before = state(backend, model)
    for vas, handles in (([va], [backend.zero_handle]), ([va, va + G], [h, backend.zero_handle])):
        with pytest.raises(vmm.MappingError, match="is the read-only zero chunk"):
            backend.map(vas, handles)
        assert state(backend, model) == before


class _DlTensor(ctypes.Structure):
    _fields_ = [  # the ctypes layout of DLPack's DLTensor
        ("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]  # fmt: skip


def dl_tensor(capsule: Any) -> tuple[int, int, int, tuple[int, ...]]:
    """(data pointer, device type, device id, shape) of an unconsumed "dltensor" capsule."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = _DlTensor.from_address(get(capsule, b"dltensor"))
    return t.data, t.device_type, t.device_id, tuple(t.shape[i] for i in range(t.ndim))


def test_views_are_cuda_dlpack_capsules_over_the_reservation(
    backend: CudaBackend, model: DriverModel
):
    """A range's tensor is a DLPack capsule of CUDA memory (kDLCUDA = 2) at va + offset,
    made in C++ like a host view; once the reservation is freed the factory refuses."""
    va = backend.reserve(4 * G)
    factory = backend.view_factory(va, 4 * G)
    assert factory is not None
    capsule = factory.capsule(G, (8, 4), (), 2, 32, 1)
    assert dl_tensor(capsule) == (va + G, 2, 0, (8, 4))
    assert factory.holders == 3  # the backend's factory, this one, the capsule
    with pytest.raises(vmm.RangeError, match="no such reservation"):
        backend.view_factory(va + G, 3 * G)
    with pytest.raises(_host.HostRangeError, match="leaves the"):
        factory.capsule(4 * G - 4, (8,), (), 1, 8, 1)
    backend.free_reservation(va, 4 * G)
    with pytest.raises(_host.HostStateError, match="after it was freed"):
        factory.capsule(0, (4,), (), 1, 8, 1)
    del capsule
    assert factory.holders == 1
    pool = vmm.ChunkPool(backend, 4 * G)
    rng = pool.reserve(2 * G)
    assert rng.num_views == 0 and rng.view_factory is not None
    assert dl_tensor(rng.view_factory.capsule(0, (2,), (), 1, 8, 1))[:3] == (rng.va, 2, 0)
    rng.close()


def test_release_failure_part_way_says_how_far(backend: CudaBackend, model: DriverModel):
    h = backend.create(3)
    model.fail_at(2, code=1)
    with pytest.raises(vmm.BackendError, match=r"INVALID_VALUE \(1\) \(after releasing 1 of 3"):
        backend.release(h)
    assert h[0] not in model.handles and h[1] in model.handles
    backend.check_invariants()


# ---- set-up, context and lifetime --------------------------------------------------------
def test_no_zero_chunk_when_device_refuses_read_only():
    model = DriverModel(granularity=G, read_only_ok=False)
    b = CudaBackend(0, driver=load_driver(model))  # type: ignore[arg-type]
    assert b.zero_handle is None and model.handles == {}
    with pytest.raises(vmm.MappingError, match="no zero chunk"):
        b.reserve(G, zero=True)
    with pytest.raises(vmm.MappingError, match="no zero chunk"):
        b.unmap([0], to_zero=True)
    b.close()


def test_failed_constructor_gives_everything_back():
    model = DriverModel(granularity=G)
    model.fail_at(1)  # the zero chunk's cuMemCreate
    with pytest.raises(vmm.OutOfMemory):
        CudaBackend(0, driver=load_driver(model))  # type: ignore[arg-type]
    assert (model.handles, model.retained, model.ctx_stack) == ({}, 0, [])


def test_bad_granularity():
    model = DriverModel(granularity=G)
    with pytest.raises(vmm.AlignmentError, match="granularity 3145728 must be a power of two"):
        CudaBackend(0, granularity=3 << 20, driver=load_driver(model))  # type: ignore[arg-type]
    assert model.retained == 0
    big = CudaBackend(0, granularity=4 * G, driver=load_driver(model))  # type: ignore[arg-type]
    assert big.granularity == 4 * G
    big.close()


def test_context_pushed_only_when_not_current(backend: CudaBackend, model: DriverModel):
    backend.create(1)
    assert "cuCtxPushCurrent" in model.calls and model.ctx_stack == []
    model.ctx_stack.append(0xC0)  # torch's thread: the primary context is already current
    model.calls.clear()
    backend.create(1)
    assert "cuCtxPushCurrent" not in model.calls and model.ctx_stack == [0xC0]
    model.ctx_stack.pop()


def test_close_is_idempotent_and_final(backend: CudaBackend, model: DriverModel):
    h = backend.create(2)
    va = backend.reserve(2 * G, zero=True)
    backend.map([va], [h[0]])
    backend.close()
    backend.close()
    assert (model.handles, model.reservations, model.mappings) == ({}, {}, {})
    with pytest.raises(vmm.ClosedError, match="cuda:0 is closed"):
        backend.create(1)


# ---- without a driver / against cuda-python itself -------------------------------------
def _driver_present() -> bool:
    try:
        load_driver()
    except vmm.BackendUnavailable:
        return False
    return True


def test_import_vmm_cuda_loads_no_driver_module():
    code = "import sys, vmm.cuda; print(any(m.startswith('cuda.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unavailable_without_a_driver():
    if _driver_present():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(vmm.BackendUnavailable) as e:
        CudaBackend()
    assert "cuda" in str(e.value).lower()


def test_unavailable_without_cuda_python(monkeypatch: pytest.MonkeyPatch):
    from vmm import cuda_driver

    monkeypatch.setattr(cuda_driver, "_MODULE_NAMES", ("no_such_cuda_module",))
    with pytest.raises(vmm.BackendUnavailable, match=r"install jenga-vmm with the 'cuda' extra"):
        CudaBackend()


def test_cuda_python_accepts_the_arguments_we_pass():
    """Each driver binding parses our argument types (ints, prop, [desc]) before it loads
    libcuda, so without a driver a wrong type is a TypeError and a right one is not."""
    mod = pytest.importorskip("cuda.bindings.driver")
    if _driver_present():
        pytest.skip("a driver is present: the cuda-marked tests make these calls for real")
    b = CudaBackend.__new__(CudaBackend)
    b._drv, b._ordinal = Driver(mod), 0
    prop, rw = b._allocation_prop(), b._access_desc("CU_MEM_ACCESS_FLAGS_PROT_READWRITE")
    gran_flag = mod.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    va, h = 1 << 40, 0x1234
    calls = [
        ("cuMemGetAllocationGranularity", (prop, gran_flag)),
        ("cuMemCreate", (G, prop, 0)),
        ("cuMemAddressReserve", (4 * G, G, 0, 0)),
        ("cuMemMap", (va, G, 0, h, 0)),
        ("cuMemSetAccess", (va, 2 * G, rw, 1)),
        ("cuMemsetD8Async", (va, 0, 2 * G, 0)),
        ("cuMemUnmap", (va, G)),
        ("cuMemRelease", (h,)),
        ("cuMemAddressFree", (va, 4 * G)),
        ("cuDevicePrimaryCtxRetain", (0,)),
        ("cuCtxPushCurrent", (0,)),
        ("cuStreamCreate", (1,)),
        ("cuStreamSynchronize", (0,)),
        ("cuStreamDestroy", (0,)),
        ("cuCtxGetCurrent", ()),
        ("cuCtxPopCurrent", ()),
        ("cuDevicePrimaryCtxRelease", (0,)),
        ("cuDeviceGet", (0,)),
        ("cuMemGetInfo", ()),
    ]
    for name, args in calls:
        with pytest.raises(Exception) as e:
            getattr(mod, name)(*args)
        assert not isinstance(e.value, TypeError), f"{name}{args}: {e.value}"
    with pytest.raises(TypeError):
        mod.cuMemMap("not an address", G, 0, h, 0)


# ---- the real driver -----------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.gpu
def test_real_backend_maps_tensors_zeros_and_shares():
    import torch

    pool = vmm.ChunkPool(CudaBackend(), 8 * G)
    try:
        rng = pool.reserve(4 * G, zero_backed=True)
        other = pool.reserve(G)
        (h,) = rng.map([1])
        other.map_handles([0], [h])
        t = rng.tensor((4 * G,), torch.uint8)
        assert t.device.type == "cuda"
        assert int(t[:G].sum()) == 0  # zero-backed slot reads zeros
        t[G : G + 8] = 7
        torch.cuda.synchronize()
        seen = other.tensor((G,), torch.uint8)
        assert seen[:8].tolist() == [7] * 8  # the same chunk at two addresses
        other.unmap([0])
        rng.unmap([1])
        pool.check_invariants()
    finally:
        pool.close()


@pytest.mark.cuda
@pytest.mark.gpu
def test_real_backend_create_is_zero_and_oom_rolls_back():
    import torch

    b = CudaBackend()
    try:
        (h,) = b.create(1)
        va = b.reserve(G)
        b.map([va], [h])

        class _Raw:  # the chunk's bytes, straight from the mapping
            def __init__(self) -> None:
                self.__cuda_array_interface__ = {
                    "shape": (G,), "typestr": "|u1", "data": (va, False), "version": 3,
                    "strides": None,
                }  # fmt: skip

        assert int(torch.as_tensor(_Raw(), device=b.device).sum()) == 0
        b.unmap([va])
        b.free_reservation(va, G)
        b.release([h])
        _, total = torch.cuda.mem_get_info()
        chunks_before = b.num_chunks
        with pytest.raises(vmm.OutOfMemory) as e:
            b.create(total // G + 1)
        assert e.value.total == total
        assert b.num_chunks == chunks_before
    finally:
        b.close()


@pytest.mark.cuda
def test_bench_cli_on_cuda(tmp_path: Any):
    from vmm.bench import cli as bench

    path = tmp_path / "cuda.json"
    argv = ["--backend", "cuda", "--chunk-sizes", "64K,2M", "--counts", "16", "--rounds", "2",
            "--map-rounds", "2", "--views", "50", "--no-progress", "--json", str(path)]  # fmt: skip
    assert bench.main(argv) == 0
    report = json.loads(path.read_text())
    ops = {r["op"] for r in report["results"]}
    assert {"create", "reserve", "map", "set_access", "unmap", "release", "free_reservation",
            "apply_plan"} <= ops  # fmt: skip
    assert {r["chunk_size"] for r in report["results"]} == {G}
    skipped = {s["op"]: s["reason"] for s in report["skipped"]}
    assert skipped["chunk size 64K"] == "not a multiple of the device's granularity 2M"
    emulated = emulator.loaded() is not None
    assert report["machine"]["device"]["emulated"] is emulated
    labels = {r["backend"] for r in report["results"]}
    if emulated:  # driver-only: no torch CUDA tensor, and never passed off as GPU figures
        assert labels == {"cuda-emulated"} and "tensor_view" not in ops
        assert "torch sees no CUDA device" in skipped["tensor_view"]
    else:
        assert labels == {"cuda"} and "tensor_view" in ops and "tensor_view" not in skipped


def test_bench_cuda_cases_run_on_the_model():
    """vmm-bench's CUDA cases (raw loop and ours) produce every op, on the driver model."""
    from vmm.bench import cuda as bench_cuda
    from vmm.bench.host import Case, ours_apply_plan

    model = DriverModel(granularity=G, capacity_bytes=64 * G)

    def make(chunk_size: int) -> CudaBackend:
        return CudaBackend(0, granularity=chunk_size, driver=load_driver(model))  # type: ignore[arg-type]

    def pools(chunk_size: int, budget: int) -> vmm.ChunkPool:
        return vmm.ChunkPool(make(chunk_size), budget)

    def plan(case: Case, samples: dict) -> None:
        ours_apply_plan(pools, case, samples)

    for mode in ("one_by_one", "batched"):
        case = Case(G, 4, mode, "contiguous", 2)
        results = bench_cuda.run_case(case, make, plan, 0, load_driver(model))  # type: ignore[arg-type]
        by_op = {r.op: r for r in results}
        expected = {"create", "reserve", "map", "set_access", "unmap", "release",
                    "free_reservation"}  # fmt: skip
        if mode == "batched":
            expected.add("apply_plan")
        assert set(by_op) == expected
        per_chunk = 4 * 2 if mode == "one_by_one" else 2
        assert by_op["map"].ours.n == by_op["map"].raw.n == per_chunk
        assert by_op["set_access"].ours.n == per_chunk
        pairs = 2 * bench_cuda.RESERVE_PAIRS  # rounds x back-to-back reserve + free pairs
        assert by_op["reserve"].ours.n == by_op["reserve"].raw.n == pairs
        assert by_op["free_reservation"].ours.n == by_op["free_reservation"].raw.n == pairs
    assert (model.handles, model.reservations, model.mappings) == ({}, {}, {})
    assert (model.retained, model.ctx_stack) == (0, [])
