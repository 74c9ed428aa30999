"""MiniEngine with and without overlapped mapping: steps, stalls, wall time, same tokens.

Runs one seeded workload through a tiny random-weight Llama (transformers) twice, with
`EngineConfig(overlap=False)` and `overlap=True`, and reports per run: steps, plans
mapped on the worker vs at sync, steps that stalled on mapping, stall time, wall time,
and whether both runs produced the same tokens. Table and `--json`.

Limitations: CPU, tiny model: compute per step is small, so the worker has little to
hide behind; the figure that matters is the stall count, not the wall time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from integrations.engine import EngineConfig, MiniEngine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--token-budget", type=int, default=64)
    p.add_argument("--chunk-bytes", type=int, default=64 << 10)
    p.add_argument("--budget-chunks", type=int, default=256)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def run(model, args: argparse.Namespace, overlap: bool) -> dict:
    config = EngineConfig(token_budget=args.token_budget, max_running=args.requests,
                          budget_bytes=args.budget_chunks * args.chunk_bytes,
                          chunk_bytes=args.chunk_bytes, block_size=16, overlap=overlap)  # fmt: skip
    engine = MiniEngine(model, config)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        prompt = torch.randint(0, 128, (32 + 8 * i,), generator=gen).tolist()
        engine.add_request(i, prompt, args.new_tokens, arrival_step=i)
    start = time.perf_counter()
    outputs = engine.run()
    wall = time.perf_counter() - start
    stats = engine.kv.stats()
    engine.close()
    return {
        "overlap": overlap, "steps": engine.stats["steps"], "wall_s": wall,
        "plans_async": stats["overlap.plans.async"], "plans_sync": stats["overlap.plans.sync"],
        "stalls": stats.get("overlap.stalls", 0),
        "stall_ms": stats.get("overlap.stall_ns", 0) / 1e6,
        "outputs": outputs,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=128, num_hidden_layers=args.layers,
        max_position_embeddings=1024, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    results = [run(model, args, overlap) for overlap in (False, True)]
    same = results[0].pop("outputs") == results[1].pop("outputs")
    print(f"same tokens with and without overlap: {same}")
    header = ("overlap", "steps", "async", "sync", "stalls", "stall ms", "wall s")
    print(" ".join(f"{h:>8}" for h in header))
    for r in results:
        cells = (r["overlap"], r["steps"], r["plans_async"], r["plans_sync"], r["stalls"],
                 f"{r['stall_ms']:.2f}", f"{r['wall_s']:.2f}")  # fmt: skip
        print(" ".join(f"{c!s:>8}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "same_tokens": same, "results": results}, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
