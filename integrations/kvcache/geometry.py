"""Where a group's blocks live in its virtual ranges (per_layer layout), in integers.

Rationale
    `jenga` names memory as (group, large page, block); `vmm` as (range, slot). This
    module is the one place that converts between the two, so plan translation, tensor
    views and invariant checks agree on the arithmetic — including large pages whose
    chunk count leaves a tail (``k*C = B*p + tail``, e.g. a Mamba state).

Approach
    Group g owns ``num_ranges`` ranges (one per layer, or K and V apart with kv_split).
    Large page q of g occupies slots ``[q*k, (q+1)*k)`` of *every* range of g; its block
    ``j`` (block id ``q*B + j``) starts at byte ``q*k*C + j*p`` of each range::

        range of layer l:  | page 0: k chunks        | page 1: k chunks        | ...
                           | b0 | b1 | ... | bB-1 |t | bB | ...        |t |
                           ^ byte 0                  ^ k*C            (t = tail bytes)

    With a tail, block b is *not* at ``b*p``; views that need one uniform block stride
    (``[num_blocks, ...]``) exist only when the tail is 0 (`uniform_blocks`).
    A group may hold at most ``total_units // units_per_large_page`` pages at once (the
    allocator recycles page indices below its high-water mark), so that many pages of
    virtual space are reserved per range; virtual space costs no memory.

    per_group (the paper's page-layer partition on VMM): one range per group (two with
    kv_split); a block holds the block of *every* layer of the group, layer after layer,
    so a layer's view is strided (block stride = all layers' bytes)::

        range of group g:  | blk 0: L0 | L1 | ... | blk 1: L0 | L1 | ... |
                             ^ layer_offset(L1) = one layer's block bytes

Limitations
    per_request (vAttention rows) is a separate class (`integrations.kvcache.rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jenga.pages import GroupPages
from jenga.specs import KVGroup


class LayoutError(ValueError):
    """A view or offset the layout cannot provide (e.g. a uniform block view with a tail)."""


@dataclass(frozen=True)
class GroupGeometry:
    """Byte geometry of one group's ranges (all sizes in bytes, per range).

    The page shape (``k`` chunks, ``B`` blocks of ``p`` bytes and a tail per large page)
    is the page table's row itself (`jenga.pages.GroupPages`, the one record of it; the
    allocator's `GroupConfig` takes its unit counts from the same row); this object adds
    where the group's ranges are and how many pages they hold.
    """

    index: int
    name: str
    layer_ids: tuple[int, ...]
    tensors_per_layer: int  # 1 (fused K+V, or a single-tensor kind), 2 (K and V apart)
    chunk_bytes: int
    pages: GroupPages
    max_pages: int

    @classmethod
    def from_row(
        cls, index: int, group: KVGroup, row: GroupPages, chunk_bytes: int, total_units: int
    ) -> GroupGeometry:
        layers_per_block = row.layers_per_small_page
        per_layer = row.num_ranges * layers_per_block // group.num_layers
        if per_layer * group.num_layers != row.num_ranges * layers_per_block:
            raise LayoutError(
                f"group {group.name!r}: {row.num_ranges} ranges for {group.num_layers} layers"
            )
        return cls(
            index=index,
            name=group.name,
            layer_ids=group.layer_ids,
            tensors_per_layer=per_layer,
            chunk_bytes=chunk_bytes,
            pages=row,
            max_pages=total_units // row.units_per_large_page,
        )

    @property
    def chunks_per_page(self) -> int:
        """k: chunks one large page takes in each range."""
        return self.pages.chunks_per_range

    @property
    def blocks_per_page(self) -> int:
        """B: blocks one large page holds."""
        return self.pages.blocks_per_large_page

    @property
    def small_page_bytes(self) -> int:
        """p: one block in one range."""
        return self.pages.small_page_bytes

    @property
    def tail_bytes(self) -> int:
        return self.pages.tail_bytes

    @property
    def layers_per_block(self) -> int:
        """per_layer: 1; per_group: every layer of the group."""
        return self.pages.layers_per_small_page

    @property
    def num_ranges(self) -> int:
        return len(self.layer_ids) * self.tensors_per_layer // self.layers_per_block

    @property
    def layer_block_bytes(self) -> int:
        """One layer's share of a block (per_group: a block holds every layer's)."""
        return self.small_page_bytes // self.layers_per_block

    @property
    def page_bytes(self) -> int:
        """One large page in one range: k chunks."""
        return self.chunks_per_page * self.chunk_bytes

    @property
    def range_bytes(self) -> int:
        return self.max_pages * self.page_bytes

    @property
    def uniform_blocks(self) -> bool:
        """True when block b starts at ``b * p`` (no tail): one block stride everywhere."""
        return self.tail_bytes == 0

    @property
    def max_blocks(self) -> int:
        return self.max_pages * self.blocks_per_page

    def page_slots(self, page: int) -> range:
        """Slots of large page `page` in each of the group's ranges."""
        if not 0 <= page < self.max_pages:
            raise LayoutError(f"group {self.name!r}: page {page} outside [0, {self.max_pages})")
        k = self.chunks_per_page
        return range(page * k, (page + 1) * k)

    def block_offset(self, block: int) -> int:
        """Byte offset of block `block` in each range of the group."""
        page, j = divmod(block, self.blocks_per_page)
        if not 0 <= page < self.max_pages:
            raise LayoutError(
                f"group {self.name!r}: block {block} is on page {page}, outside "
                f"[0, {self.max_pages})"
            )
        return page * self.page_bytes + j * self.small_page_bytes

    def range_index(self, layer: int, tensor: int = 0) -> int:
        """Position of (layer, tensor) among the group's ranges."""
        if self.layers_per_block > 1:
            return tensor
        return self.layer_ids.index(layer) * self.tensors_per_layer + tensor

    def layer_offset(self, layer: int) -> int:
        """Byte offset of `layer`'s part inside each block (0 in per_layer)."""
        if self.layers_per_block == 1:
            return 0
        return self.layer_ids.index(layer) * self.layer_block_bytes
