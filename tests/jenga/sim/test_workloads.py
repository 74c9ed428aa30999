"""Seeded workloads follow the published statistics and share prefixes exactly as stated."""

import statistics

import pytest
from jenga.sim.workloads import GENERATORS, WorkloadError, make_trace


def test_same_seed_same_trace_other_seed_other_trace():
    assert make_trace("sharegpt", seed=3, num_requests=20) == make_trace(
        "sharegpt", seed=3, num_requests=20
    )
    assert make_trace("sharegpt", seed=3, num_requests=20) != make_trace(
        "sharegpt", seed=4, num_requests=20
    )


def test_arxiv_qa_ranges():
    reqs = make_trace("arxiv-qa").requests
    assert len(reqs) == 20
    assert all(55_000 <= r.prompt_len <= 110_000 for r in reqs)
    assert all(50 <= r.output_len <= 100 for r in reqs)


def test_mmmu_pro_shape():
    reqs = make_trace("mmmu-pro", num_requests=5).requests
    assert {(r.image_tokens, r.text_tokens) for r in reqs} == {(6193, 43)}


def test_mmlu_pro_inputs_bounded():
    assert max(r.prompt_len for r in make_trace("mmlu-pro").requests) <= 3076


def test_sharegpt_mean_input_near_1085():
    reqs = make_trace("sharegpt", num_requests=2000).requests
    assert 950 <= statistics.fmean(r.prompt_len for r in reqs) <= 1200


def test_articles_questions_share_the_article_prefix():
    reqs = make_trace(
        "articles-questions",
        num_articles=3,
        questions_per_article=2,
        article_len=100,
        question_len=10,
        shuffle=0,
    ).requests
    assert [r.req_id for r in reqs] == [
        "art0-q0",
        "art1-q0",
        "art2-q0",
        "art0-q1",
        "art1-q1",
        "art2-q1",
    ]
    assert reqs[0].prompt[:100] == reqs[3].prompt[:100]
    assert reqs[0].prompt[:100] != reqs[1].prompt[:100]
    assert reqs[0].prompt[100:] != reqs[3].prompt[100:]


def test_articles_questions_shuffled_keeps_every_question_once():
    reqs = make_trace(
        "articles-questions", num_articles=3, questions_per_article=4, article_len=50
    ).requests
    ids = [r.req_id for r in reqs]
    assert sorted(ids) == sorted(f"art{a}-q{q}" for a in range(3) for q in range(4))
    assert ids != [f"art{a}-q{q}" for q in range(4) for a in range(3)]


def test_articles_with_varying_lengths_stay_in_range_and_share_per_article():
    reqs = make_trace(
        "articles-questions",
        num_articles=5,
        questions_per_article=3,
        min_article_len=200,
        max_article_len=400,
        question_len=10,
        shuffle=0,
    ).requests
    lengths = [r.prompt_len - 10 for r in reqs[:5]]
    assert all(200 <= n <= 400 for n in lengths) and len(set(lengths)) > 1
    for a in range(5):  # every question of an article quotes the same article
        assert reqs[a].prompt[: lengths[a]] == reqs[a + 5].prompt[: lengths[a]]
    with pytest.raises(WorkloadError, match="bad article length range 400-200"):
        make_trace("articles-questions", min_article_len=400, max_article_len=200)


def test_dynamic_stream_rises_then_falls_static_does_not():
    dynamic = [r.prompt_len for r in make_trace("arxiv-qa-stream", num_requests=61).requests]
    static = [
        r.prompt_len for r in make_trace("arxiv-qa-stream", num_requests=61, dynamic=0).requests
    ]
    thirds = [statistics.fmean(dynamic[i : i + 20]) for i in (0, 20, 41)]
    assert thirds[0] < 45_000 < thirds[1] and thirds[2] < 45_000  # short, long, short
    assert max(dynamic) <= 110_000 and min(dynamic) >= 6_000
    assert all(44_250 <= n <= 73_750 for n in static)  # midpoint 59,000 x [0.75, 1.25]


def test_closed_loop_turns_follow_their_predecessor():
    reqs = make_trace(
        "multi-turn", num_clients=2, num_rounds=3, closed_loop=1, think_s=0.5, rate=1.0
    ).requests
    by_id = {r.req_id: r for r in reqs}
    assert by_id["client1-turn2"].after == "client1-turn1"
    assert by_id["client1-turn2"].think_s == 0.5 and by_id["client1-turn2"].arrival_s == 0.0
    assert by_id["client0-turn0"].after == "" and by_id["client1-turn0"].arrival_s > 0.0


def test_multi_turn_quotes_history():
    reqs = make_trace(
        "multi-turn",
        num_clients=2,
        num_rounds=2,
        shared_prefix_len=500,
        request_len=10,
        output_len=5,
    ).requests
    c0t0, c1t0, c0t1 = reqs[0], reqs[1], reqs[2]
    assert c0t0.prompt[:500] == c1t0.prompt[:500]
    assert c0t1.prompt[: c0t0.prompt_len + 5] == c0t0.prompt + c0t0.output
    assert c0t1.prompt_len == 500 + 10 + 5 + 10


def test_vllm_random_range_and_prefix():
    reqs = make_trace(
        "random", num_requests=50, input_len=100, output_len=10, range_ratio=0.5, prefix_len=20
    ).requests
    assert all(20 + 50 <= r.prompt_len <= 20 + 150 for r in reqs)
    assert len({r.prompt[:20] for r in reqs}) == 1


def test_prefix_repetition_and_generated_shared_prefix():
    reqs = make_trace(
        "prefix-repetition", num_requests=30, prefix_len=8, suffix_len=4, num_prefixes=3
    ).requests
    assert len({r.prompt[:8] for r in reqs}) == 3
    gsp = make_trace(
        "generated-shared-prefix",
        num_groups=4,
        prompts_per_group=5,
        system_prompt_len=16,
        question_len=4,
    ).requests
    assert len(gsp) == 20 and len({r.prompt[:16] for r in gsp}) == 4


def test_poisson_arrivals_are_increasing_and_rate_scaled():
    reqs = make_trace("random", rate=10.0, num_requests=400, input_len=8, output_len=1).requests
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[0] == 0.0
    assert 30 <= times[-1] <= 50  # 399 gaps of mean 0.1 s


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("nope", {}, "unknown workload 'nope'"),
        ("arxiv-qa", {"min_input": 10, "max_input": 5}, "bad ranges: input 10-5"),
        ("random", {"range_ratio": 1.5}, "range_ratio must be in"),
        ("sharegpt", {"bogus": 1}, "unexpected keyword"),
        ("mmmu-pro", {"num_requests": 0}, "num_requests must be > 0, got 0"),
    ],
)
def test_bad_parameters_raise_with_numbers(name, params, message):
    with pytest.raises(WorkloadError, match=message):
        make_trace(name, **params)


def test_every_generator_runs_on_defaults():
    for name in GENERATORS:
        assert make_trace(name, seed=1).requests
