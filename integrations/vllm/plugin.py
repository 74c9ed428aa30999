"""The ``vllm.general_plugins`` entry point: jenga's scheduler and VMM-backed KV tensors, opt-in.

Rationale
    vLLM loads every installed general plugin in every process, so installing
    jenga-vmm must not change vLLM by itself. `register` wraps two config methods
    (`integrations.vllm.activation`: with the ``jenga_vmm`` key in ``additional_config``
    vLLM builds jenga's scheduler for its scheduling mode), two worker methods and one
    platform method; each wrapper checks the run's own config and, without the key (for
    the worker: unless ``additional_config={"jenga_vmm": {"kv_tensors": "vmm"}}``),
    calls vLLM's code unchanged.

Approach
    - ``GPUModelRunner.initialize_kv_cache_tensors``: while vLLM's method runs, its
      module-level ``allocate_kv_cache`` is swapped for `vmm_allocate_kv_cache`, so
      vLLM's own cross-layer sharing and ``bind_kv_cache`` run on our views; the
      `VmmKVCache` is kept on the runner.
    - ``Platform.update_block_size_for_backend`` (engine start-up): with VMM tensors a
      hybrid attention + Mamba model's attention block size is not raised to the Mamba
      state's page and the state is not padded (`_wrap_hybrid_alignment`).
    - ``GPUModelRunner.execute_model``: before vLLM's step, the mapping plans the
      scheduler attached to the `SchedulerOutput` are applied (maps and unmaps;
      `VmmKVCache.apply_scheduler_output`).
    - Both model runners: vLLM 0.32 and 0.33 build their *V2* runner
      (``vllm.v1.worker.gpu.model_runner``) whenever Triton is importable. Its
      ``initialize_kv_cache`` allocates through ``attn_utils.allocate_kv_cache`` (same
      signature as V1's), so the same swap is applied there, and its ``execute_model``
      is wrapped the same way. If the V2 runner cannot be imported (no Triton) only V1
      is wrapped; if it is imported but cannot be wrapped, a V2 start-up with
      ``kv_tensors="vmm"`` raises `UnsupportedFeature` naming the runner and
      ``VLLM_USE_V2_MODEL_RUNNER=0`` — never a silent fallback to vLLM's tensors.

Limitations
    Not exercised on a GPU in this repository's CI (no device); the host backend runs
    the same code in tests through `vmm_allocate_kv_cache`. With vLLM's plain
    `Scheduler` (no plans attached) the worker only maps, never unmaps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import vmm
from integrations.vllm.errors import UnsupportedFeature
from integrations.vllm.kv_tensors import VmmKVCache
from integrations.vllm.layout import build_layout
from integrations.vllm.options import OPTIONS_KEY, JengaVllmOptions
from integrations.vllm.slot_tensors import SlotVmmKVCache
from integrations.vllm.version import UnsupportedVllmVersion, check_vllm_version

if TYPE_CHECKING:
    import torch

    from integrations.vllm.compat import KVCacheConfig, KVCacheLayout, SchedulerOutput, VllmConfig

_log = logging.getLogger(__name__)
_MARK = "_jenga_vmm_wrapped"
_ALLOCATE = "allocate_kv_cache"  # vLLM's module-level allocator, swapped while we allocate
_EXECUTE = "execute_model"  # the runner's step, wrapped to apply the plans first


def register() -> None:
    """Entry point: wrap the worker methods once; a wrong vLLM version only logs."""
    try:
        check_vllm_version()
    except UnsupportedVllmVersion as exc:
        _log.warning("jenga-vmm plugin inactive: %s", exc)
        return
    from integrations.vllm import activation, compat

    activation.install()  # the jenga_vmm key picks our scheduler class for vLLM's mode
    _wrap_hybrid_alignment(compat.platform_base_class())
    v1 = compat.gpu_model_runner_module()
    _wrap_runner(v1.GPUModelRunner, "initialize_kv_cache_tensors", v1)
    try:
        v2, v2_alloc = compat.v2_model_runner_module(), compat.v2_attn_utils_module()
    except ImportError as exc:  # vLLM then never builds the V2 runner either
        _log.info("jenga-vmm: vLLM's V2 model runner is not importable (%s)", exc)
        return
    _wrap_runner(v2.GPUModelRunner, "initialize_kv_cache", v2_alloc)


def _wrap_runner(runner: type, init_name: str, alloc_module: ModuleType) -> None:
    """Wrap one runner class's KV-cache initialisation and step, once."""
    init = getattr(runner, init_name)
    if getattr(init, _MARK, False):
        return
    if not hasattr(alloc_module, _ALLOCATE):
        setattr(runner, init_name, _refuse_vmm(init, runner))
        return
    setattr(runner, init_name, _wrap_initialize(init, alloc_module))
    setattr(runner, _EXECUTE, _wrap_execute(getattr(runner, _EXECUTE)))


def _wrap_hybrid_alignment(platform: type) -> None:
    """With VMM tensors, keep attention blocks small beside Mamba states.

    vLLM's ``update_block_size_for_backend`` (start-up) calls the platform's
    ``_align_hybrid_block_size``, which raises a hybrid model's attention block size
    until one attention page is as large as a Mamba state and pads the state to it
    (every group must fit vLLM's one shared slot size). Our VMM ranges give every group
    its own unpadded page, so with ``kv_tensors="vmm"`` vLLM's method runs on
    `keep_block_size` of the platform, whose alignment step keeps the block size the
    backend chose (16 tokens for FlashAttention) and leaves the state unpadded. Other
    runs call vLLM's code unchanged.
    """
    original = platform.__dict__["update_block_size_for_backend"].__func__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def update_block_size_for_backend(cls: type, vllm_config: VllmConfig) -> Any:
        if wants_vmm_tensors(vllm_config):
            cls = keep_block_size(cls)
        return original(cls, vllm_config)

    setattr(update_block_size_for_backend, _MARK, True)
    platform.update_block_size_for_backend = classmethod(  # type: ignore[attr-defined]
        update_block_size_for_backend
    )


@functools.cache
def keep_block_size(platform: type) -> type:
    """``platform`` whose hybrid alignment keeps the block size and pads no state."""

    class KeepBlockSize(platform):  # type: ignore[valid-type,misc,unused-ignore]
        @classmethod
        def _align_hybrid_block_size(cls, vllm_config: VllmConfig, backend_cls: type) -> None:
            cache = vllm_config.cache_config
            if cache.mamba_cache_mode == "align":
                cache.mamba_block_size = cache.block_size
            _log.info(
                "jenga-vmm: keeping %d-token attention blocks beside unpadded Mamba states",
                cache.block_size,
            )

    KeepBlockSize.__name__ = KeepBlockSize.__qualname__ = f"JengaVmm{platform.__name__}"
    return KeepBlockSize


def _refuse_vmm(original: Callable[..., Any], runner: type) -> Callable[..., Any]:
    """A runner whose allocation we cannot reach: refuse VMM tensors, never ignore them."""

    @functools.wraps(original)
    def initialize(self: Any, *args: Any, **kw: Any) -> Any:
        if wants_vmm_tensors(self.vllm_config):
            raise UnsupportedFeature(
                f"kv_tensors='vmm' cannot take effect under {runner.__module__}."
                f"{runner.__qualname__} (its KV allocation is not reachable); select the "
                "other model runner with VLLM_USE_V2_MODEL_RUNNER=0, or use kv_tensors='torch'"
            )
        return original(self, *args, **kw)

    setattr(initialize, _MARK, True)
    return initialize


def wants_vmm_tensors(vllm_config: VllmConfig) -> bool:
    extra = getattr(vllm_config, "additional_config", None) or {}
    opts = extra.get(OPTIONS_KEY) if isinstance(extra, dict) else None
    return bool(opts) and JengaVllmOptions.from_dict(opts).vmm_tensors


def vmm_allocate_kv_cache(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    kv_cache_layout: KVCacheLayout,
    kernel_block_sizes: Sequence[int] | None = None,
    *,
    backend: vmm.Backend | None = None,
) -> VmmKVCache | SlotVmmKVCache:
    """Reserve ranges and build vLLM's per-layer views for ``kv_cache_config`` (one range
    per group or layer, or for ``geometry="slots"`` vLLM's buffer on one range)."""
    options = JengaVllmOptions.from_vllm_config(vllm_config)
    dcp = vllm_config.parallel_config.decode_context_parallel_size  # as the scheduler's
    layout = build_layout(kv_cache_config, vllm_config.model_config.max_model_len, options, dcp)
    slots = layout.slot_chunks  # the "slots" geometry: chunks of every capped slot
    units = slots.footprint(layout.total_units + 1) if slots else layout.total_units
    budget = units * options.chunk_bytes
    if backend is None and options.shared_pool:
        backend = _join_shared_pool(options, budget)
    if backend is None:
        backend = vmm.get_backend("auto", granularity=options.chunk_bytes)
    pool = vmm.ChunkPool(backend, budget_bytes=budget)
    cls = SlotVmmKVCache if slots else VmmKVCache
    return cls(kv_cache_config, layout, pool, kv_cache_layout, kernel_block_sizes)


def _join_shared_pool(options: JengaVllmOptions, budget: int) -> vmm.Backend:
    """A tenant backend of the shared pool `options.shared_pool` (max: the KV budget)."""
    import os

    from vmm.shared import join_pool

    hi = budget if options.tenant_max_bytes is None else options.tenant_max_bytes
    backend = join_pool(
        options.shared_pool,
        options.tenant_name or f"vllm-{os.getpid()}",
        min_bytes=options.tenant_min_bytes,
        max_bytes=hi,
    )
    if backend.granularity != options.chunk_bytes:
        backend.close()
        raise ValueError(
            f"shared pool {options.shared_pool!r} lends {backend.granularity}-byte chunks, "
            f"jenga_vmm chunk_bytes is {options.chunk_bytes}"
        )
    return backend


@contextlib.contextmanager
def vmm_allocation(
    module: ModuleType,
    vllm_config: VllmConfig,
    made: list[VmmKVCache | SlotVmmKVCache],
    backend: vmm.Backend | None = None,
) -> Iterator[None]:
    """While inside, ``module.allocate_kv_cache`` builds `VmmKVCache` s (kept in ``made``)."""

    def allocate(
        config: KVCacheConfig,
        device: object,
        layout: KVCacheLayout,
        kernel_sizes: Sequence[int] | None = None,
    ) -> dict[str, torch.Tensor]:
        made.append(
            vmm_allocate_kv_cache(vllm_config, config, layout, kernel_sizes, backend=backend)
        )
        return made[-1].kv_caches

    saved = getattr(module, _ALLOCATE)
    setattr(module, _ALLOCATE, allocate)
    try:
        yield
    finally:
        setattr(module, _ALLOCATE, saved)


def _wrap_initialize(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_kv_cache_tensors(
        self: Any, kv_cache_config: KVCacheConfig, *args: Any, **kw: Any
    ) -> Any:
        if not wants_vmm_tensors(self.vllm_config):
            return original(self, kv_cache_config, *args, **kw)
        made: list[VmmKVCache | SlotVmmKVCache] = []
        with vmm_allocation(module, self.vllm_config, made):
            result = original(self, kv_cache_config, *args, **kw)
        self.jenga_vmm_kv_cache = made[-1] if made else None
        return result

    setattr(initialize_kv_cache_tensors, _MARK, True)
    return initialize_kv_cache_tensors


def _wrap_execute(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: SchedulerOutput, *args: Any, **kw: Any) -> Any:
        cache = getattr(self, "jenga_vmm_kv_cache", None)
        if cache is not None:
            cache.apply_scheduler_output(scheduler_output)
        return original(self, scheduler_output, *args, **kw)

    setattr(execute_model, _MARK, True)
    return execute_model
