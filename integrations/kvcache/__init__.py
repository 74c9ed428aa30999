"""KV caches on vmm ranges, driven by the jenga allocator.

    pool = vmm.ChunkPool(vmm.get_backend("host"), 1 << 30)
    kv = KVCache(model_spec, pool, KVCacheConfig(dtype=torch.float16))
    kv.add_request("r", prompt)
    kv.allocate("r", len(prompt))              # maps the large pages jenga picked
    k_blocks = kv.block_view(layer)            # [blocks, 2, T, H, D] zero-copy tensor
    kv.block_table("r", group)                 # block ids for the kernel

Importing this package does not import torch (tensors are built lazily).
"""

from integrations.kvcache.cache import KVCache, KVCacheBroken, KVCacheConfig
from integrations.kvcache.geometry import GroupGeometry, LayoutError
from integrations.kvcache.translate import PlanTranslationError, translate

__all__ = [
    "GroupGeometry",
    "KVCache",
    "KVCacheBroken",
    "KVCacheConfig",
    "LayoutError",
    "PlanTranslationError",
    "translate",
]
