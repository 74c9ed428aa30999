"""Named scenarios (model x GPU x workload x allocators) and the allocator registry.

Rationale
    A paper figure is a scenario: one model, one GPU budget, one trace, several
    allocators run on the identical trace. Naming them keeps `docs/reproduction.md`
    commands short and makes ``jenga-sim`` with no flags a meaningful comparison.

Approach
    `ALLOCATORS` maps a CLI name to ``factory(model, kv_bytes) -> SimAllocator``. The
    Jenga entries come from `jenga.sim.jenga_adapter` (its `VARIANTS` table).
    `run_scenario` builds the trace once and runs every allocator on it with a fresh
    engine.

Limitations
    Scenarios run sequentially in one process (the machine has two cores).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from jenga.sim import baselines, jenga_adapter
from jenga.sim.engine import Engine, EngineConfig, RunResult
from jenga.sim.hardware import get_gpu
from jenga.sim.models import get_model
from jenga.sim.protocol import SimAllocator, SimError
from jenga.sim.workloads import Trace, make_trace
from jenga.specs import ModelSpec

AllocatorFactory = Callable[[ModelSpec, int], SimAllocator]

ALLOCATORS: dict[str, AllocatorFactory] = {
    "uniform": baselines.uniform,
    "static_partition": baselines.static_partition,
    "vllm_hybrid": baselines.vllm_hybrid,
    **jenga_adapter.FACTORIES,
}

DEFAULT_ALLOCATORS = (
    "uniform",
    "max_page",
    "static_partition",
    "vllm_hybrid",
    "jenga_static",
    "jenga_vmm",
    "jenga_vmm_compact",
)


@dataclass(frozen=True)
class Scenario:
    """One comparison: a model on a GPU serving a trace, under several allocators."""

    name: str
    model: str
    gpu: str
    workload: str
    workload_params: dict[str, object] = field(default_factory=dict)
    reserved_share: float = 0.10
    kv_gib: float | None = None  # overrides the budget from the GPU (a small cache)
    seed: int = 0
    rate: float | None = None
    allocators: tuple[str, ...] = DEFAULT_ALLOCATORS
    engine: EngineConfig = field(default_factory=EngineConfig)
    note: str = ""

    def kv_bytes(self, model: ModelSpec) -> int:
        if self.kv_gib is not None:
            if self.kv_gib <= 0:
                raise SimError(f"kv_gib must be > 0, got {self.kv_gib}")
            return int(self.kv_gib * (1 << 30))
        return get_gpu(self.gpu).kv_budget_bytes(model.weight_bytes, self.reserved_share)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "arxiv-ministral",
            "ministral-8b",
            "h100-80gb",
            "arxiv-qa",
            note="Jenga paper Fig. 15/16: Ministral 8B, arXiv-QA, H100 80 GB",
        ),
        Scenario(
            "mmmu-llama-vision",
            "llama-3.2-11b-vision",
            "h100-80gb",
            "mmmu-pro",
            {"num_requests": 200, "output_len": 128},
            note="Jenga paper Fig. 16: Llama 3.2 Vision, MMMU-pro",
        ),
        Scenario(
            "articles-gemma",
            "gemma-2-9b",
            "h100-80gb",
            "articles-questions",
            {"num_articles": 16, "questions_per_article": 8, "article_len": 6000},
            kv_gib=6.0,
            note="Jenga paper Fig. 17: Gemma 2, N articles x M questions, cache < articles",
        ),
        Scenario(
            "articles-gemma3",
            "gemma-3-12b",
            "h100-80gb",
            "articles-questions",
            {"num_articles": 16, "questions_per_article": 8, "article_len": 8000},
            kv_gib=16.0,
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
DEFAULT_SCENARIO = "arxiv-ministral"


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise SimError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    return SCENARIOS[name]


def check_allocators(names: tuple[str, ...]) -> None:
    """Raise `SimError` for names no allocator has."""
    unknown = [n for n in names if n not in ALLOCATORS]
    if unknown:
        raise SimError(f"unknown allocators {unknown}; known: {sorted(ALLOCATORS)}")


def build_trace(scenario: Scenario) -> Trace:
    return make_trace(
        scenario.workload, seed=scenario.seed, rate=scenario.rate, **scenario.workload_params
    )


def run_scenario(
    scenario: Scenario, on_step: Callable[[str, int, int], None] | None = None
) -> tuple[list[RunResult], dict[str, str]]:
    """Run every allocator of ``scenario`` on one trace.

    Returns the results and, for each allocator that produced none, why: the run raised
    `SimError` (e.g. a request that never fits under that allocator's page layout).
    """
    model = get_model(scenario.model)
    gpu = get_gpu(scenario.gpu)
    kv_bytes = scenario.kv_bytes(model)
    check_allocators(scenario.allocators)
    not_run: dict[str, str] = {}
    trace = build_trace(scenario)
    results = []
    for name in scenario.allocators:
        allocator = ALLOCATORS[name](model, kv_bytes)
        callback = None if on_step is None else (lambda d, t, n=name: on_step(n, d, t))
        engine = Engine(model, gpu, allocator, scenario.engine, on_step=callback)
        try:
            results.append(engine.run(trace))
        except SimError as exc:
            not_run[name] = str(exc)
        del allocator, engine
        gc.collect()
    return results, not_run


def with_overrides(scenario: Scenario, **changes: object) -> Scenario:
    """A copy of ``scenario`` with the non-None ``changes`` applied."""
    return replace(scenario, **{k: v for k, v in changes.items() if v is not None})  # type: ignore[arg-type]
