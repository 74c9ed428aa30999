"""Multi-group allocations that the paper order alone refuses with memory free.

Groups are served in order, so an earlier group's new page (step 2) or page eviction
(step 3) can spend the units a later group needed. The core then retries the call in
frugal mode (costless blocks first); these tests pin the exact outcome and check, against
an exhaustive bound, that a refused call really had no assignment under the step rules.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jenga import _core as J
from tests.jenga.core_model import CoreModel


def plan(core: J.Core) -> list[tuple[int, int, int, int]]:
    return core.drain_plan()


def order(compact: bool) -> J.Rules:
    return J.Rules(order=J.AllocationOrder.COMPACT if compact else J.AllocationOrder.PAPER)


def test_step2_of_an_earlier_group_no_longer_starves_a_later_group():
    # group 0: 2 blocks per 1-unit page; group 1: 1 block per 1-unit page; 2 units in all
    core = J.Core([2, 1], [1, 1], 2)
    assert core.allocate(1, [2, 0], 1) == [[0, 1], []]
    assert core.commit(0, [1], [11], [32]) == 1
    core.release(0, [1], 2)  # cached, on page 0 that owner 1 still uses: costs no unit
    plan(core)
    # paper order: group 0 maps a new page (the last unit), group 1 finds nothing -> retry
    assert core.allocate(2, [1, 1], 3) == [[1], [0]]
    assert plan(core) == [(0, 1, 0, 0)]  # only group 1's page is mapped
    counters = core.counters()
    assert (counters["alloc.frugal_retries"], counters["alloc.failures"]) == (1, 0)
    # steps: 2 + 1 blocks from new pages, 1 evicted cached block
    assert [counters[f"alloc.step.{i}"] for i in range(1, 6)] == [0, 3, 0, 0, 1]
    assert core.lookup(0, [11]).tolist() == [-1]  # the cached block was reused
    assert core.free_units == 0
    core.check_invariants(True)


def test_frugal_retry_spends_spare_units_before_evicting_cached_blocks():
    # group 0: 4 blocks per 1-unit page; group 1: 1 block per 1-unit page; 3 units in all
    core = J.Core([4, 1], [1, 1], 3)
    assert core.allocate(1, [4, 0], 1) == [[0, 1, 2, 3], []]
    core.commit(0, [2, 3], [12, 13], [12, 16])
    core.release(0, [2, 3], 2)  # two cached blocks on page 0, which owner 1 pins
    plan(core)
    # paper order: group 0 maps 2 pages (both free units), group 1 finds none -> retry.
    # Frugal: 1 unit is spare (group 1 needs 1 of the 2), so group 0 maps a page for 4
    # blocks and evicts only one cached block (block 3: same time, longer prefix first).
    # Without the spare step it evicted both cached blocks before mapping.
    assert core.allocate(2, [5, 1], 3) == [[4, 5, 6, 7, 3], [0]]
    assert plan(core) == [(0, 0, 1, 0), (0, 1, 0, 0)]
    assert core.lookup(0, [12, 13]).tolist() == [2, -1]
    assert core.counters()["alloc.frugal_retries"] == 1
    core.check_invariants(True)


def test_step3_of_an_earlier_group_no_longer_evicts_a_later_groups_only_page():
    # group 0: 2 blocks per 1-unit page; group 1: 1 block per 1-unit page; 2 units in all
    core = J.Core([2, 1], [1, 1], 2)
    assert core.allocate(1, [2, 0], 1) == [[0, 1], []]
    core.commit(0, [1], [11], [32])
    core.release(0, [1], 2)  # costless: cached on a page owner 1 still uses
    assert core.allocate(2, [0, 1], 3) == [[], [0]]
    core.commit(1, [0], [21], [16])
    core.release(1, [0], 4)  # group 1's only page, wholly cached: evictable
    plan(core)
    # paper order: group 0 evicts group 1's page (step 3), then group 1 has nothing left.
    # frugal: group 0 reuses its cached block, group 1 evicts and remaps its own page.
    assert core.allocate(3, [1, 1], 5) == [[1], [0]]
    assert plan(core) == [(1, 1, 0, 0), (0, 1, 0, 1)]  # Unmap(1, 0), Map(1, 0, reused=1)
    counters = core.counters()
    assert (counters["alloc.frugal_retries"], counters["pages.evicted"]) == (1, 1)
    assert core.lookup(0, [11]).tolist() == [-1] and core.lookup(1, [21]).tolist() == [-1]
    core.check_invariants(True)


def test_a_truly_infeasible_call_still_fails_with_nothing_changed():
    core = J.Core([2, 1], [1, 1], 2)
    assert core.allocate(1, [2, 0], 1) == [[0, 1], []]
    core.commit(0, [1], [11], [32])
    core.release(0, [1], 2)
    plan(core)
    before = [core.block_info(0, b) for b in range(2)], core.free_units
    assert core.allocate(2, [2, 1], 3) is None  # 2 units needed beyond the cached block
    assert ([core.block_info(0, b) for b in range(2)], core.free_units) == before
    assert core.lookup(0, [11]).tolist() == [1]
    assert plan(core) == []
    counters = core.counters()
    assert (counters["alloc.frugal_retries"], counters["alloc.failures"]) == (0, 1)
    core.check_invariants(True)


def _costless(model: CoreModel, g: int) -> int:
    """Free or cached blocks of group g on pages that are not wholly evictable."""
    G = model.groups[g]
    evictable = {p for _, _, h, p in model.evictable_pages() if h == g}
    return sum(
        1
        for b, k in enumerate(G.blocks)
        if b // G.B not in evictable and G.pages[b // G.B].mapped and k.state in (0, 2)
    )


def _feasible(model: CoreModel, counts: list[int]) -> bool:
    """Exact: some assignment under the step rules serves every group."""
    pool = model.free_units + sum(model.groups[h].U for _, _, h, _ in model.evictable_pages())
    need = 0
    for g, n in enumerate(counts):
        short = n - _costless(model, g)
        if short > 0:
            need += -(-short // model.groups[g].B) * model.groups[g].U
    return need <= pool


ops = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=2, max_size=2)),
    min_size=1,
    max_size=25,
)


@given(ops=ops, compact=st.booleans())
@settings(max_examples=60, deadline=None)
def test_allocate_fails_only_when_no_assignment_exists(ops, compact):
    """Random owners allocate, cache and finish; core and model agree, refusals are exact."""
    bpp, upp, total = [2, 1], [1, 2], 5
    core = J.Core(bpp, upp, total, order(compact))
    model = CoreModel(bpp, upp, total, order(compact))
    held: dict[int, list[list[int]]] = {}
    now = 0
    for owner, counts in ops:
        now += 1
        if owner in held and counts[0] == 0:  # finish: hash everything, release
            for g, blocks in enumerate(held.pop(owner)):
                hashes = [1000 * now + 10 * g + i for i in range(len(blocks))]
                prefixes = [16 * (i + 1) for i in range(len(blocks))]
                assert core.commit(g, blocks, hashes, prefixes) == model.commit(
                    g, blocks, hashes, prefixes
                )
                core.release(g, blocks, now)
                model.release(g, blocks, now)
            continue
        feasible = _feasible(model, counts)
        got = core.allocate(owner, counts, now)
        assert got == model.allocate(owner, counts, now, [])
        assert (got is not None) == feasible, (counts, got)
        if got is not None:
            rows = held.setdefault(owner, [[] for _ in bpp])
            for row, blocks in zip(rows, got, strict=True):
                row.extend(blocks)
        assert plan(core) == model.drain_plan()
        core.check_invariants(True)


def test_pinned_order_reuses_cached_blocks_on_pinned_pages_before_evicting_pages():
    # one group, 2 blocks per 1-unit page, 2 units. Page 0: block 0 live, block 1 cached
    # (pinned by block 0). Page 1: wholly cached (evictable).
    for pinned, expected, evicted_pages in ((False, [3], 1), (True, [1], 0)):
        step_order = J.AllocationOrder.PINNED if pinned else J.AllocationOrder.COMPACT
        core = J.Core([2], [1], 2, J.Rules(order=step_order))
        assert core.allocate(1, [2], 1) == [[0, 1]]
        assert core.allocate(2, [2], 2) == [[2, 3]]
        core.commit(0, [1, 2, 3], [11, 12, 13], [32, 16, 32])
        core.release(0, [1], 3)
        core.release(0, [2, 3], 4)
        plan(core)
        # compact order: no free unit, step 3 evicts page 1 (its prefixes) and remaps it;
        # pinned order: block 1 on the pinned page 0 is reused, page 1 stays cached
        assert core.allocate(3, [1], 5) == [expected]
        assert core.counters()["pages.evicted"] == evicted_pages
        assert core.lookup(0, [11, 12, 13]).tolist() == ([-1, 2, 3] if pinned else [1, -1, -1])
        core.check_invariants(True)


def test_without_the_frugal_retry_a_refused_call_stays_refused():
    """The first test's case with the retry switched off: the paper's single pass."""
    core = J.Core([2, 1], [1, 1], 2)
    assert core.rules.frugal_retry
    core.rules = J.Rules(frugal_retry=False)
    assert core.allocate(1, [2, 0], 1) == [[0, 1], []]
    core.commit(0, [1], [11], [32])
    core.release(0, [1], 2)
    plan(core)
    assert core.allocate(2, [1, 1], 3) is None
    assert plan(core) == []
    counters = core.counters()
    assert (counters["alloc.frugal_retries"], counters["alloc.failures"]) == (0, 1)
    assert core.lookup(0, [11]).tolist() == [1]  # the cached block survived
    core.check_invariants(True)


def test_the_allocator_config_switches_the_retry():
    from jenga.allocator import AllocationRules, AllocatorConfig, GroupConfig, JengaAllocator
    from jenga.specs import Kind

    groups = (GroupConfig("f", Kind.FULL, 4, 2, 1),)
    single_pass = AllocationRules(frugal_retry=False)
    assert JengaAllocator(AllocatorConfig(groups, 4))._core.rules.frugal_retry
    assert not JengaAllocator(AllocatorConfig(groups, 4, single_pass))._core.rules.frugal_retry


def test_lru_fair_pinned_step_lets_an_older_whole_page_go_first():
    """`pinned_lru_fair`: the pinned step takes a cached block of a pinned page only when
    no wholly evictable page is less recently used. The previous test's state with the
    release times swapped: page 1 (released at 3) is older than block 1 (released at 4)."""
    for fair, expected, evicted_pages in ((False, [1], 0), (True, [3], 1)):
        rules = J.Rules(order=J.AllocationOrder.PINNED, pinned_lru_fair=fair)
        core = J.Core([2], [1], 2, rules)
        assert core.allocate(1, [2], 1) == [[0, 1]]
        assert core.allocate(2, [2], 2) == [[2, 3]]
        core.commit(0, [1, 2, 3], [11, 12, 13], [32, 16, 32])
        core.release(0, [2, 3], 3)
        core.release(0, [1], 4)
        plan(core)
        # plain pinned order reuses the more recent block 1; LRU-fair evicts page 1
        assert core.allocate(3, [1], 5) == [expected]
        assert core.counters()["pages.evicted"] == evicted_pages
        assert core.lookup(0, [11, 12, 13]).tolist() == ([1, -1, -1] if fair else [-1, 2, 3])
        core.check_invariants(True)
