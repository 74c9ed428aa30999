"""Attention over vmm KV tensors versus the same kernel over `torch.empty` tensors.

Rationale
    The point of mapping chunks into contiguous per-layer ranges is that unmodified
    kernels read them as ordinary tensors. This benchmark checks the claim where it
    matters: the same SDPA call, on tensors of the same shape and strides, one set
    viewing our mapped ranges (host memfd chunks here, CUDA VMM on a GPU), the other
    from `torch.empty`. Goal: ratio of medians <= 1.02.

Approach
    A `KVCache` (per_layer, K and V split: the flash-attn block layout) gets `--batch`
    requests of `--seq-len` tokens; each request's blocks are consecutive (request-aware
    pages), so its K is a zero-copy slice ``[blocks, T, H, D] -> [1, H, L, D]`` of the
    layer's block view. The baseline slices `torch.empty` tensors of the same full
    shape identically. Each iteration times both (alternating which goes first, to
    cancel drift) for decode (one query per request) and prefill (``--prefill-len``
    queries, causal). Reports avg/p50/p99/max in µs, a table and `--json`.

Limitations
    CPU SDPA on a shared machine is noisy; use enough `--iters`. One layer is timed
    (every layer's view is the same kind of tensor).
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec
from vmm.bench.stats import Summary, timed_once

import vmm
from integrations.kvcache import KVCache, KVCacheConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4, help="requests (one SDPA call each)")
    p.add_argument("--seq-len", type=int, default=2048, help="cached tokens per request")
    p.add_argument("--prefill-len", type=int, default=128, help="queries of the prefill case")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", choices=("host", "cuda", "auto"), default="host")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def summarize(samples_ns: list[int]) -> dict[str, float]:
    """avg / p50 / p99 / max in microseconds."""
    s = Summary.of(samples_ns).scaled(1e-3)
    return {"avg_us": s.avg, "p50_us": s.p50, "p99_us": s.p99, "max_us": s.max}


def build_cache(args: argparse.Namespace) -> tuple[KVCache, list[list[int]]]:
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    spec = LayerSpec(Kind.FULL, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                     dtype_bytes=itemsize, block_size=args.block_size)  # fmt: skip
    model = ModelSpec("bench", (KVGroup("full", spec, (0,)),), max_model_len=args.seq_len)
    per_token = 2 * args.kv_heads * args.head_dim * itemsize
    need = args.batch * args.seq_len * per_token
    chunks = -(-need // args.chunk_bytes) + 2 * args.batch + 2
    backend = (
        vmm.get_backend(args.backend, granularity=args.chunk_bytes)
        if args.backend == "host"
        else vmm.get_backend(args.backend)
    )
    pool = vmm.ChunkPool(backend, chunks * backend.granularity)
    kv = KVCache(model, pool, KVCacheConfig(dtype=dtype, kv_split=True, epsilon=0.0))
    tables = []
    for r in range(args.batch):
        kv.add_request(r, [0], use_cache=False)
        kv.allocate(r, args.seq_len)
        tables.append(kv.block_table(r, 0))
    return kv, tables


def request_views(full_k: torch.Tensor, full_v: torch.Tensor, table: list[int], seq_len: int):
    """``[1, H, L, D]`` zero-copy views of one request's consecutive blocks."""
    first, n = table[0], len(table)
    if table != list(range(first, first + n)):
        raise RuntimeError(f"blocks of a request are not consecutive: {table[:8]}...")

    def one(full: torch.Tensor) -> torch.Tensor:
        blocks = full[first : first + n]
        return blocks.reshape(n * blocks.shape[1], *blocks.shape[2:])[:seq_len].transpose(0, 1)[
            None
        ]

    return one(full_k), one(full_v)


def time_pair(
    run_ours: Callable[[], None], run_base: Callable[[], None], args
) -> tuple[list, list]:
    for _ in range(args.warmup):
        run_ours()
        run_base()
    ours, base = [], []
    for i in range(args.iters):
        order = (
            ((run_ours, ours), (run_base, base))
            if i % 2 == 0
            else ((run_base, base), (run_ours, ours))
        )
        for fn, out in order:
            out.append(timed_once(fn)[0])
    return ours, base


def run_case(name: str, q_len: int, args, ours_kv, base_kv, device) -> dict:
    dtype = DTYPES[args.dtype]
    queries = [
        torch.randn(1, args.heads, q_len, args.head_dim, dtype=dtype, device=device)
        for _ in ours_kv
    ]
    causal = q_len > 1
    mask = None
    if causal:
        qpos = torch.arange(args.seq_len - q_len, args.seq_len, device=device)[:, None]
        mask = torch.arange(args.seq_len, device=device)[None, :] <= qpos

    def make(kvs):
        def run() -> None:
            for q, (k, v) in zip(queries, kvs, strict=True):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            if device != "cpu":
                torch.cuda.synchronize()

        return run

    gc.collect()
    ours, base = time_pair(make(ours_kv), make(base_kv), args)
    s_ours, s_base = summarize(ours), summarize(base)
    return {"case": name, "queries": q_len, "ours": s_ours, "torch_empty": s_base,
            "ratio_p50": s_ours["p50_us"] / s_base["p50_us"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kv, tables = build_cache(args)
    device = kv.pool.backend.device
    k_full, v_full = kv.block_view(0, 0), kv.block_view(0, 1)
    k_base, v_base = torch.empty_like(k_full), torch.empty_like(v_full)
    for ours, base in ((k_full, k_base), (v_full, v_base)):
        for table in tables:  # only mapped blocks may be touched (the rest would fault)
            span = slice(table[0], table[-1] + 1)
            values = torch.randn(ours[span].shape, dtype=ours.dtype)
            ours[span].copy_(values)
            base[span].copy_(values)  # same values, same shape and strides
    ours_kv = [request_views(k_full, v_full, t, args.seq_len) for t in tables]
    base_kv = [request_views(k_base, v_base, t, args.seq_len) for t in tables]
    assert all(a[0].stride() == b[0].stride() for a, b in zip(ours_kv, base_kv, strict=True))
    results = [
        run_case("decode", 1, args, ours_kv, base_kv, device),
        run_case("prefill", args.prefill_len, args, ours_kv, base_kv, device),
    ]
    print_table(args, results, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, "results": results}, f, indent=2)
    kv.close()
    kv.pool.close()
    return 0


def print_table(args, results: list[dict], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"SDPA over vmm tensors vs torch.empty ({device}, {args.dtype}, "
                  f"batch {args.batch} x {args.seq_len} tokens, H {args.heads}/{args.kv_heads} "
                  f"D {args.head_dim}, {args.iters} iters)")  # fmt: skip
    for col in ("case", "tensors", "avg µs", "p50 µs", "p99 µs", "max µs", "ratio p50"):
        table.add_column(col, justify="right" if "µs" in col or "ratio" in col else "left")
    for r in results:
        for label, key in (("vmm", "ours"), ("torch.empty", "torch_empty")):
            s = r[key]
            ratio = f"{r['ratio_p50']:.3f}" if key == "ours" else ""
            table.add_row(
                r["case"],
                label,
                *(f"{s[k]:.1f}" for k in ("avg_us", "p50_us", "p99_us", "max_us")),
                ratio,
            )
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
