"""Capacity arithmetic of the allocator, in units and blocks (no state of its own).

`JengaAllocator` owns its unit count and answers what a request needs; the arithmetic
behind those answers lives here so the allocator's methods stay thin: the checks a resize
must pass before it changes anything, and the admission estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jenga.errors import CapacityInUse, InvalidSize, PageTooLarge, as_count

if TYPE_CHECKING:
    from jenga.config import GroupConfig


def units_to_free(
    groups: Sequence[GroupConfig], units: object, total: int, free: int, evictable: int
) -> tuple[int, int]:
    """``(units, short)`` for resizing a pool of ``total`` units (``free`` free,
    ``evictable`` on wholly evictable cached pages) to ``units``: ``short`` units must be
    evicted first (0 for a grow). Raises `InvalidSize` (``units <= 0``), `PageTooLarge` (a
    group's large page would not fit), `CapacityInUse` (live requests hold more)."""
    n = as_count(units, "total_units")
    if n <= 0:
        raise InvalidSize(f"total_units must be > 0, got {n}")
    for g in groups:
        if g.units_per_large_page > n:
            raise PageTooLarge(
                f"group {g.name!r}: a large page costs {g.units_per_large_page} units, "
                f"the pool would hold {n}"
            )
    short = max(0, total - n - free)
    if evictable < short:
        raise CapacityInUse(
            f"cannot shrink from {total} to {n} units: {total - free} are mapped, "
            f"{total - free - evictable} of them by live requests ({evictable} on evictable "
            f"cached pages, {free} free); nothing was changed"
        )
    return n, short


def pages_fit(
    groups: Sequence[GroupConfig],
    missing: Sequence[int],
    free_blocks: Sequence[int],
    cached_blocks: Sequence[int],
    free_units: int,
    reserved_units: int,
) -> bool:
    """Whether ``missing`` blocks per group fit: those beyond each group's free blocks, in
    whole large pages, against the free units plus whole pages' worth of cached blocks,
    less ``reserved_units``."""
    need, avail = reserved_units, free_units
    for g, group in enumerate(groups):
        per_page, units = group.blocks_per_large_page, group.units_per_large_page
        need += -(-max(0, missing[g] - free_blocks[g]) // per_page) * units
        avail += cached_blocks[g] // per_page * units
    return need <= avail


def pages_for(groups: Sequence[GroupConfig], counts: Sequence[int]) -> int:
    """Units of the large pages ``counts`` new blocks per group would fill at most."""
    return sum(
        -(-count // g.blocks_per_large_page) * g.units_per_large_page
        for count, g in zip(counts, groups, strict=True)
    )
