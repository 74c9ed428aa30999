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

import vmm
from tests.vmm.vmm_helpers import check, data_view

G = 64 << 10
NUM_RANGES, NUM_SLOTS = 3, 6
slots_st = st.lists(st.integers(0, NUM_SLOTS - 1), min_size=1, max_size=3)
range_st = st.integers(0, NUM_RANGES - 1)
PlanStep = tuple[str, int, list[int], int, list[int]]
plan_op_st = st.tuples(
    st.sampled_from(["map", "unmap", "share", "remap"]), range_st, slots_st, range_st, slots_st
)


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
    """On the host backend, faults injected as failing syscalls; subclasses change the
    backend through the four hooks below (the CUDA one: test_cuda_emulated_faults.py)."""

    gran = G

    def make_backend(self) -> vmm.Backend:
        return HostBackend(granularity=G, capacity=1 << 24)

    def inject_fault(self, k: int) -> None:
        """The k-th backend call from now fails with an out-of-memory (0: none)."""
        self.backend.inject_fault(k, errno.ENOMEM)

    def num_backend_calls(self) -> int:
        return self.backend.syscalls

    def view(self, r: int, slot: int, n: int, *, write: bool = False) -> torch.Tensor:
        return data_view(self.ranges[r], (n,), torch.int32, slot * self.gran, write=write)

    def __init__(self) -> None:
        super().__init__()
        self.backend: Any = self.make_backend()
        self.pool = vmm.ChunkPool(self.backend, 8 * self.gran)
        self.ranges = [
            self.pool.reserve(NUM_SLOTS * self.gran, name=f"r{i}", zero_backed=(i == 2))
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
            self.view(r, slot, self.gran // 4, write=True).fill_(value)
            self.model.value[self.model.where[(r, slot)]] = value

    @rule(budget=st.integers(0, 10))
    def set_budget(self, budget: int) -> None:
        in_use = len(self.model.mapped_handles())
        err = vmm.BudgetError if budget < in_use else None
        self._expect(err, lambda: self.pool.set_budget(budget * self.gran))
        if err is None:
            excess = self.model.created - budget
            if excess > 0:
                gone = sorted(self.model.free)[-excess:]
                self.model.free -= set(gone)
                self.model.created -= excess
            self.model.budget = budget

    @rule(data=st.data(), fault_at=st.integers(0, 8))
    def plan(self, data: st.DataObject, fault_at: int) -> None:
        ops = self._draw_plan(data)
        plan = vmm.MappingPlan()
        for kind, r, slots, dst, dst_slots in ops:
            if kind in ("map", "unmap"):
                getattr(plan, kind)(self.ranges[r], slots)
            else:
                getattr(plan, kind)(self.ranges[r], slots, self.ranges[dst], dst_slots)
        err = self._predict(ops)
        before = self.num_backend_calls()
        self.inject_fault(fault_at)
        try:
            results = plan.apply()
        except (vmm.BackendError, vmm.OutOfMemory, vmm.MappingError) as exc:
            fired = fault_at > 0 and self.num_backend_calls() - before >= fault_at
            assert err is not None or fired, f"unexpected {exc!r}"
            return
        finally:
            self.inject_fault(0)
        assert err is None, f"expected {err}"
        for (kind, r, slots, dst, dst_slots), handles in zip(ops, results, strict=True):
            if kind == "map":
                assert self.model.map_new(r, slots, handles) is None
            elif kind == "unmap":
                assert self.model.unmap(r, slots) is None
            else:
                assert self.model.link(kind, r, slots, dst, dst_slots) is None

    def _draw_plan(self, data: st.DataObject) -> list[PlanStep]:
        """1-4 ops, mostly valid against the model as the plan goes (some deliberately not)."""
        where = set(self.model.where)
        ops: list[PlanStep] = []
        for _ in range(data.draw(st.integers(1, 4))):
            kind = data.draw(st.sampled_from(["map", "unmap", "share", "remap"]))
            mapped = sorted(where)
            unmapped = sorted({(r, s) for r in range(NUM_RANGES) for s in range(NUM_SLOTS)} - where)
            valid = data.draw(st.integers(0, 7)) > 0
            src_pool = mapped if kind != "map" else unmapped
            if not valid or not src_pool:
                ops.append((kind, *data.draw(plan_op_st)[1:]))  # random, likely invalid
                continue
            r, s = data.draw(st.sampled_from(src_pool))
            if kind in ("map", "unmap"):
                ops.append((kind, r, [s], 0, []))
                (where.add if kind == "map" else where.discard)((r, s))
                continue
            if not unmapped:
                continue
            dst, d = data.draw(st.sampled_from(unmapped))
            ops.append((kind, r, [s], dst, [d]))
            where.add((dst, d))
            if kind == "remap":
                where.discard((r, s))
        return [op for op in ops if op[0] in ("map", "unmap") or len(op[2]) == len(op[4])]

    def _predict(self, ops: list[PlanStep]) -> Any:
        """The error the plan must raise (None: it must succeed unless a fault fires)."""
        trial = self.model.copy()
        for kind, r, slots, dst, dst_slots in ops:
            if kind == "map":
                err = trial.map_new(r, slots, None)
                if err is None:  # simulate with the lowest free handles, as the pool does
                    fresh = sorted(trial.free)[: len(slots)]
                    trial.created += len(slots) - len(fresh)
                    fresh += [-1000 - trial.created - i for i in range(len(slots) - len(fresh))]
                    for s, h in zip(slots, fresh, strict=True):
                        trial.where[(r, s)] = h
                    trial.free -= set(fresh)
            elif kind == "unmap":
                err = trial.unmap(r, slots)
            else:
                err = trial.link(kind, r, slots, dst, dst_slots)
            if err is not None:
                return err
        return None

    @invariant()
    def pool_matches_model(self) -> None:
        check(self.pool)
        real = {
            (i, s): h for i, rng in enumerate(self.ranges) for s, h in rng.slot_to_handle().items()
        }
        assert real == self.model.where
        assert set(self.pool.ledger.free_handles()) == self.model.free
        assert self.pool.num_created == self.model.created
        for (r, s), h in real.items():
            expected = self.model.value.get(h)
            if expected is not None:
                view = self.view(r, s, self.gran // 4)
                assert int(view[0]) == int(view[-1]) == expected
        for s in range(NUM_SLOTS):
            if (2, s) not in real:
                assert int(self.view(2, s, 4).abs().sum()) == 0


PoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, derandomize=True
)
TestPoolMachine = PoolMachine.TestCase
