"""The host tier: reload bandwidth, overlap of reloads with compute, and the mini engine's
TTFT with the tier on vs off on a multi-turn workload.

Parts:

``reload``
    A `KVCache` with a host tier (``--backend host``: memfd pool, copies are memcpy on the
    tier's copy thread; ``cuda``: pinned host memory, copies on the tier's stream). One
    request of ``--tokens`` tokens is written, cached and pushed off the GPU
    (`KVCache.evict_cached`: offloaded to the host); then, ``--iters`` times: reload it
    alone (bandwidth = bytes / time), run a compute job alone (matrix products sized to
    take about as long), and both at once (reload started, compute run, reload finished).
    Overlap achieved = (reload + compute - both) / min(reload, compute): 1 is a reload
    hidden entirely, 0 none. ``layered``: the engine's pipeline, the reload opened
    (`HostTier.open_reload`) and the compute split into one part per layer, part i run
    after `HostTier.wait_layer(i)`; its overlap is computed the same way from its time.
    Also the time until layer 0's copy is done (the first layer's compute could start
    then), and a plain copy of as many bytes between two tensors allocated up front (no
    block table, no freshly mapped pages) for reference.

``engine``
    A tiny random-weight Llama (transformers) in the mini engine, a multi-turn chat
    (``--convs`` conversations of ``--turns`` turns; each turn's prompt is the whole
    history, previous answers included), a GPU pool of ``--pool-chunks`` chunks too small
    for every history, run with the tier off and on (LRU and score policies), the three
    settings alternating ``--repeats`` times (medians reported: the machine's load moves
    wall times more than anything measured here), plus LRU with ``tier_overlap=False``
    (admission waits for the whole reload): TTFT mean / p50 / p99, tokens computed, host
    hits, same tokens, and the overlap the engine achieved on its reloads: of the time a
    reload's copies still ran after its request was admitted on it (the whole of which a
    step without overlap waits), the share its step spent computing rather than waiting
    for a layer: 1 - ``tier.overlap.stall_us`` / ``tier.overlap.in_flight_us`` (summed over
    the repeats; the two times are reported as means per run). LRU also
    runs without CaR's prefetch, with and without overlap: every reload then starts when
    its request is admitted, so its copies run under the request's own step. Torch runs
    ``--threads`` intra-op threads (default 1, so the tier's copy thread has a core of its
    own on small machines).

Table on stdout; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from integrations.kvcache.tier import HostTierConfig
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec

import vmm
from integrations.kvcache import KVCache, KVCacheConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["reload", "engine", "all"], default="all")
    p.add_argument("--backend", choices=["host", "cuda"], default="host")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--convs", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--history", type=int, default=384, help="first turn's prompt tokens")
    p.add_argument("--pool-chunks", type=int, default=288, help="16 KiB chunks")
    p.add_argument("--tier-mib", type=int, default=64, help="engine part's host tier")
    p.add_argument("--repeats", type=int, default=3, help="engine runs per setting (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


# ---- reload ------------------------------------------------------------------------------
def _reload_cache(args: argparse.Namespace) -> KVCache:
    spec = LayerSpec(Kind.FULL, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                     dtype_bytes=2, block_size=16)  # fmt: skip
    model = ModelSpec("bench", (KVGroup("full", spec, tuple(range(args.layers))),),
                      max_model_len=args.tokens + 16)  # fmt: skip
    block = 2 * 16 * args.kv_heads * args.head_dim * 2
    pages = -(-args.tokens // 16 * block // (2 << 20)) + 2
    pool = vmm.ChunkPool(vmm.get_backend(args.backend), pages * args.layers * (2 << 20))
    size = (args.tokens // 16 + 16) * block * args.layers
    return KVCache(model, pool, KVCacheConfig(dtype=torch.float16, tier=HostTierConfig(size)))


def _compute_job(device: torch.device, seconds: float) -> tuple[Any, int]:
    """A matrix-product loop and how many products take about ``seconds``."""
    a = torch.randn(512, 512, device=device)

    def job(n: int) -> None:
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start = time.perf_counter()
    job(4)
    each = (time.perf_counter() - start) / 4
    return job, max(1, int(seconds / max(each, 1e-9)))


def reload_part(args: argparse.Namespace) -> dict:
    kv = _reload_cache(args)
    tier = kv.tier
    assert tier is not None
    prompt = torch.randint(0, 30000, (args.tokens + 1,)).tolist()
    kv.add_request("a", prompt)
    kv.allocate("a", len(prompt))
    kv.cache("a", len(prompt))
    kv.free("a")
    rows: dict[str, list[float]] = {"reload_s": [], "first_layer_s": [], "compute_s": [],
                                    "both_s": [], "bytes": [], "layered_s": []}  # fmt: skip
    job, n = None, 0
    for _ in range(args.iters):
        kv.evict_cached(kv.allocator.total_units)  # everything goes to the host
        start = time.perf_counter()
        r = tier.start_reload(prompt)
        assert r is not None
        r.wait_layer(0)
        rows["first_layer_s"].append(time.perf_counter() - start)
        assert tier.finish_reload(r)
        rows["reload_s"].append(time.perf_counter() - start)
        rows["bytes"].append(r.nbytes)
        tier.release(r)
        if job is None:
            job, n = _compute_job(tier.device, rows["reload_s"][-1])
        start = time.perf_counter()
        job(n)
        rows["compute_s"].append(time.perf_counter() - start)
        kv.evict_cached(kv.allocator.total_units)
        start = time.perf_counter()
        r = tier.start_reload(prompt)
        assert r is not None
        job(n)
        assert tier.finish_reload(r)
        rows["both_s"].append(time.perf_counter() - start)
        tier.release(r)
        kv.evict_cached(kv.allocator.total_units)
        rows["layered_s"].append(_layered(tier, prompt, job, n, args.layers))
    rows["plain_copy_s"] = _plain_copy_s(tier.device, int(rows["bytes"][0]), args.iters)
    med = {k: statistics.median(v) for k, v in rows.items()}

    def overlap(joint: float) -> float:
        return (med["reload_s"] + med["compute_s"] - joint) / min(med["reload_s"], med["compute_s"])

    out = {**med, "gb_per_s": med["bytes"] / med["reload_s"] / 1e9,
           "overlap": overlap(med["both_s"]), "layered_overlap": overlap(med["layered_s"]),
           "plain_gb_per_s": med["bytes"] / med["plain_copy_s"] / 1e9,
           "device": str(tier.device), "layers": args.layers}  # fmt: skip
    kv.close()
    kv.pool.close()
    return out


def _plain_copy_s(device: torch.device, nbytes: int, iters: int) -> list[float]:
    """Reference: one contiguous copy of as many bytes between two tensors made up front."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _layered(tier: Any, prompt: list[int], job: Any, n: int, layers: int) -> float:
    """Seconds of an opened reload under a compute split in ``layers`` parts, part i after
    `wait_layer(i)` (the engine's per-layer pipeline)."""
    start = time.perf_counter()
    r = tier.start_reload(prompt)
    assert r is not None
    tier.open_reload(r)
    for layer in range(layers):  # the n products in `layers` parts, n in all
        tier.wait_layer(layer)
        part = n // layers + (layer < n % layers)
        if part:
            job(part)
    assert tier.settle() == []
    return time.perf_counter() - start


# ---- engine TTFT -------------------------------------------------------------------------
def chat_requests(args: argparse.Namespace) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    histories = [torch.randint(0, 128, (args.history,), generator=gen).tolist()
                 for _ in range(args.convs)]  # fmt: skip
    return histories


def engine_run(
    args: argparse.Namespace, model: Any, tier: str | None, overlap: bool = True,
    prefetch: bool = True,
) -> dict:  # fmt: skip
    """Turn by turn: every conversation's turn t is queued together; each next turn's
    prompt is the history so far plus the answer plus 16 new user tokens."""
    from integrations.engine import EngineConfig, MiniEngine

    chunk = 16 << 10
    cfg = EngineConfig(
        token_budget=256, max_running=2, budget_bytes=args.pool_chunks * chunk,
        chunk_bytes=chunk, block_size=16, tier_bytes=None if tier is None else args.tier_mib << 20,
        tier_policy=tier or "lru", tier_overlap=overlap, tier_prefetch=prefetch,
    )  # fmt: skip
    engine = MiniEngine(model, cfg)
    gen = torch.Generator().manual_seed(11)
    histories = chat_requests(args)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            engine.add_request(f"c{c}t{turn}", history, 8, arrival_step=engine.step_index)
        done = engine.run()
        for c in range(len(histories)):
            answer = done[f"c{c}t{turn}"]
            outputs[f"c{c}t{turn}"] = answer
            histories[c] = (
                histories[c] + answer + torch.randint(0, 128, (16,), generator=gen).tolist()
            )
    wall = time.perf_counter() - start
    ttft = sorted(engine.ttft.values())
    later = [engine.ttft[f"c{c}t{t}"] for c in range(args.convs) for t in range(1, args.turns)]
    stats = {**engine.kv.stats(), **engine.stats, **(engine.tier.stats if engine.tier else {})}
    engine.close()
    flight_us = stats.get("tier.overlap.in_flight_us", 0)
    stall_us = stats.get("tier.overlap.stall_us", 0)
    return {
        "tier": " ".join([tier or "off"] + ([] if prefetch or tier is None else ["no-prefetch"])
                         + ([] if overlap or tier is None else ["no-overlap"])),
        "reloads_opened": stats.get("tier.reload.opened", 0),
        "engine_overlap": 1 - stall_us / flight_us if flight_us else float("nan"),
        "in_flight_ms": flight_us / 1e3, "stall_ms": stall_us / 1e3,
        "ttft_mean_ms": 1e3 * statistics.mean(ttft),
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "later_turns_ttft_mean_ms": 1e3 * statistics.mean(later),
        "tokens_computed": stats["tokens.computed"],
        "host_hit_tokens": stats.get("tier.hit_tokens", 0),
        "gpu_hit_tokens": stats["prefix.hit_tokens"] - stats.get("tier.hit_tokens", 0),
        "host_replaced": stats.get("tier.host.evicted", 0), "wall_s": wall, "outputs": outputs,
    }  # fmt: skip


def engine_part(args: argparse.Namespace) -> list[dict]:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=128, max_position_embeddings=4096, num_hidden_layers=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    if args.backend == "cuda":
        model = model.to("cuda")
    settings = ((None, True, True), ("lru", True, True), ("score", True, True),
                ("lru", False, True), ("lru", True, False), ("lru", False, False))  # fmt: skip
    trials: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # settings alternate, so load changes hit all alike
        for t, overlap, prefetch in settings:
            r = engine_run(args, model, t, overlap, prefetch)
            trials.setdefault(r["tier"], []).append(r)
    first = trials["off"][0]["outputs"]
    runs = []
    for name, rs in trials.items():
        row = {
            k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("tier", "outputs")
        }
        row["tier"], row["repeats"] = name, len(rs)
        row["same_tokens"] = all(r["outputs"] == first for r in rs)
        flight, stall = sum(r["in_flight_ms"] for r in rs), sum(r["stall_ms"] for r in rs)
        row["engine_overlap"] = 1 - stall / flight if flight else float("nan")  # all runs'
        row["in_flight_ms"], row["stall_ms"] = flight / len(rs), stall / len(rs)  # means
        runs.append(row)
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {}
    if args.part in ("reload", "all"):
        r = out["reload"] = reload_part(args)
        print("| device | layers | bytes | reload ms | first layer ms | GB/s | plain copy GB/s "
              "| compute ms | both ms | overlap | layered ms | layered overlap |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {r['device']} | {r['layers']} | {r['bytes']:.0f} | {1e3 * r['reload_s']:.2f} "
              f"| {1e3 * r['first_layer_s']:.2f} | {r['gb_per_s']:.2f} | "
              f"{r['plain_gb_per_s']:.2f} | "
              f"{1e3 * r['compute_s']:.2f} | {1e3 * r['both_s']:.2f} | "
              f"{r['overlap']:.2f} | {1e3 * r['layered_s']:.2f} | "
              f"{r['layered_overlap']:.2f} |")  # fmt: skip
    if args.part in ("engine", "all"):
        runs = out["engine"] = engine_part(args)
        print("\n| tier | TTFT mean ms | p50 | p99 | later turns mean | tokens computed | GPU "
              "hit tokens | host hit tokens | host replaced | wall s | reloads opened | "
              "copies in flight ms | step stalled ms | engine overlap | same tokens |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in runs:
            print(f"| {r['tier']} | {r['ttft_mean_ms']:.1f} | {r['ttft_p50_ms']:.1f} | "
                  f"{r['ttft_p99_ms']:.1f} | {r['later_turns_ttft_mean_ms']:.1f} | "
                  f"{r['tokens_computed']} | {r['gpu_hit_tokens']} | {r['host_hit_tokens']} | "
                  f"{r['host_replaced']} | "
                  f"{r['wall_s']:.2f} | {r['reloads_opened']} | {r['in_flight_ms']:.1f} | "
                  f"{r['stall_ms']:.1f} | {r['engine_overlap']:.2f} | "
                  f"{r['same_tokens']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
