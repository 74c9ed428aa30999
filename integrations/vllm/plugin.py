"""The ``vllm.general_plugins`` entry point: VMM-backed KV tensors on the worker, opt-in.

Rationale
    vLLM loads every installed general plugin in every process, so installing
    jenga-vmm must not change vLLM by itself. `register` only wraps two worker methods;
    each wrapper checks the run's own config and, unless
    ``additional_config={"jenga_vmm": {"kv_tensors": "vmm"}}``, calls vLLM's code
    unchanged.

Approach
    - ``GPUModelRunner.initialize_kv_cache_tensors``: while vLLM's method runs, its
      module-level ``allocate_kv_cache`` is swapped for `vmm_allocate_kv_cache`, so
      vLLM's own cross-layer sharing and ``bind_kv_cache`` run on our views; the
      `VmmKVCache` is kept on the runner.
    - ``GPUModelRunner.execute_model``: before vLLM's step, the mapping plans the
      scheduler attached to the `SchedulerOutput` are applied (maps and unmaps;
      `VmmKVCache.apply_scheduler_output`).

Limitations
    Not exercised on a GPU in this repository's CI (no device); the host backend runs
    the same code in tests through `vmm_allocate_kv_cache`. With vLLM's plain
    `Scheduler` (no plans attached) the worker only maps, never unmaps.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import vmm
from integrations.vllm.kv_tensors import VmmKVCache
from integrations.vllm.layout import JengaVllmOptions, build_layout
from integrations.vllm.version import UnsupportedVllmVersion, check_vllm_version

_log = logging.getLogger(__name__)
_MARK = "_jenga_vmm_wrapped"


def register() -> None:
    """Entry point: wrap the worker methods once; a wrong vLLM version only logs."""
    try:
        check_vllm_version()
    except UnsupportedVllmVersion as exc:
        _log.warning("jenga-vmm plugin inactive: %s", exc)
        return
    from integrations.vllm.compat import gpu_model_runner_module

    gpu_model_runner = gpu_model_runner_module()
    runner = gpu_model_runner.GPUModelRunner
    if getattr(runner.initialize_kv_cache_tensors, _MARK, False):
        return
    runner.initialize_kv_cache_tensors = _wrap_initialize(  # type: ignore[method-assign]
        runner.initialize_kv_cache_tensors, gpu_model_runner
    )
    runner.execute_model = _wrap_execute(runner.execute_model)  # type: ignore[method-assign]


def wants_vmm_tensors(vllm_config: Any) -> bool:
    extra = getattr(vllm_config, "additional_config", None) or {}
    opts = extra.get("jenga_vmm") if isinstance(extra, dict) else None
    return bool(opts) and JengaVllmOptions.from_dict(opts).kv_tensors == "vmm"


def vmm_allocate_kv_cache(
    vllm_config: Any,
    kv_cache_config: Any,
    kv_cache_layout: Any,
    kernel_block_sizes: Sequence[int] | None = None,
    *,
    backend: vmm.Backend | None = None,
) -> VmmKVCache:
    """Reserve ranges and build vLLM's per-layer views for ``kv_cache_config``."""
    options = JengaVllmOptions.from_vllm_config(vllm_config)
    layout = build_layout(kv_cache_config, vllm_config.model_config.max_model_len, options)
    if backend is None:
        backend = vmm.get_backend("auto", granularity=options.chunk_bytes)
    budget = layout.total_units * options.chunk_bytes
    pool = vmm.ChunkPool(backend, budget_bytes=budget)
    return VmmKVCache(kv_cache_config, layout, pool, kv_cache_layout, kernel_block_sizes)


def _wrap_initialize(original: Callable[..., Any], module: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_kv_cache_tensors(self: Any, kv_cache_config: Any, *args: Any, **kw: Any) -> Any:
        if not wants_vmm_tensors(self.vllm_config):
            return original(self, kv_cache_config, *args, **kw)
        made: list[VmmKVCache] = []

        def allocate(config: Any, device: Any, layout: Any, kernel_sizes: Any = None) -> Any:
            made.append(vmm_allocate_kv_cache(self.vllm_config, config, layout, kernel_sizes))
            return made[-1].kv_caches

        saved = module.allocate_kv_cache
        module.allocate_kv_cache = allocate
        try:
            result = original(self, kv_cache_config, *args, **kw)
        finally:
            module.allocate_kv_cache = saved
        self.jenga_vmm_kv_cache = made[-1] if made else None
        return result

    setattr(initialize_kv_cache_tensors, _MARK, True)
    return initialize_kv_cache_tensors


def _wrap_execute(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
        cache = getattr(self, "jenga_vmm_kv_cache", None)
        if cache is not None:
            cache.apply_scheduler_output(scheduler_output)
        return original(self, scheduler_output, *args, **kw)

    setattr(execute_model, _MARK, True)
    return execute_model
