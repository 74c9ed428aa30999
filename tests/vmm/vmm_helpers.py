"""Helpers shared by the vmm tests (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

import vmm
from tests.vmm import emulator

HOST_GRANULARITY = 64 << 10  # small chunks keep the host tests light


def kernel_vmas(va: int, size: int) -> int:
    """VMAs of this process that intersect [va, va + size), read from /proc/self/maps."""
    count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo < va + size and hi > va:
                count += 1
    return count


def snapshot(pool: vmm.ChunkPool, ranges: list[vmm.VirtualRange]) -> dict[str, Any]:
    """Everything observable about a pool and its ranges (rollback must restore it)."""
    stats = pool.stats()
    stats.pop("plans.rolled_back")
    state: dict[str, Any] = {
        "stats": stats,
        "free": pool.ledger.free_handles(),
        "refcount": pool.ledger.refcounts(),
        "tables": [(r.closed, r.slot_to_handle()) for r in ranges],
    }
    table_of = getattr(pool.backend, "slot_table", None)
    if table_of is not None:
        state["backend_tables"] = [table_of(r.va, r.size) for r in ranges if not r.closed]
        state["zero_slots"] = [pool.backend.zero_slots(r.va, r.size) for r in ranges]
    return state


def check(pool: vmm.ChunkPool) -> None:
    pool.check_invariants()
    pool.check_invariants(expensive=True)


def data_view(
    rng: vmm.VirtualRange,
    shape: tuple[int, ...],
    dtype: Any,
    offset: int = 0,
    *,
    write: bool = False,
) -> Any:
    """The bytes of `rng` at `offset` as a tensor, to write and check data through.

    `rng.tensor(...)` on host and on a GPU. On the CUDA driver emulator torch has no CUDA,
    so this is a CPU tensor over the same device addresses (the emulator's device memory is
    host memory at those addresses); the emulated access of every slot it spans is checked
    first (`write`: read-write, else readable), as a GPU kernel would fault without it."""
    import math

    import torch

    emu = emulator.loaded()
    if emu is None or not rng.device.startswith("cuda"):
        return rng.tensor(shape, dtype, offset=offset)
    rng.check_open()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offset < 0 or offset + nbytes > rng.size:
        raise vmm.RangeError(f"data view of {nbytes} bytes at {offset} leaves range {rng.name!r}")
    raw = emu.host_view(rng.va + offset, nbytes, rng.granularity, write=write)
    return raw.view(dtype).view(shape)
