"""vLLM's engine with vLLM's CPU offloading connector, on a CPU: the copy engine is ours.

Rationale
    vLLM's ``OffloadingConnector`` is its second KV tier: its scheduler side decides which
    blocks to store to CPU memory (its own LRU over CPU chunks) and which prefix to load
    back, and its worker side copies blocks with CUDA streams. The scheduler side is the
    part that talks to the KV-cache manager, and it runs here unchanged; only the copies
    need a GPU.

Approach
    `OffloadHostWorker` is the engine harness's `HostWorker` plus the worker side's
    protocol: every load and store job a step's `OffloadingConnectorMetadata` names
    completes with that step (``kv_connector_worker_meta`` lists the job ids, loads also
    report their request in ``finished_recving``), as vLLM's worker reports a finished
    transfer. `run_prefix_workload` drives vLLM's `EngineCore` through requests that
    share prefixes and returns the tokens served from the prefix cache (GPU hits plus
    tokens loaded from the CPU tier: vLLM's ``num_cached_tokens`` of each request).

Limitations
    No KV bytes exist (as in `integrations.vllm.harness.engine`): the jobs are reported
    finished, nothing is copied. Loads never fail here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from integrations.vllm import compat
from integrations.vllm.harness import engine


class OffloadHostWorker(engine.HostWorker):
    """A host worker that completes the offloading connector's jobs with each step."""

    def __init__(self, vllm_config: Any, case: str, memory_bytes: int) -> None:
        super().__init__(vllm_config, case, memory_bytes)
        self.jobs: list[tuple[int, str, bool]] = []  # (job id, request id, is a load)
        self.num_loads = 0
        self.num_stores = 0

    def get_kv_connector_handshake_metadata(self) -> None:
        return None

    def execute_model(self, scheduler_output: Any) -> None:
        meta = getattr(scheduler_output, "kv_connector_metadata", None)
        if meta is not None:
            self.jobs += [(j, job.req_id, True) for j, job in meta.load_jobs.items()]
            self.jobs += [(j, job.req_id, False) for j, job in meta.store_jobs.items()]
        super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> Any:
        output = super().sample_tokens(grammar_output)
        jobs, self.jobs = self.jobs, []
        loads = {rid for _, rid, is_load in jobs if is_load}
        self.num_loads += sum(1 for _, _, is_load in jobs if is_load)
        self.num_stores += sum(1 for _, _, is_load in jobs if not is_load)
        output.kv_connector_output = compat.kv_connector_output(
            finished_recving=loads or None,
            kv_connector_worker_meta=compat.offloading_worker_metadata({j: 1 for j, _, _ in jobs})
            if jobs
            else None,
        )
        return output


def offload_executor_class(case: str, memory_bytes: int) -> type:
    """`engine.host_executor_class` with an `OffloadHostWorker`."""
    base = engine.host_executor_class(case, memory_bytes)

    class OffloadExecutor(base):  # type: ignore[misc,valid-type]
        def _init_executor(self) -> None:
            self.worker = OffloadHostWorker(self.vllm_config, case, memory_bytes)

    return OffloadExecutor


def offloading_config(cpu_bytes: int, block_size: int) -> Any:
    """vLLM's ``KVTransferConfig`` for its CPU offloading connector (``cpu_bytes`` of CPU
    memory, one offloaded chunk per ``block_size`` tokens)."""
    return compat.config_classes()["KVTransferConfig"](
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, "block_size": block_size},
    )


def run_prefix_workload(
    core: Any, prompts: Sequence[Sequence[int]], max_steps: int
) -> list[tuple[int, int]]:
    """Run each prompt to completion, one after another, on vLLM's ``core``; per prompt
    the tokens vLLM reports served from cache (its ``prefill_stats``): (GPU prefix hit,
    tokens loaded by the connector)."""
    cached: list[tuple[int, int]] = []
    for i, prompt in enumerate(prompts):
        rid = f"p{i}"
        request = compat.greedy_engine_request(rid, list(prompt), 2)
        core.add_request(*core.preprocess_add_request(request))
        hit = None
        for _ in range(max_steps):
            outputs, _ = core.step()
            done = False
            for batch in outputs.values():
                for out in batch.outputs:
                    stats = out.prefill_stats
                    if out.request_id == rid and hit is None and stats is not None:
                        hit = (stats.num_local_cached_tokens, stats.num_external_cached_tokens)
                    done = done or (out.request_id == rid and out.finished)
            if done:
                break
        else:
            raise AssertionError(f"request {rid} did not finish in {max_steps} steps")
        for _ in range(4):  # let the connector's last store jobs complete
            core.step()
        if hit is None:
            raise AssertionError(f"request {rid}: vLLM reported no prefill stats")
        cached.append(hit)
    return cached
