"""Scratch mappings of the CUDA backend: short-lived reservations it maps chunks at to
clear them or to probe the device, always torn down again.

Rationale
---------
`CudaBackend` needs two one-off mappings outside any caller's reservation: clearing new
chunks (the contract says they read as zeros) and probing whether the device accepts a
read-only mapping (the zero chunk). Both must never leave a mapping behind, whatever
fails, so their set-up and teardown live here, apart from the per-op paths.

Approach
--------
Each helper reserves a scratch range, maps, does its work and tears down in `finally`:
never while a memset may still run (one more wait first), and a teardown call that fails
is tried once more before the failure is raised naming what stays held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vmm.cuda_driver import Driver
from vmm.errors import BackendError, OutOfMemory

TWO_MIB = 2 << 20


def zero_fill(drv: Driver, granularity: int, handles: Sequence[int], rw: Any, stream: Any) -> None:
    """Map `handles` side by side at a scratch reservation and clear them in one memset.

    The memset is asynchronous: if waiting for it fails, it may still be running, so
    the scratch mapping is not torn down before one more wait succeeds (unmapping under
    running work is what makes a GPU fault)."""
    g = granularity
    size = g * len(handles)
    va = int(drv.call("cuMemAddressReserve", size, TWO_MIB, 0, 0))
    num_mapped = 0
    queued = False
    try:
        for i, h in enumerate(handles):
            drv.call("cuMemMap", va + i * g, g, 0, h, 0)
            num_mapped += 1
        drv.call("cuMemSetAccess", va, size, rw, 1)
        drv.call("cuMemsetD8Async", va, 0, size, stream)
        queued = True
        drv.call("cuStreamSynchronize", stream)
        queued = False
    finally:
        if queued:  # raises (keeping the scratch mapping) if the memset cannot be awaited
            drv.call("cuStreamSynchronize", stream)
        tear_down(drv, g, va, size, num_mapped)


def read_only_mapping_works(drv: Driver, granularity: int, handle: int, ro: Any) -> bool:
    """Map `handle` at a scratch reservation and ask for read-only access: a refusal
    (BackendError from cuMemSetAccess) means False; any other failure is raised."""
    g = granularity
    va = int(drv.call("cuMemAddressReserve", g, TWO_MIB, 0, 0))
    num_mapped = 0
    try:
        drv.call("cuMemMap", va, g, 0, handle, 0)
        num_mapped = 1
        drv.call("cuMemSetAccess", va, g, ro, 1)
    except BackendError as exc:
        if exc.op != "cuMemSetAccess":
            raise
        return False
    finally:
        tear_down(drv, g, va, g, num_mapped)
    return True


def tear_down(drv: Driver, granularity: int, va: int, size: int, num_mapped: int) -> None:
    """Unmap the first `num_mapped` slots of the scratch reservation [va, va + size) and
    free it. A failed step is tried once more (a driver call that fails does nothing,
    so a transient failure then leaves nothing behind); a second failure is raised
    with what stays held."""
    g = granularity
    for i in range(num_mapped):
        call_twice(drv, f"scratch slot {i} of {num_mapped} at {va + i * g:#x} stays mapped",
                   "cuMemUnmap", va + i * g, g)  # fmt: skip
    call_twice(drv, f"scratch reservation {va:#x} of {size} bytes stays reserved",
               "cuMemAddressFree", va, size)  # fmt: skip


def call_twice(drv: Driver, leaked: str, name: str, *args: Any) -> None:
    try:
        drv.call(name, *args)
    except (BackendError, OutOfMemory):
        try:
            drv.call(name, *args)
        except (BackendError, OutOfMemory) as exc:
            raise BackendError(
                f"{exc} (failed twice; {leaked})", op=name, code=getattr(exc, "code", 0)
            ) from exc
