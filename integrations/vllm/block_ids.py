"""Allocator block ids → vLLM block ids and `KVCacheBlock` objects, one strategy per geometry.

Rationale
    A vLLM block id is made in one of three ways, fixed by the layout's
    `integrations.vllm.options.TensorGeometry`: a slot of vLLM's shared tensors, the
    allocator's own id, or the allocator's id spread over its page. The manager asks the
    same questions of each (the blocks of some block tables, the allocator block of a
    vLLM id, what a plan op changes); picking the answer once, at construction, keeps
    those questions free of geometry branches.

Approach
    `new_block_ids` picks the strategy:

    ==============  ====================================  ==============================
    geometry        vLLM id of allocator block ``b``      `KVCacheBlock` objects
    ==============  ====================================  ==============================
    SHARED_SLOTS    the page's slot (`SharedSlots`,       one per slot, made up front
    VMM_SLOTS       replaying the allocator's plan ops)   (as vLLM's `BlockPool`)
    PER_LAYER       ``b``                                 per group, made on first use
    PER_GROUP       ``q*M + j`` for ``b = q*B + j``       per group, made on first use
    ==============  ====================================  ==============================

    Objects are interned (one per id), so the scheduler's identity comparisons behave.
    On VMM ranges a group's ids span the whole pool and most are never used, so objects
    are made on first use; the last entry of each group's list (index `NULL_BLOCK` = -1)
    is the group's null block.

Limitations
    Only the shared-slot strategy sizes a block slot (`BlockIds.sizes_slots`), so only
    there can vLLM's ``reserved_blocks`` be honoured.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat

from jenga.allocator import NULL_BLOCK

from integrations.vllm.compat import KVCacheBlock
from integrations.vllm.layout import GroupLayout, JengaLayout
from integrations.vllm.options import TensorGeometry
from integrations.vllm.slot_chunks import ChunkRefs
from integrations.vllm.slots import SharedSlots

PlanKeys = list[tuple[int, int, int, int]]
"""The core's raw plan ops ``(kind, group, page, reused_units)`` (`jenga.plan`)."""


class BlockIds:
    """The vLLM side of block ids for one layout (see the module note).

    ``shares_block_ids``: ids are unique across groups (vLLM's slots); ``sizes_slots``:
    a vLLM block slot has a size, so free slots can be reserved for others.
    """

    shares_block_ids = False
    sizes_slots = False

    def __init__(self, layout: JengaLayout) -> None:
        self.layout = layout
        self.null_blocks = tuple(KVCacheBlock(g.null_block_id, is_null=True) for g in layout.groups)

    def rows(self, tables: Sequence[Sequence[int]]) -> tuple[list[KVCacheBlock], ...]:
        """Per group the blocks of these allocator block ids (`NULL_BLOCK`: the null block)."""
        raise NotImplementedError

    def allocator_block(self, group: int, vllm_id: int) -> int:
        """The allocator block of group ``group`` that vLLM block ``vllm_id`` names."""
        raise NotImplementedError

    def apply_keys(self, keys: PlanKeys) -> None:
        """Follow the allocator's plan ops (only slots move with them)."""

    def reset(self) -> None:
        """The allocator was replaced by an empty one: forget every mapping."""

    def check_invariants(self, used_units: int) -> None:
        """Raise AssertionError when the ids disagree with the allocator's used units."""


class SlotBlockIds(BlockIds):
    """vLLM's shared tensors: each mapped allocator page is one of vLLM's block slots."""

    shares_block_ids = True
    sizes_slots = True

    def __init__(self, layout: JengaLayout) -> None:
        super().__init__(layout)
        self.num_slots = layout.groups[0].capacity
        self.slots = SharedSlots(len(layout.groups), self.num_slots, num_pages=self.num_slots)
        # every slot's object up front, as vLLM's `BlockPool` makes them (index = slot)
        self.objects = [KVCacheBlock(i) for i in range(self.num_slots)]

    def rows(self, tables: Sequence[Sequence[int]]) -> tuple[list[KVCacheBlock], ...]:
        objects = self.objects
        out: list[list[KVCacheBlock]] = []
        for g, ids in enumerate(tables):
            slot_of = self.slots.slot_of[g]  # one block per page: the page's vLLM slot
            null = self.null_blocks[g]
            out.append([null if b == NULL_BLOCK else objects[slot_of[b]] for b in ids])
        return tuple(out)

    def allocator_block(self, group: int, vllm_id: int) -> int:
        return self.slots.page(group, vllm_id)

    def apply_keys(self, keys: PlanKeys) -> None:
        self.slots.apply_keys(keys)

    def reset(self) -> None:
        self.slots = SharedSlots(len(self.layout.groups), self.num_slots, num_pages=self.num_slots)

    def check_invariants(self, used_units: int) -> None:
        self.slots.check_invariants()
        assert self.slots.num_mapped == used_units, (
            f"{self.slots.num_mapped} slots mapped, the allocator uses {used_units} units"
        )


class VmmSlotBlockIds(SlotBlockIds):
    """The "slots" VMM geometry: vLLM's block slots, and per chunk of the range the
    mapped slots touching it (`integrations.vllm.slot_chunks.ChunkRefs`), so
    `committed_bytes` is what the worker's range maps."""

    def __init__(self, layout: JengaLayout) -> None:
        super().__init__(layout)
        self._track()

    def _track(self) -> None:
        assert self.layout.slot_chunks is not None
        self.chunks = ChunkRefs(self.layout.slot_chunks)
        self.slots.listener = self.chunks.change

    @property
    def committed_bytes(self) -> int:
        """Bytes of the chunks mapped slots (and the null slot) touch."""
        return self.chunks.committed_bytes

    def reset(self) -> None:
        super().reset()
        self._track()

    def check_invariants(self, used_units: int) -> None:
        super().check_invariants(used_units)
        tables, _ = self.slots.state()
        self.chunks.check(s for t in tables for s in t.values())


class RangeBlockIds(BlockIds):
    """VMM ranges, per_layer geometry: vLLM's ids are the allocator's (per group)."""

    def __init__(self, layout: JengaLayout) -> None:
        super().__init__(layout)
        # per group, indexed by allocator block (whose vLLM id never changes)
        self.objects: list[list[KVCacheBlock | None]] = [
            [None] * g.capacity + [null]
            for g, null in zip(layout.groups, self.null_blocks, strict=True)
        ]

    def rows(self, tables: Sequence[Sequence[int]]) -> tuple[list[KVCacheBlock], ...]:
        return tuple(self._row_of(g, ids) for g, ids in enumerate(tables))

    def _row_of(self, g: int, ids: Sequence[int]) -> list[KVCacheBlock]:
        """Group ``g``'s blocks: one list lookup per block."""
        objects = self.objects[g]
        row = [objects[b] for b in ids]
        if not all(map(operator.is_not, row, repeat(None))):  # `in` would call __eq__
            for i, b in enumerate(ids):
                if row[i] is None:
                    row[i] = objects[b] = self._new_block_object(g, b)
        return row  # every entry is now an object

    def _new_block_object(self, g: int, block: int) -> KVCacheBlock:
        """The object of allocator block ``block`` of group ``g``, made on first use and
        kept (the memory benchmark counts these apart)."""
        return KVCacheBlock(self.vllm_id(self.layout.groups[g], block))

    def vllm_id(self, group: GroupLayout, block: int) -> int:
        """vLLM block id of allocator block ``block``: the same id."""
        return block

    def allocator_block(self, group: int, vllm_id: int) -> int:
        return vllm_id


class SpreadBlockIds(RangeBlockIds):
    """VMM ranges, per_group geometry: page ``q`` of a group starts at vLLM id ``q*M``
    (`integrations.vllm.placement.GroupPlacement`)."""

    def vllm_id(self, group: GroupLayout, block: int) -> int:
        return group.vllm_id(block)

    def allocator_block(self, group: int, vllm_id: int) -> int:
        return self.layout.groups[group].allocator_block(vllm_id)


_STRATEGIES: dict[TensorGeometry, type[BlockIds]] = {
    TensorGeometry.SHARED_SLOTS: SlotBlockIds,
    TensorGeometry.VMM_SLOTS: VmmSlotBlockIds,
    TensorGeometry.PER_LAYER: RangeBlockIds,
    TensorGeometry.PER_GROUP: SpreadBlockIds,
}


def new_block_ids(layout: JengaLayout) -> BlockIds:
    """The block-id strategy of the layout's geometry."""
    return _STRATEGIES[layout.options.tensor_geometry](layout)
