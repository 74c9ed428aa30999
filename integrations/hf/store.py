"""`LayerStore`: what a `VmmCache` layer object needs from the rows it stores into.

The layer classes (`integrations.hf.layers`) read and write through this protocol; the
HF cache's `RowStore` (`integrations.hf.cache`) and the mini engine's `RequestStore`
(`integrations.engine.model_forward`) implement it. Keeping it apart lets the layers
module type its store without importing the cache module that imports it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import torch

from integrations.kvcache import KVCache


class LayerStore(Protocol):
    """Batch rows over a `KVCache`: one allocator request per row, grown together."""

    num_rows: int
    length: int  # tokens allocated in every row
    image_tokens: int  # cross-attention tokens per row (0: none)
    recurrent_offset: int  # byte offset of a recurrent state in its state block
    state_layers: list[Any]  # layers with states, re-pointed when a row's state moves

    @property
    def kv(self) -> KVCache: ...

    def ensure(
        self, num_rows: int, length: int, dtype: torch.dtype | None = None, *,
        check_dtype: bool = True,
    ) -> None:  # fmt: skip
        """Have `length` tokens allocated in each of `num_rows` rows (or raise)."""

    def request(self, row: int) -> Hashable:
        """The allocator request of batch row `row`."""

    def table(self, row: int, group: int) -> list[int]:
        """Row `row`'s block table in group `group`."""

    def attention_group(self, layer: int) -> int:
        """The group whose blocks hold layer `layer`'s K/V."""

    def state_group(self, layer: int) -> int:
        """The Mamba group whose blocks hold layer `layer`'s states."""
