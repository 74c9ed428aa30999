"""KVCache: jenga decides, vmm maps, and every layer's cache is one contiguous tensor.

Rationale
    A serving engine wants, per layer, an ordinary tensor its attention kernel reads
    through a block table, yet physical memory should back only the blocks the
    allocator handed out, and move between layer types (full, sliding window, Mamba...)
    as the mix of requests changes. This object owns the virtual ranges of every group,
    runs the `jenga` allocator, and applies each plan it returns through `vmm`, so that
    at any moment the chunks mapped are exactly the allocator's large pages.

Approach (per_layer layout, see `integrations.kvcache.geometry`)
    ::

        engine ── add_request / allocate / free ──► KVCache ──► JengaAllocator (ints)
                                                      │ page plan
                                                      ▼ translate (remap = reuse chunks)
                                                    vmm.MappingPlan ──► ChunkPool / ranges
        kernels ◄── layer_view(l): [pages, B, (2,) block_size, H, D] over range of layer l

    * One range per layer (K and V fused: block = ``[2, block_size, H, D]``, FlashInfer's
      NHD order), or two (kv_split: K and V ranges of ``[block_size, H, D]`` blocks, the
      flash-attn / vLLM order). Mamba / vision groups: one tensor per layer.
    * Every allocator call that returns a plan is applied at once; `mapped_pages` mirrors
      the pages the allocator holds, and `check_invariants` proves slots == pages.

Limitations
    If the backend fails (OS out of memory) after the allocator committed an allocation,
    the vmm plan rolls back but the allocator cannot; the cache is then marked broken
    and raises `KVCacheBroken` on further use. The cache object itself is single-threaded
    (one scheduler thread calls it; the overlap worker maps through the pool, whose calls
    are thread-safe); a call that changes it, entered while another thread is inside one,
    raises `vmm.ConcurrentUse` before touching anything (`_one_thread`). Arguments (token
    counts, token ids) are checked strictly (`vmm.checks`). Reserved but unmapped slots are
    zero-backed by default: a stray read gives zeros, a stray write through a raw
    `layer_view`/`block_view` still faults; `block` is the checked per-block view.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from jenga.allocator import (
    Allocation,
    AllocationOrder,
    AllocatorConfig,
    ImageSpan,
    JengaAllocator,
)
from jenga.guard import Entry, one_thread_guard
from jenga.pages import PageTable, capacity_units, vmm_page_table
from jenga.plan import MapPage
from jenga.plan import MappingPlan as PagePlan
from jenga.requests import BlockCopy
from jenga.specs import Kind, ModelSpec
from vmm.checks import as_index, as_indices
from vmm.errors import ClosedError, ConcurrentUse, MappingError, VmmError
from vmm.extras import require
from vmm.plan import MappingPlan
from vmm.pool import ChunkPool
from vmm.range import VirtualRange

from integrations.kvcache.geometry import GroupGeometry, LayoutError
from integrations.kvcache.translate import translate

if TYPE_CHECKING:
    import torch

    from integrations.kvcache.overlap import OverlapWorker
    from integrations.kvcache.tier import HostTier, HostTierConfig


def _dtype_and_itemsize(dtype: Any) -> tuple[torch.dtype, int]:
    """`dtype` (float16 when None) and its bytes per element: the first use of torch."""
    require("torch", "a KV cache (integrations.kvcache.KVCache)")
    import torch

    resolved = dtype or torch.float16
    return resolved, torch.empty((), dtype=resolved).element_size()


class KVCacheBroken(VmmError):
    """A backend failure left the allocator ahead of the mapped memory; the cache is unusable."""


class UnmappedBlockError(MappingError):
    """A checked view or write names a block whose large page is not mapped."""


@dataclass(frozen=True)
class KVCacheConfig:
    """How the cache is laid out. `dtype` is a torch dtype (its size must match the specs)."""

    dtype: Any = None  # torch.dtype; None: torch.float16
    kv_split: bool = False
    epsilon: float = 0.01
    order: AllocationOrder = AllocationOrder.PAPER
    #: back reserved but unmapped slots with the read-only zero chunk (reads give zeros, a
    #: stray read never faults); None: whenever the backend has a zero chunk
    zero_backed: bool | None = None
    layout: str = "per_layer"  # or "per_group" (one range per group, strided layer views)
    #: the most bytes `KVCache.set_capacity` may grow to (virtual ranges are reserved for
    #: it, at no physical cost); None: the pool's budget when the cache is made
    max_bytes: int | None = None
    #: a second tier in host memory for blocks leaving the GPU (`integrations.kvcache.tier`)
    tier: HostTierConfig | None = None


_F = TypeVar("_F", bound=Callable[..., Any])
# `KVCache.stats` counters besides the pool's and the allocator's
_COUNTERS = (
    "kv.plans",
    "kv.remapped_units",
    "kv.pages.mapped",
    "kv.pages.unmapped",
    "overlap.plans.async",
    "overlap.plans.sync",
    "kv.cow.blocks",
    "kv.cow.bytes",
)


_one_thread = one_thread_guard(ConcurrentUse, "a KVCache")
"""A `KVCache` call that changes it, run as the only such call in progress: another thread
entering while one is inside raises `ConcurrentUse` at once (interleaved calls would apply
their plans out of order: a map before the unmap that frees its units)."""


class KVCache:
    """Per-layer KV tensors over vmm ranges, mapped as the jenga allocator decides.

    Invariants (`check_invariants`): for every group and range, a slot is mapped iff its
    large page is in `mapped_pages[g]`; pool mapped chunks == allocator used units.
    """

    def __init__(
        self, model: ModelSpec, pool: ChunkPool, config: KVCacheConfig | None = None
    ) -> None:
        self.config = config or KVCacheConfig()
        self.dtype, self.itemsize = _dtype_and_itemsize(self.config.dtype)
        self.model = model
        self.pool = pool
        total_units = capacity_units(pool.budget_bytes, pool.granularity)
        max_bytes = self.config.max_bytes
        self.max_units = (
            total_units if max_bytes is None else capacity_units(max_bytes, pool.granularity)
        )
        if self.max_units < total_units:
            raise LayoutError(
                f"max_bytes {max_bytes} is below the pool's budget of {pool.budget_bytes} B"
            )
        self.page_table: PageTable = vmm_page_table(
            model,
            chunk_bytes=pool.granularity,
            epsilon=self.config.epsilon,
            kv_split=self.config.kv_split,
            budget_bytes=pool.budget_bytes,
            layout=self.config.layout,
        )
        self.allocator = JengaAllocator(
            AllocatorConfig.from_page_table(model, self.page_table, total_units, self.config.order)
        )
        self.geometries = tuple(
            GroupGeometry.from_row(
                i, g, self.page_table.group(g.name), pool.granularity, self.max_units
            )
            for i, g in enumerate(model.groups)
        )
        self._check_dtype()
        self.ranges: tuple[tuple[VirtualRange, ...], ...] = self._reserve_all()
        # A layer id in several groups (a Hymba/Falcon-H1 layer with attention and Mamba, an
        # encoder's layer 0 beside the decoder's) resolves to the target model's attention group.
        self._layer_to_group: dict[int, int] = {}
        for geo in sorted(self.geometries, key=lambda geo: self._lookup_rank(geo.index)):
            for layer in geo.layer_ids:
                self._layer_to_group.setdefault(layer, geo.index)
        for g in model.groups:
            for reader, owner in g.readers:
                self._layer_to_group[reader] = self._layer_to_group[owner]
        self._reader_to_owner = {r: o for g in model.groups for r, o in g.readers}
        self.mapped_pages: list[set[int]] = [set() for _ in self.geometries]
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._broken = False
        self._closed = False
        self._entry = Entry()  # held by the thread inside a `_one_thread` call
        self._worker: OverlapWorker | None = None
        self._ahead_async: list[tuple[PagePlan, MappingPlan, int]] = []
        self._ahead_sync: list[tuple[PagePlan, MappingPlan, int]] = []
        self.tier: HostTier | None = None
        if self.config.tier is not None:
            self._make_tier(self.config.tier)

    # ---- construction helpers ----------------------------------------------------------
    def _make_tier(self, config: HostTierConfig) -> None:
        from integrations.kvcache.tier import HostTier

        try:
            self.tier = HostTier(self, config)
        except BaseException:
            self.close()
            raise

    def _lookup_rank(self, group: int) -> tuple[bool, bool]:
        spec = self.model.groups[group].spec
        return (spec.model != "target", spec.kind is Kind.MAMBA)

    def _check_dtype(self) -> None:
        for g in self.model.groups:
            spec = g.spec
            if spec.kind is not Kind.MAMBA and spec.dtype_bytes != self.itemsize:
                raise LayoutError(
                    f"group {g.name!r} stores {spec.dtype_bytes}-byte elements, the cache "
                    f"dtype {self.dtype} has {self.itemsize}"
                )

    def _reserve_all(self) -> tuple[tuple[VirtualRange, ...], ...]:
        """Every group's ranges; all or nothing: a failed reserve closes the earlier ones."""
        reserved: list[VirtualRange] = []
        try:
            return tuple(self._reserve_group(geo, reserved) for geo in self.geometries)
        except BaseException:
            for rng in reversed(reserved):
                rng.close()
            raise

    def _reserve_group(
        self, geo: GroupGeometry, reserved: list[VirtualRange]
    ) -> tuple[VirtualRange, ...]:
        names = ("k", "v") if geo.tensors_per_layer == 2 else ("kv",)
        if geo.layers_per_block > 1:
            labels = [f"{geo.name}.{n}" for n in names]
        else:
            labels = [f"{geo.name}.L{layer}.{n}" for layer in geo.layer_ids for n in names]
        for label in labels:
            zero = self.config.zero_backed
            if zero is None:
                zero = self.pool.backend.zero_handle is not None
            reserved.append(self.pool.reserve(geo.range_bytes, zero_backed=zero, name=label))
        return tuple(reserved[-len(labels) :])

    # ---- allocator front -----------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("KV cache used after close(); nothing was allocated")
        if self._broken:
            raise KVCacheBroken("a backend failure left this KV cache inconsistent; rebuild it")

    @_one_thread
    def add_request(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        *,
        images: Sequence[ImageSpan] = (),
        salt: int = 0,
        use_cache: bool = True,
    ) -> int:
        """Register a request; returns its prefix-cache hit in tokens (no memory needed)."""
        self._check_usable()
        prompt = as_indices(prompt, "prompt")
        return self.allocator.add_request(
            request_id, prompt, images=images, salt=salt, use_cache=use_cache
        )

    @_one_thread
    def allocate(self, request_id: Hashable, num_new_tokens: int) -> Allocation | None:
        """Slots for `num_new_tokens` more tokens in every group, mapped; None: no room."""
        self._check_usable()
        num_new_tokens = as_index(num_new_tokens, "num_new_tokens")
        got = self.allocator.allocate(request_id, num_new_tokens)
        if got is not None:
            self._offload_evicted()
            self._apply(got.plan)
            self.copy_blocks(got.copies)
        return got

    @_one_thread
    def fork(self, parent_id: Hashable, child_ids: Sequence[Hashable]) -> None:
        """Children of a live request that share its blocks (`JengaAllocator.fork`): no
        page is mapped and no byte copied; each holder's next `allocate` copies the one
        block the next token writes into while it is still shared (`copy_blocks`)."""
        self._check_usable()
        self.allocator.fork(parent_id, child_ids)

    @_one_thread
    def copy_blocks(self, copies: Sequence[BlockCopy]) -> int:
        """Perform copy-on-writes (`Allocation.copies`; `allocate` does it itself,
        `allocate_ahead` leaves it to the caller after `sync`): in every range of the
        group, the bytes of block ``src`` (all its layers) into ``dst``. Both pages must
        be mapped (`UnmappedBlockError`, checked before any byte moves). Returns the bytes
        copied."""
        import torch

        self._check_usable()
        for c in copies:
            geo = self.geometries[c.group]
            self._check_block(geo, c.src)
            self._check_block(geo, c.dst)
        copied = 0
        for c in copies:
            geo = self.geometries[c.group]
            size = geo.small_page_bytes
            src, dst = geo.block_offset(c.src), geo.block_offset(c.dst)
            for rng in self.ranges[c.group]:
                rng.tensor((size,), torch.uint8, dst).copy_(rng.tensor((size,), torch.uint8, src))
                copied += size
        self._counters["kv.cow.blocks"] += len(copies)
        self._counters["kv.cow.bytes"] += copied
        return copied

    @_one_thread
    def free(self, request_id: Hashable) -> None:
        """Finish a request; its uncached pages are unmapped (chunks back to the pool)."""
        self._check_usable()
        self._apply(self.allocator.free(request_id))
        if self.tier is not None:
            self.tier.forget(request_id)

    @_one_thread
    def evict_cached(self, num_units: int) -> int:
        """Evict prefix-cache pages until `num_units` chunks are unmapped (or none is left,
        see `JengaAllocator.evict_cached`); returns the chunks unmapped."""
        self._check_usable()
        plan = self.allocator.evict_cached(num_units)
        self._offload_evicted()
        self._apply(plan)
        groups = self.allocator.config.groups
        return sum(groups[op.group].units_per_large_page for op in plan.ops)

    @_one_thread
    def uncache_blocks(self, group: int | str, blocks: Sequence[int]) -> None:
        """Drop ``blocks`` of ``group`` from the prefix cache (their data is bad; see
        `JengaAllocator.uncache_blocks`): cached ones turn free, held ones lose their
        identity."""
        self._check_usable()
        self._apply(self.allocator.uncache_blocks(group, blocks))

    @_one_thread
    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        self._check_usable()
        self.allocator.append_tokens(request_id, as_indices(token_ids, "token_ids"))

    @_one_thread
    def cache(self, request_id: Hashable, num_computed_tokens: int) -> int:
        """Offer the request's complete blocks to the prefix cache (see JengaAllocator.cache)."""
        got = self.allocator.cache(request_id, num_computed_tokens)
        if self.tier is not None and got:
            self.tier.note_cached(request_id)
        return got

    def block_table(self, request_id: Hashable, group: int | str) -> list[int]:
        return self.allocator.block_table(request_id, group)

    def num_tokens(self, request_id: Hashable) -> int:
        return self.allocator.num_tokens(request_id)

    def _offload_evicted(self) -> None:
        """Blocks the last allocator call evicted go to the host tier (before its plan)."""
        if self.tier is not None:
            self.tier.after_evicting()

    def _apply(self, plan: PagePlan) -> None:
        if not plan:
            return
        vmm_plan, remapped = translate(plan, self.geometries, self.ranges)
        self._apply_translated(plan, vmm_plan, remapped)

    def _apply_translated(self, plan: PagePlan, vmm_plan: MappingPlan, remapped: int) -> None:
        try:
            vmm_plan.apply(self.pool)
        except BaseException:
            self._broken = True
            raise
        for op in plan.ops:
            pages = self.mapped_pages[op.group]
            if isinstance(op, MapPage):
                pages.add(op.page)
                self._counters["kv.pages.mapped"] += 1
            else:
                pages.discard(op.page)
                self._counters["kv.pages.unmapped"] += 1
        self._counters["kv.plans"] += 1
        self._counters["kv.remapped_units"] += remapped

    # ---- overlap (see integrations.kvcache.overlap) ---------------------------------------
    @_one_thread
    def allocate_ahead(self, request_id: Hashable, num_new_tokens: int) -> Allocation | None:
        """Allocate now, map later: the plan waits for `launch_ahead` (map-only plans, on
        the worker) or `sync` (plans that unmap, and every plan after one). Call `sync`
        before any other call that touches memory."""
        self._check_usable()
        num_new_tokens = as_index(num_new_tokens, "num_new_tokens")
        got = self.allocator.allocate(request_id, num_new_tokens)
        self._offload_evicted()
        if got is not None and got.plan:
            vmm_plan, remapped = translate(got.plan, self.geometries, self.ranges)
            map_only = all(op.kind == "map" for op in vmm_plan.ops)
            if map_only and not self._ahead_sync:
                self._ahead_async.append((got.plan, vmm_plan, remapped))
            else:
                self._ahead_sync.append((got.plan, vmm_plan, remapped))
        return got

    @_one_thread
    def launch_ahead(self) -> None:
        """Hand the collected map-only plans to the overlap worker. Returns at once unless
        the worker still runs the previous batch: that is waited for first (a stall), so no
        plan is taken before the worker can accept it."""
        if not self._ahead_async:
            return
        if self._worker is not None:
            self._worker.wait()  # raises the previous batch's error, leaving these queued
        jobs, self._ahead_async = self._ahead_async, []
        if self._worker is None:
            from integrations.kvcache.overlap import OverlapWorker

            for geo in self.geometries:  # build every view now: none is made mid-job
                for layer in geo.layer_ids:
                    for tensor in range(geo.tensors_per_layer):
                        self.layer_view(layer, tensor)
            self._worker = OverlapWorker()

        def run() -> None:
            for job in jobs:
                self._apply_translated(*job)

        self._counters["overlap.plans.async"] += len(jobs)
        self._worker.launch(run)

    @_one_thread
    def sync(self) -> None:
        """Wait for the worker (a stall if it is still mapping), then apply deferred plans."""
        if self._ahead_async:
            self.launch_ahead()
        if self._worker is not None:
            self._worker.wait()
        jobs, self._ahead_sync = self._ahead_sync, []
        for job in jobs:
            self._apply_translated(*job)
        self._counters["overlap.plans.sync"] += len(jobs)

    # ---- layers and tensors --------------------------------------------------------------
    def group_of(self, layer: int) -> GroupGeometry:
        """The geometry of the group holding `layer`'s cache (a KV reader: its owner's).

        A layer in several groups resolves to the target model's attention group; address
        its other caches by group index (`geometries`, `ranges`)."""
        if layer not in self._layer_to_group:
            raise KeyError(f"layer {layer} has no cache; layers: {sorted(self._layer_to_group)}")
        return self.geometries[self._layer_to_group[layer]]

    def _block_shape(self, geo: GroupGeometry) -> tuple[int, ...]:
        spec = self.model.groups[geo.index].spec
        if spec.kind is Kind.MAMBA:
            return (geo.layer_block_bytes // self.itemsize,)
        inner = (spec.block_size, spec.num_kv_heads, spec.head_dim)
        if spec.num_kv_tensors == 2 and geo.tensors_per_layer == 1:
            return (2, *inner)
        return inner

    def layer_view(self, layer: int, tensor: int = 0) -> torch.Tensor:
        """Paged view ``[max_pages, B, *block]`` of a layer's range (any tail is skipped).

        `tensor`: 0 (K, or fused KV), 1 (V with kv_split). Cached; zero-copy."""
        self._check_usable()
        layer = self._reader_to_owner.get(layer, layer)
        key = (layer, tensor)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._make_view(layer, tensor)
        return view

    def _make_view(self, layer: int, tensor: int) -> torch.Tensor:
        geo = self.group_of(layer)
        if not 0 <= tensor < geo.tensors_per_layer:
            raise LayoutError(f"layer {layer} has {geo.tensors_per_layer} tensors, not {tensor}")
        rng = self.ranges[geo.index][geo.range_index(layer, tensor)]
        block = self._block_shape(geo)
        block_elems = geo.small_page_bytes // self.itemsize
        inner_strides = _contiguous_strides(block)
        shape = (geo.max_pages, geo.blocks_per_page, *block)
        strides = (geo.page_bytes // self.itemsize, block_elems, *inner_strides)
        return rng.tensor(shape, self.dtype, geo.layer_offset(layer), strides)

    def block(self, layer: int, block: int, tensor: int = 0) -> torch.Tensor:
        """The one block `block` of `layer` (``[*block]``, zero-copy), checked: raises
        UnmappedBlockError, before touching memory, unless its large page is mapped. The
        safe way to fill or copy a block (a raw `layer_view` / `block_view` spans unmapped
        pages too, where a write faults)."""
        owner = self._reader_to_owner.get(layer, layer)
        geo = self.group_of(owner)
        page = self._check_block(geo, block)
        view = self.layer_view(owner, tensor)
        return view[page, block % geo.blocks_per_page]

    def _check_block(self, geo: GroupGeometry, block: object) -> int:
        """The page of `block`; raises unless it is an int of a mapped page."""
        if type(block) is not int:
            block = as_index(block, f"group {geo.name!r}: block")
        if not 0 <= block < geo.max_blocks:
            raise LayoutError(f"group {geo.name!r}: block {block} outside [0, {geo.max_blocks})")
        page = block // geo.blocks_per_page
        if page not in self.mapped_pages[geo.index]:
            raise UnmappedBlockError(
                f"group {geo.name!r}: block {block} is on page {page}, which is not mapped "
                f"({len(self.mapped_pages[geo.index])} of {geo.max_pages} pages are)"
            )
        return page

    def block_view(self, layer: int, tensor: int = 0) -> torch.Tensor:
        """``[max_blocks, *block]``: block b at ``b * p``; only when the group has no tail.

        A raw view of the whole range: reading an unmapped block gives zeros (zero-backed,
        the default), writing one faults (SIGSEGV on host). Index it with the block table's
        ids only, or use `block` (checked)."""
        geo = self.group_of(self._reader_to_owner.get(layer, layer))
        if not geo.uniform_blocks:
            raise LayoutError(
                f"group {geo.name!r}: large pages of {geo.page_bytes} B hold "
                f"{geo.blocks_per_page} blocks of {geo.small_page_bytes} B and a "
                f"{geo.tail_bytes} B tail; use layer_view (paged) instead"
            )
        return _merge_pages(self.layer_view(layer, tensor))

    # ---- accounting ----------------------------------------------------------------------
    def live_bytes(self) -> int:
        """Bytes of the blocks live requests hold (allocator used blocks x small pages)."""
        used = self.allocator.usage().used_blocks
        return sum(
            n * geo.small_page_bytes * geo.num_ranges
            for n, geo in zip(used, self.geometries, strict=True)
        )

    def stats(self) -> dict[str, int]:
        """Pool stats (`vmm.stats` keys) + allocator stats + ``kv.*`` counters."""
        out = self.pool.stats()
        out.update(self.allocator.stats())
        out.update(self._counters)
        if self._worker is not None:
            out.update(self._worker.stats)
        out["kv.bytes.live.current"] = self.live_bytes()
        if self.tier is not None:
            out.update(self.tier.stats())
        for geo, pages in zip(self.geometries, self.mapped_pages, strict=True):
            out[f"kv.bytes.mapped.{geo.name}"] = len(pages) * geo.page_bytes * geo.num_ranges
        return out

    # ---- capacity ------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Bytes of chunks the cache may map now (the allocator's units x chunk size)."""
        return self.allocator.total_units * self.pool.granularity

    @_one_thread
    def set_capacity(self, budget_bytes: int) -> int:
        """Grow or shrink the cache at run time: the pool's budget and the allocator's
        units move together. Returns the chunks a shrink unmapped (cached pages evicted).

        Growing raises the pool's budget, then the allocator's units, up to ``max_bytes``
        (`KVCacheConfig`; the ranges were reserved for it). Shrinking evicts cached pages
        first (step 3's order), then lowers both; below the chunks live requests hold it
        raises `jenga.errors.CapacityInUse` with nothing changed. Raises `LayoutError`
        above ``max_bytes``, `vmm.BudgetError` when the pool refuses.
        """
        self._check_usable()
        gran = self.pool.granularity
        units = capacity_units(as_index(budget_bytes, "budget_bytes"), gran)
        if units > self.max_units:
            raise LayoutError(
                f"capacity {units * gran} B is above the {self.max_units * gran} B this cache "
                "reserved (KVCacheConfig.max_bytes)"
            )
        if units >= self.allocator.total_units:
            self.pool.set_budget(units * gran)
            self.allocator.set_total_units(units)
            return 0
        plan = self.allocator.set_total_units(units)  # CapacityInUse: nothing changed
        self._offload_evicted()
        self._apply(plan)
        self.pool.set_budget(units * gran)
        groups = self.allocator.config.groups
        return sum(groups[op.group].units_per_large_page for op in plan.ops)

    @_one_thread
    def release_free_chunks(self) -> int:
        """Hand every free (unmapped) chunk back to the OS/device; returns how many. The
        capacity stays: a later allocation creates chunks again."""
        return self.pool.release_free()

    def check_invariants(self, *, expensive: bool = False) -> None:
        """Raise AssertionError if mapped slots and the allocator's pages disagree."""
        self.allocator.check_invariants(expensive)
        self.pool.check_invariants(expensive=expensive)
        if self.tier is not None:
            self.tier.check_invariants()
        usage = self.allocator.usage()
        assert self.pool.num_mapped == usage.used_units, (
            f"pool maps {self.pool.num_mapped} chunks, allocator uses {usage.used_units} units"
        )
        for geo, pages, rngs in zip(self.geometries, self.mapped_pages, self.ranges, strict=True):
            assert len(pages) == usage.mapped_pages[geo.index], (
                f"group {geo.name!r}: {len(pages)} pages mapped here, allocator has "
                f"{usage.mapped_pages[geo.index]}"
            )
            if not expensive:
                continue
            want = {s for p in pages for s in geo.page_slots(p)}
            for rng in rngs:
                got = set(rng.slot_to_handle())
                assert got == want, f"range {rng.name!r}: slots {sorted(got)} != {sorted(want)}"

    @_one_thread
    def close(self) -> None:
        """Close every range (chunks go back to the pool). The pool stays open. Every
        later call that allocates, frees or views raises ClosedError."""
        self._closed = True
        if self.tier is not None:
            self.tier.close()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self._views.clear()
        for rngs in self.ranges:
            for rng in rngs:
                rng.close()


def _merge_pages(view: torch.Tensor) -> torch.Tensor:
    """``[pages, B, *block]`` -> ``[pages*B, *block]`` without a copy (uniform block stride)."""
    shape = (view.shape[0] * view.shape[1], *view.shape[2:])
    return view.as_strided(shape, view.stride()[1:], view.storage_offset())


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))
