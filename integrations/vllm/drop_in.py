"""A constructor with the signature of vLLM's `KVCacheManager` that builds ours.

Rationale
    vLLM's scheduler is the usual way in (`integrations.vllm.scheduler`), but code that
    builds a KV-cache manager directly — vLLM's own core tests, other schedulers — calls
    ``KVCacheManager(kv_cache_config, max_model_len, ...)``. Offering the same call lets
    such code run on the jenga manager unchanged (the conformance suite swaps it in this
    way) and gives the features we do not serve one clear refusal at construction.

Approach
    `jenga_kv_cache_manager` accepts vLLM's keyword arguments of every supported version,
    passes the speculative-decoding ones (``use_eagle``, ``num_prefill_lookahead``, 0.33's
    ``num_hash_lookahead_tokens``) on as a `SpeculativeSetup`, passes the context-parallel
    world sizes to `build_layout` (decode context parallelism scales a sharded group's
    block as vLLM's manager does; the groups vLLM refuses are refused with
    `UnsupportedFeature` naming them), validates the config's
    ``prefix_cache_retention_interval`` as vLLM does (`ValueError`), and builds
    `JengaKVCacheManager` on `build_layout` of the config with default `JengaVllmOptions`
    (or the ones given).

Limitations
    Every retention interval (``None``: dense, 0: vLLM's default, a positive one) is
    served: jenga caches sliding-window and Mamba entries densely and evicts by
    prefix-subset LRU, which keeps every hit vLLM's sparse retention keeps while the pool
    has room. A positive interval becomes the allocator's retention rule
    (`jenga.config.AllocationRules.retention_interval`, set by `build_layout`): the window
    blocks no retention-boundary hit reads are evicted first, so under pressure the
    boundaries' windows outlive them as vLLM's retained checkpoints do. Mamba states are
    not thinned by it.
    Arguments that only tune vLLM's own manager (``max_in_flight_tokens``,
    ``metrics_collector``, ``watermark``, ...) are accepted and not used.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions
from integrations.vllm.specs import dcp_shards
from integrations.vllm.speculative import SpeculativeSetup

if TYPE_CHECKING:
    from integrations.vllm.compat import KVCacheConfig


RETAINING_SPECS = ("SlidingWindowSpec", "MambaSpec")
"""vLLM's spec classes whose cache entries a retention interval thins out."""


def check_retention_interval(kv_cache_config: KVCacheConfig, scheduler_block_size: int) -> None:
    """vLLM's checks of ``prefix_cache_retention_interval`` (`ValueError`).

    As vLLM's coordinator: ``None`` (dense) and 0 always pass; a value on a model with no
    sliding-window or Mamba group, a negative value or one not a multiple of the
    scheduler block size is a `ValueError`. A valid positive interval becomes the
    allocator's retention rule (see the module's limitations).
    """
    interval = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    if interval is None or interval == 0:
        return
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    if not any(kind in RETAINING_SPECS for kind in kinds):
        raise ValueError(
            f"prefix_cache_retention_interval={interval}, but this model has no "
            f"sliding-window or Mamba KV-cache group ({kinds}), which is all it applies "
            "to; set it to 0"
        )
    if interval < 0 or interval % scheduler_block_size:
        raise ValueError(
            f"prefix_cache_retention_interval={interval} must be non-negative and a "
            f"multiple of scheduler_block_size ({scheduler_block_size})"
        )


def jenga_kv_cache_manager(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    *args: object,
    enable_caching: bool = True,
    use_eagle: bool = False,
    num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0,
    log_stats: bool = False,
    enable_kv_cache_events: bool = False,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    hash_block_size: int | None = None,
    scheduler_block_size: int | None = None,
    jenga_options: JengaVllmOptions | None = None,
    enable_mamba_shared_prefix_checkpoint: bool = False,
    **_vllm_only: object,
) -> JengaKVCacheManager:
    """`JengaKVCacheManager` from the arguments vLLM's `KVCacheManager` takes.

    ``scheduler_block_size`` defaults to the lcm of the groups' block sizes (each scaled by
    decode context parallelism where vLLM scales it); it only checks the retention
    interval here.
    """
    if scheduler_block_size is None:
        sizes = [
            int(g.kv_cache_spec.block_size) * dcp_shards(g.kv_cache_spec, dcp_world_size)
            for g in kv_cache_config.kv_cache_groups
        ]
        scheduler_block_size = math.lcm(*sizes) if sizes else 1
    check_retention_interval(kv_cache_config, scheduler_block_size)
    speculative = SpeculativeSetup(use_eagle, num_prefill_lookahead, num_hash_lookahead_tokens)
    speculative.check(scheduler_block_size, enable_caching)
    layout = build_layout(
        kv_cache_config, max_model_len, jenga_options, dcp_world_size, pcp_world_size
    )
    return JengaKVCacheManager(
        layout,
        enable_caching=enable_caching,
        log_stats=log_stats,
        enable_kv_cache_events=enable_kv_cache_events,
        kv_cache_config=kv_cache_config,
        hash_block_size=hash_block_size,
        speculative=speculative,
        shared_prefix=enable_mamba_shared_prefix_checkpoint,
    )
