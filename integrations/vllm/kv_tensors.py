"""vLLM 0.32 and 0.33 KV tensors on VMM ranges: a replacement for ``allocate_kv_cache``.

Rationale
    vLLM allocates one ``torch.zeros`` buffer for every block the KV cache could ever
    hold and views it per layer. With jenga the scheduler hands out block ids per group
    from large pages of ``k`` chunks; backing only the pages in use with physical chunks
    makes unused blocks free, and lets memory move between groups (a page unmapped from
    one group's ranges is mapped into another's).

Approach
    Two geometries (`JengaVllmOptions.geometry`) here; the third, "slots" (vLLM's
    buffer on one range), is `integrations.vllm.slot_tensors.SlotVmmKVCache`:

    - "per_group": one virtual range per KV-cache group; a large page of ``k``
      chunks holds ``B`` whole blocks of every layer of the group, layer-compact inside
      the page (`integrations.vllm.placement`), so one live block pins ``k`` chunks, not
      ``k`` chunks per layer. vLLM's `create_kv_cache_views` builds the per-layer views
      with ``layer_stride = B*S`` and ``block_stride = S`` over the range; the manager
      hands vLLM spread ids (page ``q`` starts at id ``q*M``), so any epsilon tail and a
      padded Mamba state stride keep every view uniform.
    - "per_layer": one range per layer holding ``capacity + 1`` blocks of the group's
      *unpadded* page, block ``b`` at byte ``b * page`` — a contiguous per-layer tensor
      for kernels that need one — and a large page is ``k`` chunks in each layer range.

    Either way the last id is the group's null block (zero-backed where the backend has
    a zero chunk). Where a large page lives in the ranges is
    `integrations.kvcache.geometry.GroupGeometry` (built by
    `integrations.vllm.layout.JengaLayout.geometries`), and page plans become range
    plans through `integrations.kvcache.translate` — the one translator of the project,
    so an evicted page's chunks are remapped to the page that reuses them.

    Two ways to drive the mapping (`apply_scheduler_output` picks):

    - `apply_plan` with the scheduler's `jenga.plan.MappingPlan` s (maps *and* unmaps),
      which `JengaScheduler` attaches to every `SchedulerOutput` it sends, in or out of
      process;
    - `ensure_mapped` / `map_for_scheduler_output` with the block ids a
      `SchedulerOutput` carries, for outputs without plans: pages are mapped as their
      block ids first appear and never unmapped.

Limitations
    per_layer supports only groups whose large page has no tail (exact LCM, ``epsilon``
    small enough or page sizes dividing the chunk) and layer-compact layouts
    (``LBHNC``/``LBNHC``); per_group any layout with L and B outermost (`UnsupportedLayout`
    otherwise). Unmapping a page while a previous step's kernels may still read it
    relies on steps running in order on the worker (the plan for step N + 1 is applied
    after step N was launched; on CUDA, `cuMemUnmap` of memory in use by queued kernels
    is not synchronised by us — untested on a GPU). Kernel-block splitting follows
    vLLM's rules for dense pages (per_group attention strides are the dense page).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from jenga.plan import MapPage, MappingPlan

import vmm
from integrations.kvcache.geometry import GroupGeometry
from integrations.kvcache.translate import page_units, translate
from integrations.vllm.compat import KVCacheTensor, create_kv_cache_views
from integrations.vllm.errors import JengaVllmError
from integrations.vllm.layout import GroupLayout, JengaLayout
from integrations.vllm.options import TensorGeometry

if TYPE_CHECKING:
    import torch

    from integrations.vllm.compat import (
        KVCacheConfig,
        KVCacheLayout,
        KVCacheSpec,
        SchedulerOutput,
    )

_LAYER_COMPACT = ("LBHNC", "LBNHC")


class UnsupportedLayout(JengaVllmError, NotImplementedError):
    """A group or KV layout the VMM tensor path cannot place block by block."""


class ScheduledCache:
    """How a worker-side KV cache follows the scheduler: plans, else block ids."""

    @staticmethod
    def check_pool(pool: vmm.ChunkPool, layout: JengaLayout) -> None:
        """Refuse a pool whose chunk is not the layout's exchange unit (`UnsupportedLayout`)."""
        if pool.granularity != layout.options.chunk_bytes:
            raise UnsupportedLayout(
                f"pool granularity {pool.granularity} B != jenga chunk_bytes "
                f"{layout.options.chunk_bytes} B"
            )

    def apply_plan(self, plan: MappingPlan) -> None:
        raise NotImplementedError

    def ensure_mapped(self, block_ids: Sequence[Iterable[int]]) -> int:
        raise NotImplementedError

    def apply_scheduler_output(self, scheduler_output: SchedulerOutput) -> int:
        """Before a step: apply the plans the scheduler attached (maps and unmaps), or,
        from a scheduler that attached none, map the pages of the step's block ids.

        Returns the number of plan ops applied / pages mapped.
        """
        plans = getattr(scheduler_output, "jenga_vmm_plans", None)
        if plans is None:
            return self.map_for_scheduler_output(scheduler_output)
        for plan in plans:
            self.apply_plan(plan)
        return sum(len(p) for p in plans)

    def map_for_scheduler_output(self, scheduler_output: SchedulerOutput) -> int:
        """`ensure_mapped` for every block id a vLLM `SchedulerOutput` hands the worker."""
        total = 0
        for new in scheduler_output.scheduled_new_reqs:
            total += self.ensure_mapped(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for ids in getattr(cached, "new_block_ids", ()):
            if ids is not None:
                total += self.ensure_mapped(ids)
        return total


class VmmKVCache(ScheduledCache):
    """VMM ranges (per group or per layer) and vLLM views for one `KVCacheConfig`.

    Invariant: a page is in ``mapped_pages[g]`` exactly when its chunk slots are mapped
    in every range of group g (``group_ranges[g]``).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        layout: JengaLayout,
        pool: vmm.ChunkPool,
        kv_cache_layout: KVCacheLayout,
        kernel_block_sizes: Sequence[int] | None = None,
    ) -> None:
        geometry = layout.options.tensor_geometry
        if not geometry.on_vmm_ranges:
            raise UnsupportedLayout(
                "the layout uses pages='vllm' (vLLM's shared block "
                "slots); VMM tensors need pages='vmm' (set kv_tensors='vmm')"
            )
        self.check_pool(pool, layout)
        per_group = geometry is TensorGeometry.PER_GROUP
        if per_group and not kv_cache_layout.is_block_compact:
            raise UnsupportedLayout(
                f"KV cache layout {kv_cache_layout.name} keeps heads outside blocks; the "
                "per_group geometry needs L and B outermost (LBHNC, LBNHC, BLHNC, BLNHC)"
            )
        if not per_group and kv_cache_layout.name not in _LAYER_COMPACT:
            raise UnsupportedLayout(
                f"KV cache layout {kv_cache_layout.name} is not layer-compact; "
                f"supported: {_LAYER_COMPACT}"
            )
        for g in layout.groups:
            if g.pages.tail_bytes and not per_group:
                raise UnsupportedLayout(
                    f"group {g.name!r}: its large page leaves a {g.pages.tail_bytes} B tail, so "
                    "block b is not at b * page; use jenga_vmm.epsilon=0 (exact LCM) or "
                    "geometry='per_group'"
                )
        self.layout = layout
        self.pool = pool
        self.geometries: tuple[GroupGeometry, ...] = layout.geometries()
        self.ranges: dict[str, vmm.VirtualRange] = {}  # by layer (per_layer) / group name
        self.group_ranges: list[list[vmm.VirtualRange]] = [[] for _ in layout.groups]
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.mapped_pages: list[set[int]] = [set() for _ in layout.groups]
        specs = [grp.kv_cache_spec for grp in kv_cache_config.kv_cache_groups]
        for g, spec in zip(layout.groups, specs, strict=True):
            kernel = kernel_block_sizes[g.index] if kernel_block_sizes else None
            if g.placement is not None:
                self._build_group_range(g, spec, kv_cache_layout, kernel)
            else:
                self._build_layer_ranges(g, spec, kv_cache_layout, kernel)

    def _reserve(self, g: GroupLayout, name: str, size: int) -> vmm.VirtualRange:
        zero = self.pool.backend.zero_handle is not None
        rng = self.pool.reserve(size, zero_backed=zero, name=name)
        self.ranges[name] = rng
        self.group_ranges[g.index].append(rng)
        return rng

    def _build_layer_ranges(
        self, g: GroupLayout, spec: KVCacheSpec, kv_layout: KVCacheLayout, kernel: int | None
    ) -> None:
        """per_layer: a range per layer, block b at ``b * page`` (vLLM's per-layer tensor)."""
        import torch

        geometry = self.geometries[g.index]
        size = geometry.range_bytes + geometry.page_bytes  # + the null block's page
        dense = replace(spec, page_size_padded=None)
        for name in g.layer_names:
            raw = self._reserve(g, name, size).tensor((size,), torch.int8)
            placement = KVCacheTensor(
                size=size, layers=[name], layer_stride=size, block_stride=g.page_bytes
            )
            (view,) = create_kv_cache_views(
                raw, dense, g.capacity + 1, kv_layout, placement, kernel
            )
            self.kv_caches[name] = view

    def _build_group_range(
        self, g: GroupLayout, spec: KVCacheSpec, kv_layout: KVCacheLayout, kernel: int | None
    ) -> None:
        """per_group: one range; layer l of vLLM id v at ``l * B*S + v * S``
        (`integrations.vllm.placement`), viewed by vLLM's own `create_kv_cache_views`."""
        import torch

        place = g.placement
        assert place is not None
        geometry = self.geometries[g.index]
        size = geometry.range_bytes + geometry.page_bytes  # + the page of the null ids
        raw = self._reserve(g, g.name, size).tensor((size,), torch.int8)
        tensor = KVCacheTensor(
            size=size,
            layers=list(g.layer_names),
            layer_stride=place.layer_stride,
            block_stride=place.stride,
        )
        dense = replace(spec, page_size_padded=None)
        views = create_kv_cache_views(raw, dense, g.capacity + 1, kv_layout, tensor, kernel)
        self.kv_caches.update(zip(g.layer_names, views, strict=True))

    # -- mapping ---------------------------------------------------------------------
    def _group_ranges(self, g: GroupLayout) -> list[vmm.VirtualRange]:
        return self.group_ranges[g.index]

    def apply_plan(self, plan: MappingPlan) -> None:
        """Carry out one scheduler plan atomically; `MappingPlan.unmap_all` unmaps every
        page first (a prefix-cache reset), a ``resize_units`` moves the pool's budget after
        the ops (the manager's `set_capacity`); an empty plan does nothing."""
        if plan.reset:
            self._unmap_all()
        if len(plan):
            self._apply_ops(plan)
        if plan.resize_units is not None:
            self.pool.set_budget(plan.resize_units * self.pool.granularity)

    def _apply_ops(self, plan: MappingPlan) -> None:
        ranges = [self._group_ranges(g) for g in self.layout.groups]
        batch, _ = translate(plan, self.geometries, ranges)
        mapped = [set(s) for s in self.mapped_pages]
        for op in plan.ops:
            if isinstance(op, MapPage):
                mapped[op.group].add(op.page)
            else:
                mapped[op.group].discard(op.page)
        batch.apply(self.pool)
        self.mapped_pages = mapped

    def _unmap_all(self) -> None:
        batch = vmm.MappingPlan()
        for g, pages in zip(self.layout.groups, self.mapped_pages, strict=True):
            for page in sorted(pages):
                units = page_units(self.geometries[g.index], self._group_ranges(g), page)
                for rng, slot in units:
                    batch.unmap(rng, [slot])
        batch.apply(self.pool)
        self.mapped_pages = [set() for _ in self.layout.groups]

    def ensure_mapped(self, block_ids: Sequence[Iterable[int]]) -> int:
        """Map the pages holding these block ids (per group) if not yet; returns pages mapped.

        Null-block ids are skipped (their slots read the zero chunk when zero-backed).
        """
        batch = vmm.MappingPlan()
        added: list[tuple[int, int]] = []
        for g, ids in zip(self.layout.groups, block_ids, strict=True):
            geometry = self.geometries[g.index]
            per_page = geometry.blocks_per_page if g.placement is None else g.placement.ids_per_page
            want = {b // per_page for b in ids if 0 <= b < g.capacity}
            for page in sorted(want - self.mapped_pages[g.index]):
                for rng in self._group_ranges(g):
                    batch.map(rng, list(geometry.page_slots(page)))
                added.append((g.index, page))
        if added:
            batch.apply(self.pool)
            for g_index, page in added:
                self.mapped_pages[g_index].add(page)
        return len(added)

    # -- accounting -------------------------------------------------------------------
    def mapped_bytes(self) -> int:
        return sum(rng.num_mapped for rng in self.ranges.values()) * self.pool.granularity

    def check_invariants(self) -> None:
        for g, pages in zip(self.layout.groups, self.mapped_pages, strict=True):
            slots = {s for p in pages for s in self.geometries[g.index].page_slots(p)}
            for rng in self._group_ranges(g):
                mapped = {s for s, h in rng.slot_to_handle().items() if h >= 0}
                assert mapped == slots, (
                    f"{g.name}: mapped slots {sorted(mapped)} != {sorted(slots)}"
                )

    def close(self) -> None:
        for rng in self.ranges.values():
            rng.close()
        self.ranges.clear()
        self.group_ranges = [[] for _ in self.layout.groups]
