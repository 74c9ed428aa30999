"""What vLLM's engine and scheduler read off ``kv_cache_manager.coordinator``, from our state.

Rationale
    vLLM's `EngineCore` and `Scheduler` reach past the manager into its coordinator:
    ``coordinator.single_type_managers`` (each with ``block_size``, ``kv_cache_spec``,
    ``kv_cache_group_id``, ``dcp_world_size``) and ``group_block_sizes`` for the
    effective attention block size, the KV-group metadata for event consumers and the
    speculative-step block count; ``enable_partial_hash_hits``;
    ``get_num_blocks_to_allocate`` for the blocks a request still needs; and, for 0.33's
    routed-experts connector, ``full_attention_group_id`` and each group's ``block_pool``
    (`integrations.vllm.connector.CachedBlockLookup`: cached blocks by vLLM hash). Building
    vLLM's own coordinator would allocate its block pool; this view answers the same
    questions from the jenga layout and allocator.

Approach
    `GroupView` is one vLLM group as the engine sees it (vLLM's own spec object, so
    ``is_full_attention_spec`` and friends classify it as vLLM does). `CoordinatorView`
    holds them in vLLM's group order (block sizes as the layout scales them under decode
    context parallelism) and delegates block counting to the manager's
    `blocks_needed` estimate (the same one the ``full_sequence_must_fit`` gate uses).

Limitations
    Only the members the engines and schedulers of vLLM 0.32 and 0.33 read are served; anything else
    raises AttributeError naming the member (no silent default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from integrations.vllm.compat import FullAttentionSpec

if TYPE_CHECKING:
    from integrations.vllm.compat import KVCacheConfig, KVCacheSpec
    from integrations.vllm.layout import GroupLayout


@dataclass(frozen=True)
class GroupView:
    """One KV-cache group as vLLM's single-type managers describe it."""

    kv_cache_group_id: int
    kv_cache_spec: KVCacheSpec
    block_size: int  # tokens of one block, scaled by decode context parallelism
    dcp_world_size: int = 1  # ranks one block's tokens are spread over (1: replicated)
    block_pool: object = None  # `connector.CachedBlockLookup` (one for all groups)


class CoordinatorView:
    """``kv_cache_manager.coordinator`` for the jenga manager (read-only metadata)."""

    enable_partial_hash_hits = False  # the manager sets its own (`partial_hits.enabled`)

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        blocks_needed: Callable[[str, int, int], int],
        groups: Sequence[GroupLayout],
        block_pool: object = None,
    ) -> None:
        self.single_type_managers = tuple(
            GroupView(i, vg.kv_cache_spec, g.block_size, g.dcp_world_size, block_pool)
            for i, (vg, g) in enumerate(zip(kv_cache_config.kv_cache_groups, groups, strict=True))
        )
        self.group_block_sizes = tuple(g.block_size for g in self.single_type_managers)
        self._blocks_needed = blocks_needed
        # vLLM's hybrid coordinator: its first full-attention group (None: no such group)
        self.full_attention_group_id = next(
            (
                v.kv_cache_group_id
                for v in self.single_type_managers
                if isinstance(v.kv_cache_spec, FullAttentionSpec)
            ),
            None,
        )

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, *, total_computed_tokens: int = 0, **_: object
    ) -> int:
        """Blocks (in vLLM's units) the request needs to reach ``num_tokens`` tokens."""
        return self._blocks_needed(request_id, num_tokens, total_computed_tokens)

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"the jenga KV-cache manager's coordinator view does not serve {name!r} "
            "(vLLM's coordinator internals are not built)"
        )
