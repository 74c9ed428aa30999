"""CaR's setups as ``jenga-sim --scenario`` entries: TTFT with and without a host tier.

Rationale
    CaR claims that reusing KV across requests from a second tier cuts time to first
    token by about 30 %, and by more than 60 % for OPT-13B at long context. The claim
    has three parts the simulator can separate: reuse at all (GPU prefix cache versus
    none), a second tier (what GPU-only reuse loses to eviction), and CaR's mechanisms
    on that tier (score policy, prefetch) against plain LRU and against vLLM's own CPU
    offloading. Every configuration runs on the identical trace.

Approach
    `TierScenario`: model, GPU, workload (a `jenga.sim.workloads` generator), the host
    tier's size, the host's memory and the link. `CONFIGS` lists the rows::

        no-reuse                 prefix cache off: every prompt is prefilled
        gpu-only                 prefix cache in GPU memory, evicted blocks are dropped
        vllm-cpu-offload         write-through to a host LRU, whole reloads before the step
        tier-lru[-prefetch]      CaR's tier with LRU: offload on eviction and above the
                                 high-water mark, layer-pipelined reloads, [prefetch]
        tier-score[-prefetch]    the same with CaR's score policy

    `run_tier_scenario` runs them; `tier_table` prints TTFT mean / p50 / p99 (nearest
    rank), the change of the mean against ``no-reuse``, hit shares by tier, bytes moved
    and blocks lost. `main` is ``jenga-sim``'s entry for these scenarios.

Limitations
    See `jenga.sim.tier_engine`: full-attention models, one GPU, no sparsification.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field, replace

from rich.console import Console
from rich.table import Table

from jenga.sim import report, seeds
from jenga.sim.hardware import GiB, get_gpu
from jenga.sim.models import get_model
from jenga.sim.protocol import SimError
from jenga.sim.tier_engine import TierEngine, TierEngineConfig, TierStats
from jenga.sim.tiers import LINKS, Link, TierConfig, TierError
from jenga.sim.workloads import Trace, make_trace

CONFIGS = (
    "no-reuse",
    "gpu-only",
    "vllm-cpu-offload",
    "tier-lru",
    "tier-lru-prefetch",
    "tier-score",
    "tier-score-prefetch",
)
BASELINE = "no-reuse"


@dataclass(frozen=True)
class TierScenario:
    """One CaR setup; every `CONFIGS` row runs on its trace."""

    name: str
    model: str
    gpu: str
    workload: str
    workload_params: dict[str, object] = field(default_factory=dict)
    rate: float | None = None
    seed: int = 0
    reserved_share: float = 0.10
    reserved_gib: float = 2.0  # activations and CUDA graphs, as vLLM profiles them
    host_gib: float = 32.0
    host_memory_gib: float = 128.0  # CaR's machine: 128 GB of DRAM
    link: Link = LINKS["pcie4"]
    high_water: float = 0.9
    window: int = 8
    window_priority: bool = False  # CaR's classes inside the window (tier rows)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    note: str = ""

    def kv_bytes(self) -> int:
        model = get_model(self.model)
        return get_gpu(self.gpu).kv_budget_bytes(
            model.weight_bytes, self.reserved_share, int(self.reserved_gib * GiB)
        )

    def tier(self, config: str) -> TierConfig | None:
        """The host tier of row ``config`` (None: GPU memory only)."""
        if config in ("no-reuse", "gpu-only"):
            return None
        base = TierConfig(
            host_bytes=_gib_to_bytes(self.host_gib, "host tier"),
            host_memory_bytes=_gib_to_bytes(self.host_memory_gib, "host memory"),
            link=self.link,
            high_water=self.high_water,
            window=self.window,
            window_priority=self.window_priority,
        )
        if config == "vllm-cpu-offload":
            return replace(
                base, write_through=True, pipelined=False, high_water=1.0, window_priority=False
            )
        _, policy, *prefetch = config.split("-")
        return replace(base, policy=policy, prefetch=bool(prefetch))

    def engine_config(self, config: str) -> TierEngineConfig:
        if config not in CONFIGS:
            raise SimError(f"unknown configuration {config!r}; known: {CONFIGS}")
        return TierEngineConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            prefix_cache=config != "no-reuse",
            tier=self.tier(config),
        )


def _gib_to_bytes(gib: float, what: str) -> int:
    if not 0 <= gib < math.inf:  # NaN compares false: refused too
        raise TierError(f"{what} must be a finite size >= 0 GiB, got {gib}")
    return int(gib * GiB)


TIER_SCENARIOS: dict[str, TierScenario] = {
    s.name: s
    for s in (
        TierScenario(
            "car-chat",
            "opt-13b",
            "a100-40gb",
            "multi-turn",
            {
                "num_clients": 48,
                "num_rounds": 4,
                "shared_prefix_len": 0,
                "request_len": 160,
                "output_len": 240,
                "closed_loop": 1,
                "think_s": 15.0,
            },
            rate=0.5,
            host_gib=32.0,
            note="CaR multi-turn chat: OPT-13B on an A100 40 GB, ShareGPT-like turns",
        ),
        TierScenario(
            "car-longdoc",
            "llama-2-7b-32k",
            "a100-40gb",
            "articles-questions",
            {
                "num_articles": 8,
                "questions_per_article": 4,
                "min_article_len": 8_000,
                "max_article_len": 30_000,
                "question_len": 64,
                "output_len": 128,
            },
            rate=0.1,
            host_gib=48.0,
            note="CaR long documents: Llama-2 7B LongLoRA 32K, LongAlign-like 8K-30K documents",
        ),
        # CaR's Fig. 5: one request's latency, recomputing a prompt versus reloading its
        # KV. Each document is asked twice, all first questions before any second one, at
        # a rate low enough that nothing queues: a second question's TTFT is a prefill
        # of the question alone plus the reload (or, without a tier, the whole prompt).
        TierScenario(
            "car-reload",
            "opt-13b",
            "a100-40gb",
            "articles-questions",
            {
                "num_articles": 16,
                "questions_per_article": 2,
                "article_len": 1900,
                "question_len": 32,
                "output_len": 16,
                "shuffle": 0,
            },
            rate=0.5,
            host_gib=32.0,
            note="CaR Fig. 5: recompute vs reload per request (vary --param article_len)",
        ),
    )
}


def get_tier_scenario(name: str) -> TierScenario:
    if name not in TIER_SCENARIOS:
        raise SimError(f"unknown tier scenario {name!r}; known: {sorted(TIER_SCENARIOS)}")
    return TIER_SCENARIOS[name]


def revisits(trace: Trace, block_size: int) -> set[str]:
    """Requests whose first block some request before them in the trace also starts with
    (a later turn of a chat, another question on a document): the ones reuse can serve."""
    seen: set[tuple[int, ...]] = set()
    out = set()
    for r in trace.requests:
        first = r.prompt[:block_size]
        if len(first) == block_size and first in seen:
            out.add(r.req_id)
        seen.add(first)
    return out


def run_tier_scenario(
    scenario: TierScenario, configs: tuple[str, ...] = CONFIGS
) -> tuple[dict[str, TierStats], set[str]]:
    """Run each configuration on the scenario's one trace; also returns `revisits`."""
    model, gpu = get_model(scenario.model), get_gpu(scenario.gpu)
    kv_bytes = scenario.kv_bytes()
    engines = {c: scenario.engine_config(c) for c in configs}  # refuse bad input before running
    trace = make_trace(
        scenario.workload, seed=scenario.seed, rate=scenario.rate, **scenario.workload_params
    )
    results = {c: TierEngine(model, gpu, kv_bytes, e).run(trace) for c, e in engines.items()}
    return results, revisits(trace, model.groups[0].spec.block_size)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (0 for none)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def ttft_summary(stats: TierStats) -> dict[str, float]:
    ttft = stats.ttft_s
    return {
        "mean": statistics.fmean(ttft) if ttft else 0.0,
        "p50": percentile(ttft, 0.50),
        "p99": percentile(ttft, 0.99),
    }


def summary_row(stats: TierStats, revisited: set[str]) -> dict[str, float]:
    """Everything the table and the JSON report for one configuration."""
    prompt = max(1, stats.prompt_tokens)
    again = [t for r, t in stats.ttft_by_request.items() if r in revisited]
    return {
        **{f"ttft_{k}_s": v for k, v in ttft_summary(stats).items()},
        "revisit_ttft_mean_s": statistics.fmean(again) if again else 0.0,
        "revisits": len(again),
        "gpu_hit": stats.gpu_hit_tokens / prompt,
        "host_hit": stats.host_hit_tokens / prompt,
        "reload_gb": stats.reload_bytes / 1e9,
        "offload_gb": stats.offload_bytes / 1e9,
        "lost_blocks": stats.lost_blocks,
        "host_evicted_blocks": stats.host_evicted_blocks,
        "offload_wait_s": stats.offload_wait_s,
        "prefetches": stats.prefetches,
        "preemptions": stats.preemptions,
        "sim_time_s": stats.sim_time_s,
    }


def tier_table(scenario: TierScenario, results: dict[str, TierStats], revisited: set[str]) -> Table:
    rows = {c: summary_row(s, revisited) for c, s in results.items()}
    base = rows.get(BASELINE, {}).get("ttft_mean_s")
    base_again = rows.get(BASELINE, {}).get("revisit_ttft_mean_s")
    kv = scenario.kv_bytes() / GiB
    table = Table(
        title=f"{scenario.name}: {scenario.model} on {scenario.gpu}, {kv:.1f} GiB KV, host tier "
        f"{scenario.host_gib:g} GiB over {scenario.link.name}"
    )
    for col in ("configuration", "TTFT mean s", "p50 s", "p99 s", f"mean vs {BASELINE}",
                f"revisits ({len(revisited)}) mean s", "vs no-reuse",
                "GPU hit", "host hit", "reload GB", "offload GB", "lost blocks",
                "offload wait s", "prefetches", "preemptions", "finish s"):  # fmt: skip
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for c, r in rows.items():
        change = f"{r['ttft_mean_s'] / base - 1:+.0%}" if base else "-"
        again = f"{r['revisit_ttft_mean_s'] / base_again - 1:+.0%}" if base_again else "-"
        table.add_row(
            c,
            f"{r['ttft_mean_s']:.3f}",
            f"{r['ttft_p50_s']:.3f}",
            f"{r['ttft_p99_s']:.3f}",
            change,
            f"{r['revisit_ttft_mean_s']:.3f}",
            again,
            f"{r['gpu_hit']:.1%}",
            f"{r['host_hit']:.1%}",
            f"{r['reload_gb']:.1f}",
            f"{r['offload_gb']:.1f}",
            f"{r['lost_blocks']:.0f}",
            f"{r['offload_wait_s']:.2f}",
            f"{r['prefetches']:.0f}",
            f"{r['preemptions']:.0f}",
            f"{r['sim_time_s']:.1f}",
        )
    return table


def tier_markdown(
    scenario: TierScenario, results: dict[str, TierStats], revisited: set[str]
) -> str:
    """The table's main columns as Markdown (for docs/results)."""
    rows = {c: summary_row(s, revisited) for c, s in results.items()}
    base = rows.get(BASELINE, {})
    lines = [
        f"{scenario.name}: {scenario.model} on {scenario.gpu}, {scenario.kv_bytes() / GiB:.1f} "
        f"GiB KV, host tier {scenario.host_gib:g} GiB over {scenario.link.name}",
        "",
        f"| configuration | TTFT mean s | p50 s | p99 s | mean vs {BASELINE} | revisits "
        f"({len(revisited)}) mean s | vs {BASELINE} | GPU hit | host hit | reload GB | "
        "lost blocks | offload wait s | prefetches | preemptions |",
        "|---|" + "---:|" * 13,
    ]
    for c, r in rows.items():
        change = _change(r["ttft_mean_s"], base.get("ttft_mean_s", 0.0))
        again = _change(r["revisit_ttft_mean_s"], base.get("revisit_ttft_mean_s", 0.0))
        lines.append(
            f"| {c} | {r['ttft_mean_s']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
            f"{change} | {r['revisit_ttft_mean_s']:.3f} | {again} | {r['gpu_hit']:.1%} | "
            f"{r['host_hit']:.1%} | {r['reload_gb']:.1f} | {r['lost_blocks']:.0f} | "
            f"{r['offload_wait_s']:.2f} | {r['prefetches']:.0f} | {r['preemptions']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _change(value: float, base: float) -> str:
    return f"{value / base - 1:+.0%}" if base else "-"


SEED_METRICS = (("ttft_mean_s", "TTFT mean"), ("ttft_p99_s", "TTFT p99"),
                ("revisit_ttft_mean_s", "revisit TTFT mean"))  # fmt: skip


def seeds_markdown(scenario: TierScenario, per_seed: dict[int, dict[str, dict[str, float]]]) -> str:
    """Per configuration and metric: the change against ``no-reuse`` on each seed's trace,
    as mean (min to max) over the seeds."""
    names = list(next(iter(per_seed.values())))
    heads = " | ".join(f"{label} vs {BASELINE}" for _, label in SEED_METRICS)
    lines = [
        f"{scenario.name}, seeds {', '.join(str(s) for s in per_seed)}: mean (min to max)",
        "",
        f"| configuration | {heads} |",
        "|---|" + "---:|" * len(SEED_METRICS),
    ]
    for name in names:
        cells = []
        for key, _ in SEED_METRICS:
            changes = [
                rows[name][key] / rows[BASELINE][key] - 1
                for rows in per_seed.values()
                if rows[BASELINE][key]
            ]
            cells.append(
                f"{statistics.fmean(changes):+.0%} ({min(changes):+.0%} to {max(changes):+.0%})"
                if changes
                else "-"
            )
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def run_seeds(
    scenario: TierScenario, seed_list: list[int]
) -> dict[int, dict[str, dict[str, float]]]:
    """Every configuration on each seed's trace: seed -> configuration -> summary row."""
    per_seed = {}
    for seed in seed_list:
        results, revisited = run_tier_scenario(replace(scenario, seed=seed))
        per_seed[seed] = {c: summary_row(s, revisited) for c, s in results.items()}
    return per_seed


# --- jenga-sim ------------------------------------------------------------------------------

TIER_FLAGS = ("host_gib", "host_memory_gib", "link", "link_gbps", "link_latency_us",
              "high_water", "window", "window_priority")  # fmt: skip
# jenga-sim flags a tier scenario reads; any other flag set is refused, not ignored
SHARED_FLAGS = ("scenario", "model", "gpu", "reserved", "reserved_gib", "workload", "param",
                "seed", "seeds", "rate", "max_num_batched_tokens", "max_num_seqs",
                "json", "markdown", "no_progress")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The host tier's flags (only the ``car-*`` scenarios read them)."""
    g = p.add_argument_group("host tier (car-* scenarios)")
    g.add_argument("--host-gib", type=float, help="host tier size in GiB")
    g.add_argument("--host-memory-gib", type=float, help="host memory in GiB (128)")
    g.add_argument("--link", choices=sorted(LINKS), help="GPU <-> host link preset (pcie4)")
    g.add_argument("--link-gbps", type=float, help="link bandwidth in GB/s (overrides --link's)")
    g.add_argument("--link-latency-us", type=float, help="link latency per transfer in us")
    g.add_argument("--high-water", type=float, help="background offload above this share (0.9)")
    g.add_argument("--window", type=int, help="scheduler window in requests (8)")
    g.add_argument(
        "--window-priority",
        action="store_true",
        default=None,
        help="tier rows: order the window by CaR's classes (GPU hit, no history, host hit)",
    )


def scenario_from_args(args: argparse.Namespace, params: dict[str, object]) -> TierScenario:
    """The named tier scenario with the command line's overrides (``params``: parsed
    ``--param`` items); refuses flags it would ignore."""
    ignored = [
        n
        for n, v in vars(args).items()
        if n not in SHARED_FLAGS and n not in TIER_FLAGS and v not in (None, False, [])
    ]
    if ignored:
        flags = ", ".join("--" + n.replace("_", "-") for n in sorted(ignored))
        raise SimError(f"{flags} do not apply to the tier scenario {args.scenario}")
    base = get_tier_scenario(args.scenario)
    params = {
        **(base.workload_params if args.workload in (None, base.workload) else {}),
        **params,
    }
    link = LINKS[args.link] if args.link else base.link
    if args.link_gbps is not None or args.link_latency_us is not None:
        gbps = args.link_gbps if args.link_gbps is not None else link.bytes_per_s / 1e9
        lat = args.link_latency_us if args.link_latency_us is not None else link.latency_s * 1e6
        link = Link(f"{gbps:g} GB/s, {lat:g} us", gbps * 1e9, lat * 1e-6)
    changes = {
        "model": args.model,
        "gpu": args.gpu,
        "reserved_share": args.reserved,
        "reserved_gib": args.reserved_gib,
        "workload": args.workload,
        "seed": args.seed,
        "rate": args.rate,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "host_gib": args.host_gib,
        "host_memory_gib": args.host_memory_gib,
        "high_water": args.high_water,
        "window": args.window,
        "window_priority": args.window_priority,
    }
    kept = {k: v for k, v in changes.items() if v is not None}
    return replace(base, workload_params=params, link=link, **kept)


def main(args: argparse.Namespace, console: Console, params: dict[str, object]) -> int:
    """``jenga-sim --scenario car-...``: print the TTFT table (and JSON with ``--json``)."""
    scenario = scenario_from_args(args, params)
    if args.seeds:
        per_seed = run_seeds(scenario, seeds.parse_seeds(args.seeds))
        text = seeds_markdown(scenario, per_seed)
        if args.json != "-":
            console.print(text)
        if args.markdown:
            with open(args.markdown, "w") as out:
                out.write(text)
        if args.json:
            report.write_json({"scenario": scenario.name, "per_seed": per_seed}, args.json)
        return 0
    results, revisited = run_tier_scenario(scenario)
    if args.json != "-":
        console.print(tier_table(scenario, results, revisited))
        if scenario.note:
            console.print(scenario.note)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(tier_markdown(scenario, results, revisited))
    if args.json:
        doc = {
            "scenario": scenario.name,
            "model": scenario.model,
            "gpu": scenario.gpu,
            "kv_gib": scenario.kv_bytes() / GiB,
            "host_gib": scenario.host_gib,
            "link": {
                "name": scenario.link.name,
                "bytes_per_s": scenario.link.bytes_per_s,
                "latency_s": scenario.link.latency_s,
            },
            "configs": {c: summary_row(s, revisited) for c, s in results.items()},
        }
        report.write_json(doc, args.json)
    return 0
