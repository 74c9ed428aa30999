"""Host backend: physical chunks in one memfd, mapped into anonymous reservations.

Rationale
---------
Linux offers the CUDA VMM model on the CPU: a memfd is a pool of physical pages that can
be mapped at any page-aligned address, several times over, and anonymous PROT_NONE
mappings reserve address space at no cost. So the whole `vmm` stack (pool, ranges,
plans, tensors) runs and is tested on any Linux machine.

Approach
--------
The syscalls live in C++ (`vmm._core.host.HostVmm`, design note in
`csrc/host/host_vmm.hpp`); this class adapts it to `vmm.backend.Backend` and turns its
errors into `vmm.errors` classes. Batched calls cross into C++ once, with the GIL
released. `inject_fault(k)` makes the k-th syscall from now fail, for rollback tests.

Limitations
-----------
Linux only (memfd_create, fallocate PUNCH_HOLE, MADV_COLLAPSE on >= 6.1). The
VMA count is the backend's own model (runs of mergeable slots), checked against
/proc/self/maps by the tests. Every host backend of the process adds its VMAs to one
process-wide ledger (in C++) checked against a shared budget, by default
`vm.max_map_count` less a quarter of headroom for the process's other mappings (which
are not counted); a backend may also get its own smaller `vma_budget`.
"""

from __future__ import annotations

import errno as errno_codes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from vmm._core import host as _h
from vmm.backend import Backend, SharedChunks, ViewFactory
from vmm.checks import as_index
from vmm.errors import (
    AlignmentError,
    BackendError,
    ClosedError,
    MappingError,
    OutOfMemory,
    RangeError,
    VmaBudgetExceeded,
)

_log = logging.getLogger(__name__)

#: Default chunk size: the CUDA driver's allocation granularity.
DEFAULT_GRANULARITY = 2 << 20
#: Default memfd size: sparse, so it costs nothing until chunks are created.
DEFAULT_CAPACITY = 1 << 40
#: Sentinel id of the host zero chunk (the kernel zero page behind a read-only mapping).
HOST_ZERO_HANDLE = -1
_OOM_ERRNOS = (errno_codes.ENOMEM, errno_codes.ENOSPC)
#: Mappings short of vm.max_map_count at which ENOMEM from mmap/munmap is taken as the map count.
_MAP_COUNT_SLACK = 16


#: Fraction of `vm.max_map_count` left to the process's other mappings (libraries, heaps,
#: torch's allocations): the host pools of a process share the rest.
VMA_HEADROOM_FRACTION = 4
#: Per-backend VMA budget when none is given: unlimited, only the process-wide one applies.
UNLIMITED_VMAS = 1 << 62


def default_vma_budget() -> int:
    """The process-wide VMA budget every host pool shares by default: `vm.max_map_count`
    less a quarter of it (headroom for the process's other mappings)."""
    limit = kernel_map_limit()
    return max(limit - limit // VMA_HEADROOM_FRACTION, 1)


def set_process_vma_budget(budget: int) -> None:
    """Set the VMA budget shared by every host backend of the process (the kernel's
    `vm.max_map_count` counts every mapping of the process, not one pool's)."""
    _h.set_process_vma_budget(as_index(budget, "process VMA budget", low=1))


def process_vma_budget() -> int:
    """The VMA budget shared by every host backend (set on the first backend's creation)."""
    return int(_h.process_vma_budget())


def process_vmas() -> int:
    """VMAs held now by every host backend of the process together."""
    return int(_h.process_vmas())


def translate_host_error(exc: Exception) -> NoReturn:
    """Re-raise a `vmm._core.host.HostError` as the `vmm.errors` class that fits."""
    message, op, code = exc.args
    if isinstance(exc, _h.HostVmaError):
        raise VmaBudgetExceeded(message) from None
    if isinstance(exc, _h.HostBrokenError):
        raise BackendError(message, op="rollback", code=code) from None
    if isinstance(exc, _h.HostRangeError):
        raise RangeError(message) from None
    if isinstance(exc, _h.HostArgError):
        raise AlignmentError(message) from None
    if isinstance(exc, _h.HostStateError):
        if op == "closed":
            raise ClosedError(message) from None
        raise MappingError(message) from None
    if code in _OOM_ERRNOS:
        _raise_out_of_memory(message, op, code)
    raise BackendError(message, op=op, code=code) from None


def _raise_out_of_memory(message: str, op: str, code: int) -> NoReturn:
    """ENOMEM/ENOSPC of any op: VmaBudgetExceeded where mmap/munmap hit the kernel's map
    count (the process holds about vm.max_map_count mappings), else OutOfMemory."""
    name = errno_codes.errorcode.get(code, str(code))
    if op != "create" and code == errno_codes.ENOMEM:
        count, limit = process_map_count(), kernel_map_limit()
        if count >= limit - _MAP_COUNT_SLACK:
            raise VmaBudgetExceeded(
                f"{message} ({name} in {op}: the process holds {count} of the kernel's "
                f"{limit} mappings, vm.max_map_count)"
            ) from None
        raise OutOfMemory(
            f"{message} ({name} in {op}; the process holds {count} of {limit} mappings)"
        ) from None
    raise OutOfMemory(f"{message} ({name} in {op})") from None


def process_map_count() -> int:
    """Mappings the process holds now (lines of /proc/self/maps); 0 where unreadable."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def kernel_map_limit() -> int:
    """`vm.max_map_count` (65530, the kernel default, where unreadable)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


class HostBackend(Backend):
    """memfd + mmap backend (see module note). One instance = one memfd = one pool.

    Args:
        granularity: chunk size in bytes, a power of two >= the page size (default 2 MiB).
        capacity: memfd size in bytes (sparse upper bound on physical memory).
        vma_budget: most VMAs this backend may hold (default: no limit of its own; the
            process-wide budget, `set_process_vma_budget`, always applies).
        collapse: best-effort MADV_COLLAPSE of mapped chunks into huge pages.
        import_fd: build over a memfd another host backend exported (`export_handles`);
            such a backend cannot `create`, only `import_handles` (capacity: the memfd's).
    """

    name = "host"
    device = "cpu"

    def __init__(
        self,
        granularity: int = DEFAULT_GRANULARITY,
        *,
        capacity: int = DEFAULT_CAPACITY,
        vma_budget: int | None = None,
        collapse: bool = False,
        import_fd: int | None = None,
    ) -> None:
        granularity = as_index(granularity, "granularity", low=1)
        capacity = as_index(capacity, "capacity", low=1)
        budget = UNLIMITED_VMAS
        if vma_budget is not None:
            budget = as_index(vma_budget, "vma_budget", low=1, high=UNLIMITED_VMAS)
        if _h.process_vma_budget() <= 0:
            _h.set_process_vma_budget(default_vma_budget())
        fd = -1 if import_fd is None else as_index(import_fd, "import_fd", low=0)
        try:
            self._vmm = _h.HostVmm(granularity, capacity, budget, bool(collapse), fd)
        except _h.HostError as exc:
            translate_host_error(exc)
        self._granularity = granularity

    @property
    def granularity(self) -> int:
        return self._granularity

    def create(self, count: int) -> list[int]:
        try:
            return list(self._vmm.create(count))
        except _h.HostError as exc:
            translate_host_error(exc)

    def release(self, handles: Sequence[int]) -> None:
        try:
            self._vmm.release(handles)
        except _h.HostError as exc:
            translate_host_error(exc)

    def reserve(self, size: int, *, zero: bool = False) -> int:
        try:
            return int(self._vmm.reserve(size, zero))
        except _h.HostError as exc:
            translate_host_error(exc)

    def free_reservation(self, va: int, size: int) -> None:
        try:
            self._vmm.free_reservation(va, size)
        except _h.HostError as exc:
            translate_host_error(exc)

    def map(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        try:
            self._vmm.map(vas, handles)
        except _h.HostError as exc:
            translate_host_error(exc)

    def unmap(self, vas: Sequence[int], *, to_zero: bool = False) -> None:
        try:
            self._vmm.unmap(vas, to_zero)
        except _h.HostError as exc:
            translate_host_error(exc)

    @property
    def zero_handle(self) -> int | None:
        return HOST_ZERO_HANDLE

    def view_factory(self, va: int, size: int) -> ViewFactory | None:
        try:
            factory: ViewFactory = self._vmm.view_factory(va, size)
        except _h.HostError as exc:
            translate_host_error(exc)
        return factory

    def export_handles(self, handles: Sequence[int]) -> SharedChunks:
        try:
            fd = int(self._vmm.fd)
        except _h.HostError as exc:
            translate_host_error(exc)
        gran = self._granularity
        return SharedChunks((os.dup(fd),), tuple((0, int(h) * gran) for h in handles))

    def import_handles(self, shared: SharedChunks) -> list[int]:
        try:
            own = os.fstat(int(self._vmm.fd))
        except _h.HostError as exc:
            translate_host_error(exc)
        for i, fd in enumerate(shared.fds):
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
                raise MappingError(
                    f"import: fd {i} (inode {st.st_ino}) is not this backend's memfd "
                    f"(inode {own.st_ino}); build the backend with import_fd"
                )
        gran = self._granularity
        bad = [off for _, off in shared.where if off % gran]
        if bad:
            raise AlignmentError(f"import: offset {bad[0]} is not a multiple of {gran} bytes")
        handles = [off // gran for _, off in shared.where]
        try:
            self._vmm.import_handles(handles)
        except _h.HostError as exc:
            translate_host_error(exc)
        return handles

    def stats(self) -> dict[str, int]:
        vmm: Any = self._vmm
        return {
            "vmas.current": vmm.vmas,
            "vmas.budget": min(vmm.vma_budget, _h.process_vma_budget()),
            "bytes.physical.current": vmm.physical_bytes,
        }

    def close(self) -> None:
        self._vmm.close()

    # ---- host only ----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return bool(self._vmm.closed)

    @property
    def syscalls(self) -> int:
        """Counted syscalls so far (the unit of `inject_fault`), including rollbacks."""
        return int(self._vmm.syscalls)

    def inject_fault(self, k: int, errno_value: int = errno_codes.ENOMEM, count: int = 1) -> None:
        """Make the k-th counted syscall from now and the `count` - 1 after it fail with
        `errno_value` (k <= 0: off); `count` > 1 makes the rollback of a batch fail too."""
        self._vmm.inject_fault(k, errno_value, count)

    @property
    def num_chunks(self) -> int:
        """Chunks created and not released (pools check they agree)."""
        return int(self._vmm.chunks)

    def slot_table(self, va: int, size: int) -> list[int]:
        """Per slot of a reservation: its handle, or -1 when unmapped or zero-backed."""
        try:
            table = self._vmm.slot_table(va, size)
        except _h.HostError as exc:
            translate_host_error(exc)
        return [h if h >= 0 else -1 for h in table]

    def zero_slots(self, va: int, size: int) -> list[int]:
        """Slots of a reservation that are zero-backed."""
        try:
            table = self._vmm.slot_table(va, size)
        except _h.HostError as exc:
            translate_host_error(exc)
        return [i for i, h in enumerate(table) if h == -2]

    def physical_bytes(self) -> int:
        """Bytes the memfd really holds (st_blocks * 512): proves release gives memory back."""
        return int(self._vmm.physical_bytes)
