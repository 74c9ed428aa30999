"""vLLM's real `EngineCore` on a CPU: only the model executor is ours (fake outputs).

Rationale
    ``--scheduler-cls`` is used by vLLM's engine, not by our tests: `EngineCore.__init__`
    profiles memory, builds the KV-cache config, constructs the scheduler and then reads
    the manager's coordinator metadata. The model executor needs a GPU; everything else
    runs here, so the engine's start-up and steps are exercised for real.

Approach
    `HostExecutor` is a `vllm.v1.executor.abstract.Executor` whose one in-process
    `HostWorker` answers the calls vLLM's engine makes (KV specs, available memory,
    layouts, ``initialize_from_config``, ``execute_model``, ``sample_tokens``, and with
    speculative decoding configured ``take_draft_token_ids``: every decoding request gets
    ``num_speculative_tokens`` drafts, all accepted in the next step; Mamba specs then
    keep a state per draft token, as vLLM's Mamba layers build them). With routed experts
    returned (``enable_return_routed_experts``) each sampling step also returns, per
    request, one row per token from the request's emit start (the scheduler's
    auxiliary-output metadata) up to the sampled token: `routed_row` of its position,
    as a worker that kept every row would. With
    ``kv_tensors="vmm"`` the worker builds the VMM KV tensors on the host backend
    (`integrations.vllm.plugin.vmm_allocate_kv_cache`) and applies each step's plans,
    as the GPU runner's wrapper does. Each step samples one deterministic token for
    every request whose prompt the step completes.

Limitations
    One worker, no model, no sampling; the KV tensors are never read or written.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import numpy as np

import vmm
from integrations.vllm import compat
from integrations.vllm.harness import cases, replay
from integrations.vllm.kv_tensors import VmmKVCache
from integrations.vllm.plugin import vmm_allocate_kv_cache, wants_vmm_tensors
from integrations.vllm.slot_tensors import SlotVmmKVCache


class HostWorker:
    """The worker-side calls of vLLM's engine, answered on the host."""

    def __init__(self, vllm_config: Any, case: str, memory_bytes: int) -> None:
        self.vllm_config = vllm_config
        specs = cases.layer_specs(case, block_size=vllm_config.cache_config.block_size)
        self.specs = _with_speculative_states(specs, vllm_config)
        self.memory_bytes = memory_bytes
        # request -> per group the block ids the scheduler sent, appended as vLLM's
        # worker appends a running request's new blocks to its block table
        self.block_tables: dict[str, list[list[int]]] = {}
        self.kv_cache: VmmKVCache | SlotVmmKVCache | None = None
        self.lengths: dict[str, int] = {}
        self.steps = 0
        self.pending: Any = None
        self.decoding: list[str] = []  # requests the last step sampled a token for
        self.accepted_drafts = 0
        self.emit_start: dict[str, int] = {}  # routed experts: the next row to return

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return dict(self.specs)

    def determine_available_memory(self) -> int:
        return self.memory_bytes

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def set_kv_cache_layout(self, layout_name: str, interleave_size: int | None = None) -> None:
        """0.32 passes the layout's name; 0.33 also the context-parallel interleave size."""
        self.layout_name = layout_name

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        if wants_vmm_tensors(self.vllm_config):
            chunk = compat_chunk_bytes(self.vllm_config)
            backend = vmm.HostBackend(chunk, capacity=self.memory_bytes + chunk)
            self.kv_cache = vmm_allocate_kv_cache(
                self.vllm_config,
                kv_cache_configs[0],
                compat.kv_cache_layout("LBNHC"),
                backend=backend,
            )

    def execute_model(self, scheduler_output: Any) -> None:
        if self.kv_cache is not None:
            self.kv_cache.apply_scheduler_output(scheduler_output)
        self._update_block_tables(scheduler_output)
        self.pending = scheduler_output
        return None

    def _update_block_tables(self, out: Any) -> None:
        """A new (or resumed) request's table is the one sent; a running request's
        grows by the rows ``allocate_slots`` returned."""
        for rid in getattr(out, "finished_req_ids", ()):
            self.block_tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if ids is None:
                continue
            if rid in resumed or rid not in self.block_tables:
                self.block_tables[rid] = [list(row) for row in ids]
            else:
                for table, row in zip(self.block_tables[rid], ids, strict=True):
                    table.extend(row)

    def sample_tokens(self, grammar_output: Any) -> Any:
        out, self.pending = self.pending, None
        self.steps += 1
        for new in out.scheduled_new_reqs:
            self.lengths[new.req_id] = len(new.prompt_token_ids)
        cached = out.scheduled_cached_reqs
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        ids = list(out.num_scheduled_tokens)
        sampled = []
        drafts = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        for rid in ids:
            done = computed[rid] + out.num_scheduled_tokens[rid] >= self.lengths[rid]
            token = [1000 + (len(rid) * 7 + self.steps) % 20000] if done else []
            accepted = list(drafts.get(rid, ())) if done else []
            sampled.append(accepted + token)
            self.accepted_drafts += len(accepted)
            self.lengths[rid] += len(sampled[-1])
        self.decoding = [rid for rid, got in zip(ids, sampled, strict=True) if got]
        more = {}
        if self.vllm_config.aux_output_config.enabled:
            more["aux_output_connector_output"] = self._routed_experts(out, computed)
        return compat.model_runner_output(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            **more,
        )

    def _routed_experts(self, out: Any, computed: dict[str, int]) -> dict[str, Any]:
        """Per request that sampled this step, its rows from its emit start up to the
        sampled token (the step's last position)."""
        starts = out.aux_output_connector_metadata.requests
        rows = {}
        for rid in self.decoding:
            start = self.emit_start.get(rid, starts[rid])
            end = computed[rid] + out.num_scheduled_tokens[rid]
            rows[rid] = compat.aux_request_output(start, routed_row(np.arange(start, end)))
            self.emit_start[rid] = end
        return rows

    def take_draft_token_ids(self) -> Any:
        """Drafts for the requests the last step sampled for (None: no speculation)."""
        spec = self.vllm_config.speculative_config
        if spec is None or not self.decoding:
            return None
        k = int(spec.num_speculative_tokens)
        drafts = [[2000 + (self.steps + j) % 1000 for j in range(k)] for _ in self.decoding]
        return compat.draft_token_ids(list(self.decoding), drafts)


def _with_speculative_states(specs: dict[str, Any], vllm_config: Any) -> dict[str, Any]:
    """As vLLM's Mamba layers build their spec: a state per draft token
    (``num_speculative_blocks``) when speculative decoding is configured."""
    spec_config = vllm_config.speculative_config
    k = int(spec_config.num_speculative_tokens) if spec_config is not None else 0
    if not k:
        return specs
    return {
        name: dataclasses.replace(spec, num_speculative_blocks=k)
        if type(spec).__name__ == "MambaSpec"
        else spec
        for name, spec in specs.items()
    }


def routed_row(positions: np.ndarray) -> np.ndarray:
    """The routed-experts rows the host worker returns for these token positions: one
    expert id per token, ``(n, 1, 1)`` uint8 (the position modulo 251)."""
    return (np.asarray(positions) % 251).astype(np.uint8).reshape(-1, 1, 1)


def compat_chunk_bytes(vllm_config: Any) -> int:
    from integrations.vllm.options import JengaVllmOptions

    return JengaVllmOptions.from_vllm_config(vllm_config).chunk_bytes


def host_engine_core(
    model_dir: Any,
    case: str,
    *,
    jenga: bool,
    kv_tensors: str = "torch",
    kv_bytes: int = 48 << 20,
    configure: Any = None,
    max_model_len: int = 1024,
    **setup: Any,
) -> Any:
    """vLLM's `EngineCore` over a `HostWorker` for ``case`` with ``kv_bytes`` of KV memory,
    on our manager (``kv_tensors``: the one jenga setting) or, ``jenga=False``, on vLLM's
    own (`replay.engine_core`, which also takes ``configure`` and the `SchedulerSetup`
    fields in ``setup``)."""
    return replay.engine_core(
        model_dir,
        host_executor_class(case, kv_bytes),
        jenga=jenga,
        options={"kv_tensors": kv_tensors},
        configure=configure,
        max_model_len=max_model_len,
        **setup,
    )


def host_executor_class(case: str, memory_bytes: int) -> type:
    """An `Executor` subclass whose worker is a `HostWorker` for ``case``."""

    class HostExecutor(compat.executor_base_class()):  # type: ignore[misc]
        def _init_executor(self) -> None:
            self.worker = HostWorker(self.vllm_config, case, memory_bytes)

        def collective_rpc(
            self,
            method: Any,
            timeout: float | None = None,
            args: tuple = (),
            kwargs: dict | None = None,
            non_block: bool = False,
        ) -> Any:
            if isinstance(method, str):
                result = getattr(self.worker, method)(*args, **(kwargs or {}))
            else:
                result = method(self.worker, *args, **(kwargs or {}))
            return _done([result]) if non_block else [result]

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            self.worker.execute_model(scheduler_output)  # the host worker returns nothing
            return _done(None) if non_block else None

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            result = self.worker.sample_tokens(grammar_output)
            return _done(result) if non_block else result

        def compile_or_warm_up_model(self) -> None:
            return None

        def check_health(self) -> None:
            return None

        def shutdown(self) -> None:
            if self.worker.kv_cache is not None:
                self.worker.kv_cache.close()

    return HostExecutor


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
