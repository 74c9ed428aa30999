"""Random sequences of pool / range / plan operations (with injected faults) against a plain
Python model of what the pool must hold: which slots map which chunk, which chunks are free,
what each chunk contains."""

from __future__ import annotations

import errno
from typing import Any

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from vmm.host import HostBackend
from vmm_helpers import check

import vmm

G = 64 << 10
NUM_RANGES, NUM_SLOTS = 3, 6
slots_st = st.lists(st.integers(0, NUM_SLOTS - 1), min_size=1, max_size=3)
range_st = st.integers(0, NUM_RANGES - 1)


class Model:
    """What the pool must hold. `where[(r, s)]` = chunk handle; `value[h]` = its int32 fill
    (None: unknown, a reused chunk keeps stale bytes)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.where: dict[tuple[int, int], int] = {}
        self.free: set[int] = set()
        self.created = 0
        self.value: dict[int, int | None] = {}

    def copy(self) -> Model:
        m = Model(self.budget)
        m.where, m.free, m.created = dict(self.where), set(self.free), self.created
        m.value = dict(self.value)
        return m

    def mapped_handles(self) -> set[int]:
        return set(self.where.values())

    def check_slots(self, r: int, slots: list[int], mapped: bool) -> type[Exception] | None:
        if len(set(slots)) != len(slots):
            return vmm.MappingError
        if any(((r, s) in self.where) != mapped for s in slots):
            return vmm.MappingError
        return None

    def drop(self, handles: list[int]) -> None:
        for h in handles:
            if h not in self.mapped_handles():
                self.free.add(h)

    def map_new(self, r: int, slots: list[int], handles: list[int] | None) -> Any:
        err = self.check_slots(r, slots, False)
        if err:
            return err
        if len(slots) > len(self.free) + self.budget - self.created:
            return vmm.OutOfMemory
        if handles is None:
            return None  # feasible; the real handles are learned after the call
        reused = [h for h in handles if h in self.free]
        assert len(reused) == min(len(slots), len(self.free)), (handles, self.free)
        assert not set(handles) & self.mapped_handles()
        self.created += len(slots) - len(reused)
        self.free -= set(handles)
        for s, h in zip(slots, handles, strict=True):
            self.where[(r, s)] = h
            self.value[h] = self.value.get(h) if h in reused else 0
        return None

    def unmap(self, r: int, slots: list[int]) -> Any:
        err = self.check_slots(r, slots, True)
        if err:
            return err
        handles = [self.where.pop((r, s)) for s in slots]
        self.drop(handles)
        return None

    def link(self, kind: str, src: int, ss: list[int], dst: int, ds: list[int]) -> Any:
        err = self.check_slots(src, ss, True) or self.check_slots(dst, ds, False)
        if err or len(ss) != len(ds):
            return err or vmm.MappingError
        handles = [self.where[(src, s)] for s in ss]
        for d, h in zip(ds, handles, strict=True):
            self.where[(dst, d)] = h
        if kind == "remap":
            for s in ss:
                del self.where[(src, s)]
        return None


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.backend = HostBackend(granularity=G, capacity=1 << 24)
        self.pool = vmm.ChunkPool(self.backend, 8 * G)
        self.ranges = [
            self.pool.reserve(NUM_SLOTS * G, name=f"r{i}", zero_backed=(i == 2))
            for i in range(NUM_RANGES)
        ]
        self.model = Model(8)

    def teardown(self) -> None:
        self.pool.close()

    def _expect(self, err: Any, fn: Any) -> Any:
        if err is None:
            return fn()
        try:
            fn()
        except err:
            return None
        raise AssertionError(f"expected {err.__name__}")

    @rule(r=range_st, slots=slots_st)
    def map(self, r: int, slots: list[int]) -> None:
        err = self.model.map_new(r, slots, None)
        handles = self._expect(err, lambda: self.ranges[r].map(slots))
        if err is None:
            assert self.model.map_new(r, slots, handles) is None

    @rule(r=range_st, slots=slots_st)
    def unmap(self, r: int, slots: list[int]) -> None:
        err = self.model.copy().unmap(r, slots)
        self._expect(err, lambda: self.ranges[r].unmap(slots))
        if err is None:
            self.model.unmap(r, slots)

    @rule(
        kind=st.sampled_from(["share", "remap"]),
        src=range_st,
        dst=range_st,
        ss=slots_st,
        ds=slots_st,
    )
    def link(self, kind: str, src: int, dst: int, ss: list[int], ds: list[int]) -> None:
        trial = self.model.copy()
        err = trial.link(kind, src, ss, dst, ds) if len(ss) == len(ds) else vmm.MappingError
        if src == dst and err is None and set(ss) & set(ds):
            err = vmm.MappingError

        def call() -> None:
            method = self.ranges[dst].share_from if kind == "share" else self.ranges[dst].remap_from
            method(self.ranges[src], ss, ds)

        self._expect(err, call)
        if err is None:
            self.model = trial

    @rule(r=range_st, slot=st.integers(0, NUM_SLOTS - 1), value=st.integers(1, 1000))
    def write(self, r: int, slot: int, value: int) -> None:
        if (r, slot) in self.model.where:
            self.ranges[r].tensor((G // 4,), torch.int32, offset=slot * G).fill_(value)
            self.model.value[self.model.where[(r, slot)]] = value

    @rule(budget=st.integers(0, 10))
    def set_budget(self, budget: int) -> None:
        in_use = len(self.model.mapped_handles())
        err = vmm.BudgetError if budget < in_use else None
        self._expect(err, lambda: self.pool.set_budget(budget * G))
        if err is None:
            excess = self.model.created - budget
            if excess > 0:
                gone = sorted(self.model.free)[-excess:]
                self.model.free -= set(gone)
                self.model.created -= excess
            self.model.budget = budget

    @rule(
        ops=st.lists(st.tuples(st.sampled_from(["map", "unmap"]), range_st, slots_st), max_size=4),
        fault_at=st.integers(0, 6),
    )
    def plan(self, ops: list[tuple[str, int, list[int]]], fault_at: int) -> None:
        plan = vmm.MappingPlan()
        for kind, r, slots in ops:
            getattr(plan, kind)(self.ranges[r], slots)
        trial, err = self.model.copy(), None
        for kind, r, slots in ops:
            err = trial.map_new(r, slots, None) if kind == "map" else trial.unmap(r, slots)
            if err is not None:
                break
            if kind == "map":  # simulate with the lowest free handles, as the pool does
                fresh = sorted(trial.free)[: len(slots)]
                trial.created += len(slots) - len(fresh)
                fresh += [-1 - i for i in range(len(slots) - len(fresh))]
                for s, h in zip(slots, fresh, strict=True):
                    trial.where[(r, s)] = h
                trial.free -= set(fresh)
        before = self.backend.syscalls
        self.backend.inject_fault(fault_at, errno.ENOMEM)
        try:
            self.plan_result = plan.apply()
        except (vmm.BackendError, vmm.OutOfMemory, vmm.MappingError) as exc:
            fired = fault_at > 0 and self.backend.syscalls - before >= fault_at
            assert err is not None or fired, f"unexpected {exc!r}"
            return
        finally:
            self.backend.inject_fault(0, 0)
        assert err is None, f"expected {err}"
        for (kind, r, slots), handles in zip(ops, self.plan_result, strict=True):
            if kind == "map":
                assert self.model.map_new(r, slots, handles) is None
            else:
                assert self.model.unmap(r, slots) is None

    @invariant()
    def pool_matches_model(self) -> None:
        check(self.pool)
        real = {
            (i, s): h for i, rng in enumerate(self.ranges) for s, h in rng.slot_to_handle().items()
        }
        assert real == self.model.where
        assert set(self.pool._free) == self.model.free
        assert self.pool.num_created == self.model.created
        for (r, s), h in real.items():
            expected = self.model.value.get(h)
            if expected is not None:
                view = self.ranges[r].tensor((G // 4,), torch.int32, offset=s * G)
                assert int(view[0]) == int(view[-1]) == expected
        zero = self.ranges[2]
        for s in range(NUM_SLOTS):
            if (2, s) not in real:
                assert int(zero.tensor((4,), torch.int32, offset=s * G).abs().sum()) == 0


PoolMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None, derandomize=True
)
TestPoolMachine = PoolMachine.TestCase
