"""The CUDA backend under real kernels (`cuda` + `gpu`: skipped without a GPU and on the
driver emulator). Every test here also passes tests/conftest.py's leak check: device
memory (`cuMemGetInfo` through torch) and the open `CudaBackend` count back to where the
test started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vmm

pytestmark = [pytest.mark.cuda, pytest.mark.gpu]
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("gpu_share_worker.py")


@pytest.fixture
def pool() -> Iterator[vmm.ChunkPool]:
    from vmm.cuda import CudaBackend

    p = vmm.ChunkPool(CudaBackend(), 64 << 21)
    yield p
    p.check_invariants(expensive=True)
    p.close()


def _attention(q: Any, k: Any, v: Any) -> Any:
    import torch

    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_graph_replay_over_a_vmm_range_survives_remaps_outside_its_window(pool):
    """A CUDA graph captures one attention step whose K/V are views of slots 0-1 of a VMM
    range; slots 2-7 are unmapped, remapped to other chunks and overwritten; the replay
    reads the same bytes and gives the same output, bit for bit. A write inside the
    window does change the replay (the graph reads the range, not a copy)."""
    import torch

    g = pool.backend.granularity
    rng = pool.reserve(8 * g)
    rng.map(list(range(8)))
    heads, dim = 4, 64
    tokens = 2 * g // (2 * heads * dim * 2)  # K then V, fp16, in slots 0-1
    k = rng.tensor((1, heads, tokens, dim), torch.float16, 0)
    v = rng.tensor((1, heads, tokens, dim), torch.float16, g)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k.copy_(torch.randn(k.shape, generator=gen, device="cuda", dtype=torch.float16))
    v.copy_(torch.randn(v.shape, generator=gen, device="cuda", dtype=torch.float16))
    q = torch.randn((1, heads, 1, dim), generator=gen, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _attention(q, k, v)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _attention(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    torch.testing.assert_close(first, _attention(q, k, v), rtol=0, atol=0)

    rng.unmap(list(range(2, 8)))
    extra = pool.reserve(6 * g)
    extra.map(list(range(6)))  # takes the freed chunks: slots 2-7 get new ones
    rng.map(list(range(2, 8)))
    rng.tensor((6 * g,), torch.uint8, 2 * g).fill_(0x7F)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)

    k[0, 0, 0].fill_(1000.0)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, first)
    del graph, out, k, v
    extra.close()
    rng.close()


def test_unmapping_a_chunk_while_a_kernel_reads_other_chunks_is_safe(pool):
    """A kernel queued behind a long sleep reads slots 0-3 of a range; slots 4-7 are
    unmapped (`cuMemUnmap`) while it is in flight. The kernel's result is exact and the
    stream reports no fault."""
    import torch

    g = pool.backend.granularity
    rng = pool.reserve(8 * g)
    rng.map(list(range(8)))
    data = rng.tensor((4 * g // 4,), torch.float32, 0)
    data.fill_(1.0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s at 2 GHz: the read below is still queued
        total = data.sum()
    assert not stream.query()  # still in flight
    rng.unmap([4, 5, 6, 7])
    stream.synchronize()
    assert float(total) == 4 * g // 4
    del data
    rng.close()


def test_two_processes_read_each_others_writes_through_exported_chunks():
    """The owner exports two chunks as POSIX fds to a worker process, which imports and
    maps them; each side writes one chunk with a kernel and reads the other's bytes."""
    import torch
    from vmm.cuda import CudaBackend

    owner = CudaBackend(shareable=True)
    g = owner.granularity
    handles = owner.create(2)
    va = owner.reserve(2 * g)
    owner.map([va, va + g], handles)
    shared = owner.export_handles(handles)
    view = _raw_tensor(va, 2 * g)
    view[:g].fill_(0x11)
    torch.cuda.synchronize()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        pass_fds=shared.fds, env=env, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        for fd in shared.fds:
            os.close(fd)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"fds": list(shared.fds), "granularity": g}) + "\n")
        proc.stdin.flush()
        reply = json.loads(proc.stdout.readline())
        assert reply == {"first_chunk_bytes": [0x11] * 8, "error": None}
        assert view[g : g + 8].tolist() == [0x22] * 8  # the worker's write
        assert int((view[g:] == 0x22).sum()) == g
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    del view
    owner.unmap([va, va + g])
    owner.free_reservation(va, 2 * g)
    owner.release(handles)
    owner.close()


def _raw_tensor(va: int, size: int) -> Any:
    """A uint8 CUDA tensor over `size` mapped bytes at `va` (no range object)."""
    import torch

    class _Raw:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "shape": (size,), "typestr": "|u1", "data": (va, False), "version": 3,
                "strides": None,
            }  # fmt: skip

    return torch.as_tensor(_Raw(), device="cuda")
