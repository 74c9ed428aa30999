"""Host backend export/import: a memfd chunk mapped by a backend that did not create it."""

from __future__ import annotations

import ctypes
import os

import pytest
from vmm.backend import SharedChunks
from vmm.host import HostBackend

import vmm

G = 4096


def poke(va: int, data: bytes) -> None:
    ctypes.memmove(va, data, len(data))


def peek(va: int, n: int) -> bytes:
    return ctypes.string_at(va, n)


def test_imported_chunks_share_bytes_with_the_exporter():
    owner = HostBackend(G, capacity=16 * G)
    handles = owner.create(3)
    shared = owner.export_handles(handles)
    assert shared.where == tuple((0, h * G) for h in handles)
    tenant = HostBackend(G, import_fd=shared.fds[0])
    local = tenant.import_handles(shared)
    os.close(shared.fds[0])  # export handed out a new fd; the tenant keeps its own copy
    assert tenant.num_chunks == 3
    va_o, va_t = owner.reserve(3 * G), tenant.reserve(3 * G)
    owner.map([va_o + i * G for i in range(3)], handles)
    tenant.map([va_t + i * G for i in range(3)], local)
    poke(va_t + G + 5, b"tenant")
    assert peek(va_o + G + 5, 6) == b"tenant"
    poke(va_o, b"owner")
    assert peek(va_t, 5) == b"owner"
    tenant.unmap([va_t + i * G for i in range(3)])
    tenant.release(local)  # forgets: the owner's copy keeps its bytes
    assert tenant.num_chunks == 0
    assert peek(va_o + G + 5, 6) == b"tenant"
    owner.unmap([va_o + i * G for i in range(3)])
    owner.release(handles)
    tenant.close()
    owner.close()


def test_import_refuses_bad_input_and_changes_nothing():
    owner = HostBackend(G, capacity=8 * G)
    other = HostBackend(G, capacity=8 * G)
    handles = owner.create(2)
    tenant = HostBackend(G, import_fd=owner.export_handles([]).fds[0])
    with pytest.raises(vmm.MappingError, match="not this backend's memfd"):
        tenant.import_handles(other.export_handles(other.create(1)))
    with pytest.raises(vmm.AlignmentError, match="offset 100"):
        tenant.import_handles(SharedChunks(owner.export_handles([]).fds, ((0, 100),)))
    with pytest.raises(vmm.AlignmentError, match="outside the memfd's 8 chunks"):
        tenant.import_handles(SharedChunks(owner.export_handles([]).fds, ((0, 0), (0, 9 * G))))
    assert tenant.num_chunks == 0  # the valid first chunk was not adopted either
    tenant.import_handles(owner.export_handles(handles))
    with pytest.raises(vmm.MappingError, match="already held"):
        tenant.import_handles(owner.export_handles(handles[:1]))
    with pytest.raises(vmm.MappingError, match="imported memfd"):
        tenant.create(1)
    with pytest.raises(vmm.MappingError, match="owns its memfd"):
        owner.import_handles(owner.export_handles(handles))
    assert tenant.num_chunks == 2
    for b in (tenant, other, owner):
        b.close()


def test_import_fd_must_be_a_multiple_of_the_granularity(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(vmm.AlignmentError, match="100 bytes"):
            HostBackend(G, import_fd=fd)
    finally:
        os.close(fd)


def test_backends_without_sharing_say_so():
    class Plain(HostBackend):
        export_handles = vmm.Backend.export_handles
        import_handles = vmm.Backend.import_handles

    b = Plain(G, capacity=4 * G)
    with pytest.raises(vmm.BackendError, match="cannot export"):
        b.export_handles([0])
    with pytest.raises(vmm.BackendError, match="cannot import"):
        b.import_handles(SharedChunks((), ()))
    b.close()
