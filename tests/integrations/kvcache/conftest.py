"""Small models and pools for the KV cache tests: 4 KiB host chunks keep pages tiny.

With float32, 2 KV heads x head_dim 8 and 4-token blocks, one block of one layer is
2 * 4 * 2 * 8 * 4 = 512 B, so a 4 KiB chunk holds 8 blocks (32 tokens) per range.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec

import vmm
from integrations.kvcache import KVCache, KVCacheConfig

CHUNK = 4096
HEADS, DIM, BLOCK = 2, 8, 4


def full_spec() -> LayerSpec:
    return LayerSpec(Kind.FULL, num_kv_heads=HEADS, head_dim=DIM, dtype_bytes=4, block_size=BLOCK)


def window_spec(window: int = 8) -> LayerSpec:
    return LayerSpec(
        Kind.SLIDING_WINDOW,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype_bytes=4,
        block_size=BLOCK,
        window=window,
    )


def hybrid_model(window: int = 8, max_len: int = 4096) -> ModelSpec:
    """Layers 0, 2 full attention; 1, 3 sliding window."""
    return ModelSpec(
        "hybrid-tiny",
        (
            KVGroup("full", full_spec(), (0, 2)),
            KVGroup("sliding_window", window_spec(window), (1, 3)),
        ),
        max_model_len=max_len,
    )


MakeCache = Callable[..., KVCache]


@pytest.fixture
def make_cache() -> Iterator[MakeCache]:
    """make_cache(model, budget_chunks, **config) -> KVCache over a fresh host pool."""
    pools: list[vmm.ChunkPool] = []

    def make(model: ModelSpec, budget_chunks: int = 64, **config: object) -> KVCache:
        backend = vmm.get_backend("host", granularity=CHUNK, capacity=64 << 20)
        pool = vmm.ChunkPool(backend, budget_chunks * CHUNK)
        pools.append(pool)
        config.setdefault("dtype", torch.float32)
        return KVCache(model, pool, KVCacheConfig(**config))  # type: ignore[arg-type]

    yield make
    for pool in pools:
        pool.close()
