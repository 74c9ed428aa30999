"""jenga MappingPlan (pages) -> vmm MappingPlan (range slots).

Rationale
    The allocator speaks in large pages; vmm in slots of virtual ranges. A step-3
    eviction (``Unmap(h, p) ... Map(g, q, reused_units=k)``) must become a *remap*: the
    chunks just unmapped from group h are mapped for g without going through the free
    pool, so the evicted page's physical memory is what backs the new page.

Approach
    Walk the page ops in order, keeping a FIFO of (range, slot) units released by the
    ``UnmapPage`` ops seen since the last ``MapPage``::

        Unmap(h, p1)           pending += slots of p1 in every range of h
        Map(g, q, reused=r)    target slots still pending (same page unmapped and
                               mapped again) keep their chunk; then up to r
                               target slots <- remap from pending (FIFO)
                               rest of pending      -> unmap (back to the pool)
                               other target slots   <- map fresh chunks
        end of plan            rest of pending      -> unmap

    Pending units are flushed before any fresh map, so the pool never needs more chunks
    than the allocator's unit count at any moment of the plan.

Limitations
    A ``MapPage`` may reuse at most the pending units (the allocator guarantees it); a
    plan that breaks this raises `PlanTranslationError` before anything is applied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import groupby

from jenga.plan import MapPage
from jenga.plan import MappingPlan as PagePlan
from vmm.plan import MappingPlan
from vmm.range import VirtualRange

from integrations.kvcache.geometry import GroupGeometry

Unit = tuple[VirtualRange, int]


class PlanTranslationError(ValueError):
    """A jenga plan is inconsistent with the layout (reuses more units than were unmapped)."""


def page_units(geometry: GroupGeometry, ranges: Sequence[VirtualRange], page: int) -> list[Unit]:
    """Every (range, slot) unit of large page `page`, range by range."""
    slots = geometry.page_slots(page)
    return [(rng, slot) for rng in ranges for slot in slots]


def translate(
    plan: PagePlan,
    geometries: Sequence[GroupGeometry],
    ranges: Sequence[Sequence[VirtualRange]],
) -> tuple[MappingPlan, int]:
    """The vmm plan carrying out `plan`, and how many units it remaps."""
    out = MappingPlan()
    pending: deque[Unit] = deque()
    remapped = 0
    for op in plan.ops:
        units = page_units(geometries[op.group], ranges[op.group], op.page)
        if not isinstance(op, MapPage):
            pending.extend(units)
            continue
        if op.reused_units > len(pending) or op.reused_units > len(units):
            raise PlanTranslationError(
                f"MapPage(group {op.group}, page {op.page}) reuses {op.reused_units} units, "
                f"{len(pending)} were unmapped before it and the page has {len(units)}"
            )
        targets = _keep_in_place(pending, units, op.reused_units)
        num_moved = op.reused_units - (len(units) - len(targets))
        sources = [pending.popleft() for _ in range(num_moved)]
        _emit_remaps(out, sources, targets[:num_moved])
        remapped += op.reused_units
        _emit_unmaps(out, pending)
        pending.clear()
        _emit_maps(out, targets[num_moved:])
    _emit_unmaps(out, pending)
    return out, remapped


def _keep_in_place(pending: deque[Unit], units: Sequence[Unit], reused: int) -> list[Unit]:
    """Drop from `pending` up to `reused` units the page maps again at the same slot (the
    allocator evicted a page and reuses its index): their chunks simply stay. Returns the
    page's units still to be filled, in order."""
    if not reused:
        return list(units)
    pending_set = set(pending)
    kept = set([u for u in units if u in pending_set][:reused])
    if kept:
        remaining = [u for u in pending if u not in kept]
        pending.clear()
        pending.extend(remaining)
    return [u for u in units if u not in kept]


def _by_range(units: Sequence[Unit]) -> list[tuple[VirtualRange, list[int]]]:
    """Consecutive units of one range merged into one op (one batched backend call)."""
    return [(rng, [slot for _, slot in run]) for rng, run in groupby(units, key=lambda u: u[0])]


def _emit_maps(out: MappingPlan, units: Sequence[Unit]) -> None:
    for rng, slots in _by_range(units):
        out.map(rng, slots)


def _emit_unmaps(out: MappingPlan, units: Sequence[Unit]) -> None:
    for rng, slots in _by_range(list(units)):
        out.unmap(rng, slots)


def _emit_remaps(out: MappingPlan, sources: Sequence[Unit], targets: Sequence[Unit]) -> None:
    """Pair sources with targets in order; one op per run sharing a source and target range."""
    pairs = list(zip(sources, targets, strict=True))
    for (src, dst), run in groupby(pairs, key=lambda st: (st[0][0], st[1][0])):
        items = list(run)
        out.remap(src, [s for (_, s), _ in items], dst, [t for _, (_, t) in items])
