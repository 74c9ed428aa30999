"""Fault injection through the CUDA driver emulator: every backend operation, every mapping
plan and close, with the k-th memory call failing for every k the operation makes.

An operation that raises must leave the backend's tables, the pool's and the emulated
driver's state (live objects, the access of every slot) exactly as before, and go through
once the fault is gone; one that absorbs the fault (a teardown step tried again) must end
as a fault-free run does. Nothing may be left behind in the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import settings
from vmm.cuda import CudaBackend

import vmm
from tests.vmm import emulator as emu_mod
from tests.vmm import test_plan as plan_cases
from tests.vmm.emulator import CUDA_ERROR_OUT_OF_MEMORY, Emulator
from tests.vmm.test_cuda_emulated import CLEAN, G, memory_calls, observed
from tests.vmm.test_stateful import PoolMachine
from tests.vmm.vmm_helpers import check, data_view, snapshot

pytestmark = [pytest.mark.cuda, pytest.mark.emulator]
OOM_TEXT = "CUDA_ERROR_OUT_OF_MEMORY (2)"


@pytest.fixture
def emu() -> Iterator[Emulator]:
    loaded = emu_mod.loaded()
    assert loaded is not None
    yield loaded
    loaded.fail_after(0)


# ---- backend operations -----------------------------------------------------------------------
def _map(b: CudaBackend) -> Callable[[], Any]:
    va = b.reserve(4 * G, zero=True)
    h = b.create(3)
    return lambda: b.map([va, va + G, va + 3 * G], h)


def _unmap(b: CudaBackend) -> Callable[[], Any]:
    va = b.reserve(3 * G)
    b.map([va, va + G, va + 2 * G], b.create(3))
    return lambda: b.unmap([va + 2 * G, va])


def _unmap_to_zero(b: CudaBackend) -> Callable[[], Any]:
    va = b.reserve(3 * G)
    b.map([va, va + G, va + 2 * G], b.create(3))
    return lambda: b.unmap([va + 2 * G, va], to_zero=True)


def _reserve_zero(b: CudaBackend) -> Callable[[], Any]:
    return lambda: b.reserve(3 * G, zero=True)


def _free_zero_reservation(b: CudaBackend) -> Callable[[], Any]:
    va = b.reserve(3 * G, zero=True)
    return lambda: b.free_reservation(va, 3 * G)


def _create(b: CudaBackend) -> Callable[[], Any]:
    return lambda: b.create(3)


SCENARIOS: dict[str, Callable[[CudaBackend], Callable[[], Any]]] = {
    "map": _map,
    "unmap": _unmap,
    "unmap_to_zero": _unmap_to_zero,
    "reserve_zero": _reserve_zero,
    "free_zero_reservation": _free_zero_reservation,
    "create": _create,  # cuMemCreate x3, then the zero fill through a scratch mapping
}


def _outcome(b: CudaBackend, emu: Emulator) -> tuple[Any, ...]:
    """What a completed operation leaves, without handle identities."""
    b.check_invariants()
    return (emu.live_objects(), b.stats(), b.num_chunks, b.num_zero_slots)


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_failing_driver_call_of_an_operation_rolls_back(emu: Emulator, name: str):
    probe = CudaBackend(0)
    op = SCENARIOS[name](probe)
    num_calls = memory_calls(emu, op)
    fault_free = _outcome(probe, emu)
    probe.close()
    assert num_calls >= 2
    for k in range(1, num_calls + 1):
        b = CudaBackend(0)
        try:
            op = SCENARIOS[name](b)
            before = observed(b, emu)
            emu.fail_after(k)
            try:
                op()
            except vmm.OutOfMemory as exc:
                assert OOM_TEXT in str(exc), (name, k)
                assert observed(b, emu) == before, f"{name}: state changed by failing call {k}"
                op()  # the same call goes through once the fault is gone
            assert emu.count("pending_fault") == 0
            assert _outcome(b, emu) == fault_free, f"{name}: failing call {k}"
        finally:
            b.close()
        assert emu.live_objects() == CLEAN, f"{name}: driver objects left after call {k}"


def test_close_resumes_after_a_failing_driver_call(emu: Emulator):
    def populated() -> CudaBackend:
        b = CudaBackend(0)
        h = b.create(3)
        va = b.reserve(4 * G, zero=True)
        b.map([va, va + 2 * G], h[:2])
        b.reserve(2 * G)
        return b

    num_calls = memory_calls(emu, populated().close)
    assert num_calls >= 10
    for k in range(1, num_calls + 1):
        b = populated()
        emu.fail_after(k)
        with pytest.raises(vmm.OutOfMemory, match=r"CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
            b.close()
        b.close()  # picks up where the failed close stopped
        assert emu.live_objects() == CLEAN, f"close leaked after failing memory call {k}"


# ---- mapping plans through the pool -----------------------------------------------------------
def _grow(ranges: list[vmm.VirtualRange]) -> vmm.MappingPlan:
    a, b, _ = ranges
    return vmm.MappingPlan().map(b, [2, 3, 4, 6]).unmap(a, [1])  # creates beyond the free one


def _evict_and_remap(ranges: list[vmm.VirtualRange]) -> vmm.MappingPlan:
    a, b, z = ranges
    return vmm.MappingPlan().remap(a, [0, 2, 3], b, [2, 3, 4]).unmap(z, [4])  # z: back to zero


def _share_then_unmap(ranges: list[vmm.VirtualRange]) -> vmm.MappingPlan:
    a, _, z = ranges
    return vmm.MappingPlan().share(a, [0, 2], z, [1, 2]).unmap(a, [0, 2, 3])


PLANS: dict[str, Callable[[list[vmm.VirtualRange]], vmm.MappingPlan]] = {
    "mixed": plan_cases.big_plan,  # unmap, map (reuse + create), remap, share, zero slots
    "grow": _grow,
    "evict_and_remap": _evict_and_remap,
    "share_then_unmap": _share_then_unmap,
}


def _fresh_pool() -> tuple[vmm.ChunkPool, list[vmm.VirtualRange]]:
    pool = vmm.ChunkPool(CudaBackend(0), 16 * G)
    return pool, plan_cases.setup(pool)


def _state(pool: vmm.ChunkPool, ranges: list[vmm.VirtualRange], emu: Emulator) -> Any:
    assert isinstance(pool.backend, CudaBackend)
    return snapshot(pool, ranges), observed(pool.backend, emu)


def _shape(pool: vmm.ChunkPool, ranges: list[vmm.VirtualRange], emu: Emulator) -> Any:
    """A plan's result without handle identities: which slots share a chunk, the counts."""
    labels: dict[int, int] = {}
    tables = [{s: labels.setdefault(h, len(labels)) for s, h in sorted(r.slot_to_handle().items())}
              for r in ranges]  # fmt: skip
    stats = {k: v for k, v in pool.stats().items() if not k.startswith("plans.")}
    assert isinstance(pool.backend, CudaBackend)
    return tables, stats, pool.num_free, observed(pool.backend, emu)[4:]


def _first_word(rng: vmm.VirtualRange) -> int:
    return int(data_view(rng, (1,), torch.int32)[0])


@pytest.mark.parametrize("plan_name", PLANS)
def test_every_failing_driver_call_in_a_plan_leaves_state_identical(emu: Emulator, plan_name: str):
    make_plan = PLANS[plan_name]
    pool, ranges = _fresh_pool()
    num_calls = memory_calls(emu, lambda: make_plan(ranges).apply())
    done = _shape(pool, ranges, emu)
    pool.close()
    assert num_calls >= 4
    for k in range(1, num_calls + 1):
        pool, ranges = _fresh_pool()
        try:
            before = _state(pool, ranges, emu)
            emu.fail_after(k)
            try:
                make_plan(ranges).apply()
            except vmm.OutOfMemory as exc:
                assert OOM_TEXT in str(exc), (plan_name, k)
                assert _state(pool, ranges, emu) == before, f"{plan_name}: state after fault {k}"
                assert pool.stats()["plans.rolled_back"] == 1
                check(pool)
                assert _first_word(ranges[0]) == 100  # the data survived the rollback
                make_plan(ranges).apply()  # the same plan then goes through
            assert emu.count("pending_fault") == 0
            assert _shape(pool, ranges, emu) == done, f"{plan_name}: result after fault {k}"
        finally:
            pool.close()
        assert emu.live_objects() == CLEAN, f"{plan_name}: driver objects left after fault {k}"


# ---- random plans (the host suite's state machine, on the emulator) ---------------------------
class CudaPoolMachine(PoolMachine):
    """Random map / unmap / share / remap / write / set_budget steps and plans with a fault
    at a random memory call, on CudaBackend, checked against the pool model after each."""

    gran = G

    def make_backend(self) -> vmm.Backend:
        return CudaBackend(0)

    def inject_fault(self, k: int) -> None:
        _emulator().fail_after(k, CUDA_ERROR_OUT_OF_MEMORY)

    def num_backend_calls(self) -> int:
        return _emulator().count("memory_calls")


def _emulator() -> Emulator:
    loaded = emu_mod.loaded()
    assert loaded is not None
    return loaded


CudaPoolMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None, derandomize=True
)
TestCudaPoolMachine = CudaPoolMachine.TestCase
