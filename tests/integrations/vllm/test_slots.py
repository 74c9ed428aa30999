"""`SharedSlots`: jenga page ids → vLLM's shared block slots (needs no vLLM)."""

from __future__ import annotations

import pytest
from integrations.vllm.slots import SharedSlots, SlotError
from jenga.plan import MapPage, MappingPlan, UnmapPage


def test_pages_of_two_groups_get_distinct_slots_and_slot_zero_stays_null() -> None:
    slots = SharedSlots(num_groups=2, num_slots=5)
    slots.apply(MappingPlan((MapPage(0, 0), MapPage(1, 0), MapPage(1, 3))))
    assert slots.ids(0, [0]) == [1] and slots.ids(1, [0, 3]) == [2, 3]
    assert slots.page(1, 3) == 3 and slots.num_mapped == 3
    with pytest.raises(SlotError, match=r"block slot 1 does not back a page of group 1"):
        slots.page(1, 1)
    slots.check_invariants()


def test_a_remap_reuses_the_slot_just_evicted() -> None:
    slots = SharedSlots(num_groups=2, num_slots=3)
    slots.apply(MappingPlan((MapPage(0, 0), MapPage(0, 1))))
    slots.apply(MappingPlan((UnmapPage(0, 0), MapPage(1, 4, reused_units=1))))
    assert slots.ids(1, [4]) == [1] and slots.ids(0, [1]) == [2]
    slots.check_invariants()


def test_a_bad_plan_changes_nothing() -> None:
    slots = SharedSlots(num_groups=2, num_slots=3)
    slots.apply(MappingPlan((MapPage(0, 0),)))
    before = slots.state()
    over = MappingPlan((UnmapPage(0, 0), MapPage(1, 0), MapPage(1, 1), MapPage(1, 2)))
    with pytest.raises(SlotError, match=r"no free block slot for group 1 page 2: all 2 slots"):
        slots.apply(over)
    with pytest.raises(SlotError, match=r"group 1 page 9 is not mapped"):
        slots.apply(MappingPlan((MapPage(1, 1), UnmapPage(1, 9))))
    with pytest.raises(SlotError, match=r"group 0 page 0 is already mapped"):
        slots.apply(MappingPlan((MapPage(0, 0),)))
    assert slots.state() == before
    slots.check_invariants()
    with pytest.raises(SlotError, match=r"group 1 page 7 has no slot"):
        slots.ids(1, [7])
    with pytest.raises(SlotError, match=r"need at least 2 slots"):
        SharedSlots(1, 1)
