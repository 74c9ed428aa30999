"""vLLM's KV buffer on one VMM range, mapped chunk by chunk (the "slots" geometry's worker).

Rationale
    With ``geometry="slots"`` the scheduler hands out vLLM's own block slots (the
    shared-slot allocator, `integrations.vllm.slots`), so vLLM's per-layer views must be
    exactly the ones vLLM builds over its torch buffer. Only the buffer changes: a VMM
    range in which a 2 MiB chunk is backed only while a mapped slot touches it.

Approach
    - One range of vLLM's backing allocation (`KVCacheConfig.kv_cache_tensors` all
      place their layers in one allocation of ``size`` bytes, groups aliasing from byte
      0), rounded up to a chunk. vLLM's own `create_kv_cache_views` views it per
      `KVCacheTensor`, as vLLM's ``allocate_kv_cache`` does over its ``torch.zeros``
      buffer, so every layer tensor has vLLM's shape and strides.
    - The scheduler's plans (the same `jenga.plan.MappingPlan` s the per_group worker
      replays) drive a `SharedSlots` replica, whose slot changes drive
      `integrations.vllm.slot_chunks.ChunkRefs`: a chunk whose count becomes positive is
      mapped, one whose count drops to 0 unmapped, in one range plan per scheduler plan
      (unmaps first). The replica gives every page the slot the scheduler's gives it
      (the same ops on the same free stack). The null slot 0's chunks stay mapped.
    - A scheduler that attaches no plans: `ensure_mapped` maps the chunks of the slots a
      `SchedulerOutput` names and never unmaps (as the per_group worker does).

Limitations
    A plan's ``resize_units`` (`JengaKVCacheManager.set_capacity`) counts slots here; the
    allocator enforces it and the pool keeps the cap's budget (the "slots" geometry
    refuses a shared pool, whose capacity is in chunks). A cache is driven either by
    plans or by block ids, not both. Unmapping chunks that queued kernels may still read
    relies on steps running in order on the worker, as for the other geometries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from jenga.plan import MappingPlan

import vmm
from integrations.vllm.compat import create_kv_cache_views
from integrations.vllm.kv_tensors import ScheduledCache, UnsupportedLayout
from integrations.vllm.layout import JengaLayout
from integrations.vllm.options import TensorGeometry
from integrations.vllm.slot_chunks import ChunkRefs
from integrations.vllm.slots import SharedSlots

if TYPE_CHECKING:
    import torch

    from integrations.vllm.compat import KVCacheConfig, KVCacheLayout


class SlotVmmKVCache(ScheduledCache):
    """vLLM's buffer on one VMM range, chunks mapped while a mapped slot touches them.

    Invariant: the range's mapped chunks are exactly those with a positive count in
    ``chunks``, whose counts are those of the slots ``slots`` maps plus slot 0.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        layout: JengaLayout,
        pool: vmm.ChunkPool,
        kv_cache_layout: KVCacheLayout,
        kernel_block_sizes: Sequence[int] | None = None,
    ) -> None:
        if layout.options.tensor_geometry is not TensorGeometry.VMM_SLOTS:
            raise UnsupportedLayout(
                f"SlotVmmKVCache serves geometry='slots', the layout has "
                f"{layout.options.tensor_geometry}"
            )
        assert layout.slot_chunks is not None
        self.check_pool(pool, layout)
        self.layout = layout
        self.pool = pool
        self.slot_chunks = layout.slot_chunks
        self.num_slots = layout.total_units + 1
        size = self.slot_chunks.num_chunks * pool.granularity
        zero = pool.backend.zero_handle is not None
        self.range = pool.reserve(size, zero_backed=zero, name="kv")
        self.ranges = {"kv": self.range}
        self.kv_caches = self._views(kv_cache_config, kv_cache_layout, kernel_block_sizes)
        self._record: list[tuple[int, bool]] = []
        self._ensured: set[int] = set()
        self._start()

    def _views(
        self,
        kv_cache_config: KVCacheConfig,
        kv_layout: KVCacheLayout,
        kernel_block_sizes: Sequence[int] | None,
    ) -> dict[str, torch.Tensor]:
        """vLLM's per-layer views over the range, built as vLLM's ``allocate_kv_cache``
        builds them over its buffer."""
        import torch

        buf = self.range.tensor((self.range.size,), torch.int8)[: self.slot_chunks.buffer_bytes]
        groups = list(kv_cache_config.kv_cache_groups)
        views: dict[str, torch.Tensor] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            gid = next(i for i, g in enumerate(groups) if tensor.layers[0] in g.layer_names)
            spec = groups[gid].kv_cache_spec
            if not getattr(spec, "has_layer_views", True):
                views.update((name, buf) for name in tensor.layers)
                continue
            kernel = (
                kernel_block_sizes[gid]
                if kernel_block_sizes and gid < len(kernel_block_sizes)
                else None
            )
            made = create_kv_cache_views(
                buf, spec, int(kv_cache_config.num_blocks), kv_layout, tensor, kernel
            )
            views.update(zip(tensor.layers, made, strict=True))
        return views

    def _start(self, null_mapped: bool = False) -> None:
        """A fresh replica: no page mapped, the null slot's chunks mapped (here, unless
        ``null_mapped`` says the range maps them already)."""
        self.slots = SharedSlots(len(self.layout.groups), self.num_slots, num_pages=self.num_slots)
        self._record.clear()
        self.chunks = ChunkRefs(self.slot_chunks, self._record)
        self.slots.listener = self.chunks.change
        if null_mapped:
            self._record.clear()
        else:
            self._flush()

    def _flush(self) -> None:
        """Carry the recorded chunk changes into the range (unmaps first), atomically;
        the record is emptied either way."""
        net: dict[int, bool] = {}
        first: dict[int, bool] = {}
        for chunk, now_mapped in self._record:
            first.setdefault(chunk, now_mapped)
            net[chunk] = now_mapped
        self._record.clear()
        changed = [c for c, m in net.items() if m == first[c]]  # the last op undid nothing
        unmap = sorted(c for c in changed if not net[c])
        new = sorted(c for c in changed if net[c])
        batch = vmm.MappingPlan()
        if unmap:
            batch.unmap(self.range, unmap)
        if new:
            batch.map(self.range, new)
        batch.apply(self.pool)

    # -- mapping ---------------------------------------------------------------------
    def apply_plan(self, plan: MappingPlan) -> None:
        """Carry out one scheduler plan atomically: `MappingPlan.unmap_all` unmaps every
        slot first (a prefix-cache reset); a bad op or a failed range plan changes
        nothing."""
        if plan.reset:
            self._unmap_all()
        if not len(plan):
            return
        self._record.clear()
        self.slots.apply(plan)  # SlotError: rolled back, the listener's counts too
        try:
            self._flush()
        except BaseException:
            self.slots.undo(plan)
            self._record.clear()
            raise

    def _unmap_all(self) -> None:
        keep = set(self.slot_chunks.chunks(0))
        mapped = sorted(self.chunks.mapped_chunks() - keep)
        if mapped:
            vmm.MappingPlan().unmap(self.range, mapped).apply(self.pool)
        self._ensured.clear()
        self._start(null_mapped=True)

    def ensure_mapped(self, block_ids: Sequence[Iterable[int]]) -> int:
        """Map the chunks of these slots (any group) if not yet; returns slots added.
        The null slot 0 and ids past the slots are skipped."""
        want = {b for ids in block_ids for b in ids if 0 < b < self.num_slots} - self._ensured
        if not want:
            return 0
        self._record.clear()
        for slot in sorted(want):
            self.chunks.change(slot, 1)
        try:
            self._flush()
        except BaseException:
            for slot in want:
                self.chunks.change(slot, -1)
            self._record.clear()
            raise
        self._ensured |= want
        return len(want)

    # -- accounting -------------------------------------------------------------------
    def mapped_bytes(self) -> int:
        return self.range.num_mapped * self.pool.granularity

    def check_invariants(self) -> None:
        mapped = {s for s, h in self.range.slot_to_handle().items() if h >= 0}
        assert mapped == self.chunks.mapped_chunks(), (
            f"range maps {sorted(mapped)}, counts say {sorted(self.chunks.mapped_chunks())}"
        )
        self.slots.check_invariants()
        tables, _ = self.slots.state()
        self.chunks.check([s for t in tables for s in t.values()] + sorted(self._ensured))

    def close(self) -> None:
        self.range.close()
        self.ranges.clear()
