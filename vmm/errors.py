"""Exceptions raised by `vmm`. Every message carries the numbers that explain it.

Rationale
---------
Callers must tell "this request does not fit" (OutOfMemory: evict, preempt, retry) from
"this call is wrong" (alignment, slot state, range bounds: a bug) from "the device
failed" (BackendError), without parsing messages.

Approach
--------
One base class, `VmmError`; each subclass names one kind of failure and, where a
builtin fits, also derives from it (`AlignmentError` is a `ValueError`, `RangeError` an
`IndexError`), so generic handlers keep working. `OutOfMemory` carries `needed`, `free`
and `total` (chunks); `BackendError` carries the failing `op` and its errno / CUresult.
Each error is raised either before any state changed or after a full rollback, so
catching one never leaves a pool, range or plan half-applied.

Limitations
-----------
A pool marked broken (a rollback that failed) raises `BackendError(op="broken")` on
every later call: that state is not recoverable, only closable.
"""

from __future__ import annotations


class VmmError(Exception):
    """Base class of every error `vmm` raises on purpose."""


class InputError(VmmError, TypeError, ValueError):
    """An argument of the wrong type (a float or string where an integer is needed) or out
    of the bounds a public call accepts (a negative count, a size past the address space).
    Both a `TypeError` and a `ValueError`, so either builtin handler catches it."""


class ConcurrentUse(VmmError):
    """An object that is not thread-safe was entered by a second thread while in use."""


class OutOfMemory(VmmError):
    """The pool's byte budget, or the device/OS, cannot provide the chunks asked for."""

    def __init__(self, message: str, *, needed: int = 0, free: int = 0, total: int = 0):
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.total = total


class BudgetError(VmmError, ValueError):
    """A pool budget change asks for less than is in use (or is not a chunk multiple)."""


class AlignmentError(VmmError, ValueError):
    """An address, offset or size is not a multiple of the granularity (or is <= 0)."""


class MappingError(VmmError):
    """A slot is in the wrong state: mapping over a mapped slot, unmapping an unmapped one."""


class RangeError(VmmError, IndexError):
    """An offset, slot or tensor view lies outside its virtual range."""


class VmaBudgetExceeded(VmmError):
    """The host backend would exceed its share of `vm.max_map_count` mappings."""


class ClosedError(VmmError):
    """Use of a pool, range or backend after `close()`."""


class BackendError(VmmError):
    """A driver call or syscall failed for a reason not covered above (errno / CUresult)."""

    def __init__(self, message: str, *, op: str = "", code: int = 0):
        super().__init__(message)
        self.op = op
        self.code = code


class BackendUnavailable(VmmError):
    """The requested backend cannot run here (no driver, no device, not Linux)."""
