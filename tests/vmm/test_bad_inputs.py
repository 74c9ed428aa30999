"""The vmm bad-input table: every public vmm entry refuses a wrong type or an
out-of-bounds number with a `vmm.errors` class whose message carries the numbers, and
changes nothing: a float budget (`ChunkPool(backend, 131072.0)`), negative or float sizes
and `shape=2**64` are refused before they reach pybind11."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import vmm
from tests.vmm.vmm_helpers import HOST_GRANULARITY

G = HOST_GRANULARITY


@pytest.fixture
def pool() -> Iterator[vmm.ChunkPool]:
    p = vmm.ChunkPool(vmm.HostBackend(G, capacity=1 << 28), 8 * G)
    yield p
    p.close()


def _backend() -> vmm.HostBackend:
    return vmm.HostBackend(G, capacity=1 << 28)


# (id, call, error class, text the message must contain)
POOL_CASES: list[tuple[str, Callable[[vmm.ChunkPool], Any], type[Exception], str]] = [
    ("budget float", lambda p: vmm.ChunkPool(_backend(), 131072.0), vmm.BudgetError, "131072.0"),
    ("budget str", lambda p: vmm.ChunkPool(_backend(), "131072"), vmm.BudgetError, "'131072'"),
    ("budget negative", lambda p: vmm.ChunkPool(_backend(), -G), vmm.BudgetError, str(-G)),
    ("budget 2**64", lambda p: vmm.ChunkPool(_backend(), 2**64), vmm.BudgetError, str(2**64)),
    ("budget bool", lambda p: vmm.ChunkPool(_backend(), True), vmm.BudgetError, "bool"),
    (
        "reserve_ahead float",
        lambda p: vmm.ChunkPool(_backend(), G, reserve_ahead=1.5),
        vmm.InputError,
        "1.5",
    ),
    (
        "reserve_ahead negative",
        lambda p: vmm.ChunkPool(_backend(), G, reserve_ahead=-1),
        vmm.InputError,
        "-1",
    ),
    ("set_budget float", lambda p: p.set_budget(4.0 * G), vmm.BudgetError, str(4.0 * G)),
    ("reserve float", lambda p: p.reserve(float(G)), vmm.InputError, str(float(G))),
    ("reserve negative", lambda p: p.reserve(-G), vmm.InputError, str(-G)),
    ("reserve zero", lambda p: p.reserve(0), vmm.InputError, "0"),
    ("reserve 2**64", lambda p: p.reserve(2**64), vmm.InputError, str(2**64)),
    ("reserve misaligned", lambda p: p.reserve(G + 1), vmm.AlignmentError, str(G + 1)),
    ("granularity float", lambda p: vmm.HostBackend(65536.0), vmm.InputError, "65536.0"),
    ("capacity negative", lambda p: vmm.HostBackend(G, capacity=-1), vmm.InputError, "-1"),
    ("vma_budget float", lambda p: vmm.HostBackend(G, vma_budget=2.5), vmm.InputError, "2.5"),
]


@pytest.mark.parametrize(
    ("call", "error", "text"), [c[1:] for c in POOL_CASES], ids=[c[0] for c in POOL_CASES]
)
def test_pool_and_backend_refuse(
    pool: vmm.ChunkPool, call: Callable[[vmm.ChunkPool], Any], error: type[Exception], text: str
) -> None:
    before = pool.stats()
    with pytest.raises(error) as info:
        call(pool)
    assert isinstance(info.value, vmm.VmmError)
    assert text in str(info.value)
    assert pool.stats() == before


RANGE_CASES: list[tuple[str, Callable[[vmm.VirtualRange], Any], type[Exception], str]] = [
    ("map float slot", lambda r: r.map([1.0]), vmm.InputError, "1.0"),
    ("map bool slot", lambda r: r.map([True]), vmm.InputError, "True"),
    ("map str slot", lambda r: r.map(["1"]), vmm.InputError, "'1'"),
    ("map negative slot", lambda r: r.map([-1]), vmm.RangeError, "-1"),
    ("map slot 2**64", lambda r: r.map([2**64]), vmm.RangeError, str(2**64)),
    ("unmap float slot", lambda r: r.unmap([0.0]), vmm.InputError, "0.0"),
    ("handle float slot", lambda r: r.handle(0.5), vmm.InputError, "0.5"),
    ("tensor shape 2**64", lambda r: r.tensor((2**64,), "uint8"), vmm.InputError, str(2**64)),
    ("tensor shape float", lambda r: r.tensor((4.0,), "uint8"), vmm.InputError, "4.0"),
    ("tensor int shape 2**64", lambda r: r.tensor(2**64, "uint8"), vmm.InputError, str(2**64)),
    ("tensor offset float", lambda r: r.tensor((4,), "uint8", offset=1.0), vmm.InputError, "1.0"),
    ("tensor offset negative", lambda r: r.tensor((4,), "uint8", offset=-8), vmm.InputError, "-8"),
    (
        "tensor stride float",
        lambda r: r.tensor((4,), "uint8", strides=(1.0,)),
        vmm.InputError,
        "1.0",
    ),
    (
        "tensor past range",
        lambda r: r.tensor((4 * G + 1,), "uint8"),
        vmm.RangeError,
        str(4 * G + 1),
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "text"), [c[1:] for c in RANGE_CASES], ids=[c[0] for c in RANGE_CASES]
)
def test_range_refuses(
    pool: vmm.ChunkPool, call: Callable[[vmm.VirtualRange], Any], error: type[Exception], text: str
) -> None:
    rng = pool.reserve(4 * G, name="r")
    rng.map([2])
    before = (pool.stats(), rng.slot_to_handle())
    with pytest.raises(error) as info:
        call(rng)
    assert isinstance(info.value, vmm.VmmError)
    assert text in str(info.value)
    assert (pool.stats(), rng.slot_to_handle()) == before
    pool.check_invariants(expensive=True)
