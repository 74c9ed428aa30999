"""Named scenarios (model x GPU x workload x engine x allocators) and the allocator registry.

Rationale
    A paper figure is a scenario: one model, one GPU budget, one trace, one engine
    configuration, several allocators run on the identical trace. Naming them keeps
    `docs/reproduction.md` commands short and makes ``jenga-sim`` with no flags a
    meaningful comparison: the default shows where Jenga beats *today's* vLLM
    (`vllm_v1`), the paper's setups are one ``--scenario`` away.

Approach
    `ALLOCATORS` maps a CLI name to ``factory(model, kv_bytes) -> SimAllocator``. The
    Jenga entries come from `jenga.sim.jenga_adapter` (its `VARIANTS` table).
    A scenario that names no allocators runs `DEFAULT_ALLOCATORS`: the paper's rows and
    `RECOMMENDED` (``jenga_vmm_group``, per-group VMM ranges, the geometry the vLLM
    integration recommends). `run_scenario` builds the trace once and runs every
    allocator on it with a fresh engine; ``prefix_cache=False`` turns every
    allocator's lookups off and ``block_size`` rewrites the model's tokens per block
    first. A scenario's
    ``headline`` names the metric and the baseline its one-line verdict under the table
    compares against (`report.headline_line`).

Limitations
    Scenarios run sequentially in one process (the machine has two cores).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from jenga.errors import AllocatorError
from jenga.sim import baselines, jenga_adapter, vllm_v1
from jenga.sim.engine import Engine, EngineConfig, RunResult
from jenga.sim.hardware import GiB, get_gpu
from jenga.sim.models import get_model, with_block_size
from jenga.sim.protocol import SimAllocator, SimError
from jenga.sim.workloads import Trace, make_trace
from jenga.specs import ModelSpec

AllocatorFactory = Callable[[ModelSpec, int], SimAllocator]

ALLOCATORS: dict[str, AllocatorFactory] = {
    "uniform": baselines.uniform,
    "static_partition": baselines.static_partition,
    "vllm_hybrid": baselines.vllm_hybrid,
    "vllm_v1": vllm_v1.vllm_v1,
    **jenga_adapter.FACTORIES,
}

JENGA_NAMES = frozenset(jenga_adapter.VARIANTS)
PAPER_ALLOCATORS = (
    "uniform",
    "max_page",
    "static_partition",
    "vllm_hybrid",
    "vllm_v1",
    "jenga_static",
    "jenga_vmm",
    "jenga_vmm_compact",
)
RECOMMENDED = "jenga_vmm_group"  # per-group VMM ranges: the geometry docs/vllm.md recommends
# the paper's rows and the recommended geometry (the only Jenga row that does not lose
# prefix hits to request-owned large pages on a Mamba chat: docs/reproduction.md)
DEFAULT_ALLOCATORS = (*PAPER_ALLOCATORS, RECOMMENDED)
MAMBA_ALLOCATORS = ("vllm_v1", "jenga_static", "jenga_vmm", "jenga_vmm_group")
# vLLM 0.6.3 as the Jenga paper ran it: the whole prompt allocated at admission, prefill in
# steps of its own, a token budget of max_model_len (its default without chunked prefill)
PAPER_ENGINE = EngineConfig(
    max_num_batched_tokens=131_072, admission="whole-prompt", prefill="separate"
)
HEADLINE_METRICS = {
    "hit_rate": "prefix hit rate",
    "avg_decode_batch": "average decode batch",
    "sim_time_s": "time to finish the trace",
}


@dataclass(frozen=True)
class Scenario:
    """One comparison: a model on a GPU serving a trace, under several allocators."""

    name: str
    model: str
    gpu: str
    workload: str
    workload_params: dict[str, object] = field(default_factory=dict)
    reserved_share: float = 0.10  # 1 - gpu_memory_utilization
    kv_gib: float | None = None  # overrides the budget from the GPU (a small cache)
    seed: int = 0
    rate: float | None = None
    allocators: tuple[str, ...] = DEFAULT_ALLOCATORS
    engine: EngineConfig = field(default_factory=EngineConfig)
    note: str = ""
    reserved_gib: float = 0.0  # fixed: activations, CUDA graphs (what vLLM profiles)
    prefix_cache: bool = True
    block_size: int | None = None  # tokens per block of attention groups (None: 16)
    headline: tuple[str, str] = ("avg_decode_batch", "uniform")  # (metric, baseline)
    overrides: tuple[str, ...] = ()  # "key=value" changed from the named scenario's own

    @property
    def label(self) -> str:
        """The name, and what was changed from the named scenario (tables, plots)."""
        return f"{self.name} with {', '.join(self.overrides)}" if self.overrides else self.name

    def kv_bytes(self, model: ModelSpec) -> int:
        if self.kv_gib is not None:
            if not 0 < self.kv_gib < math.inf:  # NaN compares false: refused too
                raise SimError(f"kv_gib must be > 0 and finite, got {self.kv_gib}")
            return int(self.kv_gib * GiB)
        if not 0 <= self.reserved_gib < math.inf:
            raise SimError(f"reserved_gib must be >= 0 and finite, got {self.reserved_gib}")
        return get_gpu(self.gpu).kv_budget_bytes(
            model.weight_bytes, self.reserved_share, int(self.reserved_gib * GiB)
        )

    def model_spec(self) -> ModelSpec:
        model = get_model(self.model)
        return model if self.block_size is None else with_block_size(model, self.block_size)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "mamba-chat",
            "nemotron-nano-9b-v2",
            "h100-80gb",
            "multi-turn",
            {
                "num_clients": 32,
                "num_rounds": 6,
                "request_len": 200,
                "output_len": 600,
                "closed_loop": 1,
                "think_s": 2.0,
            },
            rate=4.0,
            reserved_gib=2.0,
            allocators=MAMBA_ALLOCATORS,
            headline=("hit_rate", "vllm_v1"),
            note="a Mamba-2 hybrid chatting: today's vLLM vs Jenga on prefix reuse",
        ),
        Scenario(
            "arxiv-ministral",
            "ministral-8b",
            "h100-80gb",
            "arxiv-qa",
            reserved_gib=12.0,
            engine=PAPER_ENGINE,
            note="Jenga paper Fig. 15: Ministral 8B, arXiv-QA, H100, vLLM 0.6.3's engine",
        ),
        Scenario(
            "arxiv-ministral-static",
            "ministral-8b",
            "h100-80gb",
            "arxiv-qa-stream",
            {"num_requests": 60, "dynamic": 0},
            rate=0.5,
            reserved_gib=12.0,
            engine=PAPER_ENGINE,
            allocators=("uniform", "vllm_v1", "jenga_static", "jenga_vmm"),
            note="Jenga paper Fig. 16a/b: static length distribution, requests over time",
        ),
        Scenario(
            "arxiv-ministral-dynamic",
            "ministral-8b",
            "h100-80gb",
            "arxiv-qa-stream",
            {"num_requests": 60, "dynamic": 1},
            rate=0.5,
            reserved_gib=12.0,
            engine=PAPER_ENGINE,
            allocators=("uniform", "vllm_v1", "jenga_static", "jenga_vmm"),
            note="Jenga paper Fig. 16c/d: average length rising then falling over time",
        ),
        # Fig. 17: arXiv-QA articles average 92,408 tokens for Ministral (paper §7.2); the
        # range keeps Fig. 15's 110K maximum. Every question arrives at once: Fig. 17b is a
        # throughput, so the paper ran the trace as a batch, not at a request rate. The
        # paper states neither the questions per article nor their order ("asking multiple
        # questions at the end of each article"): a random order is the one that fits its
        # "up to 1.60x" (grouped questions hit on both systems, round-robin on neither).
        # docs/reproduction.md, Fig. 17.
        Scenario(
            "articles-ministral",
            "ministral-8b",
            "h100-80gb",
            "articles-questions",
            {
                "num_articles": 6,
                "questions_per_article": 4,
                "min_article_len": 74_816,
                "max_article_len": 110_000,
                "question_len": 64,
                "output_len": 64,
            },
            reserved_gib=12.0,
            engine=PAPER_ENGINE,
            allocators=("uniform", "vllm_v1", "jenga_vmm", "jenga_vmm_demote"),
            headline=("hit_rate", "uniform"),
            note="Jenga paper Fig. 17: N arXiv-QA articles x 4 questions at once, Ministral 8B",
        ),
        Scenario(
            "mmmu-llama-vision",
            "llama-3.2-11b-vision",
            "h100-80gb",
            "mmmu-pro",
            {"num_requests": 200, "output_len": 128},
            # vllm_v1 does not model cross attention: every default row but that one
            allocators=tuple(a for a in DEFAULT_ALLOCATORS if a != "vllm_v1"),
            note="Llama 3.2 Vision on MMMU-pro: the paper's §3.2 / Fig. 3 waste at serving scale",
        ),
        Scenario(
            "articles-gemma",
            "gemma-2-9b",
            "h100-80gb",
            "articles-questions",
            {"num_articles": 16, "questions_per_article": 8, "article_len": 6000},
            kv_gib=6.0,
            headline=("hit_rate", "uniform"),
            note="Jenga paper Fig. 17: Gemma 2, N articles x M questions, cache < articles",
        ),
        Scenario(
            "articles-gemma3",
            "gemma-3-12b",
            "h100-80gb",
            "articles-questions",
            {"num_articles": 16, "questions_per_article": 8, "article_len": 8000},
            kv_gib=16.0,
            headline=("hit_rate", "uniform"),
            note="Fig. 17 variant: Gemma 3 12B (1K window, 5:1), 8K-token articles, 16 GiB",
        ),
        Scenario(
            "sharegpt-gemma3",
            "gemma-3-12b",
            "h100-80gb",
            "sharegpt",
            {"num_requests": 250},
            note="ShareGPT-like chat, Gemma 3 12B (5:1 local:global) on an H100",
        ),
        Scenario(
            "sharegpt-gemma2-l4",
            "gemma-2-9b",
            "l4-24gb",
            "sharegpt",
            {"num_requests": 200, "max_input": 6000, "max_output": 1024},
            reserved_share=0.05,
            note="ShareGPT-like chat, Gemma 2 9B on an L4 24 GB (a tight KV budget)",
        ),
        Scenario(
            "multiturn-llama",
            "llama-3.1-8b",
            "h100-80gb",
            "multi-turn",
            note="multi-turn chat, 500-token shared prefix, Llama 3.1 8B",
        ),
    )
}
DEFAULT_SCENARIO = "mamba-chat"


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise SimError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    return SCENARIOS[name]


def check_allocators(names: tuple[str, ...]) -> None:
    """Raise `SimError` for names no allocator has."""
    unknown = [n for n in names if n not in ALLOCATORS]
    if unknown:
        raise SimError(f"unknown allocators {unknown}; known: {sorted(ALLOCATORS)}")


def make_allocator(
    name: str, model: ModelSpec, kv_bytes: int, prefix_cache: bool = True
) -> SimAllocator:
    """A fresh allocator ``name`` for ``model`` (``prefix_cache=False``: no lookups).

    Raises `SimError` when the allocator cannot be built for this budget (a Jenga large
    page larger than the whole KV memory: "does not fit") or model ("not modelled")."""
    try:
        allocator = ALLOCATORS[name](model, kv_bytes)
    except AllocatorError as exc:
        raise SimError(f"{name}: does not fit: {exc}") from exc
    allocator.use_prefix_cache = prefix_cache
    return allocator


def build_trace(scenario: Scenario) -> Trace:
    return make_trace(
        scenario.workload, seed=scenario.seed, rate=scenario.rate, **scenario.workload_params
    )


def run_scenario(
    scenario: Scenario, on_step: Callable[[str, int, int], None] | None = None
) -> tuple[list[RunResult], dict[str, str]]:
    """Run every allocator of ``scenario`` on one trace.

    Returns the results and, for each allocator that produced none, why: the run raised
    `SimError` (a request that never fits under that allocator's page layout, a large
    page bigger than the KV memory, a layer kind the baseline does not model).
    """
    model = scenario.model_spec()
    gpu = get_gpu(scenario.gpu)
    kv_bytes = scenario.kv_bytes(model)
    check_allocators(scenario.allocators)
    not_run: dict[str, str] = {}
    trace = build_trace(scenario)
    results = []
    for name in scenario.allocators:
        callback = None if on_step is None else (lambda d, t, n=name: on_step(n, d, t))
        try:
            allocator = make_allocator(name, model, kv_bytes, scenario.prefix_cache)
            engine = Engine(model, gpu, allocator, scenario.engine, on_step=callback)
            results.append(engine.run(trace))
        except SimError as exc:
            not_run[name] = str(exc)
        gc.collect()
    return results, not_run


def with_overrides(scenario: Scenario, **changes: object) -> Scenario:
    """A copy of ``scenario`` with the non-None ``changes`` applied. What differs from the
    named scenario is listed in ``overrides`` (the tables' titles show it), and the note,
    which describes the named scenario's own setup, becomes that list (a new ``seed`` keeps
    the note; ``allocators`` are not listed: the table's rows name them)."""
    given = {k: v for k, v in changes.items() if v is not None}
    changed = _changed(scenario, given)
    if any(not c.startswith("seed=") for c in changed):
        given["note"] = f"{scenario.name} with {', '.join(changed)}"
    return replace(scenario, **given, overrides=tuple(changed))  # type: ignore[arg-type]


def _changed(scenario: Scenario, given: dict[str, object]) -> list[str]:
    """``key=value`` for each value in ``given`` that differs from ``scenario``'s."""
    out = []
    for key, value in given.items():
        old = getattr(scenario, key)
        if key == "workload_params" and isinstance(value, dict):
            out += [f"{k}={v}" for k, v in value.items() if old.get(k, _ABSENT) != v]
        elif key == "engine" and isinstance(value, EngineConfig):
            out += [f"{f}={getattr(value, f)}" for f in vars(value)
                    if getattr(value, f) != getattr(old, f)]  # fmt: skip
        elif key == "allocators":
            continue  # the table's rows name them
        elif value != old:
            out.append(f"{key}={value}")
    return out


_ABSENT = object()
