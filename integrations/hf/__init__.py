"""transformers integration: `VmmCache`, a `transformers.Cache` stored in vmm chunks.

Importing this package imports torch and transformers (it is an integration, not core).
Hand the cache over with ``model.generate(**inputs, **cache_kwargs(cache))``: ``cache=``
from transformers 5.24, ``past_key_values=`` before.
"""

from vmm.extras import require

require("torch", "integrations.hf (the transformers KV cache)", extra="hf")
require("transformers", "integrations.hf (the transformers KV cache)", extra="hf")

from integrations.hf.cache import RowStore, VmmCache, default_budget_bytes  # noqa: E402
from integrations.hf.compat import cache_kwargs  # noqa: E402
from integrations.hf.layers import (  # noqa: E402
    UnsupportedLayer,
    VmmChunkedLayer,
    VmmCrossLayer,
    VmmHybridLayer,
    VmmHybridSlidingLayer,
    VmmLatentLayer,
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
    "VmmLatentLayer",
    "VmmLayer",
    "VmmMambaLayer",
    "VmmSlidingLayer",
    "cache_kwargs",
    "default_budget_bytes",
]
