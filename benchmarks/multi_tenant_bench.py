"""Two engines with alternating bursty loads: one shared pool versus a static 50/50 split.

Rationale
    A static split gives each engine half the device whatever the load; when one engine
    is busy and the other idle, half the memory sits unused while requests queue. A
    shared pool (`vmm.shared`) lets the busy engine borrow the idle one's memory. This
    benchmark measures the difference on real engines: two `MiniEngine`s (tiny random
    Llamas, 2 and 3 layers) whose KV caches draw from one `vmm-pool` owner process.

Approach
    The owner runs in a child process (``vmm-pool start``). Both engines live in this
    process and step in lockstep (engine A then engine B), so time is counted in steps and
    the two configurations see the same arrivals. Loads alternate: in phase p, the engine
    p % 2 receives a burst of ``--burst`` requests spread over the first ``--spread`` steps
    (prompts 24..64 tokens, 16..40 new tokens, seeded). Configurations:

    * shared: one pool of ``--budget-chunks`` chunks, each tenant min = ``--min-chunks``,
      max = the whole budget;
    * static: the same owner and budget, each tenant min = max = half the budget.

    Per configuration and engine: requests served by the end of the horizon, waiting
    request-steps (sum over steps of the requests queued, preempted ones included),
    queueing delay (steps from arrival to first admission: mean, p50, p99, max), peak
    chunks held, and
    whether every output equals the same engine run alone with ample memory (optional,
    ``--check``). ``waiting_ratio_static_over_shared`` = static / shared waiting
    request-steps (goal >= 1.5). Wall-clock seconds per step are reported too.

Limitations
    Time is in engine steps (the forward of a tiny model on CPU costs about the same per
    step in both configurations); the waiting request-seconds ratio equals the
    request-steps ratio under that assumption. Prefix caching is off in both (the owner
    cannot evict cached pages on request).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def tiny_llama(layers: int) -> Any:
    import transformers

    torch.manual_seed(layers)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=512, initializer_range=0.2,
        num_hidden_layers=layers,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def loads(args: argparse.Namespace) -> list[list[tuple[str, list[int], int, int]]]:
    """Per engine: (id, prompt, max_new_tokens, arrival_step), alternating bursts."""
    gen = torch.Generator().manual_seed(args.seed)
    out: list[list[tuple[str, list[int], int, int]]] = [[], []]
    for phase in range(args.phases):
        start = phase * args.phase_steps
        for i in range(args.burst):
            plen = int(torch.randint(24, 65, (1,), generator=gen))
            new = int(torch.randint(16, 41, (1,), generator=gen))
            prompt = torch.randint(0, 128, (plen,), generator=gen).tolist()
            arrival = start + int(torch.randint(0, args.spread, (1,), generator=gen))
            out[phase % 2].append((f"p{phase}-{i}", prompt, new, arrival))
    return out


def start_owner(name: str, budget: int, chunk: int) -> subprocess.Popen:
    from vmm.shared.cli import pool_state

    cmd = [sys.executable, "-m", "vmm.shared.cli", "start", name, "--budget", str(budget),
           "--chunk", str(chunk)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            pool_state(name)
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"owner of {name} did not start") from None
            time.sleep(0.05)


def run_config(args: argparse.Namespace, models: list[Any], shared: bool) -> dict[str, Any]:
    from integrations.engine import EngineConfig, MiniEngine

    chunk, budget = args.chunk, args.budget_chunks * args.chunk
    half = budget // 2
    name = f"bench-{uuid.uuid4().hex[:8]}"
    owner = start_owner(name, budget, chunk)
    engines: list[Any] = []
    try:
        for i, model in enumerate(models):
            lo = args.min_chunks * chunk if shared else half
            cfg = EngineConfig(chunk_bytes=chunk, block_size=4, use_prefix_cache=False,
                               max_running=args.max_running, token_budget=args.token_budget,
                               shared_pool=name, tenant_name=f"engine{i}", tenant_min_bytes=lo,
                               tenant_max_bytes=budget if shared else half)  # fmt: skip
            engines.append(MiniEngine(model, cfg))
        return _replay(args, engines, loads(args))
    finally:
        for engine in engines:
            engine.close()
        owner.terminate()
        owner.wait(10)


def _replay(args: argparse.Namespace, engines: list[Any], work: list[list[tuple]]) -> dict:
    horizon = args.phases * args.phase_steps
    for engine, reqs in zip(engines, work, strict=True):
        for rid, prompt, new, arrival in reqs:
            engine.add_request(rid, prompt, new, arrival_step=arrival)
    waiting = [0, 0]
    admitted: list[dict[str, int]] = [{}, {}]
    peak = [0, 0]
    t0 = time.perf_counter()
    for _ in range(horizon):
        for i, engine in enumerate(engines):
            engine.step()
            waiting[i] += len(engine.waiting)  # arrived, not running (preempted included)
            for req in engine.running:
                admitted[i].setdefault(req.request_id, engine.step_index - 1)
            peak[i] = max(peak[i], engine.pool.backend.tenant.held_chunks)
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {"engines": [], "seconds_per_step": wall / (2 * horizon)}
    for i, engine in enumerate(engines):
        arrivals = {rid: a for rid, _, _, a in work[i]}
        delays = [admitted[i].get(rid, horizon) - a for rid, a in arrivals.items()]
        out["engines"].append({
            "requests": len(arrivals), "served": len(engine.done),
            "waiting_request_steps": waiting[i],
            "mean_queueing_delay_steps": sum(delays) / max(len(delays), 1),
            "queueing_delay_steps": _quantiles(delays),
            "peak_held_chunks": peak[i], "preemptions": engine.stats["preemptions"],
            "outputs": {rid: r.output for rid, r in engine.done.items()},
        })  # fmt: skip
    out["served"] = sum(e["served"] for e in out["engines"])
    out["waiting_request_steps"] = sum(waiting)
    out["waiting_request_seconds"] = sum(waiting) * out["seconds_per_step"]
    return out


def _quantiles(values: list[int]) -> dict[str, float]:
    """p50 / p99 / max (nearest rank) of `values`."""
    ordered = sorted(values) or [0]

    def rank(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"p50": rank(0.50), "p99": rank(0.99), "max": float(ordered[-1])}


def check_outputs(args: argparse.Namespace, models: list[Any], result: dict) -> bool:
    """Every served output equals the same engine's output alone with ample memory."""
    from integrations.engine import EngineConfig, MiniEngine

    ok = True
    for model, reqs, got in zip(models, loads(args), result["engines"], strict=True):
        cfg = EngineConfig(chunk_bytes=args.chunk, block_size=4, use_prefix_cache=False,
                           max_running=args.max_running, token_budget=args.token_budget,
                           budget_bytes=4 * args.budget_chunks * args.chunk)  # fmt: skip
        alone = MiniEngine(model, cfg)
        for rid, prompt, new, _ in reqs:
            if rid in got["outputs"]:
                alone.add_request(rid, prompt, new)
        want = alone.run()
        alone.close()
        ok = ok and all(got["outputs"][rid] == out for rid, out in want.items())
    return ok


def _print_table(results: dict[str, Any]) -> None:
    print(f"{'config':8} {'engine':6} {'served':>7} {'waiting req-steps':>18} "
          f"{'delay avg/p50/p99/max (steps)':>30} {'peak chunks':>12} {'preempt':>8}")  # fmt: skip
    for label, res in results.items():
        for i, e in enumerate(res["engines"]):
            q = e["queueing_delay_steps"]
            delay = (f"{e['mean_queueing_delay_steps']:.1f}/{q['p50']:.0f}/{q['p99']:.0f}/"
                     f"{q['max']:.0f}")  # fmt: skip
            print(f"{label:8} {i:6d} {e['served']:4d}/{e['requests']:<3d}"
                  f"{e['waiting_request_steps']:18d} {delay:>30}"
                  f"{e['peak_held_chunks']:12d} {e['preemptions']:8d}")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-chunks", type=int, default=160)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--min-chunks", type=int, default=8, help="shared: each tenant's min")
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--phase-steps", type=int, default=80)
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--spread", type=int, default=10)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare outputs with engines alone")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    models = [tiny_llama(2), tiny_llama(3)]
    results = {"shared": run_config(args, models, True)}
    gc.collect()
    results["static"] = run_config(args, models, False)
    summary: dict[str, Any] = {"config": vars(args)}
    for label, res in results.items():
        if args.check:
            res["outputs_match"] = check_outputs(args, models, res)
        for engine in res["engines"]:
            engine.pop("outputs")
        summary[label] = res
    shared_wait = max(results["shared"]["waiting_request_steps"], 1)
    summary["waiting_ratio_static_over_shared"] = (
        results["static"]["waiting_request_steps"] / shared_wait
    )
    summary["served_shared"] = results["shared"]["served"]
    summary["served_static"] = results["static"]["served"]
    _print_table(results)
    print(f"waiting_ratio_static_over_shared = {summary['waiting_ratio_static_over_shared']:.2f}"
          f" (goal >= 1.5); served shared {summary['served_shared']}, "
          f"static {summary['served_static']}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
