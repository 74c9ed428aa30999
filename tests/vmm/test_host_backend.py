"""The host backend on its own: syscalls, VMA accounting against the kernel, physical release,
and all-or-nothing batches under injected faults."""

from __future__ import annotations

import errno
import os

import pytest
from vmm.host import HostBackend

import vmm
from tests.vmm.vmm_helpers import kernel_vmas

G = 64 << 10


@pytest.fixture
def backend():
    b = HostBackend(granularity=G, capacity=64 * G, vma_budget=64)
    yield b
    b.close()


def test_granularity_and_capacity_are_validated():
    with pytest.raises(vmm.AlignmentError, match="power of two"):
        HostBackend(granularity=96 << 10)
    with pytest.raises(vmm.AlignmentError, match="page size"):
        HostBackend(granularity=1024)
    with pytest.raises(vmm.AlignmentError, match="capacity 100000"):
        HostBackend(granularity=G, capacity=100_000)


def test_reservations_are_2mib_aligned_and_cost_no_memory(backend):
    va = backend.reserve(3 * G)
    assert va % (2 << 20) == 0
    assert backend.physical_bytes() == 0
    assert kernel_vmas(va, 3 * G) == 1
    backend.free_reservation(va, 3 * G)
    assert backend.stats()["vmas.current"] == 0


def test_create_populates_and_release_punches_holes(backend):
    handles = backend.create(4)
    assert handles == [0, 1, 2, 3]
    assert backend.physical_bytes() == 4 * G
    backend.release([1, 2])
    assert backend.physical_bytes() == 2 * G
    assert backend.create(3) == [1, 2, 4]  # lowest free offsets first
    backend.release([0, 1, 2, 3, 4])
    assert backend.physical_bytes() == 0
    assert backend.num_chunks == 0


def test_vma_model_matches_the_kernel(backend):
    va = backend.reserve(16 * G)
    handles = backend.create(8)
    expected = [
        ([va, va + G, va + 2 * G], handles[0:3], 2),  # one merged run + the PROT_NONE tail
        ([va + 4 * G], [handles[3]], 4),  # hole at slot 3 splits
        ([va + 3 * G], [handles[5]], 4),  # handle 5 after 2 does not merge with 3
        ([va + 5 * G], [handles[4]], 4),  # handle 4 after handle 3: merges left
    ]
    for vas, hs, vmas in expected:
        backend.map(vas, hs)
        assert backend.stats()["vmas.current"] == vmas == kernel_vmas(va, 16 * G)
    backend.unmap([va + G])  # h0 | none | h2 | h5 | h3 h4 | none
    assert backend.stats()["vmas.current"] == kernel_vmas(va, 16 * G) == 6
    backend.unmap([va, va + 2 * G, va + 3 * G, va + 4 * G, va + 5 * G])
    assert backend.stats()["vmas.current"] == kernel_vmas(va, 16 * G) == 1


def test_zero_backed_slots_merge_and_read_zero(backend):
    import ctypes

    va = backend.reserve(8 * G, zero=True)
    assert kernel_vmas(va, 8 * G) == 1
    assert ctypes.string_at(va + 3 * G, 16) == bytes(16)
    (h,) = backend.create(1)
    backend.map([va + 3 * G], [h])
    ctypes.memmove(va + 3 * G, b"abc", 3)
    assert kernel_vmas(va, 8 * G) == backend.stats()["vmas.current"] == 3
    backend.unmap([va + 3 * G], to_zero=True)
    assert ctypes.string_at(va + 3 * G, 3) == bytes(3)
    assert kernel_vmas(va, 8 * G) == backend.stats()["vmas.current"] == 1
    assert backend.zero_slots(va, 8 * G) == list(range(8))


def test_vma_budget_refuses_before_any_syscall():
    backend = HostBackend(granularity=G, capacity=64 * G, vma_budget=4)
    va = backend.reserve(16 * G)
    handles = backend.create(4)
    backend.map([va, va + 2 * G], handles[:2])  # 4 VMAs: map, none, map, none
    before = backend.syscalls
    with pytest.raises(vmm.VmaBudgetExceeded, match=r"needs 2 more VMAs, 4 of budget 4"):
        backend.map([va + 4 * G], [handles[3]])
    assert backend.syscalls == before
    assert backend.slot_table(va, 16 * G)[:5] == [0, -1, 1, -1, -1]
    backend.map([va + G], [handles[2]])  # fills the hole: 0,2,1 do not merge -> still 4
    assert backend.stats()["vmas.current"] == kernel_vmas(va, 16 * G) == 4
    backend.close()


def test_misaligned_and_unknown_addresses(backend):
    va = backend.reserve(4 * G)
    (h,) = backend.create(1)
    with pytest.raises(vmm.AlignmentError, match=r"not aligned .* \(off by 4096\)"):
        backend.map([va + 4096], [h])
    with pytest.raises(vmm.AlignmentError, match="inside no reservation"):
        backend.map([va + 8 * G], [h])
    with pytest.raises(vmm.AlignmentError, match="size 1000 must be a positive multiple"):
        backend.reserve(1000)
    with pytest.raises(vmm.AlignmentError, match="unknown handle 7"):
        backend.map([va], [7])
    with pytest.raises(vmm.MappingError, match=r"slot 1 .* which is not mapped"):
        backend.unmap([va + G])
    backend.map([va], [h])
    with pytest.raises(vmm.MappingError, match="already mapped to handle 0"):
        backend.map([va], [h])
    with pytest.raises(vmm.MappingError, match="still mapped at 1 slots"):
        backend.release([h])
    with pytest.raises(vmm.MappingError, match="1 slots still mapped"):
        backend.free_reservation(va, 4 * G)


@pytest.mark.parametrize("op", ["create", "map", "unmap", "release"])
def test_batches_are_all_or_nothing_under_injected_faults(backend, op):
    va = backend.reserve(16 * G)
    handles = backend.create(6)
    mapped_slots = [0, 1, 4, 6]  # two runs, one isolated slot
    backend.map([va + s * G for s in mapped_slots], handles[:4])

    def run() -> None:
        if op == "create":
            backend.create(3)
        elif op == "map":
            backend.map([va + 9 * G, va + 10 * G, va + 12 * G], [handles[4], handles[5], 0])
        elif op == "unmap":
            backend.unmap([va + s * G for s in (0, 4, 6)])
        else:
            backend.release([handles[4], handles[5]])

    state = (backend.slot_table(va, 16 * G), backend.num_chunks, backend.physical_bytes())
    start = backend.syscalls
    run()
    calls = backend.syscalls - start
    assert calls >= 1
    # undo the successful run, then fail each of its syscalls in turn
    backend.close()
    for k in range(1, calls + 1):
        b = HostBackend(granularity=G, capacity=64 * G, vma_budget=64)
        va = b.reserve(16 * G)
        handles = b.create(6)
        b.map([va + s * G for s in mapped_slots], handles[:4])
        backend = b
        b.inject_fault(k, errno.ENOMEM)
        with pytest.raises((vmm.BackendError, vmm.OutOfMemory), match="Cannot allocate memory"):
            run()
        assert (b.slot_table(va, 16 * G), b.num_chunks, b.physical_bytes()) == state
        assert b.stats()["vmas.current"] == kernel_vmas(va, 16 * G)
        b.close()


def test_use_after_close(backend):
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(vmm.ClosedError, match="closed host backend"):
        backend.create(1)


def memfds() -> list[int]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:jenga-vmm"):
                out.append(int(name))
        except OSError:
            pass
    return out


def test_one_memfd_per_backend_not_inherited_and_closed():
    before = memfds()
    backend = HostBackend(granularity=G, capacity=4 * G)
    (fd,) = set(memfds()) - set(before)
    assert os.get_inheritable(fd) is False
    backend.close()
    assert memfds() == before
