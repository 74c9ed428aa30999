"""transformers integration: `VmmCache`, a `transformers.Cache` stored in vmm chunks.

Importing this package imports torch and transformers (it is an integration, not core).
"""

from integrations.hf.cache import (
    RowStore,
    UnsupportedLayer,
    VmmCache,
    VmmCrossLayer,
    VmmLayer,
    VmmMambaLayer,
    VmmSlidingLayer,
)

__all__ = [
    "RowStore",
    "UnsupportedLayer",
    "VmmCache",
    "VmmCrossLayer",
    "VmmLayer",
    "VmmMambaLayer",
    "VmmSlidingLayer",
]
