"""The one dotted-key scheme of `ChunkPool.stats()` — every key is documented here.

Rationale: monitoring and tests read one flat dict whose keys say what they count, like
`torch.cuda.memory_stats()`, instead of a different attribute per fact.
Approach: the key lists below are the contract; `ChunkLedger` keeps the event counters,
`ChunkPool.stats()` adds the gauges and the backend's own gauges.
Limitations: gauges are computed on each call (O(open ranges)); not meant for a hot loop.

Keys are `<what>.<which>[.current]`: a `.current` key is a gauge (state now), a key
without it under `ops.` / `plans.` is a cumulative event count. Counts are in chunks
or slots, `bytes.*` in bytes. A plan that rolls back leaves every key exactly as it was
except `plans.rolled_back` (+1); event counts only move when an operation commits.

    chunks.budget              chunks the byte budget allows (budget // granularity)
    chunks.created.current     physical chunks that exist (free + mapped)
    chunks.free.current        created chunks mapped nowhere: ready handles, reused first
    chunks.mapped.current      chunks mapped at >= 1 slot
    chunks.shared.current      chunks mapped at >= 2 slots
    slots.mapped.current       slots mapped read-write, over all open ranges
    ranges.current             open virtual ranges
    bytes.budget               the byte budget
    bytes.created.current      chunks.created.current * granularity
    bytes.mapped.current       chunks.mapped.current * granularity (physical bytes in use)
    bytes.reserved.current     virtual address space reserved by open ranges
    ops.create                 chunks created (backend `create`)
    ops.release                chunks released to the device/OS (budget shrink, close)
    ops.map                    slots mapped (fresh, shared or remapped chunks)
    ops.unmap                  slots unmapped
    ops.remap                  slots whose chunk moved to another slot (no copy)
    ops.share                  slots that got a chunk already mapped elsewhere
    plans.applied              mapping plans that committed
    plans.rolled_back          mapping plans undone after a failure

From the backend (gauges; absent where a backend has no such notion):

    vmas.current               host: VMAs the reservations cost (runs of mergeable slots)
    vmas.budget                host: most VMAs allowed before VmaBudgetExceeded
    bytes.physical.current     host: bytes the memfd really holds (st_blocks * 512)
"""

from __future__ import annotations

#: Event counters of a pool (cumulative; committed only when an operation succeeds).
COUNTER_KEYS: tuple[str, ...] = (
    "ops.create",
    "ops.release",
    "ops.map",
    "ops.unmap",
    "ops.remap",
    "ops.share",
    "plans.applied",
    "plans.rolled_back",
)

#: Gauges every pool reports, whatever its backend.
GAUGE_KEYS: tuple[str, ...] = (
    "chunks.budget",
    "chunks.created.current",
    "chunks.free.current",
    "chunks.mapped.current",
    "chunks.shared.current",
    "slots.mapped.current",
    "ranges.current",
    "bytes.budget",
    "bytes.created.current",
    "bytes.mapped.current",
    "bytes.reserved.current",
)

#: Gauges a backend may add.
BACKEND_KEYS: tuple[str, ...] = ("vmas.current", "vmas.budget", "bytes.physical.current")


def new_counters() -> dict[str, int]:
    """A zeroed counter dict with every key of `COUNTER_KEYS`."""
    return dict.fromkeys(COUNTER_KEYS, 0)
