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

from collections.abc import Sequence
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


class MappingPlan:
    """An ordered list of page ops; apply in order.

    Empty when physical needs did not change. Two explicit whole-pool ops ride on a plan,
    never implied by an empty one: ``reset`` (from `MappingPlan.unmap_all`: unmap every
    page of every group first, an engine dropping its whole cache) and ``resize_units``
    (from `MappingPlan.resize`: after the ops, the pool holds that many units; the
    allocator's `set_total_units` moved, and whoever owns the memory follows).

    The allocator hands out plans built from the core's raw ``(kind, group, page,
    reused_units)`` keys (`plan_from_keys`); the op objects are made on first use of
    `ops`, so an engine that replays `keys` into its own tables builds none.
    """

    __slots__ = ("_keys", "_ops", "reset", "resize_units")

    def __init__(
        self, ops: Sequence[PlanOp] = (), *, reset: bool = False, resize_units: int | None = None
    ) -> None:
        self._ops: tuple[PlanOp, ...] | None = tuple(ops)
        self._keys: list[tuple[int, int, int, int]] | None = None
        self.reset = reset
        self.resize_units = resize_units

    @classmethod
    def unmap_all(cls) -> MappingPlan:
        """The plan that unmaps every page of every group (the engine's cache is reset)."""
        return cls(reset=True)

    @classmethod
    def resize(cls, plan: MappingPlan, units: int) -> MappingPlan:
        """``plan``'s ops, then the pool resized to ``units`` units."""
        return cls(plan.ops, reset=plan.reset, resize_units=units)

    @property
    def ops(self) -> tuple[PlanOp, ...]:
        if self._ops is None:
            assert self._keys is not None
            self._ops = _ops_of_keys(self._keys)
        return self._ops

    @property
    def keys(self) -> list[tuple[int, int, int, int]]:
        """The ops as ``(kind, group, page, reused_units)`` tuples, kind `OP_MAP` or `OP_UNMAP`."""
        if self._keys is None:
            self._keys = [_key_of(op) for op in self.ops]
        return self._keys

    def __len__(self) -> int:
        return len(self._keys) if self._ops is None else len(self._ops)  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return self.reset or self.resize_units is not None or len(self) > 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MappingPlan):
            return NotImplemented
        mine = (self.reset, self.resize_units, self.ops)
        return mine == (other.reset, other.resize_units, other.ops)

    def __hash__(self) -> int:
        return hash((self.reset, self.resize_units, self.ops))

    def __repr__(self) -> str:
        extra = ", reset=True" if self.reset else ""
        if self.resize_units is not None:
            extra += f", resize_units={self.resize_units}"
        return f"MappingPlan({self.ops!r}{extra})"

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


def _key_of(op: PlanOp) -> tuple[int, int, int, int]:
    if isinstance(op, MapPage):
        return (OP_MAP, op.group, op.page, op.reused_units)
    return (OP_UNMAP, op.group, op.page, 0)


def _ops_of_keys(keys: list[tuple[int, int, int, int]]) -> tuple[PlanOp, ...]:
    found: list[PlanOp | None] = list(map(_op_cache.get, keys))  # ops are truthy, misses None
    if all(found):
        return tuple(found)  # type: ignore[arg-type]  # no None left
    return tuple(op or _make_op(key) for op, key in zip(found, keys, strict=True))


def plan_from_keys(keys: list[tuple[int, int, int, int]]) -> MappingPlan:
    """A plan over the core's `drain_plan`: ``(kind, group, page, reused)`` tuples, kind
    `OP_MAP` or `OP_UNMAP` (ops are built when first read)."""
    plan = MappingPlan.__new__(MappingPlan)
    plan._keys, plan._ops, plan.reset, plan.resize_units = keys, None, False, None
    return plan
