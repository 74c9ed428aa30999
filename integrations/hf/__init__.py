"""transformers integration: `VmmCache`, a `transformers.Cache` stored in vmm chunks.

Importing this package imports torch and transformers (it is an integration, not core).
"""

from integrations.hf.cache import RowStore, VmmCache, default_budget_bytes
from integrations.hf.layers import (
    UnsupportedLayer,
    VmmChunkedLayer,
    VmmCrossLayer,
    VmmHybridLayer,
    VmmHybridSlidingLayer,
    VmmLayer,
    VmmMambaLayer,
    VmmSlidingLayer,
)

__all__ = [
    "RowStore",
    "UnsupportedLayer",
    "VmmCache",
    "VmmChunkedLayer",
    "VmmCrossLayer",
    "VmmHybridLayer",
    "VmmHybridSlidingLayer",
    "VmmLayer",
    "VmmMambaLayer",
    "VmmSlidingLayer",
    "default_budget_bytes",
]
