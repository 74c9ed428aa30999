"""Hypothesis stateful test: the C++ core against the pure-Python model, op by op.

Every rule runs on both and requires identical answers (block ids, None, plan ops);
after every rule the invariants are checked on both sides:
- no block owned twice: each block's refcount equals the references the test holds,
- unit accounting conserved: free units + mapped pages' units == total,
- cached blocks hashable: every cached block is found by lookup of its hash,
- plan ops consistent with ownership: Map only of unmapped pages, Unmap only of mapped
  pages whose blocks are all free (checked by replaying the plan on a page map),
- eviction orders (blocks per group, pages) equal between core and model, with early
  releases drawn per group (allocate's releases: head-first ties) and demotion on or off
  (early blocks rank below every block cached by release).

Budget: 600 examples of up to 250 steps; Hypothesis ends some early, measured ~175 steps
per example, so ~105k rule steps (about a minute on one core).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jenga import _core as J
from tests.jenga.core_model import MAP, CoreModel

NUM_HASHES = 24  # small hash space: duplicate commits and shared prefixes happen often


class CoreVsModel(RuleBasedStateMachine):
    @initialize(
        shape=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=3),
        total=st.integers(3, 12),
        compact=st.booleans(),
        early=st.lists(st.booleans(), min_size=3, max_size=3),
        demote=st.booleans(),
    )
    def setup(
        self,
        shape: list[tuple[int, int]],
        total: int,
        compact: bool,
        early: list[bool],
        demote: bool,
    ) -> None:
        bpp = [b for b, _ in shape]
        upp = [min(u, total) for _, u in shape]
        rules = J.Rules(
            order=J.AllocationOrder.COMPACT if compact else J.AllocationOrder.PAPER,
            early_release_groups=early[: len(shape)],
            demote_window_releases=demote,
        )
        self.core = J.Core(bpp, upp, total, rules)
        self.model = CoreModel(bpp, upp, total, rules)
        self.G = len(shape)
        self.upp = upp
        self.total = total
        self.now = 0
        self.held: dict[int, list[list[int]]] = {}  # owner -> per group blocks (with repeats)
        self.next_owner = 0
        self.mapped: set[tuple[int, int]] = set()

    def _tick(self) -> int:
        self.now += 1
        return self.now

    def _check_plan(self) -> None:
        core_ops = self.core.drain_plan()
        model_ops = self.model.drain_plan()
        assert core_ops == model_ops
        for kind, g, p, reused in core_ops:
            if kind == MAP:
                assert (g, p) not in self.mapped, f"map of mapped page {(g, p)}"
                assert 0 <= reused <= self.upp[g]
                self.mapped.add((g, p))
            else:
                assert (g, p) in self.mapped, f"unmap of unmapped page {(g, p)}"
                self.mapped.remove((g, p))

    @rule(
        data=st.data(),
        counts=st.lists(st.integers(0, 2), min_size=3, max_size=3),
        new_owner=st.integers(0, 3).map(lambda x: x == 0),
    )
    def allocate(self, data: st.DataObject, counts: list[int], new_owner: bool) -> None:
        if new_owner or not self.held:
            owner = self.next_owner
            self.next_owner += 1
            self.held[owner] = [[] for _ in range(self.G)]
        else:
            owner = data.draw(st.sampled_from(sorted(self.held)))
        releases = []
        for g in range(self.G):
            mine = sorted(set(self.held[owner][g]))
            rel = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
            releases.append(rel)
        now = self._tick()
        got = self.core.allocate(owner, counts[: self.G], now, releases)
        want = self.model.allocate(owner, counts[: self.G], now, releases)
        assert got == want
        if got is not None:
            for g in range(self.G):
                for b in releases[g]:
                    self.held[owner][g].remove(b)
                self.held[owner][g].extend(got[g])
        self._check_plan()

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), finish=st.booleans())
    def release(self, data: st.DataObject, finish: bool) -> None:
        owner = data.draw(st.sampled_from(sorted(self.held)))
        now = self._tick()
        for g in range(self.G):
            blocks = list(self.held[owner][g])
            if not finish and blocks:
                blocks = data.draw(st.lists(st.sampled_from(blocks), unique=True))
            self.core.release(g, blocks, now)
            self.model.release(g, blocks, now)
            for b in blocks:
                self.held[owner][g].remove(b)
        if finish:
            del self.held[owner]
        self._check_plan()

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), g=st.integers(0, 2))
    def commit(self, data: st.DataObject, g: int) -> None:
        g %= self.G
        owner = data.draw(st.sampled_from(sorted(self.held)))
        blocks = sorted(set(self.held[owner][g]))
        if not blocks:
            return
        blocks = data.draw(st.lists(st.sampled_from(blocks), unique=True, min_size=1))
        hashes = [data.draw(st.integers(0, NUM_HASHES - 1)) for _ in blocks]
        prefixes = [data.draw(st.integers(1, 8)) for _ in blocks]
        assert self.core.commit(g, blocks, hashes, prefixes) == self.model.commit(
            g, blocks, hashes, prefixes
        )

    @rule(data=st.data(), g=st.integers(0, 2), h=st.integers(0, NUM_HASHES - 1))
    def hit(self, data: st.DataObject, g: int, h: int) -> None:
        """A prefix hit: look a hash up; a new or live owner takes a reference."""
        g %= self.G
        found = self.core.lookup(g, [h]).tolist()
        assert found == self.model.lookup(g, [h])
        if found[0] < 0:
            return
        if not self.held or data.draw(st.booleans()):
            owner = self.next_owner
            self.next_owner += 1
            self.held[owner] = [[] for _ in range(self.G)]
        else:
            owner = data.draw(st.sampled_from(sorted(self.held)))
        now = self._tick()
        self.core.acquire(g, found, now)
        self.model.acquire(g, found, now)
        self.held[owner][g].append(found[0])

    @rule(g=st.integers(0, 2), block=st.integers(-1, 40))
    def bad_release_changes_nothing(self, g: int, block: int) -> None:
        g %= self.G
        refs = sum(h[g].count(block) for h in self.held.values())
        if refs > 0:
            return
        before = (self.core.free_units, self.core.eviction_order(g))
        try:
            self.core.release(g, [block], self._tick())
        except ValueError:
            pass
        else:
            raise AssertionError(f"release of unheld block {block} did not raise")
        assert (self.core.free_units, self.core.eviction_order(g)) == before

    @invariant()
    def agree_and_consistent(self) -> None:
        if not hasattr(self, "core"):
            return
        self.core.check_invariants(True)
        assert self.core.free_units == self.model.free_units
        assert self.core.page_eviction_order() == self.model.page_eviction_order()
        mapped_units = 0
        for g in range(self.G):
            assert self.core.eviction_order(g) == self.model.eviction_order(g)
            pages, _cached, _free, used = self.core.group_counts(g)
            mapped_units += pages * self.upp[g]
            refs: dict[int, int] = {}
            for h in self.held.values():
                for b in h[g]:
                    refs[b] = refs.get(b, 0) + 1
            assert used == len(refs)
            for b, n in refs.items():
                state, refcount = self.core.block_info(g, b)[:2]
                assert (state, refcount) == (1, n)
            for b, k in enumerate(self.model.groups[g].blocks):
                if k.state == 2:
                    assert self.core.lookup(g, [k.hash]).tolist() == [b]
        assert mapped_units + self.core.free_units == self.total
        assert len(self.mapped) == sum(self.core.group_counts(g)[0] for g in range(self.G))


CoreVsModel.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_core_matches_model = CoreVsModel.TestCase
