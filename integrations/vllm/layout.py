"""vLLM `KVCacheConfig` → jenga geometry, shared by the scheduler and the worker.

Rationale
    The scheduler-side manager hands out block ids and the worker-side tensors must
    place block ``b`` of group ``g`` where those ids say. Both sides therefore derive
    the same geometry from the same inputs (vLLM's `KVCacheConfig`, ``max_model_len``
    and `JengaVllmOptions`) through this one function, `build_layout`.

Approach
    - One jenga group per vLLM KV-cache group, in vLLM's order, so group ``i`` of the
      scheduler output is jenga group ``i``. Layer names become integer layer ids.
    - Each group's ``block_size`` is the one vLLM's manager uses: the spec's, times the
      decode context parallel world size for a sharded group (one rank's page still
      holds the spec's ``block_size`` tokens: `integrations.vllm.specs`). Where a block
      id points depends on `JengaVllmOptions.tensor_geometry`:

      * shared slots (``pages="vllm"``, with vLLM's own KV tensors): vLLM overlays
        every group on one buffer, so id ``b`` names the same bytes in every group.
        One pool unit is one such block slot, every group's large page is one slot
        (padded, as vLLM pads it), the allocator's per-group page ids are translated to
        slots by `integrations.vllm.slots.SharedSlots`, and slot 0 is the null block,
        as in vLLM.
      * VMM ranges (``pages="vmm"``, with `integrations.vllm.kv_tensors`): each group
        its *unpadded* page in large pages of ``k`` chunks, placed per geometry:
        per_group (default) gives each group one range whose pages hold ``B`` whole
        blocks of all its layers (`integrations.vllm.placement`; vLLM ids are spread,
        page ``q`` spanning ids ``q*M ..``); per_layer gives each layer a range and a
        page ``k`` chunks in each (`jenga.pages.vmm_page_table`). Group ``g`` holds at
        most ``total_units // U_g`` pages (the C++ core recycles page ids LIFO below its
        peak), so vLLM ids are ``< capacity`` and the id ``capacity`` is its null block.

      * VMM slots (``pages="vmm"``, ``geometry="slots"``): the shared-slot allocator
        above, unchanged, over one VMM range laid out as vLLM's buffer
        (`integrations.vllm.slot_chunks`): the slot count is capped so that mapping
        every slot's chunks fits vLLM's bytes, and a chunk is mapped while a mapped slot
        touches it. ``geometry="auto"`` resolves here: "slots" when every group's
        unpadded block bytes equal vLLM's bytes per block, "per_group" otherwise.

      A null block stands for entries a request released (blocks out of a sliding
      window, old Mamba states).
    - The memory budget is vLLM's: the single backing allocation of the config's
      `KVCacheTensor` s (or ``num_blocks`` × the largest per-block footprint when the
      config lists no tensors, as vLLM's own scheduler tests build it). On vLLM's shared
      slots only slots are counted, as vLLM's manager counts them: a Mamba spec whose
      ``shapes`` do not size a state (vLLM's tests build ``MambaSpec(shapes=(1, 1))``)
      takes the slot, and a page larger than the slot is left to vLLM's worker.
    - Mamba groups follow vLLM's cache mode: "align" writes a state only where a step
      ends (``mamba_step_end_only``) and, on VMM pages, caches only the states within a
      request's prompt (``mamba_prompt_states_only``), as vLLM's manager does; "none"
      keeps one per block.

    The pieces live by concern: errors in `integrations.vllm.errors`, the user's
    options and `TensorGeometry` in `integrations.vllm.options`, spec translation and
    the budget in `integrations.vllm.specs`, one page table per geometry in
    `integrations.vllm.page_tables`; this module joins them into a `JengaLayout`.

Limitations
    Supported vLLM specs: `FullAttentionSpec` (plain), `SlidingWindowSpec`,
    `ChunkedLocalAttentionSpec`, `MambaSpec`, `CrossAttentionSpec` (encoder-decoder
    models). Encoder-only, R-SWA, uniform-type and HiSparse specs raise
    `UnsupportedLayerKind` (a HiSparse config as a whole, host-resident and
    HiSparse-role groups included). A sliding
    window wider than ``max_model_len`` is clamped to it (it then behaves as full).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jenga.allocator import AllocationOrder, AllocationRules, AllocatorConfig, JengaAllocator
from jenga.pages import GroupPages, PageTable
from jenga.specs import Kind, KVGroup, ModelSpec

from integrations.kvcache.geometry import GroupGeometry
from integrations.vllm.errors import JengaVllmError
from integrations.vllm.options import JengaVllmOptions, TensorGeometry
from integrations.vllm.page_tables import (
    check_room,
    group_page_table,
    layer_pages,
    place_groups,
    vllm_slot_pages,
)
from integrations.vllm.placement import GroupPlacement
from integrations.vllm.slot_chunks import SlotChunks, slot_cap
from integrations.vllm.specs import (
    check_context_parallel,
    check_kinds,
    kv_cache_memory_bytes,
    layer_spec_from_vllm,
    mamba_step_end_only,
)

if TYPE_CHECKING:
    from integrations.vllm.compat import KVCacheConfig, KVCacheGroupSpec


@dataclass(frozen=True)
class GroupLayout:
    """One vLLM KV-cache group as jenga sees it (index = vLLM group id = jenga group)."""

    index: int
    name: str
    kind: Kind
    layer_names: tuple[str, ...]
    block_size: int
    page_bytes: int  # unpadded bytes of one block of one layer
    pages: GroupPages
    capacity: int  # block ids of this group are < capacity
    null_block_id: int  # capacity (vmm pages) or 0 (vllm pages, vLLM's null block)
    block_bytes: int  # what one block of this group costs in the KV-cache budget
    placement: GroupPlacement | None = None  # per_group VMM geometry, else None
    dcp_world_size: int = 1  # ranks one block's tokens are spread over (decode CP)

    @property
    def spread_ids(self) -> bool:
        """True when vLLM's block ids differ from the allocator's (per_group pages)."""
        return self.placement is not None and self.placement.spread

    def vllm_id(self, block: int) -> int:
        """vLLM block id of allocator block ``block`` (identity unless `spread_ids`)."""
        return block if self.placement is None else self.placement.vllm_id(block)

    def allocator_block(self, vllm_id: int) -> int:
        """Allocator block of vLLM block id ``vllm_id`` (inverse of `vllm_id`)."""
        return vllm_id if self.placement is None else self.placement.allocator_block(vllm_id)


@dataclass(frozen=True)
class JengaLayout:
    """Everything both sides derive from one `KVCacheConfig`."""

    model: ModelSpec
    table: PageTable
    allocator_config: AllocatorConfig
    groups: tuple[GroupLayout, ...]
    memory_bytes: int
    options: JengaVllmOptions
    slot_chunks: SlotChunks | None = None  # the "slots" VMM geometry, else None

    @property
    def total_units(self) -> int:
        return self.allocator_config.total_units

    def new_allocator(self) -> JengaAllocator:
        return JengaAllocator(self.allocator_config)

    def geometries(self) -> tuple[GroupGeometry, ...]:
        """Where each group's large pages live in its VMM ranges (per group or per layer).

        The KV cache's own record (`integrations.kvcache.geometry`), so the vLLM tensors
        and `integrations.kvcache.KVCache` share one arithmetic and one plan translator.
        """
        if not self.options.tensor_geometry.on_vmm_ranges:
            raise JengaVllmError(
                f"geometry {self.options.tensor_geometry} has no per-group or per-layer VMM "
                "ranges (block ids are vLLM's shared slots); use kv_tensors='vmm' with "
                "geometry='per_group' or 'per_layer'"
            )
        return tuple(
            GroupGeometry.from_row(
                i, kg, row, self.options.chunk_bytes, self.allocator_config.total_units
            )
            for i, (kg, row) in enumerate(zip(self.model.groups, self.table.groups, strict=True))
        )


def build_layout(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    options: JengaVllmOptions | None = None,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> JengaLayout:
    """Convert vLLM's config; raises UnsupportedLayerKind, UnsupportedFeature, JengaVllmError."""
    options = options or JengaVllmOptions()
    vgroups = list(kv_cache_config.kv_cache_groups)
    if not vgroups:
        raise JengaVllmError("the KV-cache config has no groups (attention-free model)")
    check_kinds(kv_cache_config)
    check_context_parallel(vgroups, dcp_world_size, pcp_world_size)
    memory = kv_cache_memory_bytes(kv_cache_config)
    slot = memory // max(1, int(kv_cache_config.num_blocks))
    if options.vmm_pages and options.geometry is TensorGeometry.AUTO:
        options = options.resolve(_uniform_slots(vgroups, max_model_len, slot, dcp_world_size))
    shared = options.tensor_geometry.slot_ids
    kv_groups = _kv_groups(vgroups, max_model_len, slot if shared else None, dcp_world_size)
    model = ModelSpec("vllm", kv_groups, max_model_len)
    table, total_units, placements, slot_chunks = _page_table(
        model, kv_cache_config, options, memory
    )
    align = mamba_step_end_only(vgroups)
    config = AllocatorConfig.from_page_table(
        model, table, total_units, _rules(options, kv_cache_config), mamba_step_end_only=align
    )
    # vLLM's "align" mode caches the states prefill steps write, none a decode step
    # writes; on VMM pages ours does the same (each cached state holds part of a mapped
    # page); on vLLM's shared slots every state stays cached, as measured best there
    config = dataclasses.replace(config, mamba_prompt_states_only=align and not shared)
    groups = []
    rows = zip(vgroups, kv_groups, table.groups, placements, strict=True)
    for i, (vg, kg, row, placement) in enumerate(rows):
        per_page = row.blocks_per_large_page if placement is None else placement.ids_per_page
        capacity = (total_units // row.units_per_large_page) * per_page
        groups.append(
            GroupLayout(
                index=i,
                name=kg.name,
                kind=kg.spec.kind,
                layer_names=tuple(vg.layer_names),
                block_size=kg.spec.block_size,
                page_bytes=kg.spec.page_bytes,
                pages=row,
                capacity=capacity + 1 if shared else capacity,
                null_block_id=0 if shared else capacity,
                block_bytes=slot if shared else kg.spec.page_bytes * kg.num_layers,
                placement=placement,
                dcp_world_size=kg.spec.token_shards,
            )
        )
    return JengaLayout(model, table, config, tuple(groups), memory, options, slot_chunks)


def _page_table(
    model: ModelSpec, kv_cache_config: KVCacheConfig, options: JengaVllmOptions, memory: int
) -> tuple[PageTable, int, tuple[GroupPlacement | None, ...], SlotChunks | None]:
    """The allocator's page table and pool units for the options' geometry, with the
    per_group placements (else Nones) and the slots geometry's chunk map (else None)."""
    geometry = options.tensor_geometry
    num_blocks = int(kv_cache_config.num_blocks)
    placements: tuple[GroupPlacement | None, ...] = (None,) * len(model.groups)
    if geometry.slot_ids:
        slot_chunks = None
        if geometry is TensorGeometry.VMM_SLOTS:
            slot_chunks = SlotChunks.from_config(kv_cache_config, options.chunk_bytes)
        num_slots = slot_cap(slot_chunks, num_blocks) if slot_chunks else num_blocks
        table, total_units = vllm_slot_pages(model, memory, num_blocks, num_slots)
        return table, total_units, placements, slot_chunks
    if geometry is TensorGeometry.PER_GROUP:
        placements = place_groups(model.groups, options, memory)
        table = group_page_table(model, placements, options)
        return table, check_room(table, memory, options), placements, None
    table, total_units = layer_pages(model, memory, options)
    return table, total_units, placements, None


def _uniform_slots(
    vgroups: list[KVCacheGroupSpec], max_model_len: int, slot: int, dcp_world_size: int
) -> bool:
    """Whether every group's unpadded block (all its layers) is exactly vLLM's slot of
    ``slot`` bytes: vLLM's overlay then pads nothing ("auto" picks "slots")."""
    try:
        groups = _kv_groups(vgroups, max_model_len, None, dcp_world_size)
    except JengaVllmError:  # a state whose size only the padded slot gives
        return False
    return all(g.spec.page_bytes * g.num_layers == slot for g in groups)


def _kv_groups(
    vgroups: list[KVCacheGroupSpec], max_model_len: int, slot: int | None, dcp_world_size: int
) -> tuple[KVGroup, ...]:
    """One jenga group per vLLM group, in vLLM's order; layer names become layer ids."""
    kv_groups: list[KVGroup] = []
    next_layer = 0
    for i, g in enumerate(vgroups):
        spec = layer_spec_from_vllm(
            g.kv_cache_spec, max_model_len, i, slot, len(g.layer_names), dcp_world_size
        )
        ids = tuple(range(next_layer, next_layer + len(g.layer_names)))
        next_layer += len(ids)
        kv_groups.append(KVGroup(f"g{i}.{spec.kind}", spec, ids))
    return tuple(kv_groups)


def _rules(
    options: JengaVllmOptions, kv_cache_config: KVCacheConfig | None = None
) -> AllocationRules:
    """The allocator's rules: the order, window-release reuse (`window_reuse`) and, on
    per_group VMM pages, the LRU-fair pinned step (it acts with the pinned order only),
    with window-release reuse the `pack_window_blocks` option, and the config's
    ``prefix_cache_retention_interval`` (None and 0: no retention boundaries)."""
    reuse = options.window_reuse
    interval = getattr(kv_cache_config, "prefix_cache_retention_interval", None) or 0
    return AllocationRules(
        retention_interval=int(interval),
        order=AllocationOrder(options.allocation_order),
        demote_window_releases=reuse,
        reuse_window_releases=reuse,
        pinned_lru_fair=options.per_group_vmm,
        pack_window_blocks=reuse and options.pack_window_blocks,
    )
