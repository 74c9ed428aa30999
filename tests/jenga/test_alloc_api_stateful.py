"""Hypothesis stateful test of the engine-facing API over a mixed model.

Groups: full attention, sliding window, chunked local, Mamba and cross attention, in a
small pool, with requests that share prefixes and an image. After every rule:
`check_invariants(expensive=True)` (core structures, and every live table entry is a
USED block whose refcount equals the live tables holding it), plus:
- "no room" changes nothing (usage, tables, token counts),
- a hit never covers the whole prompt and is a multiple of every text block size,
- a request that just cached its blocks is found by `prefix_match`,
- units are conserved (used + free == total) and plans only unmap mapped pages.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from jenga.allocator import (
    AllocationOrder,
    AllocationRules,
    AllocatorConfig,
    GroupConfig,
    ImageSpan,
    JengaAllocator,
)
from jenga.plan import MapPage
from jenga.specs import Kind

GROUPS = (
    GroupConfig("full", Kind.FULL, 2, 4, 1),
    GroupConfig("swa", Kind.SLIDING_WINDOW, 2, 4, 1, window=5),
    GroupConfig("chunk", Kind.CHUNKED_LOCAL, 2, 2, 1, chunk=8),
    GroupConfig("mamba", Kind.MAMBA, 4, 1, 2),
    GroupConfig("cross", Kind.CROSS_ATTENTION, 2, 4, 1),
)
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5])
IMAGE = ImageSpan(2, 3, 4242)


class ApiMachine(RuleBasedStateMachine):
    @initialize(total=st.integers(8, 24), compact=st.booleans())
    def setup(self, total: int, compact: bool) -> None:
        order = AllocationOrder.COMPACT if compact else AllocationOrder.PAPER
        rules = AllocationRules(order)
        self.alloc = JengaAllocator(AllocatorConfig(GROUPS, total, rules, max_model_len=40))
        self.live: dict[int, int] = {}  # request -> prompt length
        self.next_id = 0
        self.mapped: set[tuple[int, int]] = set()

    def _apply(self, ops: tuple) -> None:
        for op in ops:
            key = (op.group, op.page)
            if isinstance(op, MapPage):
                assert key not in self.mapped
                self.mapped.add(key)
            else:
                assert key in self.mapped
                self.mapped.remove(key)

    @rule(
        which=st.integers(0, 2), tail=st.lists(st.integers(0, 9), max_size=10), image=st.booleans()
    )
    def add(self, which: int, tail: list[int], image: bool) -> None:
        prompt = PREFIXES[which] + tail
        images = [IMAGE] if image and len(prompt) >= IMAGE.end else []
        expected = self.alloc.prefix_match(prompt, images=images).hit
        hit = self.alloc.add_request(self.next_id, prompt, images=images)
        assert hit == expected
        assert 0 <= hit < len(prompt) and hit % 4 == 0  # lcm of the text block sizes
        self.live[self.next_id] = len(prompt)
        self.next_id += 1

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), n=st.integers(1, 9))
    def allocate(self, data: st.DataObject, n: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.alloc.num_tokens(rid) + n > 40:
            return
        before = (self.alloc.usage(), self._tables(rid), self.alloc.num_tokens(rid))
        got = self.alloc.allocate(rid, n)
        if got is None:
            assert (self.alloc.usage(), self._tables(rid), self.alloc.num_tokens(rid)) == before
            return
        self._apply(got.plan.ops)
        assert got.num_tokens == before[2] + n

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def compute_and_cache(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        allocated = self.alloc.num_tokens(rid)
        known = self.live[rid]
        if allocated > known:
            self.alloc.append_tokens(rid, [7] * (allocated - known))
            self.live[rid] = allocated
        self.alloc.cache(rid, allocated)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._apply(self.alloc.free(rid).ops)
        del self.live[rid]

    def _tables(self, rid: int) -> list[list[int]]:
        return [self.alloc.block_table(rid, g) for g in range(len(GROUPS))]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_invariants(expensive=True)
        use = self.alloc.usage()
        assert use.used_units + use.free_units == use.total_units
        assert len(self.mapped) == sum(use.mapped_pages)


ApiMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_api_machine = ApiMachine.TestCase
