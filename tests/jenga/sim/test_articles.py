"""The Jenga paper's Fig. 17 setup (`articles-ministral`): its trace, and the mechanism
behind the figure on a trace small enough for a unit test."""

from dataclasses import replace
from statistics import fmean

from jenga.sim.metrics import summarize
from jenga.sim.scenarios import PAPER_ENGINE, build_trace, get_scenario, run_scenario


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
