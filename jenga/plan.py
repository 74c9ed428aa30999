"""Mapping plans: what the allocator asks `vmm` to do with physical memory.

Rationale
    `jenga` decides, `vmm` carries out. Keeping the decision as plain data lets the
    simulator count mapping work without any memory, lets `vmm` apply a plan atomically
    (all ops or none), and keeps torch and device calls out of `jenga`.

Approach
    A plan is an ordered tuple of ops on large pages named by ``(group, page)``; the page
    index lives in that group's own virtual page space (one VA slot of
    ``units_per_large_page`` units per page). Two ops exist:

    - ``MapPage(group, page, reused_units)``: back the page with units. ``reused_units``
      of them are the very units that the ``UnmapPage`` ops just before it released
      (a step-3 remap: no create, no release); the rest come from the free pool.
    - ``UnmapPage(group, page)``: the page's units go back to the pool (or, when a
      ``MapPage`` with ``reused_units > 0`` follows, straight to that page).

    A step-3 eviction reads ``Unmap(h, p1) [Unmap(h', p2) ...] Map(g, q, reused_units=k)``.

Limitations
    A plan names pages, not physical chunks: `vmm` picks which chunk handles back a page
    (any free or just-unmapped handle does, they are interchangeable).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MapPage:
    """Map large page ``page`` of group ``group``; ``reused_units`` come from unmaps just before."""

    group: int
    page: int
    reused_units: int = 0


@dataclass(frozen=True, slots=True)
class UnmapPage:
    """Unmap large page ``page`` of group ``group``; its units return to the pool."""

    group: int
    page: int


PlanOp = MapPage | UnmapPage


@dataclass(frozen=True, slots=True)
class MappingPlan:
    """An ordered list of page ops; apply in order. Empty when physical needs did not change."""

    ops: tuple[PlanOp, ...] = ()

    def __len__(self) -> int:
        return len(self.ops)

    def __bool__(self) -> bool:
        return bool(self.ops)

    @property
    def num_maps(self) -> int:
        return sum(1 for op in self.ops if isinstance(op, MapPage))

    @property
    def num_unmaps(self) -> int:
        return sum(1 for op in self.ops if isinstance(op, UnmapPage))

    @property
    def num_reused_units(self) -> int:
        """Units moved from an evicted page to a new page without going through the pool."""
        return sum(op.reused_units for op in self.ops if isinstance(op, MapPage))


OP_MAP = 0
OP_UNMAP = 1


def page_slots(page: int, chunks_per_range: int) -> range:
    """Chunk slots that large page ``page`` occupies in each of its group's virtual ranges.

    Page p of a group whose large page is k chunks per range covers slots
    ``[p*k, (p+1)*k)`` of every range of the group (per_layer layout, `jenga.pages`):
    a `MapPage` maps those slots in all of the group's ranges, an `UnmapPage` unmaps them.
    """
    if page < 0 or chunks_per_range <= 0:
        raise ValueError(
            f"page must be >= 0 and chunks_per_range > 0, got {page}, {chunks_per_range}"
        )
    return range(page * chunks_per_range, (page + 1) * chunks_per_range)


_OPS_CACHED_MAX = 1 << 16
_op_cache: dict[tuple[int, int, int, int], PlanOp] = {}


def _make_op(key: tuple[int, int, int, int]) -> PlanOp:
    """The op for ``(kind, group, page, reused)``, built once and shared (ops are frozen).

    Building a frozen dataclass costs ~0.7 µs; a page's ops recur as it is mapped and
    unmapped again, so sharing them makes plans nearly free. The cache is cleared when it
    holds `_OPS_CACHED_MAX` ops (memory stays bounded for any pool).
    """
    kind, group, page, units = key
    op: PlanOp = MapPage(group, page, units) if kind == OP_MAP else UnmapPage(group, page)
    if len(_op_cache) >= _OPS_CACHED_MAX:
        _op_cache.clear()
    _op_cache[key] = op
    return op


def plan_from_keys(keys: list[tuple[int, int, int, int]]) -> MappingPlan:
    """Build a plan from the core's `drain_plan`: ``(kind, group, page, reused)`` tuples,
    kind `OP_MAP` or `OP_UNMAP`."""
    found: list[PlanOp | None] = list(map(_op_cache.get, keys))  # ops are truthy, misses None
    if all(found):
        return MappingPlan(tuple(found))  # type: ignore[arg-type]  # no None left
    return MappingPlan(tuple(op or _make_op(key) for op, key in zip(found, keys, strict=True)))
