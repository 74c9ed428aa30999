"""vmm-bench, CUDA backend: each op through `CudaBackend` and as a raw cuda-python loop.

Rationale
---------
On CUDA the floor is the driver itself, reached the same way the backend reaches it:
a plain Python loop over `cuda.bindings.driver` calls with no bookkeeping, timed per call
with `time.perf_counter_ns`. Ours minus raw is what the backend's validation, undo log
and tables cost.

Approach
--------
Per round, on one device, for N chunks of G bytes:

    create      cuMemCreate per chunk                (ours: CudaBackend.create, zero
                                                      fill off unless --zero-fill)
    reserve     cuMemAddressReserve(N*G)             (per call; back-to-back reserve + free
                                                      pairs, see `reserve_free_pairs`)
    map         cuMemMap per slot + cuMemSetAccess   (one_by_one: one SetAccess per slot;
                                                      batched: one over the whole run)
    set_access  the cuMemSetAccess calls alone       (ours: timed inside our driver wrapper)
    unmap       cuMemUnmap per slot
    release     cuMemRelease per chunk
    free_reservation  cuMemAddressFree(N*G)          (per call, in the same pairs)
    apply_plan  ChunkPool.apply(MappingPlan of N maps) against the batched raw map

Limitations
-----------
Needs a CUDA driver and cuda-python. On the test suite's driver emulator (device name
"... emulator ...") it runs end to end, and every figure is labelled "cuda-emulated":
host mmap/mprotect costs, not GPU latencies (docs/vmm-bench.md says where GPU figures
came from).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vmm.bench.host import Case, Samples, add_per_chunk
from vmm.bench.report import OpResult
from vmm.bench.stats import Summary, gc_paused, timed_calls, timed_once

CUDA_OPS = ("create", "reserve", "map", "set_access", "unmap", "release", "free_reservation")


def _ok(result: Any) -> Any:
    if result[0]:
        raise RuntimeError(f"raw driver call failed: {result[0]!r}")
    return result[1] if len(result) > 1 else None


class RawCuda:
    """The driver module plus the allocation/access descriptors for one device."""

    def __init__(self, ordinal: int, driver: Any = None):
        from vmm.cuda_driver import load_driver

        drv = load_driver() if driver is None else driver
        self.d = d = drv.mod
        self.dev = _ok(d.cuDeviceGet(ordinal))
        self.ctx = _ok(d.cuDevicePrimaryCtxRetain(self.dev))
        _ok(d.cuCtxPushCurrent(self.ctx))
        self.prop = d.CUmemAllocationProp()
        self.prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = ordinal
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.rw = [desc]

    def close(self) -> None:
        """Pop the context pushed at start and drop the retain."""
        _ok(self.d.cuCtxPopCurrent())
        _ok(self.d.cuDevicePrimaryCtxRelease(self.dev))


#: back-to-back reserve + free pairs timed per round (see `reserve_free_pairs`)
RESERVE_PAIRS = 20


def reserve_free_pairs(
    reserve: Callable[[], int], free: Callable[[int], None], samples: Samples
) -> None:
    """Time `RESERVE_PAIRS` reserve calls, each followed by the free of what it reserved.

    Timed in a loop of their own, not inside the create/map/release cycle: on the driver
    emulator that cycle's chunks are host memory, and populating them evicts the CPU caches
    the next call runs from, which a single cold call charges to whichever side makes more
    calls. The pairs compare the calls themselves."""
    for _ in range(RESERVE_PAIRS):
        t, va = timed_once(reserve)
        samples.setdefault("reserve", []).append(float(t))
        t, _ = timed_once(lambda: free(va))  # noqa: B023 - called at once
        samples.setdefault("free_reservation", []).append(float(t))


def raw_round(raw: RawCuda, case: Case, samples: Samples) -> None:
    """One raw cycle: create, reserve, map (+ set access), unmap, release, free; then the
    reserve + free pairs."""
    d, g, n = raw.d, case.chunk_size, case.num_chunks
    t_create, handles = timed_calls(lambda _: _ok(d.cuMemCreate(g, raw.prop, 0)), [0] * n)
    va = _ok(d.cuMemAddressReserve(n * g, g, 0, 0))
    vas = [int(va) + i * g for i in range(n)]
    pairs = list(zip(vas, handles, strict=True))
    t_map, _ = timed_calls(lambda p: _ok(d.cuMemMap(p[0], g, 0, p[1], 0)), pairs)
    if case.mode == "one_by_one":
        t_access, _ = timed_calls(lambda v: _ok(d.cuMemSetAccess(v, g, raw.rw, 1)), vas)
    else:
        t, _ = timed_once(lambda: _ok(d.cuMemSetAccess(vas[0], n * g, raw.rw, 1)))
        t_access = [t // n] * n
    t_unmap, _ = timed_calls(lambda v: _ok(d.cuMemUnmap(v, g)), vas)
    t_release, _ = timed_calls(lambda h: _ok(d.cuMemRelease(h)), handles)
    _ok(d.cuMemAddressFree(va, n * g))
    reserve_free_pairs(
        lambda: int(_ok(d.cuMemAddressReserve(n * g, g, 0, 0))),
        lambda v: _ok(d.cuMemAddressFree(v, n * g)),
        samples,
    )
    both = [a + b for a, b in zip(t_map, t_access, strict=True)]
    for op, values in (("create", t_create), ("map", both), ("set_access", t_access)):
        add_per_chunk(samples, op, values, case.mode)
    for op, values in (("unmap", t_unmap), ("release", t_release)):
        add_per_chunk(samples, op, values, case.mode)
    add_per_chunk(samples, "apply_plan", both, "batched")


def ours_round(backend: Any, case: Case, samples: Samples) -> None:
    """Same cycle through CudaBackend, then the reserve + free pairs; set_access is read
    from the driver wrapper's timings in one more map pass (timing every driver call
    slows the calls down, so the timed map and unmap run without it)."""
    from vmm.bench.host import ours_lifecycle

    lifecycle: Samples = {}
    ours_lifecycle(backend, case, lifecycle)
    for op in ("create", "release"):
        samples.setdefault(op, []).extend(lifecycle[op])
    g, n = case.chunk_size, case.num_chunks
    reserve_free_pairs(
        lambda: backend.reserve(n * g), lambda v: backend.free_reservation(v, n * g), samples
    )
    handles = backend.create(n)
    va = backend.reserve(n * g)
    vas = [va + i * g for i in range(n)]
    timings: dict[str, list[int]] = {}
    try:
        t_map, t_unmap = _ours_map_unmap(backend, case.mode, vas, handles)
        backend.driver.timings = timings
        _ours_map_unmap(backend, case.mode, vas, handles)
    finally:
        backend.driver.timings = None
        backend.free_reservation(va, n * g)
        backend.release(handles)
    access = timings.get("cuMemSetAccess", [0])
    t_access = [int(t) for t in access] if case.mode == "one_by_one" else [sum(access) // n] * n
    add_per_chunk(samples, "map", t_map, case.mode)
    add_per_chunk(samples, "set_access", t_access, case.mode)
    add_per_chunk(samples, "unmap", t_unmap, case.mode)


def _ours_map_unmap(
    backend: Any, mode: str, vas: list[int], handles: list[int]
) -> tuple[list[int], list[int]]:
    """Map every slot, then unmap it, one call per slot or one call for all; ns per slot."""
    n = len(vas)
    if mode == "one_by_one":
        t_map, _ = timed_calls(
            lambda p: backend.map([p[0]], [p[1]]), list(zip(vas, handles, strict=True))
        )
        t_unmap, _ = timed_calls(lambda v: backend.unmap([v]), vas)
        return t_map, t_unmap
    t, _ = timed_once(lambda: backend.map(vas, handles))
    t_map = [t // n] * n
    t, _ = timed_once(lambda: backend.unmap(vas))
    return t_map, [t // n] * n


def run_case(
    case: Case,
    make_backend: Callable[[int], Any],
    apply_plan: Callable[[Case, Samples], None] | None,
    ordinal: int,
    driver: Any = None,
    label: str = "cuda",
) -> list[OpResult]:
    """All CUDA ops of one case, `rounds` rounds of raw and ours interleaved (`driver`:
    an initialised `vmm.cuda_driver.Driver` for the raw loop, default cuda-python's;
    `label`: the results' backend, "cuda-emulated" on the test suite's driver emulator)."""
    raw = RawCuda(ordinal, driver)
    ours: Samples = {}
    raw_samples: Samples = {}
    try:
        with gc_paused():
            for _ in range(case.rounds):
                raw_round(raw, case, raw_samples)
                backend = make_backend(case.chunk_size)
                try:
                    ours_round(backend, case, ours)
                finally:
                    backend.close()
            if apply_plan is not None and case.mode == "batched":
                apply_plan(case, ours)
    finally:
        raw.close()
    ops = (*CUDA_OPS, "apply_plan")
    return [
        OpResult(
            op=op,
            backend=label,
            chunk_size=case.chunk_size,
            num_chunks=case.num_chunks,
            mode=case.mode,
            layout="-",
            ours=Summary.of(ours[op]),
            raw=Summary.of(raw_samples[op]),
            unit="ns_per_call" if op in ("reserve", "free_reservation") else "ns_per_chunk",
        )
        for op in ops
        if op in ours and op in raw_samples
    ]
