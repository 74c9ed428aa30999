"""Prefill/decode disaggregation over the jenga manager: a prefill scheduler and a decode
scheduler with vLLM's NIXL connector between them, in one process (vLLM's real schedulers
and connector scheduler sides; the transfer itself, a worker's job, is reported done)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import cases, replay

from integrations.vllm import compat

BLOCK = 16
PROMPT = list(range(100))


def _scheduler(model_dir: Path, role: str, jenga: bool) -> Any:
    setup = replay.SchedulerSetup(max_model_len=512, jenga_options={} if jenga else None)
    config = replay.make_vllm_config(model_dir, setup)
    config.kv_transfer_config = compat.config_classes()["KVTransferConfig"](
        kv_connector="NixlConnector", kv_role=role
    )
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("llama"), 16 << 20)
    return replay.make_scheduler(config, kv_config, jenga=jenga)


def _request(params: dict[str, Any], max_tokens: int) -> Any:
    request = compat.Request(
        request_id="a",
        prompt_token_ids=list(PROMPT),
        sampling_params=compat.sampling_params(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=compat.request_block_hasher(BLOCK, "sha256"),
    )
    request.kv_transfer_params = params
    return request


def _step(scheduler: Any, sampled: bool = True, **connector: Any) -> tuple[Any, list[Any]]:
    """One step: schedule, then the worker's output (one token for each scheduled request,
    the connector's finished transfers)."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    result = compat.model_runner_output(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids] if sampled else [[] for _ in ids],
        kv_connector_output=compat.kv_connector_output(**connector) if connector else None,
    )
    outputs = [
        o for batch in scheduler.update_from_output(out, result).values() for o in batch.outputs
    ]
    return out, outputs


def _used(scheduler: Any, jenga: bool) -> int:
    manager = scheduler.kv_cache_manager
    if jenga:
        return int(sum(manager.allocator.usage().used_blocks))
    pool = manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def _run_pair(model_dir: Path, jenga: bool) -> dict[str, Any]:
    """The P/D hand-off of one 100-token request; what each side saw, step by step."""
    prefill = _scheduler(model_dir, "kv_producer", jenga)
    decode = _scheduler(model_dir, "kv_consumer", jenga)
    seen: dict[str, Any] = {}
    # prefill: the whole prompt, one token, then the blocks wait for the decode side
    prefill.add_request(_request({"do_remote_decode": True}, max_tokens=1))
    out, outputs = _step(prefill)
    seen["prefill_tokens"] = out.num_scheduled_tokens["a"]
    (done,) = outputs
    assert done.finished
    params = done.kv_transfer_params
    seen["remote_blocks"] = [len(ids) for ids in params["remote_block_ids"]]
    seen["held_while_sending"] = _used(prefill, jenga)
    # decode: the prompt's KV comes from the prefill side, asynchronously
    decode.add_request(_request(params, max_tokens=3))
    out, _ = _step(decode, sampled=False)
    seen["decode_first"] = dict(out.num_scheduled_tokens)
    recv = out.kv_connector_metadata.reqs_to_recv
    seen["recv_blocks"] = [len(ids) for ids in recv["a"].local_block_ids]
    seen["held_while_receiving"] = _used(decode, jenga)
    # the transfer finished on both sides
    _step(prefill, finished_sending={"a"})
    seen["prefill_held_after"] = _used(prefill, jenga)
    tokens = []
    for i in range(6):
        out, outputs = _step(decode, finished_recving={"a"} if i == 0 else None)
        tokens.append(out.num_scheduled_tokens.get("a", 0))
        if any(o.finished for o in outputs):
            break
    seen["decode_steps"] = tokens
    seen["decode_held_after"] = _used(decode, jenga)
    if jenga:
        for side in (prefill, decode):
            side.kv_cache_manager.check_invariants(expensive=True)
    return seen


def test_a_prefill_decode_pair_hands_the_prompt_over_as_on_vllms_manager(
    model_dir: Path,
) -> None:
    ours = _run_pair(model_dir, jenga=True)
    assert ours == _run_pair(model_dir, jenga=False)
    assert ours["prefill_tokens"] == 100
    assert ours["remote_blocks"] == [7] and ours["recv_blocks"] == [7]
    assert ours["held_while_sending"] == 7  # the finished request's blocks wait for the send
    assert ours["decode_first"] == {}  # waiting for the remote KV
    assert ours["held_while_receiving"] == 7
    assert ours["prefill_held_after"] == 0
    # the step that reports the load schedules nothing; then the last prompt token, then
    # two decodes (3 tokens in all)
    assert ours["decode_steps"] == [0, 1, 1, 1]
    assert ours["decode_held_after"] == 0
