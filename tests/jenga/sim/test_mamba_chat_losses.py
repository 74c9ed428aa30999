"""Why the paper-order Jenga rows lose prefix hits on a Mamba-2 multi-turn chat.

Eight closed-loop clients x three turns of the default scenario (Nemotron Nano 9B v2) in
14 GiB of KV. A Mamba state is 143.5 MB (27 layers), and the paper's step order gives
every request a large page of its own before it uses a free slot on another request's
page (steps 2 and 3 before step 4). With the LCM geometry a page is 4.3 GiB (32 states or
17,523 attention blocks); with per-layer VMM ranges a Mamba page is 621 chunks (9 states
per layer range). Each new request either maps a fresh page it fills with one to three
states, or, once units run out, evicts a whole cached page (step 3) for it: cached
states and attention blocks the next turns would hit are thrown away while other
requests' pages have free slots. The same geometries in compact order (step 4 first)
evict nothing and hit as often as per-group pages do (docs/reproduction.md).
"""

from dataclasses import replace

import pytest
from jenga.sim.engine import Engine
from jenga.sim.hardware import get_gpu
from jenga.sim.metrics import summarize
from jenga.sim.scenarios import build_trace, get_scenario, make_allocator

SMALL_CHAT = replace(
    get_scenario("mamba-chat"),
    kv_gib=14.0,
    workload_params={**get_scenario("mamba-chat").workload_params, "num_clients": 8,
                     "num_rounds": 3},
)  # fmt: skip


def _run(name: str) -> tuple[float, dict[str, int]]:
    model = SMALL_CHAT.model_spec()
    alloc = make_allocator(name, model, SMALL_CHAT.kv_bytes(model))
    result = Engine(model, get_gpu(SMALL_CHAT.gpu), alloc, SMALL_CHAT.engine).run(
        build_trace(SMALL_CHAT)
    )
    return summarize(result).hit_rate, alloc.core.stats()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("paper", "compact"),
    [("jenga_static", "jenga_static_compact"), ("jenga_vmm", "jenga_vmm_compact")],
)
def test_paper_order_evicts_whole_cached_pages_that_compact_order_keeps(paper, compact):
    paper_hit, paper_stats = _run(paper)
    compact_hit, compact_stats = _run(compact)
    group_hit, _ = _run("jenga_vmm_group")
    # per client: prompts 700, 1,500, 2,300 tokens; a state every 512 tokens: hits 0,
    # 1,024, 2,048 = 3,072 of 4,500 prompt tokens when nothing the next turn needs is evicted
    assert compact_hit == group_hit == 3072 / 4500
    assert compact_stats["pages.evicted"] == 0 and compact_stats["blocks.evicted"] == 0
    # the paper's order evicted whole cached pages (step 3) to give requests pages of
    # their own
    assert paper_stats["alloc.step.3"] > 0 and paper_stats["pages.evicted"] > 0
    assert paper_hit < 0.3 * compact_hit  # 2.8 % (LCM pages), 17.1 % (per-layer VMM)
