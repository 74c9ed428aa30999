"""Page tables for the tensor geometries (`TensorGeometry`), from a jenga model.

Rationale
    The allocator sees every geometry as a `jenga.pages.PageTable` (per group: blocks
    and units per large page) plus a pool size in units; what a unit and a page are
    differs by geometry. One function per geometry builds that pair, so
    `integrations.vllm.layout.build_layout` only picks one.

Approach
    - `vllm_slot_pages` (shared slots, on vLLM's tensors or VMM slots): one unit = one
      of vLLM's block slots, every group's large page is one slot (slot 0 is the null
      block, so ``num_slots - 1`` units).
    - `group_page_table` (per_group): one range per group, rows from each group's
      `integrations.vllm.placement.GroupPlacement` (`place`).
    - `layer_pages` (per_layer): `jenga.pages.vmm_page_table`, ``k`` chunks per layer
      range.
    The VMM geometries count the pool in chunks and refuse a budget that cannot give
    one request a large page in every group (`check_room`).

Limitations
    Shared slots never check a page against the slot: vLLM's worker owns those bytes.
"""

from __future__ import annotations

import math

from jenga.pages import GroupPages, PageTable, capacity_units, static_page_table, vmm_page_table
from jenga.specs import KVGroup, ModelSpec, SpecError

from integrations.vllm.errors import JengaVllmError
from integrations.vllm.options import JengaVllmOptions
from integrations.vllm.placement import (
    GroupPlacement,
    PlacementError,
    place_group,
    pool_least_waste_chunks,
)


def layer_pages(model: ModelSpec, memory: int, options: JengaVllmOptions) -> tuple[PageTable, int]:
    """Per-layer ranges: large pages of ``k`` chunks per range (`vmm_page_table`)."""
    try:
        table = vmm_page_table(
            model,
            chunk_bytes=options.chunk_bytes,
            epsilon=options.page_epsilon,
            budget_bytes=memory,
        )
    except SpecError as exc:
        raise JengaVllmError(f"KV cache of {memory} B cannot hold one large page: {exc}") from exc
    return table, check_room(table, memory, options)


def place(
    group: KVGroup, options: JengaVllmOptions, memory: int, epsilon: float | None = None
) -> GroupPlacement:
    try:
        return place_group(
            group.spec.page_bytes,
            group.num_layers,
            options.chunk_bytes,
            epsilon=options.page_epsilon if epsilon is None else epsilon,
            least_waste_chunks=pool_least_waste_chunks(memory, options.chunk_bytes),
        )
    except PlacementError as exc:
        raise JengaVllmError(f"group {group.name!r}: {exc}") from exc


WIDEST_EPSILON = 0.5
"""The most waste a page takes, with the default epsilon, to let one page per group fit."""


def place_groups(
    groups: tuple[KVGroup, ...], options: JengaVllmOptions, memory: int
) -> tuple[GroupPlacement, ...]:
    """Per-group placements (`place`). With the default epsilon, pages small enough that
    one in each group fits the pool: the epsilon doubles (up to `WIDEST_EPSILON`) until
    they do. The least-waste Mamba page of Jamba's 2-layer groups is 9 chunks (32 states),
    so its 7 Mamba groups and one attention group need 64 chunks and a 128 MiB pool (63)
    was refused; 5-chunk pages (16 states, 12.5 % waste) fit it. An explicit ``epsilon``
    is kept as given (`check_room` then refuses a pool without room)."""
    epsilon = options.page_epsilon
    total = memory // options.chunk_bytes
    while True:
        placements = tuple(place(g, options, memory, epsilon) for g in groups)
        fits = sum(p.chunks_per_page for p in placements) <= total
        if fits or options.epsilon is not None or epsilon >= WIDEST_EPSILON:
            return placements
        epsilon = min(WIDEST_EPSILON, 2 * epsilon)


def group_page_table(
    model: ModelSpec, placements: tuple[GroupPlacement | None, ...], options: JengaVllmOptions
) -> PageTable:
    """One range per group: the allocator's rows for `integrations.vllm.placement`."""
    rows = []
    for g, place in zip(model.groups, placements, strict=True):
        assert place is not None
        rows.append(
            GroupPages(
                group=g.name,
                small_page_bytes=place.block_bytes,
                num_ranges=1,
                chunks_per_range=place.chunks_per_page,
                blocks_per_large_page=place.blocks_per_page,
                units_per_large_page=place.chunks_per_page,
                tail_bytes=place.tail_bytes,
                kind=str(g.spec.kind),
                layers_per_small_page=g.num_layers,
                lcm_chunks_per_range=math.lcm(place.block_bytes, options.chunk_bytes)
                // options.chunk_bytes,
                within_epsilon=place.within_epsilon,
            )
        )
    return PageTable(
        "vmm",
        options.chunk_bytes,
        tuple(rows),
        model.name,
        options.page_epsilon,
        layout="per_group",
    )


def check_room(table: PageTable, memory: int, options: JengaVllmOptions) -> int:
    """The pool's chunk count; raises when one request's large page per group does not fit."""
    try:
        total_units = capacity_units(memory, options.chunk_bytes)
    except SpecError as exc:
        raise JengaVllmError(f"the KV cache holds no chunk: {exc}") from exc
    one_each = sum(row.units_per_large_page for row in table.groups)
    if one_each > total_units:
        raise JengaVllmError(
            f"one request needs a large page in each group: {one_each} chunks of "
            f"{options.chunk_bytes} B, but the KV cache holds {total_units}; give the KV "
            "cache more memory or raise jenga_vmm.epsilon for smaller Mamba pages"
        )
    return total_units


def vllm_slot_pages(
    model: ModelSpec, memory: int, num_blocks: int, num_slots: int | None = None
) -> tuple[PageTable, int]:
    """vLLM's block slots: one unit = one block slot shared by all groups (slot 0 = null).

    vLLM overlays every group on one buffer, so slot ``b`` is the same bytes in every
    group and may belong to one group at a time; a group's large page is one slot (its
    pages padded to the slot, exactly as vLLM pads them). vLLM's worker owns those bytes
    on this geometry and vLLM's manager only counts slots, so neither do we check a page
    against the slot: the table's unit is the slot, or a larger page where a config
    (vLLM's tests build such) declares one; the budget is counted in slots either way:
    ``num_slots - 1`` units (``num_slots``: vLLM's ``num_blocks`` unless given; the
    "slots" VMM geometry caps it, `integrations.vllm.slot_chunks.slot_cap`).
    """
    if num_blocks < 2:
        raise JengaVllmError(f"the KV cache holds {num_blocks} block(s); at least 2 are needed")
    pages = [g.spec.page_bytes * g.num_layers for g in model.groups]
    unit = max(memory // num_blocks, *pages)
    try:
        table = static_page_table(model, strategy="max", unit_bytes=unit)
    except SpecError as exc:
        raise JengaVllmError(f"vLLM's block slot cannot hold a block: {exc}") from exc
    return table, (num_blocks if num_slots is None else num_slots) - 1
