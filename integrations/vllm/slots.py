"""Jenga page ids → vLLM's shared block slots (the ``pages="vllm"`` geometry).

Rationale
    vLLM 0.32 and 0.33 allocate one KV buffer and overlay every KV-cache group on it from byte
    0 (`KVCacheTensor`): block id ``b`` is the same bytes in every group, which is sound
    only because a block id belongs to one group at a time. The jenga core numbers large
    pages per group (page 5 of group 0 and page 5 of group 1 are different memory), so
    handing its page ids to vLLM's tensors unchanged would make two groups write the same
    bytes. Here each mapped page gets a physical slot of its own.

Approach
    The allocator's `jenga.plan.MappingPlan` s say exactly when a page gains or loses
    memory. `SharedSlots.apply` replays them in order: ``MapPage`` takes a free slot,
    ``UnmapPage`` returns it. The free slots form a stack, so a step-3 remap (unmaps
    followed by a map that reuses their units) gives the new page the slot just evicted.
    Slot 0 is never handed out: it is the null block, as in vLLM's `BlockPool`.

Limitations
    One block per large page (the "vllm" geometry has no other); the translation is a
    Python dict lookup per block id.
"""

from __future__ import annotations

from collections.abc import Iterable

from jenga.plan import MapPage, MappingPlan


class SlotError(RuntimeError):
    """A plan asked for a slot that is not free / unmapped a page that has none."""


class SharedSlots:
    """Which vLLM block slot backs each mapped (group, page).

    Invariant: ``slot_of[g]`` maps disjoint sets of slots in ``1 .. num_slots - 1``;
    together with ``free`` they partition that range.
    """

    def __init__(self, num_groups: int, num_slots: int) -> None:
        if num_slots < 2:
            raise SlotError(f"need at least 2 slots (one is the null block), got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: list[dict[int, int]] = [{} for _ in range(num_groups)]
        self.page_of: dict[int, tuple[int, int]] = {}  # slot -> (group, page)
        # a stack: pop() hands out the lowest slot first, remaps reuse the slot just freed
        self.free: list[int] = list(range(num_slots - 1, 0, -1))

    def apply(self, plan: MappingPlan) -> None:
        """Replay one plan's ops in order; on a bad op nothing has changed."""
        done: list[tuple[int, int, int, bool]] = []  # (group, page, slot, was_map)
        try:
            for op in plan.ops:
                pages = self.slot_of[op.group]
                if isinstance(op, MapPage):
                    if op.page in pages:
                        raise SlotError(f"group {op.group} page {op.page} is already mapped")
                    if not self.free:
                        raise SlotError(
                            f"no free block slot for group {op.group} page {op.page}: all "
                            f"{self.num_slots - 1} slots are mapped"
                        )
                    slot = pages[op.page] = self.free.pop()
                    self.page_of[slot] = (op.group, op.page)
                    done.append((op.group, op.page, slot, True))
                else:
                    slot = pages.pop(op.page, -1)
                    if slot < 0:
                        raise SlotError(f"group {op.group} page {op.page} is not mapped")
                    self.free.append(slot)
                    del self.page_of[slot]
                    done.append((op.group, op.page, slot, False))
        except SlotError:
            for group, page, slot, was_map in reversed(done):
                if was_map:
                    del self.slot_of[group][page]
                    del self.page_of[slot]
                    self.free.append(slot)
                else:
                    self.free.pop()
                    self.slot_of[group][page] = slot
                    self.page_of[slot] = (group, page)
            raise

    def ids(self, group: int, pages: Iterable[int]) -> list[int]:
        """vLLM block ids of these allocator page ids of one group."""
        table = self.slot_of[group]
        try:
            return [table[p] for p in pages]
        except KeyError as exc:
            raise SlotError(f"group {group} page {exc.args[0]} has no slot") from None

    def page(self, group: int, slot: int) -> int:
        """The allocator page of ``group`` that vLLM block id ``slot`` backs."""
        owner = self.page_of.get(slot)
        if owner is None or owner[0] != group:
            raise SlotError(f"block slot {slot} does not back a page of group {group}: {owner}")
        return owner[1]

    @property
    def num_mapped(self) -> int:
        return sum(len(m) for m in self.slot_of)

    def check_invariants(self) -> None:
        used = [s for m in self.slot_of for s in m.values()]
        every = sorted(used + self.free)
        assert every == list(range(1, self.num_slots)), "slots are lost or doubly owned"
        assert len(self.page_of) == len(used)
        for g, table in enumerate(self.slot_of):
            for page, slot in table.items():
                assert self.page_of[slot] == (g, page), f"slot {slot}: reverse map is stale"
