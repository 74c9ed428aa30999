"""Every import from vLLM, and every version-dependent signature, in one module.

Rationale
    vLLM's scheduler/manager surface changes between releases (module moves, new
    arguments). With the imports spread over the product and the harness, supporting
    the next release was a search; here it is one file, and `tests/test_layout.py`
    (`test_vllm_is_imported_only_through_compat`) keeps it that way.

Approach
    - Module-level imports of what the product uses on every path (the scheduler side:
      blocks, requests, stats, events, the scheduler classes).
    - Lazy accessors (functions) for what only some paths need, or what is costly or
      version-specific to import: the worker's model-runner modules, the harness's
      configuration and request builders, kv-cache planning.
    - Version-dependent signatures are wrapped here (`get_kv_cache_configs`, ...): a
      caller never branches on the version itself. ``VLLM_VERSION`` is the installed
      version; `integrations.vllm.version.check_vllm_version` refuses others.

Limitations
    Importing this module imports vLLM (it needs vLLM installed: without it,
    `vmm.extras.MissingExtra` names the `vllm` extra); `integrations.vllm` and
    `integrations.vllm.version` do not import it.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from vmm.extras import require

require("vllm", "integrations.vllm (the vLLM scheduler and plugin)")

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    KVCacheBlockCopy,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

import vllm

if TYPE_CHECKING:  # types of the lazy accessors' results, never imported at run time
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import ModelRunnerOutput

VLLM_VERSION = str(vllm.__version__)
AT_LEAST_0_33 = tuple(int(p) for p in VLLM_VERSION.split("+")[0].split(".")[:2]) >= (0, 33)
"""0.33 differs from 0.32 in: KV-config building moved to ``kv_cache_planning``
(`get_kv_cache_configs`); the scheduler calls ``get_computed_blocks(request,
max_cache_hit_length)`` (the manager takes the bound on both); the output update that
caches blocks under async scheduling moved from ``AsyncScheduler`` into ``Scheduler``
(``_update_request_with_output``; `scheduler_owns_output_update`); the scheduler-side
auxiliary-output (routed experts) connector is built on the manager and reads its
``block_pool`` (`scheduler_aux_output_connector`); `KVCacheManager` takes
``num_hash_lookahead_tokens`` (EAGLE lookahead block hashes, refused by
`integrations.vllm.drop_in`)."""

__all__ = [
    "AT_LEAST_0_33",
    "VLLM_VERSION",
    "AllBlocksCleared",
    "AsyncScheduler",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlockCopy",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "VllmConfig",
    "create_kv_cache_views",
    "generate_block_hash_extra_keys",
    "maybe_convert_block_hash",
    "to_event_extra_keys",
]


# -- worker side ------------------------------------------------------------------------
def gpu_model_runner_module() -> ModuleType:
    """The module of vLLM's V1 ``GPUModelRunner`` (its ``allocate_kv_cache`` is swapped)."""
    from vllm.v1.worker import gpu_model_runner

    return gpu_model_runner


def v2_model_runner_module() -> ModuleType:
    """The module of vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner``)."""
    from vllm.v1.worker.gpu import model_runner

    return model_runner


def v2_attn_utils_module() -> ModuleType:
    """The V2 runner's attention utilities (holds its KV-cache allocation)."""
    from vllm.v1.worker.gpu import attn_utils

    return attn_utils


def platform_base_class() -> type:
    """vLLM's ``Platform`` base class (holds ``_align_hybrid_block_size``, the hybrid
    attention + Mamba page-size unification every GPU platform inherits)."""
    from vllm.platforms.interface import Platform

    return Platform


# -- configuration and requests (harness, tests) ------------------------------------------
def config_classes() -> dict[str, type]:
    """vLLM's config dataclasses by name: CacheConfig, DeviceConfig, ModelConfig, ..."""
    from vllm import config

    names = (
        "CacheConfig",
        "DeviceConfig",
        "KVTransferConfig",
        "ModelConfig",
        "ParallelConfig",
        "SchedulerConfig",
        "SpeculativeConfig",
        "VllmConfig",
    )
    return {name: getattr(config, name) for name in names}


def get_kv_cache_configs(
    vllm_config: VllmConfig, layer_specs: list[dict[str, KVCacheSpec]], memory_bytes: list[int]
) -> list[KVCacheConfig]:
    """vLLM's grouping and block count per worker, as its engine core computes them.

    0.32: ``kv_cache_utils.get_kv_cache_configs(config, specs, memory)``. 0.33 moved it to
    ``kv_cache_planning`` and takes the whole model's groups as a fourth argument, which
    the engine computes first with ``get_global_kv_cache_groups(config, specs)``.
    """
    if AT_LEAST_0_33:
        from vllm.v1.core import kv_cache_planning as planning

        groups = planning.get_global_kv_cache_groups(vllm_config, layer_specs)
        return list(planning.get_kv_cache_configs(vllm_config, layer_specs, memory_bytes, groups))
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as build

    return list(build(vllm_config, layer_specs, memory_bytes))


def mamba_state_calculators() -> tuple[Any, Any]:
    """vLLM's ``MambaStateShapeCalculator`` and ``MambaStateDtypeCalculator`` (the state
    shapes and dtypes its models derive from their configs)."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    return MambaStateShapeCalculator, MambaStateDtypeCalculator


def structured_output_manager(vllm_config: VllmConfig) -> Any:
    from vllm.v1.structured_output import StructuredOutputManager

    return StructuredOutputManager(vllm_config)


def sampling_params(**kwargs: Any) -> SamplingParams:
    from vllm.sampling_params import SamplingParams

    return SamplingParams(**kwargs)


def request_block_hasher(block_size: int, algorithm: str = "sha256") -> Any:
    """vLLM's per-request block hasher with the named algorithm (as the engine builds it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(algorithm)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def multimodal_feature(
    identifier: str, offset: int, length: int, modality: str
) -> MultiModalFeatureSpec:
    """A `MultiModalFeatureSpec` with no data (vLLM's "already cached" form)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality=modality,
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def model_runner_output(**kwargs: Any) -> ModelRunnerOutput:
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(**kwargs)


def aux_request_output(token_start: int, rows: Any) -> Any:
    """One request's routed-experts rows in a model runner's output (from ``token_start``)."""
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    return AuxRequestOutput(token_start, rows)


def kv_connector_output(**kwargs: Any) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(**kwargs)


def offloading_worker_metadata(completed_jobs: dict[int, int]) -> Any:
    """The worker-to-scheduler metadata of vLLM's OffloadingConnector (finished jobs)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    return OffloadingWorkerMetadata(completed_jobs=dict(completed_jobs))


def draft_token_ids(req_ids: list[str], drafts: list[list[int]]) -> Any:
    """vLLM's ``DraftTokenIds`` (what a worker's drafter proposes for the next step)."""
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds(req_ids=req_ids, draft_token_ids=drafts)


def scheduler_owns_output_update() -> bool:
    """Whether ``Scheduler`` itself defines the async-aware ``_update_request_with_output``.

    0.32: ``AsyncScheduler`` overrides it (placeholders, ``cache_blocks`` of new tokens);
    0.33: the override moved into ``Scheduler`` (``is_stale`` argument), so a subclass
    that wraps it must wrap ``Scheduler``'s on 0.33 and ``AsyncScheduler``'s on 0.32.
    """
    return AT_LEAST_0_33


def scheduler_aux_output_connector(manager: object, kv_connector: object) -> object | None:
    """0.33's scheduler-side auxiliary-output (routed experts) connector built on
    ``manager`` (it keys the rows it keeps by the manager's ``block_pool`` and its
    cached blocks); None on 0.32, whose ``AuxOutputSchedulerConnector()`` keeps its own
    state and needs no rebuilding."""
    if not AT_LEAST_0_33:
        return None
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    return AuxOutputSchedulerConnector(manager, kv_connector)


def kv_connector_base_class() -> type:
    """vLLM's `KVConnectorBase_V1` (the scheduler-side connector interface)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1


# -- engine (harness, tests) -------------------------------------------------------------
def engine_core_class() -> type:
    from vllm.v1.engine.core import EngineCore

    return EngineCore


def load_general_plugins() -> None:
    """vLLM's own plugin loader (every ``vllm.general_plugins`` entry point, once)."""
    from vllm.plugins import load_general_plugins as load

    load()


def executor_base_class() -> type:
    from vllm.v1.executor.abstract import Executor

    return Executor


def engine_core_request(**kwargs: Any) -> EngineCoreRequest:
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(**kwargs)


def greedy_engine_request(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    """A greedy request of ``max_tokens`` for vLLM's `EngineCore` that ignores EOS (no
    multimodal inputs, LoRA, salt or data-parallel rank)."""
    return engine_core_request(
        request_id=rid,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=sampling_params(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


def lora_request(name: str, adapter_id: int) -> LoRARequest:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=adapter_id, lora_path="/nonexistent")


def kv_cache_layout(name: str) -> KVCacheLayout:
    """vLLM's `KVCacheLayout` member of this name (e.g. "LBNHC")."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout[name]
