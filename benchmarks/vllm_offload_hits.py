"""Prefix-hit tokens (GPU + CPU tier) with vLLM's CPU offloading connector: ours vs vLLM's.

Rationale
    vLLM's second KV tier is its ``OffloadingConnector``: blocks stored to CPU memory come
    back when a later request shares their prefix. With the same connector, GPU memory and
    CPU memory, the tokens a workload gets without recomputing (GPU hits plus CPU loads)
    tell whether the jenga manager serves that tier as well as vLLM's manager does.

Approach
    vLLM's `EngineCore` runs each manager in turn (`integrations.vllm.harness.offload`:
    the connector's scheduler side is vLLM's, the host worker reports each step's copy
    jobs done). Workload: ``docs`` documents of ``doc_tokens`` tokens (distinct), then
    ``rounds`` rounds asking each again in a seeded random order, one request at a time,
    each with a distinct suffix of ``suffix`` tokens. Per manager: prompt tokens, tokens
    hit on the GPU, tokens loaded from CPU memory (vLLM's ``prefill_stats``).

Limitations
    No KV bytes are copied (no GPU); the llama case only (full attention: the connector
    offloads every group).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from integrations.vllm.harness import offload, replay

BLOCK = 16


def _core(model_dir: Path, jenga: bool, gpu_mb: int, cpu_mb: int, max_len: int) -> Any:
    def configure(config: Any) -> None:
        config.kv_transfer_config = offload.offloading_config(cpu_mb << 20, BLOCK)

    executor = offload.offload_executor_class("llama", gpu_mb << 20)
    return replay.engine_core(
        model_dir,
        executor,
        jenga=jenga,
        configure=configure,
        max_model_len=max_len,
        max_num_batched_tokens=max(max_len, 512),
    )


def workload(docs: int, doc_tokens: int, rounds: int, suffix: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    bodies = [[50_000 + d, *range(1000 * d, 1000 * d + doc_tokens - 1)] for d in range(docs)]
    prompts: list[list[int]] = []
    for r in range(rounds + 1):
        order = list(range(docs)) if r == 0 else rng.sample(range(docs), docs)
        for d in order:
            prompts.append(bodies[d] + [60_000 + len(prompts)] * suffix)
    return prompts


def run(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    prompts = workload(args.docs, args.doc_tokens, args.rounds, args.suffix, args.seed)
    max_len = args.doc_tokens + args.suffix + 16
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = replay.write_tiny_model(Path(tmp) / "model")
        for name, jenga in (("vllm", False), ("jenga", True)):
            core = _core(model_dir, jenga, args.gpu_mb, args.cpu_mb, max_len)
            try:
                cached = offload.run_prefix_workload(core, prompts, max_steps=400)
            finally:
                core.model_executor.shutdown()
            gpu = sum(c[0] for c in cached)
            cpu = sum(c[1] for c in cached)
            out[name] = {
                "prompt_tokens": sum(map(len, prompts)),
                "gpu_hit_tokens": gpu,
                "cpu_loaded_tokens": cpu,
                "hit_tokens": gpu + cpu,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--suffix", type=int, default=8)
    parser.add_argument("--gpu-mb", type=int, default=12)
    parser.add_argument("--cpu-mb", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print("| manager | prompt tokens | GPU hit tokens | CPU loaded tokens | hit tokens |")
    print("|---|---|---|---|---|")
    for name, row in result.items():
        print(
            f"| {name} | {row['prompt_tokens']} | {row['gpu_hit_tokens']} | "
            f"{row['cpu_loaded_tokens']} | {row['hit_tokens']} |"
        )


if __name__ == "__main__":
    main()
