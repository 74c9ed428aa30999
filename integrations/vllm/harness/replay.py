"""Drive a real vLLM 0.32 `Scheduler` on CPU with fake model outputs.

Rationale
    The scheduler, its KV-cache manager and their interplay (chunked prefill, prefix
    hits, preemption) are what we change; the model is not. vLLM's own scheduler tests
    build a `Scheduler` from a local folder holding only a tiny ``config.json``
    (``skip_tokenizer_init=True``, ``DeviceConfig(device="cpu")``) and feed it
    `ModelRunnerOutput` s by hand. This module does the same so tests and the
    side-by-side comparison run vLLM's real scheduling code against either manager.

Approach
    - `make_vllm_config`: a `VllmConfig` for a tiny Llama folder written on the fly
      (or a tiny Whisper folder from `integrations.vllm.harness.encdec` for cross attention);
      the hybrid KV-cache manager is re-enabled after validation (vLLM turns it off on
      CPU platforms, where it would run on a GPU).
    - `kv_cache_config_for`: vLLM's own `get_kv_cache_configs` on per-layer specs and a
      byte budget, so both managers see the grouping and memory vLLM would use.
    - `make_scheduler` / `expect_manager`: vLLM's scheduler or ours, each checked to run
      the manager it claims (vLLM's own `KVCacheManager` for a baseline).
    - `replay`: steps until every request finishes; a request gets one sampled token
      per step once its prompt (and any recomputation) is done. After every step it
      checks that no block id is held by two running requests of one group.

Limitations
    No model runs: token ids are a deterministic function of (request, step).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from integrations.vllm import compat
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.scheduler import JengaAsyncScheduler, JengaScheduler

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "torch_dtype": "float16",
    "rms_norm_eps": 1e-5,
    "head_dim": 16,
}


@dataclass(frozen=True)
class SchedulerSetup:
    """Scheduling limits of one run."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    enable_prefix_caching: bool = True
    mamba_cache_mode: str = "align"
    #: None: vLLM decides (async unless something rules it out)
    async_scheduling: bool | None = False
    #: the ``jenga_vmm`` key of ``additional_config``; None: no key (jenga off)
    jenga_options: Mapping[str, Any] | None = field(default_factory=dict)
    #: vLLM's ``SpeculativeConfig`` arguments (e.g. n-gram lookup); None: no speculation
    speculative: Mapping[str, Any] | None = None


def write_tiny_model(folder: Path) -> Path:
    """A model folder holding only ``config.json`` (enough for `ModelConfig`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_TINY_LLAMA))
    return folder


def is_encoder_decoder_folder(folder: Path) -> bool:
    """A model folder written by `integrations.vllm.harness.encdec` (it has a feature
    extractor, so vLLM sizes the encoder budget from it)."""
    return (folder / "preprocessor_config.json").exists()


def make_vllm_config(model_dir: Path, setup: SchedulerSetup) -> Any:
    classes = compat.config_classes()
    encdec = is_encoder_decoder_folder(model_dir)  # needs its tokenizer (see encdec.py)
    extra: dict[str, Any] = {"mm_hasher_algorithm": "sha256"} if encdec else {}
    model_config = classes["ModelConfig"](
        model=str(model_dir),
        skip_tokenizer_init=not encdec,
        dtype="float16",
        seed=0,
        max_model_len=setup.max_model_len,
        **extra,
    )
    scheduler_config = classes["SchedulerConfig"](
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        async_scheduling=setup.async_scheduling,
    )
    cache_config = classes["CacheConfig"](
        block_size=setup.block_size, enable_prefix_caching=setup.enable_prefix_caching
    )
    config = classes["VllmConfig"](
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=classes["DeviceConfig"](device="cpu"),
        additional_config=(
            {} if setup.jenga_options is None else {"jenga_vmm": dict(setup.jenga_options)}
        ),
        speculative_config=_speculative_config(setup, model_config),
    )
    # As on a GPU platform: hybrid groups, a resolved layout, Mamba "align" caching.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.cache_config.kv_cache_layout = "LBNHC"
    config.cache_config.mamba_cache_mode = setup.mamba_cache_mode
    return config


def _speculative_config(setup: SchedulerSetup, model_config: Any) -> Any:
    """vLLM's ``SpeculativeConfig`` of ``setup.speculative`` for this target (or None)."""
    if setup.speculative is None:
        return None
    classes = compat.config_classes()
    return classes["SpeculativeConfig"](
        **setup.speculative,
        target_model_config=model_config,
        target_parallel_config=classes["ParallelConfig"](),
    )


def kv_cache_config_for(vllm_config: Any, layer_specs: Mapping[str, Any], memory_bytes: int) -> Any:
    """vLLM's own grouping and block count for these per-layer specs and bytes."""
    return compat.get_kv_cache_configs(vllm_config, [dict(layer_specs)], [memory_bytes])[0]


def make_scheduler(vllm_config: Any, kv_cache_config: Any, *, jenga: bool) -> Any:
    """vLLM's `Scheduler` (``jenga=False``) or ours, on the same configs."""
    is_async = bool(vllm_config.scheduler_config.async_scheduling)
    if jenga:
        cls: Any = JengaAsyncScheduler if is_async else JengaScheduler
    else:
        cls = compat.AsyncScheduler if is_async else compat.Scheduler
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=compat.structured_output_manager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=True,
    )
    expect_manager(scheduler, jenga=jenga)
    return scheduler


def expect_manager(scheduler: Any, *, jenga: bool) -> None:
    """Raise unless ``scheduler`` runs our manager (``jenga``) or exactly vLLM's own
    `KVCacheManager`. A comparison with vLLM's manager must not run ours twice: with the
    ``jenga_vmm`` key in ``additional_config`` the plugin makes vLLM's engine build our
    scheduler, so a baseline engine must be configured without the key."""
    wanted = JengaKVCacheManager if jenga else compat.KVCacheManager
    got = type(scheduler.kv_cache_manager)
    if got is not wanted:
        raise RuntimeError(
            f"{type(scheduler).__qualname__} runs {got.__module__}.{got.__qualname__}; "
            f"expected {wanted.__module__}.{wanted.__qualname__} (jenga={jenga})"
        )


def engine_core(
    model_dir: Path,
    executor_class: type,
    *,
    jenga: bool,
    options: Mapping[str, Any] | None = None,
    configure: Callable[[Any], None] | None = None,
    **setup: Any,
) -> Any:
    """vLLM's `EngineCore` over ``executor_class`` (a host executor from
    `integrations.vllm.harness`) on our manager (``options``: the ``jenga_vmm`` key, {} when
    None) or, ``jenga=False``, on vLLM's own: that config holds no key, which would make a
    loaded plugin build ours; `expect_manager` checks either way. ``setup``:
    `SchedulerSetup` fields; ``configure(config)`` edits the vLLM config before the core is
    built (a KV connector, decode context parallelism, routed experts)."""
    jenga_options = (dict(options) if options is not None else {}) if jenga else None
    config = make_vllm_config(model_dir, SchedulerSetup(jenga_options=jenga_options, **setup))
    if configure is not None:
        configure(config)
    if jenga:
        name = "JengaAsyncScheduler" if setup.get("async_scheduling") else "JengaScheduler"
        config.scheduler_config.scheduler_cls = f"integrations.vllm.scheduler.{name}"
    core = compat.engine_core_class()(config, executor_class, log_stats=True)
    expect_manager(core.scheduler, jenga=jenga)
    return core


def make_requests(
    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], block_size: int, prefix: str = "r"
) -> list[Any]:
    """vLLM `Request` s with vLLM's sha256 block hashes (both managers key blocks by them)."""
    hasher = compat.request_block_hasher(block_size, "sha256")
    return [
        compat.Request(
            request_id=f"{prefix}{i}",
            prompt_token_ids=list(prompt),
            sampling_params=compat.sampling_params(max_tokens=n, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
        )
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]


@dataclass
class ReplayReport:
    """What one replay observed."""

    steps: int = 0
    max_running: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    resumed_hit_tokens: int = 0  # hits of preempted requests coming back
    scheduler_seconds: float = 0.0  # wall time in schedule() + update_from_output()
    scheduler_cpu_ns: int = 0  # thread CPU time in schedule() + update_from_output()
    output_tokens: dict[str, int] = field(default_factory=dict)
    running_per_step: list[int] = field(default_factory=list)


def replay(
    scheduler: Any,
    requests: Sequence[Any],
    *,
    max_steps: int = 10_000,
    after_step: Callable[[Any, Any], None] | None = None,
    check_blocks: bool = True,
) -> ReplayReport:
    """Add ``requests`` and step the scheduler with fake outputs until all finish.

    ``scheduler_seconds`` of the report sums the wall time of ``schedule`` and
    ``update_from_output`` alone (the manager's cost rides in both), ``scheduler_cpu_ns``
    their thread CPU time (another process's load does not count); ``check_blocks``
    runs `check_no_shared_live_blocks` after every step (outside that time).
    """
    report = ReplayReport()
    for req in requests:
        scheduler.add_request(req)
    by_id = {r.request_id: r for r in requests}
    while scheduler.get_num_unfinished_requests():
        if report.steps >= max_steps:
            raise RuntimeError(f"replay did not finish in {max_steps} steps")
        start, cpu = time.perf_counter(), time.thread_time_ns()
        out = scheduler.schedule()
        report.scheduler_cpu_ns += time.thread_time_ns() - cpu
        report.scheduler_seconds += time.perf_counter() - start
        report.steps += 1
        report.preemptions += len(out.preempted_req_ids or ())
        report.max_running = max(report.max_running, len(scheduler.running))
        report.running_per_step.append(len(scheduler.running))
        if check_blocks:
            check_no_shared_live_blocks(scheduler)
        runner_output = fake_model_output(out, by_id, report.steps)
        start, cpu = time.perf_counter(), time.thread_time_ns()
        engine_outputs = scheduler.update_from_output(out, runner_output)
        report.scheduler_cpu_ns += time.thread_time_ns() - cpu
        report.scheduler_seconds += time.perf_counter() - start
        _collect_stats(report, engine_outputs)
        if after_step is not None:
            after_step(scheduler, out)
    report.output_tokens = {r.request_id: r.num_output_tokens for r in requests}
    return report


def fake_model_output(out: Any, by_id: Mapping[str, Any], step: int) -> Any:
    """The `ModelRunnerOutput` of a step: one token for every request whose prompt (and
    any recomputation) this step completes, a deterministic id of (request, step)."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = by_id[rid]
        done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
        sampled.append([1000 + (hash(rid) + step) % 20000] if done else [])
    return compat.model_runner_output(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )


def _collect_stats(report: ReplayReport, engine_outputs: Mapping[int, Any]) -> None:
    for outputs in engine_outputs.values():
        stats = getattr(outputs, "scheduler_stats", None)
        if stats is None or stats.prefix_cache_stats is None:
            continue
        report.prefix_hit_tokens += stats.prefix_cache_stats.hits
        report.prefix_query_tokens += stats.prefix_cache_stats.queries
        report.resumed_hit_tokens += stats.prefix_cache_stats.preempted_hits


def check_no_shared_live_blocks(scheduler: Any) -> None:
    """Raise AssertionError if two running requests hold one block id of one group.

    Blocks shared through a prefix hit are the exception vLLM and jenga both make: a
    block may be in two tables when it is a hashed (read-only) cached block; only
    blocks not yet committed to the cache must be exclusive.
    """
    manager = scheduler.kv_cache_manager
    # vLLM's pool and jenga on vLLM's tensors hand out ids unique across groups
    across_groups = getattr(manager, "shares_block_ids", True)
    owners: dict[tuple[int, int], tuple[str, int]] = {}
    for req in scheduler.running:
        blocks = manager.get_blocks(req.request_id).blocks
        for g, row in enumerate(blocks):
            for blk in row:
                if blk.is_null:
                    continue
                key = (-1 if across_groups else g, blk.block_id)
                owner = owners.get(key)
                if owner is not None and owner[1] == g and _is_shared_prefix_block(manager, g, blk):
                    continue
                assert owner is None, (
                    f"block {blk.block_id} held by {owner[0]} (group {owner[1]}) and "
                    f"{req.request_id} (group {g})"
                )
                owners[key] = (req.request_id, g)


def _is_shared_prefix_block(manager: Any, group: int, blk: Any) -> bool:
    if not hasattr(manager, "is_cached_block"):  # vLLM's manager: hashed blocks may be shared
        return blk.block_hash is not None
    return bool(manager.is_cached_block(group, blk.block_id))
