"""The Jenga paper's Fig. 17 setup (`articles-ministral`): its trace, and the mechanism
behind the figure on a trace small enough for a unit test."""

import random
from dataclasses import replace
from statistics import fmean

from jenga.sim.hardware import GiB
from jenga.sim.metrics import summarize
from jenga.sim.models import get_model
from jenga.sim.protocol import RequestState
from jenga.sim.scenarios import (
    PAPER_ENGINE,
    build_trace,
    get_scenario,
    make_allocator,
    run_scenario,
)
from jenga.sim.workloads import Request


def test_fig17_trace_has_the_papers_arxiv_qa_lengths_and_arrives_as_one_batch():
    scenario = get_scenario("articles-ministral")
    params = scenario.workload_params
    # paper §7.2: Ministral's arXiv-QA requests average 92,408 tokens; Fig. 15's 110K maximum
    assert (params["min_article_len"] + params["max_article_len"]) / 2 == 92_408
    assert params["max_article_len"] == 110_000
    assert scenario.engine == PAPER_ENGINE and scenario.rate is None
    trace = build_trace(replace(scenario, workload_params={**params, "num_articles": 40}))
    assert {r.arrival_s for r in trace.requests} == {0.0}  # Fig. 17b is a throughput
    question = params["question_len"]
    articles = {r.req_id.split("-")[0]: r.prompt_len - question for r in trace.requests}
    assert len(articles) == 40 and len(trace.requests) == 40 * params["questions_per_article"]
    assert all(74_816 <= n <= 110_000 for n in articles.values())
    assert abs(fmean(articles.values()) - 92_408) < 4_000


def test_jenga_lru_caches_every_article_where_uniform_paging_cannot():
    """Two 60,000-token articles, three questions each, 14 GiB of KV. Uniform paging keeps
    36 x 60,000 layer-tokens per article (8.8 GB): one article and part of the other.
    Jenga keeps 9 x 60,000 + 27 x 32,768 (5.8 GB) once the out-of-window blocks are evicted
    (the paper's rule: they keep the older time of the last step that read them), so both
    articles stay and every repeat question hits its whole article."""
    base = get_scenario("articles-ministral")
    params = {
        **base.workload_params,
        "num_articles": 2,
        "questions_per_article": 3,
        "min_article_len": 60_000,
        "max_article_len": 60_000,
    }
    allocators = ("uniform", "jenga_vmm")
    for seed in (0, 1, 2):
        scenario = replace(
            base, workload_params=params, kv_gib=14.0, seed=seed, allocators=allocators
        )
        results, not_run = run_scenario(scenario)
        assert not not_run
        got = {r.allocator: summarize(r) for r in results}
        # 2 articles x 2 repeat questions hit 60,000 tokens; 6 prompts of 60,064 tokens
        assert got["jenga_vmm"].hit_rate == 4 * 60_000 / (6 * 60_064)
        assert got["uniform"].hit_rate < got["jenga_vmm"].hit_rate - 0.05
        assert got["jenga_vmm"].requests_per_s > 1.2 * got["uniform"].requests_per_s


def test_jenga_serves_no_shorter_hit_once_an_articles_tail_is_evicted():
    """The paper's rules leave no partial hit on a cut article. A sliding layer hits a
    prefix only if "the last sliding_window_size tokens of the prefix remain unevicted"
    (§5.2), and its tokens outside the window keep an older last-access time, "making
    them a higher priority for eviction" (§5.1, Fig. 10). So the out-of-window blocks go
    first (the whole hit survives), then the last window and the full-attention tail
    together (same time, highest prefix length first): once the article's end is cut
    (beyond the few out-of-window blocks left) no shorter prefix has its window, while
    the full-attention group still holds almost the whole article
    (`match_prefix_junction`)."""
    rng = random.Random(0)
    article = [rng.randrange(1, 30_000) for _ in range(60_000)]
    alloc = make_allocator("jenga_vmm", get_model("ministral-8b"), 40 * GiB, True)

    def serve(req_id: str) -> int:
        question = tuple(rng.randrange(1, 30_000) for _ in range(64))
        state = RequestState(Request(req_id, tuple(article) + question, tuple(range(7, 23))))
        hit = alloc.admit(state)
        prompt = list(state.tokens)
        for n in range(len(prompt), len(prompt) + 16):  # prefill, then 15 decode steps
            state.tokens[:] = prompt + list(state.request.output[: n - len(prompt)])
            assert alloc.allocate(state, n)
            state.num_computed = n
            alloc.trim(state)
        alloc.release(state)
        return hit

    assert (serve("q0"), serve("q1")) == (0, 60_000)
    hits, full_prefix_at_loss = [], None
    while sum(alloc.core.usage().cached_blocks):
        match = alloc.core.prefix_match(article + [1] * 64)
        hit, junction = match.hit, match.junction
        hits.append(hit)
        if hit == 0 and full_prefix_at_loss is None:
            full_prefix_at_loss = junction
        alloc.core.evict_cached(8)
    assert hits[0] == 60_000 and hits[-1] == 0
    assert all(h == 0 or h > 60_000 - 1_024 for h in hits)  # all or (almost) nothing
    assert full_prefix_at_loss is not None and full_prefix_at_loss > 55_000
