"""A KV connector whose remote store holds one prompt prefix, for scheduler tests.

vLLM's scheduler loads it by name (``kv_connector="PrefixStoreConnector"`` with
``kv_connector_module_path`` naming this module). Its scheduler side answers
``get_num_new_matched_tokens`` with the stored prefix beyond the local hit (``stored_tokens``
in ``kv_connector_extra_config``), loaded synchronously, restores the Mamba state at the end
of what it loads when ``supports_divergent_local_hybrid_hits`` is set (as vLLM's NIXL
connector does), and records what the scheduler asked and handed it
(`PrefixStoreConnector.seen`). The worker side moves no data: these tests run no model.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class PrefixStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Serves ``stored_tokens`` of every prompt from a store beside the GPU cache."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.stored_tokens = int(extra["stored_tokens"])
        self._divergent = bool(extra.get("supports_divergent_local_hybrid_hits", False))
        # per request: (local hit it was told, tokens it offered, block ids it was handed)
        self.seen: dict[str, tuple[int, int, tuple[list[int], ...]]] = {}
        self._asked: dict[str, tuple[int, int]] = {}

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._divergent

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        stored = min(self.stored_tokens, request.num_tokens - 1)
        offered = max(0, stored - num_computed_tokens)
        self._asked[request.request_id] = (num_computed_tokens, offered)
        return offered, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        local, _ = self._asked[request.request_id]
        ids = tuple(list(row) for row in blocks.get_block_ids())
        self.seen[request.request_id] = (local, num_external_tokens, ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None  # nothing is saved: the blocks are freed at once

    # -- worker side (no model runs in these tests) ---------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
