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
    One block per large page (the "vllm" geometry has no other). The tables are flat
    int32 arrays sized up front (pages per group, slots), so a mapped page costs no
    Python object; a page id beyond a table grows it.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable

from jenga.plan import OP_MAP, MapPage, MappingPlan, plan_from_keys


class SlotError(RuntimeError):
    """A plan asked for a slot that is not free / unmapped a page that has none."""


class SharedSlots:
    """Which vLLM block slot backs each mapped (group, page).

    ``slot_of[g][page]`` is the page's slot (0: unmapped; slot 0 is the null block and
    never handed out); ``group_of[slot]`` / ``page_of[slot]`` the reverse (-1: free).
    Invariant: the mapped slots of all groups and ``free`` partition ``1 .. num_slots - 1``.
    ``listener`` (the "slots" VMM geometry's `integrations.vllm.slot_chunks.ChunkRefs.
    change`): called ``(slot, 1)`` when a slot is mapped and ``(slot, -1)`` when it is
    unmapped, rolled-back ops included.
    """

    listener: Callable[[int, int], None] | None = None

    def __init__(self, num_groups: int, num_slots: int, num_pages: int = 0) -> None:
        if num_slots < 2:
            raise SlotError(f"need at least 2 slots (one is the null block), got {num_slots}")
        self.num_slots = num_slots
        self.slot_of = [array("i", bytes(4 * num_pages)) for _ in range(num_groups)]
        self.group_of = array("i", [-1]) * num_slots
        self.page_of = array("i", [-1]) * num_slots
        self.num_mapped = 0
        # a stack: pop() hands out the lowest slot first, remaps reuse the slot just freed
        self.free: list[int] = list(range(num_slots - 1, 0, -1))

    def _table(self, group: int, page: int) -> array:
        """Group ``group``'s page → slot table, grown to hold ``page``."""
        table = self.slot_of[group]
        if page >= len(table):
            table.extend(bytes(4 * (page + 1 - len(table))))
        return table

    def _map(self, group: int, page: int) -> int:
        """Give a free slot to the unmapped ``(group, page)``; 0 when none is free."""
        if not self.free:
            return 0
        slot = self._table(group, page)[page] = self.free.pop()
        self.group_of[slot], self.page_of[slot] = group, page
        self.num_mapped += 1
        if self.listener is not None:
            self.listener(slot, 1)
        return slot

    def _unmap(self, group: int, page: int) -> int:
        """Take back the slot of the mapped ``(group, page)``; 0 when it has none."""
        table = self.slot_of[group]
        slot = table[page] if page < len(table) else 0
        if slot:
            table[page] = 0
            self.group_of[slot] = self.page_of[slot] = -1
            self.free.append(slot)
            self.num_mapped -= 1
            if self.listener is not None:
                self.listener(slot, -1)
        return slot

    def _mapped(self, group: int, page: int) -> bool:
        table = self.slot_of[group]
        return page < len(table) and table[page] != 0

    def apply(self, plan: MappingPlan) -> None:
        """Replay one plan's ops in order; on a bad op nothing has changed."""
        done: list[tuple[int, int, bool]] = []  # (group, page, was_map)
        try:
            for op in plan.ops:
                if isinstance(op, MapPage):
                    if self._mapped(op.group, op.page):
                        raise SlotError(f"group {op.group} page {op.page} is already mapped")
                    if not self._map(op.group, op.page):
                        raise SlotError(
                            f"no free block slot for group {op.group} page {op.page}: all "
                            f"{self.num_slots - 1} slots are mapped"
                        )
                elif not self._unmap(op.group, op.page):
                    raise SlotError(f"group {op.group} page {op.page} is not mapped")
                done.append((op.group, op.page, isinstance(op, MapPage)))
        except SlotError:
            self._undo(done)
            raise

    def _undo(self, done: list[tuple[int, int, bool]]) -> None:
        """Reverse applied ops, last first: the free stack ends as it was."""
        for group, page, was_map in reversed(done):
            if was_map:
                self._unmap(group, page)
            else:  # the slot it gave back is on top of the stack
                slot = self.free.pop()
                self._table(group, page)[page] = slot
                self.group_of[slot], self.page_of[slot] = group, page
                self.num_mapped += 1
                if self.listener is not None:
                    self.listener(slot, 1)

    def undo(self, plan: MappingPlan) -> None:
        """Reverse ``plan``, the last plan applied (all its ops)."""
        self._undo([(op.group, op.page, isinstance(op, MapPage)) for op in plan.ops])

    def apply_keys(self, keys: list[tuple[int, int, int, int]]) -> None:
        """`apply` on the core's raw ops ``(kind, group, page, reused)`` (`jenga.plan.
        plan_from_keys`), no plan objects built; on a bad op nothing has changed."""
        done: list[tuple[int, int, bool]] = []
        for kind, group, page, _ in keys:
            if kind == OP_MAP:
                if self._mapped(group, page) or not self._map(group, page):
                    break
            elif not self._unmap(group, page):
                break
            done.append((group, page, kind == OP_MAP))
        else:
            return
        self._undo(done)
        self.apply(plan_from_keys(keys))  # raises the SlotError, changing nothing

    def ids(self, group: int, pages: Iterable[int]) -> list[int]:
        """vLLM block ids of these allocator page ids of one group."""
        out = []
        for p in pages:
            if not self._mapped(group, p):
                raise SlotError(f"group {group} page {p} has no slot")
            out.append(self.slot_of[group][p])
        return out

    def page(self, group: int, slot: int) -> int:
        """The allocator page of ``group`` that vLLM block id ``slot`` backs."""
        owner = self.group_of[slot] if 0 < slot < self.num_slots else -1
        if owner != group:
            found = None if owner < 0 else (owner, self.page_of[slot])
            raise SlotError(f"block slot {slot} does not back a page of group {group}: {found}")
        return self.page_of[slot]

    def state(self) -> tuple[list[dict[int, int]], list[int]]:
        """(per group: page -> slot of the mapped pages, the free stack), for comparisons."""
        tables = [{p: s for p, s in enumerate(t) if s} for t in self.slot_of]
        return tables, list(self.free)

    def check_invariants(self) -> None:
        tables, free = self.state()
        used = [s for t in tables for s in t.values()]
        every = sorted(used + free)
        assert every == list(range(1, self.num_slots)), "slots are lost or doubly owned"
        assert self.num_mapped == len(used)
        for g, table in enumerate(tables):
            for page, slot in table.items():
                assert (self.group_of[slot], self.page_of[slot]) == (g, page), (
                    f"slot {slot}: reverse map is stale"
                )
        for slot in free:
            assert self.group_of[slot] == -1, f"free slot {slot} still names a page"
