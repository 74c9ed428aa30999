"""The real Jenga allocator (`jenga.allocator.JengaAllocator`, C++ core) behind the sim protocol.

Rationale
    The simulator must measure the project's allocator, not a model of it. This adapter
    only translates: engine calls become `add_request` / `append_tokens` / `cache` /
    `allocate` / `free`, and the core's `usage()` becomes byte counts. No allocation
    decision is made here.

Approach
    Two configurations of the one core, differing only in the page table
    (`jenga.pages`):

        jenga_static  one buffer of large pages of lcm(all small pages) bytes, the page-
                      layer partition of the paper's Fig. 7b (pool unit = one large page);
        jenga_vmm     2 MiB chunks; group g's large page is k chunks per range (the
                      smallest k with a tail <= epsilon), chunks are the exchange unit.

    A third configuration is the MAX baseline of the paper's §4.4 (``max_page``): the
    same core with a static page table whose unit is the largest group block, every
    other group's block padded to it.

    Bytes: a block is charged its share of a large page (``large page bytes /
    blocks per large page``: its real bytes plus its share of a VMM tail or of MAX
    padding); live = blocks owned by requests, cached = evictable blocks. Committed =
    the whole buffer in static modes; mapped units (chunks) x unit bytes in VMM mode.

Limitations
    Image tokens are given to the core as an `ImageSpan` over the prompt positions they
    occupy, so full-attention groups allocate slots for those positions too (the core's
    LLaVA-style convention). For Llama 3.2 Vision, whose self-attention layers never see
    the image tokens, that is memory the model does not need, and the simulator counts
    it as waste (see docs/reproduction.md).
"""

from __future__ import annotations

from collections.abc import Callable

from jenga.allocator import AllocationOrder, AllocatorConfig, ImageSpan, JengaAllocator
from jenga.pages import PageTable, static_page_table, vmm_page_table
from jenga.sim.protocol import AllocatorSnapshot, RequestState
from jenga.specs import ModelSpec


class JengaCoreAllocator:
    """`SimAllocator` over one `JengaAllocator`; see the module note."""

    def __init__(
        self,
        name: str,
        model: ModelSpec,
        kv_bytes: int,
        table: PageTable,
        order: AllocationOrder = AllocationOrder.PAPER,
    ) -> None:
        self.name = name
        self.table = table
        self._unit_bytes = table.unit_bytes
        self._total_units = kv_bytes // table.unit_bytes
        self.core = JengaAllocator(
            AllocatorConfig.from_page_table(model, table, self._total_units, order)
        )
        # bytes a block is charged: its share of a large page (padding and tails included)
        self._page_bytes = [table.group(g.name).large_page_total_bytes for g in model.groups]
        self._blocks_per_page = [table.group(g.name).blocks_per_large_page for g in model.groups]
        self._group_names = [g.name for g in model.groups]
        self._known_tokens: dict[str, int] = {}

    @staticmethod
    def _images(state: RequestState) -> tuple[ImageSpan, ...]:
        image = state.image_tokens
        if not image:
            return ()
        return (ImageSpan(0, image, hash(tuple(state.tokens[:image]))),)

    def _sync_tokens(self, state: RequestState) -> None:
        """Tell the core the generated tokens that are computed (only those get hashed)."""
        known = self._known_tokens[state.req_id]
        if state.num_computed > known:
            self.core.append_tokens(state.req_id, state.tokens[known : state.num_computed])
            self._known_tokens[state.req_id] = state.num_computed

    def _commit(self, state: RequestState) -> None:
        self._sync_tokens(state)
        self.core.cache(state.req_id, min(state.num_computed, self.core.num_tokens(state.req_id)))

    def admit(self, state: RequestState) -> int:
        hit = self.core.add_request(state.req_id, state.tokens, images=self._images(state))
        self._known_tokens[state.req_id] = len(state.tokens)
        state.num_computed = hit
        return hit

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        self._commit(state)
        delta = num_tokens - self.core.num_tokens(state.req_id)
        if delta <= 0:
            return True
        return self.core.allocate(state.req_id, delta) is not None

    def release(self, state: RequestState) -> None:
        self._commit(state)
        self.core.free(state.req_id)
        del self._known_tokens[state.req_id]

    def snapshot(self) -> AllocatorSnapshot:
        use = self.core.usage()
        live = [self._charged(g, n) for g, n in enumerate(use.used_blocks)]
        cached = sum(self._charged(g, n) for g, n in enumerate(use.cached_blocks))
        units = use.used_units if self.table.mode == "vmm" else use.total_units
        return AllocatorSnapshot(
            capacity_bytes=use.total_units * self._unit_bytes,
            committed_bytes=units * self._unit_bytes,
            live_bytes=sum(live),
            cached_bytes=cached,
            group_live_bytes=dict(zip(self._group_names, live, strict=True)),
        )

    def _charged(self, group: int, num_blocks: int) -> int:
        return num_blocks * self._page_bytes[group] // self._blocks_per_page[group]

    def check_invariants(self) -> None:
        self.core.check_invariants(expensive=True)


def jenga_static(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """Paper-faithful Jenga: LCM large pages in one static buffer."""
    return JengaCoreAllocator(
        "jenga_static", model, kv_bytes, static_page_table(model, strategy="lcm")
    )


def max_page(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """MAX page (paper §4.4) on the Jenga core: every group block padded to the largest."""
    return JengaCoreAllocator("max_page", model, kv_bytes, static_page_table(model, strategy="max"))


def jenga_vmm(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """Jenga on VMM: 2 MiB chunks, per-group large pages within 1 % tail."""
    return JengaCoreAllocator("jenga_vmm", model, kv_bytes, vmm_page_table(model, epsilon=0.01))


def jenga_vmm_compact(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """Jenga on VMM with the compact step order (free slots of other requests first)."""
    return JengaCoreAllocator(
        "jenga_vmm_compact",
        model,
        kv_bytes,
        vmm_page_table(model, epsilon=0.01),
        AllocationOrder.COMPACT,
    )


FACTORIES: dict[str, Callable[[ModelSpec, int], JengaCoreAllocator]] = {
    "max_page": max_page,
    "jenga_static": jenga_static,
    "jenga_vmm": jenga_vmm,
    "jenga_vmm_compact": jenga_vmm_compact,
}
