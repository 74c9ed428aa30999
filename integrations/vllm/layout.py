"""vLLM `KVCacheConfig` → jenga geometry, shared by the scheduler and the worker.

Rationale
    The scheduler-side manager hands out block ids and the worker-side tensors must
    place block ``b`` of group ``g`` where those ids say. Both sides therefore derive
    the same geometry from the same inputs (vLLM's `KVCacheConfig`, ``max_model_len``
    and `JengaVllmOptions`) through this one function, `build_layout`.

Approach
    - One jenga group per vLLM KV-cache group, in vLLM's order, so group ``i`` of the
      scheduler output is jenga group ``i``. Layer names become integer layer ids.
    - Each group keeps vLLM's ``block_size`` (the worker's slot mapping uses it). Where a
      block id points depends on `JengaVllmOptions.pages`:

      * "vllm" (with vLLM's own KV tensors): vLLM overlays every group on one buffer, so
        id ``b`` names the same bytes in every group. One pool unit is one such block
        slot, every group's large page is one slot (padded, as vLLM pads it), the
        allocator's per-group page ids are translated to slots by
        `integrations.vllm.slots.SharedSlots`, and slot 0 is the null block, as in vLLM.
      * "vmm" (with `integrations.vllm.kv_tensors`): each group its *unpadded* page in
        large pages of ``k`` chunks, placed by `JengaVllmOptions.geometry`:
        "per_group" (default) gives each group one range whose pages hold ``B`` whole
        blocks of all its layers (`integrations.vllm.placement`; vLLM ids are spread,
        page ``q`` spanning ids ``q*M ..``); "per_layer" gives each layer a range and a
        page ``k`` chunks in each (`jenga.pages.vmm_page_table`). Group ``g`` holds at
        most ``total_units // U_g`` pages (the C++ core recycles page ids LIFO below its
        peak), so vLLM ids are ``< capacity`` and the id ``capacity`` is its null block.

      A null block stands for entries a request released (blocks out of a sliding
      window, old Mamba states).
    - The memory budget is vLLM's: the single backing allocation of the config's
      `KVCacheTensor` s (or ``num_blocks`` × the largest per-block footprint when the
      config lists no tensors, as vLLM's own scheduler tests build it). On vLLM's shared
      slots only slots are counted, as vLLM's manager counts them: a Mamba spec whose
      ``shapes`` do not size a state (vLLM's tests build ``MambaSpec(shapes=(1, 1))``)
      takes the slot, and a page larger than the slot is left to vLLM's worker.
    - Mamba groups follow vLLM's cache mode: "align" writes a state only where a step
      ends (``mamba_step_end_only``); "none" keeps one per block, as vLLM's manager.

Limitations
    Supported vLLM specs: `FullAttentionSpec` (plain), `SlidingWindowSpec`,
    `ChunkedLocalAttentionSpec`, `MambaSpec`, `CrossAttentionSpec` (encoder-decoder
    models). Encoder-only, MLA, sink, R-SWA, uniform-type and HiSparse specs raise
    `UnsupportedLayerKind`. A sliding
    window wider than ``max_model_len`` is clamped to it (it then behaves as full).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from jenga.allocator import AllocationOrder, AllocationRules, AllocatorConfig, JengaAllocator
from jenga.pages import (
    DEFAULT_CHUNK_BYTES,
    GroupPages,
    PageTable,
    static_page_table,
    vmm_page_table,
)
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec, SpecError

from integrations.kvcache.geometry import GroupGeometry
from integrations.vllm.placement import (
    GroupPlacement,
    PlacementError,
    place_group,
    pool_least_waste_chunks,
)

GEOMETRIES = ("per_group", "per_layer")
"""Where VMM pages place a group's blocks: one range per group, or one per layer."""

OPTIONS_KEY = "jenga_vmm"
"""Key of our options inside ``VllmConfig.additional_config``."""

SUPPORTED_SPECS = (
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
    "MambaSpec",
    "CrossAttentionSpec",
)


class JengaVllmError(Exception):
    """Base class of the vLLM integration's own errors."""


class UnsupportedLayerKind(JengaVllmError, NotImplementedError):
    """A KV-cache spec jenga cannot manage in this integration."""


class UnsupportedFeature(JengaVllmError, NotImplementedError):
    """A vLLM feature (connector, speculative decoding, ...) this manager does not serve."""


class InvalidOptions(JengaVllmError, ValueError):
    """``additional_config["jenga_vmm"]`` holds an unknown key or a bad value."""


@dataclass(frozen=True)
class JengaVllmOptions:
    """What the user may set under ``additional_config={"jenga_vmm": {...}}``.

    ``pages``: where a block id points. "vllm" (the default with ``kv_tensors="torch"``):
    vLLM's own KV tensors, in which every group overlays the same buffer and block id
    ``b`` is the same bytes in every group, so ids are vLLM's shared block slots (1 ..
    ``num_blocks - 1``, 0 = null) and a group's large page is one slot; memory moves
    between groups block by block, as in vLLM, and jenga adds request-aware allocation
    and the prefix-subset evictor. "vmm" (required by ``kv_tensors="vmm"``): VMM ranges
    placed per ``geometry``, each group with its unpadded page in large pages of ``k``
    chunks. "auto" picks by ``kv_tensors``.
    ``junctions``: report the shared-prefix boundary to the scheduler
    (`JengaKVCacheManager.get_computed_blocks`) so Mamba states get cached where
    siblings' prompts diverge.
    ``geometry`` (VMM pages): "per_group" (default; one range per KV-cache group, a
    large page holds whole blocks of all the group's layers) or "per_layer" (one range
    per layer, a large page is ``k`` chunks of each; per-layer contiguous tensors).
    ``chunk_bytes``: the exchange unit between groups (CUDA: the 2 MiB granularity).
    ``epsilon``: the waste (tail, padding) a large page may carry; None: 0.01 per_layer
    (whose VMM tensor path needs 0-tail groups), 0.05 per_group (any tail works).
    ``reuse_window_releases``: blocks that left a sliding window / local chunk are cached
    in a lower tier and the group reuses those stranded in pages it still pins before
    mapping or evicting a page (`jenga.config.AllocationRules`); None: on with per_group
    VMM pages (a page holds many blocks there), off otherwise.
    ``order``: "compact" (steps 1, 4, 2, 3, 5), "pinned" (compact plus step 5 on pinned
    pages before step 3) or "paper" (`jenga.allocator`); None: "pinned" with per_group VMM
    pages, where its pinned step is LRU-fair (it takes a cached block of a page live
    blocks pin only when no wholly evictable page is less recently used:
    `AllocationRules.pinned_lru_fair`), "compact" otherwise. Compact keeps other
    prompts' cached pages alive where the paper order evicts whole pages before using
    free slots in other requests' pages; pinned keeps pages evictable and more requests
    running under memory pressure (figures: `docs/results/`). ``kv_tensors``:
    "vmm" makes the worker plugin put the KV cache on VMM ranges
    (`integrations.vllm.plugin`); "torch" leaves vLLM's. ``shared_pool``: with
    ``kv_tensors="vmm"``, draw the chunks from the shared pool of that name (`vmm-pool
    start NAME`, docs/multi-tenant.md) as tenant ``tenant_name`` with byte limits
    ``tenant_min_bytes`` / ``tenant_max_bytes`` instead of a private pool (host backend).
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    epsilon: float | None = None
    geometry: str = "per_group"
    reuse_window_releases: bool | None = None
    order: str | None = None
    kv_tensors: str = "torch"
    pages: str = "auto"
    junctions: bool = True
    shared_pool: str = ""
    tenant_name: str = ""
    tenant_min_bytes: int = 0
    tenant_max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.shared_pool and self.kv_tensors != "vmm":
            raise InvalidOptions("shared_pool needs kv_tensors='vmm' (chunks come from the pool)")
        if self.kv_tensors not in ("torch", "vmm"):
            raise InvalidOptions(f"kv_tensors must be 'torch' or 'vmm', got {self.kv_tensors!r}")
        if self.pages not in ("auto", "vllm", "vmm"):
            raise InvalidOptions(f"pages must be 'auto', 'vllm' or 'vmm', got {self.pages!r}")
        if self.kv_tensors == "vmm" and self.pages == "vllm":
            raise InvalidOptions(
                "pages='vllm' places blocks in vLLM's own shared KV tensors; "
                "kv_tensors='vmm' needs pages='vmm' (or 'auto')"
            )
        if self.chunk_bytes <= 0:
            raise InvalidOptions(f"chunk_bytes must be > 0, got {self.chunk_bytes}")
        if self.epsilon is not None and not 0.0 <= self.epsilon < 1.0:
            raise InvalidOptions(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.geometry not in GEOMETRIES:
            raise InvalidOptions(f"geometry must be one of {GEOMETRIES}, got {self.geometry!r}")
        if self.order is not None and self.order not in tuple(AllocationOrder):
            raise InvalidOptions(
                f"order must be one of {[str(o) for o in AllocationOrder]}, got {self.order!r}"
            )

    @property
    def page_epsilon(self) -> float:
        """`epsilon`, or the geometry's default when None."""
        if self.epsilon is not None:
            return self.epsilon
        return 0.05 if self.geometry == "per_group" else 0.01

    @property
    def per_group_vmm(self) -> bool:
        """VMM pages in one range per group (the geometry several defaults follow)."""
        return self.page_geometry == "vmm" and self.geometry == "per_group"

    @property
    def window_reuse(self) -> bool:
        """`reuse_window_releases`, or its default (per_group VMM pages) when None."""
        if self.reuse_window_releases is not None:
            return self.reuse_window_releases
        return self.per_group_vmm

    @property
    def allocation_order(self) -> str:
        """`order`, or its default when None: "pinned" on per_group VMM pages, else
        "compact"."""
        if self.order is not None:
            return self.order
        return "pinned" if self.per_group_vmm else "compact"

    @property
    def page_geometry(self) -> str:
        """ "vllm" or "vmm": `pages` with "auto" resolved by `kv_tensors`."""
        if self.pages != "auto":
            return self.pages
        return "vmm" if self.kv_tensors == "vmm" else "vllm"

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> JengaVllmOptions:
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidOptions(f"unknown jenga_vmm option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> JengaVllmOptions:
        extra = getattr(vllm_config, "additional_config", None) or {}
        return cls.from_dict(extra.get(OPTIONS_KEY) if isinstance(extra, dict) else None)


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
        if self.options.page_geometry != "vmm":
            raise JengaVllmError(
                f"pages={self.options.page_geometry!r} has no VMM range geometry "
                "(block ids are vLLM's shared slots); use kv_tensors='vmm'"
            )
        return tuple(
            GroupGeometry.from_row(
                i, kg, row, self.options.chunk_bytes, self.allocator_config.total_units
            )
            for i, (kg, row) in enumerate(zip(self.model.groups, self.table.groups, strict=True))
        )


def declared_page_bytes(spec: Any) -> int | None:
    """Bytes of one block of one layer as vLLM's spec declares them (padded), or None.

    None for a `MambaSpec` with no ``page_size_padded`` whose ``shapes`` are not a tuple
    of shapes (vLLM's own tests build ``MambaSpec(shapes=(1, 1))``): vLLM's manager never
    sizes a page, so such a spec is valid to it, and only the block slot sizes it.
    """
    if type(spec).__name__ == "MambaSpec":
        if spec.page_size_padded is not None:
            return int(spec.page_size_padded)
        if not all(isinstance(shape, tuple | list) for shape in spec.shapes):
            return None
    return int(spec.page_size_bytes)


def kv_cache_memory_bytes(kv_cache_config: Any) -> int:
    """Bytes vLLM would allocate for this config (its one backing buffer)."""
    tensors = kv_cache_config.kv_cache_tensors
    if tensors:
        return max(int(t.size) for t in tensors)
    sized = [
        (page, g)
        for g in kv_cache_config.kv_cache_groups
        if (page := declared_page_bytes(g.kv_cache_spec)) is not None
    ]
    if not sized:
        raise JengaVllmError(
            "the KV-cache config lists no tensors and no group's spec gives a page size "
            f"({[type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]})"
        )
    per_block = max(page * len(g.layer_names) for page, g in sized)
    return int(kv_cache_config.num_blocks) * per_block


def _mamba_state_bytes(spec: Any, where: str, slot_bytes: int | None, num_layers: int) -> int:
    """One layer's Mamba state: the spec's unpadded size, else its padded page, else (on
    vLLM's shared slots, where every page is padded to the slot) the slot's share."""
    if all(isinstance(shape, tuple | list) for shape in spec.shapes):
        return int(spec.real_page_size_bytes)
    if spec.page_size_padded is not None:
        return int(spec.page_size_padded)
    if slot_bytes is not None:
        return slot_bytes // max(1, num_layers)
    raise JengaVllmError(
        f"{where}: shapes {spec.shapes!r} are not a tuple of state shapes and the spec has "
        "no page_size_padded, so the state size is unknown; pages='vmm' needs it"
    )


def check_spec_kind(spec: Any, group_index: int) -> None:
    """Raise `UnsupportedLayerKind` for a vLLM spec class this manager does not serve."""
    name = type(spec).__name__
    if name not in SUPPORTED_SPECS:
        raise UnsupportedLayerKind(
            f"KV-cache group {group_index} ({name}): jenga-vmm's vLLM manager supports "
            f"{', '.join(SUPPORTED_SPECS)}; {name} is not supported"
        )


def layer_spec_from_vllm(
    spec: Any,
    max_model_len: int,
    group_index: int,
    slot_bytes: int | None = None,
    num_layers: int = 1,
) -> LayerSpec:
    """The jenga `LayerSpec` whose page equals the vLLM spec's unpadded page.

    ``slot_bytes``: vLLM's block slot when blocks live in its shared tensors (sizes a
    Mamba state its spec does not size, see `declared_page_bytes`).
    """
    name = type(spec).__name__
    where = f"KV-cache group {group_index} ({name})"
    check_spec_kind(spec, group_index)
    if name == "MambaSpec":
        return LayerSpec(
            Kind.MAMBA,
            state_bytes=_mamba_state_bytes(spec, where, slot_bytes, num_layers),
            checkpoint_interval=int(spec.block_size),
            block_size=int(spec.block_size),
        )
    if getattr(spec, "tokens_per_state", 1) != 1 or spec.state_content_size_bytes % 2:
        raise UnsupportedLayerKind(
            f"{where}: packed or compressed attention pages are not supported"
        )
    common = {
        "num_kv_heads": int(spec.num_heads),
        "head_dim": int(spec.state_content_size_bytes) // 2,
        "dtype_bytes": 1,
        "block_size": int(spec.block_size),
    }
    if name == "SlidingWindowSpec":
        return LayerSpec(
            Kind.SLIDING_WINDOW, window=min(int(spec.sliding_window), max_model_len), **common
        )
    if name == "ChunkedLocalAttentionSpec":
        return LayerSpec(Kind.CHUNKED_LOCAL, chunk=int(spec.attention_chunk_size), **common)
    if name == "CrossAttentionSpec":  # K/V of the encoder input, held for the whole request
        return LayerSpec(Kind.CROSS_ATTENTION, **common)
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        raise UnsupportedLayerKind(
            f"{where}: a FullAttentionSpec carrying sliding_window/attention_chunk_size "
            "(hybrid manager disabled) is not supported; enable vLLM's hybrid KV-cache "
            "manager so such layers get SlidingWindowSpec/ChunkedLocalAttentionSpec"
        )
    return LayerSpec(Kind.FULL, **common)


def build_layout(
    kv_cache_config: Any, max_model_len: int, options: JengaVllmOptions | None = None
) -> JengaLayout:
    """Convert vLLM's config; raises `UnsupportedLayerKind`, `JengaVllmError` (no room)."""
    options = options or JengaVllmOptions()
    vgroups = list(kv_cache_config.kv_cache_groups)
    if not vgroups:
        raise JengaVllmError("the KV-cache config has no groups (attention-free model)")
    for i, g in enumerate(vgroups):
        check_spec_kind(g.kv_cache_spec, i)
    memory = kv_cache_memory_bytes(kv_cache_config)
    slot = None
    if options.page_geometry == "vllm":
        slot = memory // max(1, int(kv_cache_config.num_blocks))
    kv_groups: list[KVGroup] = []
    next_layer = 0
    for i, g in enumerate(vgroups):
        spec = layer_spec_from_vllm(g.kv_cache_spec, max_model_len, i, slot, len(g.layer_names))
        ids = tuple(range(next_layer, next_layer + len(g.layer_names)))
        next_layer += len(ids)
        kv_groups.append(KVGroup(f"g{i}.{spec.kind}", spec, ids))
    model = ModelSpec("vllm", tuple(kv_groups), max_model_len)
    placements: tuple[GroupPlacement | None, ...] = (None,) * len(kv_groups)
    if options.page_geometry == "vllm":
        table, total_units = _vllm_slot_pages(model, memory, int(kv_cache_config.num_blocks))
    elif options.geometry == "per_group":
        placements = tuple(_place(g, options, memory) for g in kv_groups)
        table = _group_page_table(model, placements, options)
        total_units = _check_room(table, memory, options)
    else:
        table, total_units = _vmm_pages(model, memory, options)
    config = AllocatorConfig.from_page_table(
        model,
        table,
        total_units,
        _rules(options),
        mamba_step_end_only=_mamba_step_end_only(vgroups),
    )
    shared = options.page_geometry == "vllm"
    groups = []
    rows = zip(vgroups, kv_groups, table.groups, placements, strict=True)
    for i, (vg, kg, row, place) in enumerate(rows):
        per_page = row.blocks_per_large_page if place is None else place.ids_per_page
        capacity = (total_units // row.units_per_large_page) * per_page
        groups.append(
            GroupLayout(
                index=i,
                name=kg.name,
                kind=kg.spec.kind,
                layer_names=tuple(vg.layer_names),
                block_size=int(vg.kv_cache_spec.block_size),
                page_bytes=kg.spec.page_bytes,
                pages=row,
                capacity=capacity + 1 if shared else capacity,
                null_block_id=0 if shared else capacity,
                block_bytes=(slot or 0) if shared else kg.spec.page_bytes * kg.num_layers,
                placement=place,
            )
        )
    return JengaLayout(model, table, config, tuple(groups), memory, options)


def _rules(options: JengaVllmOptions) -> AllocationRules:
    """The allocator's rules: the order, window-release reuse (`window_reuse`) and, on
    per_group VMM pages, the LRU-fair pinned step (it acts with the pinned order only)."""
    reuse = options.window_reuse
    return AllocationRules(
        order=AllocationOrder(options.allocation_order),
        demote_window_releases=reuse,
        reuse_window_releases=reuse,
        pinned_lru_fair=options.per_group_vmm,
    )


def _mamba_step_end_only(vgroups: list[Any]) -> bool:
    """Whether Mamba states exist only where a step ends (vLLM's "align" cache mode).

    With "none" (prefix caching off in a real engine; vLLM's own tests also build it with
    caching on) vLLM's manager treats every Mamba block as a state written and cacheable,
    as it treats attention blocks; jenga's Mamba policy then keeps every checkpoint.
    """
    modes = {
        str(getattr(g.kv_cache_spec, "mamba_cache_mode", "none"))
        for g in vgroups
        if type(g.kv_cache_spec).__name__ == "MambaSpec"
    }
    if len(modes) > 1:
        raise UnsupportedLayerKind(
            f"Mamba groups with different mamba_cache_mode values {sorted(modes)} "
            "(vLLM sets one mode per engine)"
        )
    return modes != {"none"}


def _vmm_pages(model: ModelSpec, memory: int, options: JengaVllmOptions) -> tuple[PageTable, int]:
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
    return table, _check_room(table, memory, options)


def _place(group: KVGroup, options: JengaVllmOptions, memory: int) -> GroupPlacement:
    try:
        return place_group(
            group.spec.page_bytes,
            group.num_layers,
            options.chunk_bytes,
            epsilon=options.page_epsilon,
            least_waste_chunks=pool_least_waste_chunks(memory, options.chunk_bytes),
        )
    except PlacementError as exc:
        raise JengaVllmError(f"group {group.name!r}: {exc}") from exc


def _group_page_table(
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


def _check_room(table: PageTable, memory: int, options: JengaVllmOptions) -> int:
    """The pool's chunk count; raises when one request's large page per group does not fit."""
    total_units = memory // options.chunk_bytes
    one_each = sum(row.units_per_large_page for row in table.groups)
    if one_each > total_units:
        raise JengaVllmError(
            f"one request needs a large page in each group: {one_each} chunks of "
            f"{options.chunk_bytes} B, but the KV cache holds {total_units}; give the KV "
            "cache more memory or raise jenga_vmm.epsilon for smaller Mamba pages"
        )
    return total_units


def _vllm_slot_pages(model: ModelSpec, memory: int, num_blocks: int) -> tuple[PageTable, int]:
    """vLLM's own tensors: one unit = one block slot shared by all groups (slot 0 = null).

    vLLM overlays every group on one buffer, so slot ``b`` is the same bytes in every
    group and may belong to one group at a time; a group's large page is one slot (its
    pages padded to the slot, exactly as vLLM pads them). vLLM's worker owns those bytes
    on this geometry and vLLM's manager only counts slots, so neither do we check a page
    against the slot: the table's unit is the slot, or a larger page where a config
    (vLLM's tests build such) declares one; the budget is counted in slots either way.
    """
    if num_blocks < 2:
        raise JengaVllmError(f"the KV cache holds {num_blocks} block(s); at least 2 are needed")
    pages = [g.spec.page_bytes * g.num_layers for g in model.groups]
    unit = max(memory // num_blocks, *pages)
    try:
        table = static_page_table(model, strategy="max", unit_bytes=unit)
    except SpecError as exc:
        raise JengaVllmError(f"vLLM's block slot cannot hold a block: {exc}") from exc
    return table, num_blocks - 1
