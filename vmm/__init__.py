"""vmm: physical chunk pools mapped on demand into contiguous virtual ranges.

    backend = vmm.get_backend("auto")                 # host (memfd + mmap) or cuda (driver VMM)
    pool = vmm.ChunkPool(backend, budget_bytes=1 << 30, reserve_ahead=8)
    k = pool.reserve(64 << 20, name="layer0.k")      # VA only, no physical cost
    k.map([0, 1])                                     # back two slots with chunks
    t = k.tensor((2, 1024, 8, 128), torch.float16)    # zero-copy view, never a copy
    vmm.MappingPlan().unmap(k, [1]).map(k, [5, 6]).apply()  # atomic batch
    pool.stats()["bytes.mapped.current"]

Rationale
---------
Callers need five names (a backend, a pool, its ranges, plans, the errors); the pieces
behind them are small modules with one job each, so this facade re-exports the public
names and nothing inside `vmm` imports it.

Approach
--------
Modules, each importing at run time only modules listed before it (no import circle;
checked by `tests/test_layout.py`):

    errors, stats, backend        exceptions, the stats key scheme, the backend contract
    extras                        optional dependencies: the install extra each needs
    checks                        strict integer arguments (InputError)
    host, cuda_driver, cuda       the two backends (cuda imported only when asked for)
    selection                     get_backend("host" | "cuda" | "auto")
    ledger                        ChunkLedger: free heap, refcounts, budget, counters, state
    tensor                        zero-copy torch views (torch imported on first view)
    range                         VirtualRange: slot table over one reservation
    plan                          MappingPlan: ops over ranges, all or nothing
    pool                          ChunkPool: the user's handle (owns backend and ledger)
    bench/                        vmm-bench (cli, host, cuda, report, stats)

Limitations
-----------
Importing this package never imports torch and never touches a GPU driver; tensors and
the CUDA backend load them lazily. It does load the compiled `vmm._core` (host backend).
"""

from vmm.backend import Backend, ViewFactory
from vmm.errors import (
    AlignmentError,
    BackendError,
    BackendUnavailable,
    BudgetError,
    ClosedError,
    ConcurrentUse,
    InputError,
    MappingError,
    OutOfMemory,
    RangeError,
    VmaBudgetExceeded,
    VmmError,
)
from vmm.host import HostBackend
from vmm.plan import MappingPlan, PlanOp
from vmm.pool import ChunkPool
from vmm.range import VirtualRange
from vmm.selection import get_backend

__all__ = [
    "AlignmentError",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "BudgetError",
    "ChunkPool",
    "ClosedError",
    "ConcurrentUse",
    "HostBackend",
    "InputError",
    "MappingError",
    "MappingPlan",
    "OutOfMemory",
    "PlanOp",
    "RangeError",
    "ViewFactory",
    "VirtualRange",
    "VmaBudgetExceeded",
    "VmmError",
    "get_backend",
]
