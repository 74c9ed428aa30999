"""Refused addresses and sizes of the host backend next to whatever else the process maps:
a refusal must never touch a mapping it does not own, nor leave one behind."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import pytest
from vmm.host import HostBackend

import vmm
from tests.vmm.vmm_helpers import kernel_vmas

G = 64 << 10
MAP_FIXED_NOREPLACE = 0x100000  # Linux >= 4.17: fail with EEXIST rather than replace

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def try_foreign_mapping(addr: int, size: int) -> int | None:
    """A private read-write mapping at exactly `addr` that no backend knows of, or None
    where something is mapped there already."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE
    got = _libc.mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got == addr:
        return addr
    if got not in (None, (1 << 64) - 1):
        _libc.munmap(got, size)  # a kernel without MAP_FIXED_NOREPLACE took it as a hint
    return None


def foreign_mapping(addr: int, size: int) -> int:
    got = try_foreign_mapping(addr, size)
    assert got is not None, f"could not map {size} bytes at {addr:#x} (errno {ctypes.get_errno()})"
    return got


def reservation_with_foreign_tail(backend: HostBackend, size: int, tail: int) -> tuple[int, int]:
    """A reservation of `size` bytes with a foreign mapping of `tail` bytes right after its
    end (reserving again until the space past one is free; the others are freed)."""
    tried = []
    try:
        for _ in range(32):
            va = backend.reserve(size)
            foreign = try_foreign_mapping(va + size, tail)
            if foreign is not None:
                return va, foreign
            tried.append(va)
        raise AssertionError(f"no free {tail} bytes past any of {len(tried)} reservations")
    finally:
        for va in tried:
            backend.free_reservation(va, size)


def mapping_at(addr: int) -> str | None:
    """The /proc/self/maps range ("lo-hi", hex) holding `addr`, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[0]
    return None


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    b = HostBackend(granularity=G, capacity=64 * G, vma_budget=64)
    yield b
    b.close()


def _victim_below_the_next_gap(wrapped: int) -> tuple[list[int], int, int]:
    """A foreign 64 KiB mapping right below where the kernel places the next mapping of
    `wrapped` bytes, 2 MiB aligned (plus a filler above it when alignment leaves a gap).
    Other threads (torch's, the test runner's) may map in between the probe and the
    fillers, and a gap that fits `wrapped` exactly leaves no room below it: the layout is
    tried again, and where it never holds there are no fillers ([]); the refusal before
    any syscall is checked either way."""
    for _ in range(50):
        # Where the kernel puts a mapping of `wrapped` bytes now: the top of the highest gap.
        probe = _libc.mmap(None, wrapped, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        _libc.munmap(probe, wrapped)
        top = probe + wrapped
        aligned_top = (top - wrapped) // (2 << 20) * (2 << 20) + wrapped  # start 2 MiB aligned
        victim = try_foreign_mapping(aligned_top - wrapped - G, G)  # right below
        if victim is None:
            continue
        if aligned_top == top:
            return [victim], top, aligned_top
        above = try_foreign_mapping(aligned_top, top - aligned_top)
        if above is not None:
            return [victim, above], top, aligned_top
        _libc.munmap(victim, G)
    return [], 0, 0


def test_reserve_of_a_wrapping_size_leaves_the_mapping_below_alone(backend: HostBackend) -> None:
    """`reserve` over-allocates size + 2 MiB to trim an aligned start. For a size of
    2^64 - 64 KiB that sum wraps to 2 MiB - 64 KiB: the layout below makes that small
    mapping land 2 MiB aligned right above a foreign mapping, where trimming "size" bytes
    past the start would unmap the foreign mapping's top (and crash its owner later)."""
    size = (1 << 64) - G
    wrapped = (size + (2 << 20)) % (1 << 64)
    fillers, top, aligned_top = _victim_below_the_next_gap(wrapped)
    try:
        before = [mapping_at(addr) for addr in fillers]
        syscalls = backend.syscalls
        with pytest.raises(vmm.AlignmentError, match=rf"reserve size {size} exceeds"):
            backend.reserve(size)
        assert backend.syscalls == syscalls  # refused before any mmap
        assert [mapping_at(addr) for addr in fillers] == before  # the victim is still whole
        assert not fillers or kernel_vmas(fillers[0], G) == 1
    finally:
        for addr in fillers:
            _libc.munmap(addr, G if addr == fillers[0] else top - aligned_top)


def test_refused_addresses_leave_neighbouring_mappings_alone(backend: HostBackend) -> None:
    """The probe lies just past a reservation, inside a foreign mapping; or inside another
    backend's reservation; or below every reservation; or at the ends of the address space.
    Every entry point refuses each with AlignmentError and touches nothing."""
    va, foreign = reservation_with_foreign_tail(backend, 4 * G, 8 * G)
    (h,) = backend.create(1)
    ctypes.memset(foreign, 0x5A, 8 * G)
    other = HostBackend(granularity=G, capacity=4 * G)
    try:
        other_va = other.reserve(4 * G)
        probes = [foreign, foreign + 4 * G, other_va, va - G, 0, (1 << 64) - G]
        before = (backend.slot_table(va, 4 * G), other.slot_table(other_va, 4 * G))
        for probe in probes:
            with pytest.raises(vmm.AlignmentError, match="inside no reservation"):
                backend.map([probe], [h])
            with pytest.raises(vmm.AlignmentError, match="inside no reservation"):
                backend.unmap([probe])
            with pytest.raises(vmm.AlignmentError, match="no reservation of"):
                backend.free_reservation(probe, G)
            with pytest.raises(vmm.AlignmentError, match="no reservation of"):
                backend.view_factory(probe, G)
            with pytest.raises(vmm.AlignmentError, match="no reservation of"):
                backend.slot_table(probe, G)
        assert (backend.slot_table(va, 4 * G), other.slot_table(other_va, 4 * G)) == before
        assert ctypes.string_at(foreign, 8 * G) == b"\x5a" * (8 * G)
        assert kernel_vmas(foreign, 8 * G) == 1
    finally:
        other.close()
        _libc.munmap(foreign, 8 * G)


def test_an_address_past_one_reservation_maps_only_where_it_lies(backend: HostBackend) -> None:
    """Reservations of one backend packed side by side (2 MiB each, 2 MiB aligned: the
    kernel tends to place them back to back): the slot just past one end and just before
    one start maps into the reservation that holds it, at the right slot, or is refused."""
    size = 2 << 20
    bases = sorted(backend.reserve(size) for _ in range(3))
    (h,) = backend.create(1)
    for probe in sorted({p for b in bases for p in (b - G, b + size)}):
        owner = next((b for b in bases if b <= probe < b + size), None)
        if owner is None:
            with pytest.raises(vmm.AlignmentError, match="inside no reservation"):
                backend.map([probe], [h])
            continue
        backend.map([probe], [h])
        for b in bases:
            table = backend.slot_table(b, size)
            expected = [-1] * (size // G)
            if b == owner:
                expected[(probe - b) // G] = h
            assert table == expected, (hex(probe), hex(b))
        backend.unmap([probe])


@pytest.mark.parametrize("size", [(1 << 64) - G, (1 << 64) - 4 * G, (1 << 64) - (2 << 20), 1 << 48])
def test_reserve_of_an_impossible_size_is_refused_and_maps_nothing(
    backend: HostBackend, size: int
) -> None:
    """A size whose over-allocated mapping (size + 2 MiB alignment) wraps, or that no mmap
    could give, is refused before any syscall: nothing is mapped, trimmed or leaked."""
    syscalls = backend.syscalls
    with pytest.raises(vmm.AlignmentError, match=rf"reserve size {size} exceeds the largest"):
        backend.reserve(size)
    assert backend.syscalls == syscalls  # not even the reserving mmap was tried
    assert backend.stats()["vmas.current"] == 0


@pytest.mark.parametrize("count", [65, 1 << 40, (1 << 64) - 1])
def test_create_of_more_chunks_than_the_memfd_holds_is_refused_up_front(
    backend: HostBackend, count: int
) -> None:
    """A count the memfd could never hold is refused before any table grows or any memory
    is allocated for it (a count near 2^64 must not reach an allocation of that size)."""
    (h,) = backend.create(1)
    syscalls = backend.syscalls
    with pytest.raises(
        vmm.OutOfMemory, match=rf"create needs {count} chunks, memfd has 63 free of 64"
    ):
        backend.create(count)
    assert (backend.syscalls, backend.num_chunks) == (syscalls, 1)
    assert backend.create(1) == [h + 1]
