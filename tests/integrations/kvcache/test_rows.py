"""per_request rows: chunks mapped as a request grows, shared prefixes, copy-on-write."""

from __future__ import annotations

import pytest
import torch
from integrations.kvcache.geometry import LayoutError
from integrations.kvcache.rows import RowKVCache, RowShape

import vmm

CHUNK = 4096  # 2 heads x 16 dims x fp32 = 128 B per token: 32 tokens per chunk


@pytest.fixture
def rows():
    backend = vmm.get_backend("host", granularity=CHUNK, capacity=16 << 20)
    pool = vmm.ChunkPool(backend, 64 * CHUNK)
    cache = RowKVCache(pool, RowShape(2, 4, 100, 2, 16, torch.float32))
    yield cache
    pool.close()


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)


def test_rows_grow_chunk_by_chunk_and_free(rows: RowKVCache):
    assert (rows.tokens_per_chunk, rows.chunks_per_row, rows.row_tokens) == (32, 4, 128)
    assert rows.add_request("a") == 0
    rows.grow("a", 40)  # 2 chunks x 4 ranges (2 layers x K, V)
    assert rows.pool.stats()["chunks.mapped.current"] == 8
    k, v = kv(40, 1)
    rows.write(1, "a", 0, k, v)
    got_k, got_v = rows.read(1, "a", 40)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert got_k.data_ptr() == rows.row_view(1, 0).data_ptr()  # row 0: a zero-copy view
    rows.check_invariants()
    rows.free("a")
    assert rows.pool.stats()["chunks.mapped.current"] == 0
    rows.check_invariants()


def test_shared_prefix_maps_the_same_chunks_and_copies_on_write(rows: RowKVCache):
    rows.add_request("a")
    rows.grow("a", 48)  # chunk 0 full, chunk 1 holds 16 of 32 tokens
    k, v = kv(48, 2)
    for layer in (0, 1):
        rows.write(layer, "a", 0, k, v)
    rows.add_request("b")
    rows.share_prefix("b", "a", 48)
    stats = rows.pool.stats()
    assert (stats["chunks.mapped.current"], stats["chunks.shared.current"]) == (8, 8)
    assert torch.equal(rows.read(0, "b", 48)[0], k)
    rows.grow("b", 50)
    k2, v2 = kv(2, 3)
    for layer in (0, 1):
        rows.write(layer, "b", 48, k2, v2)  # into the shared, partly filled chunk 1: CoW
    stats = rows.pool.stats()
    assert rows.stats["rows.cow_chunks"] == 1
    assert (stats["chunks.mapped.current"], stats["chunks.shared.current"]) == (12, 4)
    assert torch.equal(rows.read(1, "b", 50)[0], torch.cat([k, k2]))
    assert torch.equal(rows.read(1, "a", 48)[1], v)  # a's copy untouched
    rows.check_invariants()
    rows.free("a")  # chunk 0 stays mapped for b
    assert rows.pool.stats()["chunks.mapped.current"] == 8
    assert torch.equal(rows.read(0, "b", 50)[1], torch.cat([v, v2]))
    rows.check_invariants()


def test_bad_requests_raise(rows: RowKVCache):
    rows.add_request("a")
    with pytest.raises(LayoutError, match="129 tokens exceed the row of 128"):
        rows.grow("a", 129)
    with pytest.raises(LayoutError, match="row has 0 tokens mapped"):
        rows.write(0, "a", 0, *kv(1, 0))
    for rid in "bcd":
        rows.add_request(rid)
    with pytest.raises(vmm.OutOfMemory, match="all 4 rows"):
        rows.add_request("e")
