"""Step vLLM's manager and ours side by side and report where their schedules part.

Rationale
    The side-by-side totals say *that* two managers differ, not *why*. Running both
    schedulers one step at a time on the same requests shows the first step at which
    they schedule different token counts, with each manager's per-request block counts
    and hit lengths at that moment.

Usage::

    python -m integrations.vllm.harness.lockstep --case gemma2 --window 1024 \\
        --question-tokens 3000 --memory-mb 1024 --requests 32

Limitations
    One wave of requests; fake outputs as in `integrations.vllm.harness.replay`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from integrations.vllm.harness import cases, replay
from integrations.vllm.harness.side_by_side import Workload


def _step(scheduler: Any, by_id: dict[str, Any], step: int) -> dict[str, int]:
    out = scheduler.schedule()
    scheduler.update_from_output(out, replay.fake_model_output(out, by_id, step))
    return dict(out.num_scheduled_tokens)


def _blocks(scheduler: Any) -> dict[str, list[int]]:
    manager = scheduler.kv_cache_manager
    out = {}
    for r in scheduler.running:
        rows = manager.get_blocks(r.request_id).blocks
        out[r.request_id] = [sum(not b.is_null for b in row) for row in rows]
    return out


def first_divergence(args: argparse.Namespace, model_dir: Path) -> list[str]:
    workload = Workload(requests=args.requests, question_tokens=args.question_tokens)
    longest = workload.system_tokens + workload.topic_tokens + args.question_tokens + 64
    setup = replay.SchedulerSetup(
        max_model_len=max(2048, -(-longest // 1024) * 1024),
        max_num_seqs=256,
        max_num_batched_tokens=2048,
    )
    config = replay.make_vllm_config(model_dir, setup)
    runs = []
    for jenga in (False, True):
        specs = cases.layer_specs(args.case, window=args.window)
        kv_config = replay.kv_cache_config_for(config, specs, args.memory_mb << 20)
        scheduler = replay.make_scheduler(config, kv_config, jenga=jenga)
        requests = replay.make_requests(workload.prompts(), [64] * args.requests, 16)
        for req in requests:
            scheduler.add_request(req)
        runs.append((scheduler, {r.request_id: r for r in requests}))
    lines = []
    for step in range(args.max_steps):
        scheduled = [_step(s, by_id, step) for s, by_id in runs]
        if scheduled[0] != scheduled[1]:
            lines.append(f"step {step}: vllm scheduled {scheduled[0]}")
            lines.append(f"step {step}: jenga scheduled {scheduled[1]}")
            for name, (s, _) in zip(("vllm", "jenga"), runs, strict=True):
                computed = {r.request_id: r.num_computed_tokens for r in s.running}
                lines.append(f"  {name} computed tokens {computed}")
                lines.append(f"  {name} blocks per group {_blocks(s)}")
            return lines
        if not any(s.get_num_unfinished_requests() for s, _ in runs):
            break
    return [f"no divergence in {step + 1} steps"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=cases.CASES, default="gemma2")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--question-tokens", type=int, default=200)
    parser.add_argument("--memory-mb", type=int, default=256)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=2000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = replay.write_tiny_model(Path(tmp) / "model")
        print("\n".join(first_divergence(args, model_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
