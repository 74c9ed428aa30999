"""One vmm suite for every backend: the `backend_kind` fixture runs each test on host and
(marked `cuda`: a GPU or the CUDA driver emulator) on cuda. Helpers snapshot the full
observable state of a pool so rollback tests can compare before and after exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import vmm
from tests.vmm.vmm_helpers import HOST_GRANULARITY


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def new_backend(kind: str, **opts: Any) -> vmm.Backend:
    if kind == "host":
        opts.setdefault("granularity", HOST_GRANULARITY)
        opts.setdefault("capacity", 1 << 30)
        return vmm.get_backend(kind, **opts)
    # Directly, not through get_backend("cuda"): that one also wants torch to see a device,
    # which the driver emulator (no torch CUDA) does not give; the backend itself does not.
    from vmm.cuda import CudaBackend

    return CudaBackend(**opts)


MakePool = Callable[..., vmm.ChunkPool]


@pytest.fixture
def make_pool(backend_kind: str) -> Iterator[MakePool]:
    """make_pool(budget_chunks, reserve_ahead=0, **backend_opts) -> ChunkPool (closed after)."""
    pools: list[vmm.ChunkPool] = []

    def make(budget_chunks: int = 16, reserve_ahead: int = 0, **opts: Any) -> vmm.ChunkPool:
        backend = new_backend(backend_kind, **opts)
        pool = vmm.ChunkPool(
            backend, budget_chunks * backend.granularity, reserve_ahead=reserve_ahead
        )
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def host_pool() -> Iterator[vmm.ChunkPool]:
    backend = new_backend("host")
    pool = vmm.ChunkPool(backend, 32 * HOST_GRANULARITY)
    yield pool
    pool.close()
