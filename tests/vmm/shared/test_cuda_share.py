"""CUDA export/import of chunks as POSIX fds (`cuda`; the byte test also `gpu`: the driver
emulator has no shareable handles)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.cuda


@pytest.mark.gpu
def test_cuda_chunk_exported_as_fd_is_imported_and_shares_bytes():
    import torch
    from vmm.cuda import CudaBackend

    owner = CudaBackend(shareable=True)
    tenant = CudaBackend(granularity=owner.granularity)
    (handle,) = owner.create(1)
    shared = owner.export_handles([handle])
    try:
        (local,) = tenant.import_handles(shared)
    finally:
        for fd in shared.fds:
            os.close(fd)
    g = owner.granularity
    va_o, va_t = owner.reserve(g), tenant.reserve(g)
    owner.map([va_o], [handle])
    tenant.map([va_t], [local])

    class View:
        def __init__(self, va: int) -> None:
            self.__cuda_array_interface__ = {"shape": (g,), "typestr": "|u1",
                                             "data": (va, False), "version": 3}  # fmt: skip

    a, b = torch.as_tensor(View(va_o), device="cuda"), torch.as_tensor(View(va_t), device="cuda")
    b[:16] = 7
    torch.cuda.synchronize()
    assert int(a[:16].sum()) == 7 * 16
    tenant.unmap([va_t])
    tenant.release([local])  # drops the import; the owner's chunk lives on
    assert int(a[:16].sum()) == 7 * 16
    owner.unmap([va_o])
    owner.release([handle])
    tenant.close()
    owner.close()


def test_cuda_export_needs_a_shareable_backend():
    from vmm.cuda import CudaBackend
    from vmm.errors import BackendError

    backend = CudaBackend()
    (handle,) = backend.create(1)
    with pytest.raises(BackendError, match="shareable=True"):
        backend.export_handles([handle])
    backend.release([handle])
    backend.close()
