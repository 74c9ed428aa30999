"""Physical bytes mapped versus bytes the live tokens need, per layout, over one trace.

Rationale
    Mapping whole chunks costs memory beyond what tokens need: a large page is mapped
    for its first block, a per_request row maps a chunk for its first token, windows
    are released only in whole pages. This benchmark replays one request trace through
    each layout and measures that granularity overhead, side by side.

Approach
    A synthetic trace (seeded): `--requests` requests, prompt and output lengths uniform
    in their ranges, one arrival per step while fewer than `--max-running` run; each
    step every running request decodes one token. The model is a hybrid of full-attention
    and sliding-window layers (`--layers`, every other one sliding, `--window`). Layouts:

    * per_layer and per_group: `KVCache` driven by the jenga allocator (paper order);
    * per_request: `RowKVCache` rows (vAttention style; sliding layers keep everything).

    Needed bytes at a step = sum over running requests and layers of the tokens that layer
    must hold (`jenga.pages.tokens_needed`: all for full attention, the window for sliding)
    x bytes per token. Mapped = the pool's `bytes.mapped.current`. Reported per layout:
    overhead = mapped / needed - 1 (avg / p50 / p99 / max over steps), peak mapped, peak
    needed. Table and `--json`.

Limitations
    No prefix sharing in the trace; the allocator's prefix cache is off (finished
    requests' blocks would otherwise stay mapped on purpose). Host backend only.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from collections.abc import Callable

import torch
from integrations.kvcache.rows import RowKVCache, RowShape
from jenga.pages import tokens_needed
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec
from vmm.bench.stats import Summary

import vmm
from integrations.kvcache import KVCache, KVCacheConfig

LAYOUTS = ("per_layer", "per_group", "per_request")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--prompt", type=int, nargs=2, default=(64, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-bytes", type=int, default=64 << 10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    common = {"num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype_bytes": 2,
              "block_size": args.block_size}  # fmt: skip
    full = LayerSpec(Kind.FULL, **common)
    window = LayerSpec(Kind.SLIDING_WINDOW, window=args.window, **common)
    groups = (
        KVGroup("full", full, tuple(range(0, args.layers, 2))),
        KVGroup("sliding_window", window, tuple(range(1, args.layers, 2))),
    )
    return ModelSpec("hybrid-bench", groups, max_model_len=args.prompt[1] + args.output[1])


def trace(args: argparse.Namespace) -> list[tuple[int, int]]:
    rng = random.Random(args.seed)
    return [(rng.randint(*args.prompt), rng.randint(*args.output)) for _ in range(args.requests)]


def needed_bytes(model: ModelSpec, lengths: list[int]) -> int:
    return sum(
        g.num_layers * g.spec.bytes_per_token * tokens_needed(g.spec, n)
        for n in lengths
        for g in model.groups
    )


class Replayer:
    """Grow/free callbacks for one layout over a fresh pool."""

    def __init__(self, layout: str, model: ModelSpec, args: argparse.Namespace, budget: int):
        backend = vmm.get_backend("host", granularity=args.chunk_bytes)
        self.pool = vmm.ChunkPool(backend, budget)
        self.layout = layout
        if layout == "per_request":
            shape = RowShape(args.layers, args.max_running, model.max_model_len,
                             args.kv_heads, args.head_dim, torch.float16)  # fmt: skip
            self.rows = RowKVCache(self.pool, shape)
            self.grow: Callable[[int, int, int], None] = self._grow_row
            self.free: Callable[[int], None] = self.rows.free
        else:
            config = KVCacheConfig(dtype=torch.float16, layout=layout)
            self.kv = KVCache(model, self.pool, config)
            self.grow, self.free = self._grow_kv, self.kv.free

    def _grow_row(self, rid: int, old: int, new: int) -> None:
        if old == 0:
            self.rows.add_request(rid)
        self.rows.grow(rid, new)

    def _grow_kv(self, rid: int, old: int, new: int) -> None:
        if old == 0:
            self.kv.add_request(rid, [0], use_cache=False)
        if self.kv.allocate(rid, new - old) is None:
            raise vmm.OutOfMemory(f"layout {self.layout}: budget too small for the trace")

    def mapped(self) -> int:
        return self.pool.stats()["bytes.mapped.current"]


def replay(layout: str, model: ModelSpec, args: argparse.Namespace, budget: int) -> dict:
    gc.collect()
    rep = Replayer(layout, model, args, budget)
    queue = list(enumerate(trace(args)))
    running: dict[int, list[int]] = {}  # rid -> [length, remaining output]
    ratios, peak_mapped, peak_needed = [], 0, 0
    while queue or running:
        if queue and len(running) < args.max_running:
            rid, (prompt, output) = queue.pop(0)
            rep.grow(rid, 0, prompt)
            running[rid] = [prompt, output]
        for rid, state in list(running.items()):
            if state[1] == 0:
                rep.free(rid)
                del running[rid]
                continue
            rep.grow(rid, state[0], state[0] + 1)
            state[0] += 1
            state[1] -= 1
        need = needed_bytes(model, [s[0] for s in running.values()])
        mapped = rep.mapped()
        peak_mapped, peak_needed = max(peak_mapped, mapped), max(peak_needed, need)
        if need:
            ratios.append(mapped / need - 1)
    rep.pool.close()
    s = Summary.of(ratios)
    return {
        "layout": layout, "steps": s.n,
        "overhead_avg": s.avg, "overhead_p50": s.p50, "overhead_p99": s.p99, "overhead_max": s.max,
        "peak_mapped_bytes": peak_mapped, "peak_needed_bytes": peak_needed,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = model_spec(args)
    per_token = model.bytes_per_token
    budget_tokens = args.max_running * (model.max_model_len + 4 * args.chunk_bytes)
    budget = -(-budget_tokens * per_token // args.chunk_bytes) * args.chunk_bytes
    results = [replay(layout, model, args, budget) for layout in args.layouts]
    print_table(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


def print_table(args: argparse.Namespace, results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"mapped vs needed bytes per layout: {args.requests} requests, "
             f"{args.layers} layers (window {args.window}), chunk {args.chunk_bytes >> 10} KiB, "
             f"block {args.block_size}")  # fmt: skip
    table = Table(title=title)
    cols = ("layout", "overhead avg", "p50", "p99", "max", "peak mapped MiB", "peak needed MiB")
    for col in cols:
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in results:
        table.add_row(
            r["layout"],
            *(
                f"{r[k]:.1%}"
                for k in ("overhead_avg", "overhead_p50", "overhead_p99", "overhead_max")
            ),
            f"{r['peak_mapped_bytes'] / 2**20:.1f}",
            f"{r['peak_needed_bytes'] / 2**20:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
