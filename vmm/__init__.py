"""vmm: physical chunk pools mapped on demand into contiguous virtual ranges.

Importing this package never imports torch and never touches a GPU driver; tensors and
the CUDA backend load them lazily, so `jenga` (integers only) can share the extension.
"""

from vmm.errors import (
    AlignmentError,
    BackendError,
    BackendUnavailable,
    ClosedError,
    MappingError,
    OutOfMemory,
    RangeError,
    VmaBudgetExceeded,
    VmmError,
)

__all__ = [
    "AlignmentError",
    "BackendError",
    "BackendUnavailable",
    "ClosedError",
    "MappingError",
    "OutOfMemory",
    "RangeError",
    "VmaBudgetExceeded",
    "VmmError",
]
