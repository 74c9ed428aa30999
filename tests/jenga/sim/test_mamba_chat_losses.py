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
from jenga.pages import vmm_page_table
from jenga.sim.diagnose import diagnose, main
from jenga.sim.engine import Engine
from jenga.sim.hardware import get_gpu
from jenga.sim.jenga_adapter import JengaCoreAllocator
from jenga.sim.scenarios import build_trace, get_scenario

SMALL_CHAT = replace(
    get_scenario("mamba-chat"),
    kv_gib=14.0,
    workload_params={**get_scenario("mamba-chat").workload_params, "num_clients": 8,
                     "num_rounds": 3},
)  # fmt: skip
# per client: prompts 700, 1,500, 2,300 tokens; a state every 512 tokens: hits 0, 1,024,
# 2,048, so 8 x 3,072 of 8 x 4,500 prompt tokens when nothing the next turn needs is evicted
EVERY_TURN_HITS = 8 * 3072


@pytest.mark.parametrize(
    ("paper", "compact", "short_group"),
    [("jenga_static", "jenga_static_compact", "mamba"), ("jenga_vmm", "jenga_vmm_compact", "full")],
)
def test_paper_order_evicts_whole_cached_pages_that_compact_order_keeps(
    paper, compact, short_group
):
    mine, kept, group = (diagnose(SMALL_CHAT, n) for n in (paper, compact, "jenga_vmm_group"))
    assert mine.prompt_tokens == kept.prompt_tokens == 8 * 4500
    assert kept.hit_tokens == group.hit_tokens == EVERY_TURN_HITS
    assert kept.alone_tokens == {"mamba": EVERY_TURN_HITS, "full": EVERY_TURN_HITS}
    assert kept.counters["pages.evicted"] == kept.counters["blocks.evicted"] == 0
    # the paper's order evicted whole cached pages (step 3) to give requests pages of
    # their own, and one group lost what the next turns needed: the Mamba states under
    # 4.3 GiB LCM pages, attention blocks under 621-chunk per-layer Mamba pages
    assert mine.counters["alloc.step.3"] > 0 and mine.counters["pages.evicted"] > 0
    assert mine.hit_tokens < 0.3 * kept.hit_tokens  # 2.8 % and 17.1 % against 68.3 %
    other = "full" if short_group == "mamba" else "mamba"
    assert mine.alone_tokens[short_group] < mine.alone_tokens[other] < EVERY_TURN_HITS
    assert mine.hit_tokens <= mine.alone_tokens[short_group]


def test_diagnose_cli_prints_every_row_and_refuses_other_allocators(capsys):
    assert main(["--kv-gib", "14", "--allocators", "vllm_v1"]) == 2
    assert "vllm_v1 is not a Jenga row" in capsys.readouterr().err


def test_step_end_states_alone_still_serve_every_turn_under_per_group_pages():
    """vLLM's "align" mode writes a Mamba state only where a step ends. The state a next
    turn needs is the last checkpoint before the conversation's end, inside the 600-token
    answer, and a decode step ends at every token: per-group pages still hit every turn."""
    model = SMALL_CHAT.model_spec()
    table = vmm_page_table(model, epsilon=0.01, layout="per_group")
    alloc = JengaCoreAllocator(
        "jenga_vmm_group", model, SMALL_CHAT.kv_bytes(model), table, mamba_step_end_only=True
    )
    assert alloc.core.config.mamba_step_end_only
    result = Engine(model, get_gpu(SMALL_CHAT.gpu), alloc, SMALL_CHAT.engine).run(
        build_trace(SMALL_CHAT)
    )
    assert result.hit_tokens == EVERY_TURN_HITS
