"""
memfd + mmap virtual-memory backend
"""

from __future__ import annotations

import collections.abc
import typing

import typing_extensions

__all__: list[str] = [
    "HostArgError",
    "HostBrokenError",
    "HostError",
    "HostOsError",
    "HostRangeError",
    "HostStateError",
    "HostVmaError",
    "HostVmm",
    "ViewFactory",
    "device_view_factory",
    "process_vma_budget",
    "process_vmas",
    "set_process_vma_budget",
]

class HostError(Exception):
    """
    host backend error
    """

class HostOsError(HostError):
    """
    a syscall failed; code = errno
    """

class HostStateError(HostError):
    """
    slot/handle in the wrong state
    """

class HostArgError(HostError):
    """
    bad address, size or handle
    """

class HostRangeError(HostError):
    """
    view outside its reservation
    """

class HostVmaError(HostError):
    """
    VMA budget exceeded
    """

class HostBrokenError(HostOsError):
    """
    a syscall failed and so did its rollback
    """

class ViewFactory:
    """
    DLPack capsules over one reservation
    """
    def capsule(
        self,
        offset: typing.SupportsInt | typing.SupportsIndex,
        shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        strides: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        code: typing.SupportsInt | typing.SupportsIndex,
        bits: typing.SupportsInt | typing.SupportsIndex,
        lanes: typing.SupportsInt | typing.SupportsIndex,
    ) -> typing_extensions.CapsuleType: ...
    def retire(self) -> None:
        """
        later capsules raise (the range was freed)
        """
    def share(self) -> ViewFactory:
        """
        another factory over the same range (it counts as one more holder)
        """
    @property
    def holders(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def va(self) -> int: ...

class HostVmm:
    """
    memfd-backed chunks mapped into anonymous reservations
    """
    def __init__(
        self,
        granularity: typing.SupportsInt | typing.SupportsIndex,
        capacity: typing.SupportsInt | typing.SupportsIndex,
        vma_budget: typing.SupportsInt | typing.SupportsIndex,
        collapse: bool = False,
        import_fd: typing.SupportsInt | typing.SupportsIndex = -1,
    ) -> None: ...
    def close(self) -> None: ...
    def create(self, count: typing.SupportsInt | typing.SupportsIndex) -> list[int]: ...
    def free_reservation(
        self,
        va: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def import_handles(
        self, handles: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> None: ...
    def inject_fault(
        self,
        k: typing.SupportsInt | typing.SupportsIndex,
        errno_value: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex = 1,
    ) -> None:
        """
        Make the k-th counted syscall from now and the count-1 after it fail with errno_value (k <= 0: off).
        """
    def map(
        self,
        vas: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        handles: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    ) -> None: ...
    def release(
        self, handles: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> None: ...
    def reserve(
        self, size: typing.SupportsInt | typing.SupportsIndex, zero: bool = False
    ) -> int: ...
    def slot_table(
        self,
        va: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> list[int]: ...
    def unmap(
        self,
        vas: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        to_zero: bool = False,
    ) -> None: ...
    def view_factory(
        self,
        va: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> ViewFactory: ...
    @property
    def capacity(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def fd(self) -> int: ...
    @property
    def granularity(self) -> int: ...
    @property
    def imported(self) -> bool: ...
    @property
    def physical_bytes(self) -> int: ...
    @property
    def syscalls(self) -> int: ...
    @property
    def vma_budget(self) -> int: ...
    @property
    def vmas(self) -> int: ...

def device_view_factory(
    va: typing.SupportsInt | typing.SupportsIndex,
    size: typing.SupportsInt | typing.SupportsIndex,
    device_type: typing.SupportsInt | typing.SupportsIndex,
    device_id: typing.SupportsInt | typing.SupportsIndex,
) -> ViewFactory:
    """
    DLPack capsules over device memory at [va, va + size) (no mapping kept alive)
    """

def process_vma_budget() -> int:
    """
    shared VMA budget (<= 0: unlimited)
    """

def process_vmas() -> int:
    """
    VMAs held by every HostVmm of the process
    """

def set_process_vma_budget(budget: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    set the VMA budget shared by every HostVmm of the process (<= 0: unlimited)
    """
