"""Scheduler subclasses that swap vLLM's KV-cache manager for `JengaKVCacheManager`.

Rationale
    vLLM 0.32 and 0.33 build their `KVCacheManager` inside ``Scheduler.__init__`` with no hook, and
    we may not edit vLLM's files. ``SchedulerConfig.scheduler_cls`` accepts any
    `Scheduler` subclass, so the subclass lets vLLM build everything, then replaces
    ``self.kv_cache_manager`` and resets the few derived flags that read the old one.

Approach
    The opt-in is the ``jenga_vmm`` key of ``additional_config`` (options inside it,
    `JengaVllmOptions`): the plugin then sets ``scheduler_cls`` to `JengaAsyncScheduler`
    under async scheduling and to `JengaScheduler` otherwise
    (`integrations.vllm.activation`); ``--scheduler-cls`` naming either class also works.
    Features the manager does not serve are refused up front with `UnsupportedFeature`
    (decode context parallelism over a group vLLM cannot shard, before vLLM's own manager
    asserts on it), and so is a HiSparse config (`UnsupportedLayerKind`, before vLLM's
    own manager binds its host pool);
    a KV connector vLLM built is re-bound to the jenga manager
    (`integrations.vllm.connector.bind_connector`, which refuses the ones that drive
    vLLM's own block pool); 0.33's routed-experts connector, which vLLM built on its own
    manager, is rebuilt on ours.

Limitations
    vLLM's own manager is built once and dropped (its block objects cost memory for
    the life of ``__init__`` only). Supported vLLM versions: exactly 0.32.0 and 0.33.0
    (`integrations.vllm.version`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from integrations.vllm.compat import AsyncScheduler, Scheduler, scheduler_aux_output_connector
from integrations.vllm.connector import bind_connector
from integrations.vllm.layout import build_layout
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.options import JengaVllmOptions
from integrations.vllm.specs import check_context_parallel, check_host_tier
from integrations.vllm.speculative import speculative_setup_of
from integrations.vllm.version import check_vllm_version

if TYPE_CHECKING:
    from integrations.vllm.compat import SchedulerOutput


def install_jenga_manager(scheduler: Scheduler) -> JengaKVCacheManager:
    """Replace ``scheduler.kv_cache_manager`` (built by vLLM) with a jenga-backed one."""
    options = JengaVllmOptions.from_vllm_config(scheduler.vllm_config)
    # vLLM's scheduler builds its manager with its DCP world size and pcp_world_size=1
    layout = build_layout(
        scheduler.kv_cache_config,
        scheduler.max_model_len,
        options,
        dcp_world_size=scheduler.vllm_config.parallel_config.decode_context_parallel_size,
    )
    manager = JengaKVCacheManager(
        layout,
        enable_caching=bool(scheduler.cache_config.enable_prefix_caching),
        log_stats=scheduler.log_stats,
        enable_kv_cache_events=scheduler.enable_kv_cache_events,
        kv_cache_config=scheduler.kv_cache_config,
        hash_block_size=getattr(scheduler, "hash_block_size", None),
        speculative=speculative_setup_of(scheduler),
        shared_prefix=bool(
            getattr(scheduler.cache_config, "enable_mamba_shared_prefix_checkpoint", False)
        ),
    )
    scheduler.kv_cache_manager = manager
    kv_connector = getattr(scheduler, "connector", None)
    if kv_connector is not None:  # vLLM bound it to its own manager: bind it to ours
        bind_connector(manager, kv_connector)
    if getattr(scheduler, "aux_output_connector", None) is not None:
        # 0.33 built the routed-experts connector on vLLM's manager: rebuild it on ours
        rebuilt = scheduler_aux_output_connector(manager, kv_connector)
        if rebuilt is not None:
            scheduler.aux_output_connector = rebuilt
    # Flags vLLM derived from its own manager's coordinator.
    scheduler.mamba_partial_cache_hit = bool(
        getattr(scheduler, "need_mamba_block_aligned_split", False)
        and scheduler.hash_block_size < scheduler.block_size
        and manager.enable_partial_hash_hits
    )
    scheduler.mamba_shared_prefix_checkpoint = (
        scheduler.mamba_partial_cache_hit and manager.mamba_shared_prefix_checkpoint
    )
    return manager


PLANS_ATTR = "jenga_vmm_plans"
"""Attribute of a `SchedulerOutput` holding the mapping plans made since the last one."""


def attach_mapping_plans(scheduler: Scheduler, output: SchedulerOutput) -> SchedulerOutput:
    """Hand the worker the plans queued since the last step (VMM tensors only).

    The plans ride on the `SchedulerOutput` (a plain dataclass, pickled to worker
    processes with its extra attribute), so a worker in another process learns unmaps
    as well as maps: its committed memory follows the allocator instead of growing to
    the high-water mark. Frees made while processing step N's output travel with step
    N + 1, before which the worker applies them.
    """
    manager = scheduler.kv_cache_manager
    if manager.layout.options.vmm_tensors:
        setattr(output, PLANS_ATTR, manager.take_mapping_plans())
    return output


class _JengaManagerMixin:
    """Checks, vLLM's own construction, then the manager swap; plans on every output."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_vllm_version()
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        # before vLLM's own manager, which asserts on the groups decode CP cannot shard
        kv_cache_config = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
        if kv_cache_config is not None:  # before vLLM's manager builds the HiSparse host pool
            check_host_tier(kv_cache_config)
        if vllm_config is not None and kv_cache_config is not None:
            dcp = vllm_config.parallel_config.decode_context_parallel_size
            check_context_parallel(kv_cache_config.kv_cache_groups, dcp, 1)
        super().__init__(*args, **kwargs)
        install_jenga_manager(self)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        scheduled = super().schedule(*args, **kwargs)  # type: ignore[misc]  # a mixin: vLLM's
        return attach_mapping_plans(self, scheduled)


class JengaScheduler(_JengaManagerMixin, Scheduler):
    """vLLM's Scheduler with the jenga KV-cache manager."""


class JengaAsyncScheduler(_JengaManagerMixin, AsyncScheduler):
    """vLLM's AsyncScheduler with the jenga KV-cache manager."""
