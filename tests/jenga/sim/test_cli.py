"""jenga-sim end to end: table, JSON, plots, errors."""

import json

import pytest
from jenga.sim.cli import main

SMALL = [
    "--scenario",
    "arxiv-ministral",
    "--param",
    "num_requests=3",
    "--param",
    "min_input=2000",
    "--param",
    "max_input=3000",
]


def test_json_has_every_allocator_and_ratios(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["--no-progress", *SMALL, "--json", str(out), "--timelines"]) == 0
    doc = json.loads(out.read_text())
    names = [s["allocator"] for s in doc["summaries"]]
    assert names == [
        "uniform",
        "max_page",
        "static_partition",
        "vllm_hybrid",
        "vllm_v1",
        "jenga_static",
        "jenga_vmm",
        "jenga_vmm_compact",
        "jenga_vmm_group",  # the recommended geometry is in every default set
    ]
    assert doc["not_run"] == {}
    assert doc["scenario"]["workload_params"] == {
        "num_requests": 3,
        "min_input": 2000,
        "max_input": 3000,
    }
    assert set(doc["timelines"]["uniform"]) >= {"live_bytes", "needed_bytes", "decode_batch"}
    assert doc["ratios_vs_uniform"]["uniform"]["decode_batch_x"] == 1.0
    assert "arxiv-ministral" in capsys.readouterr().out


def test_plots_are_written(tmp_path):
    args = [
        "--no-progress",
        *SMALL,
        "--allocators",
        "uniform,jenga_vmm",
        "--plot-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == [  # nothing hit, no step held 10 % of the KV: no empty plots
        "decode_batch.png",
        "memory_jenga_vmm.png",
        "memory_uniform.png",
    ]
    assert all(p.stat().st_size > 1000 for p in tmp_path.iterdir())


def test_bad_input_exits_2_with_reason(capsys):
    assert main(["--no-progress", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["--no-progress", "--allocators", "uniform,bogus"]) == 2
    assert "unknown allocators ['bogus']" in capsys.readouterr().err
    assert main(["--no-progress", "--param", "oops"]) == 2
    assert "--param expects key=value, got 'oops'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--kv-gib", "nan", "--kv-gib: expects a finite number > 0, got 'nan'"),
        ("--kv-gib", "inf", "--kv-gib: expects a finite number > 0, got 'inf'"),
        ("--kv-gib", "-1", "--kv-gib: expects a finite number > 0, got '-1'"),
        ("--reserved-gib", "inf", "--reserved-gib: expects a finite number >= 0, got 'inf'"),
        ("--reserved", "nan", "--reserved: expects a share in [0, 1), got 'nan'"),
        ("--rate", "nan", "--rate: expects a finite number > 0, got 'nan'"),
        ("--block-size", "0", "--block-size: expects an integer > 0, got '0'"),
        ("--block-size", "-16", "--block-size: expects an integer > 0, got '-16'"),
        ("--max-num-seqs", "0", "--max-num-seqs: expects an integer > 0, got '0'"),
        ("--sweep", "kv_gib=4,nan", "--sweep expects KEY=V1,V2,... (finite numbers)"),
        ("--sweep-kv-scales", "1,inf", "--sweep-kv-scales expects distinct finite numbers > 0"),
        ("--sweep-scenarios", "nope", "unknown scenario 'nope'"),
        ("--kv-gib", "4", "--kv-gib does not apply to the --sweep grid"),
        ("--markdown", "x.md", "--markdown does not apply to a run without the --sweep grid"),
    ],
)
def test_cli_mistakes_are_one_line_on_stderr(flag, value, expected, capsys):
    args = ["--no-progress", flag, value]
    if flag.startswith("--sweep-") or (flag, value) == ("--kv-gib", "4"):
        args.append("--sweep")  # the grid's flags, or a single run's flag given to the grid
    assert _exit_code(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err


def _exit_code(args: list[str]) -> int | str | None:
    """main's status, whether it returns it or argparse exits with it."""
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


def test_a_requested_allocator_without_a_row_exits_1(capsys):
    # 2 GiB: vllm_v1 and jenga_vmm_group fit; jenga_vmm's Mamba large page (621 chunks,
    # 1.2 GiB per range set) fits too, jenga_static's 4.3 GiB LCM page does not
    args = ["--no-progress", "--param", "num_clients=2", "--param", "num_rounds=1"]
    assert main([*args, "--kv-gib", "2"]) == 1
    captured = capsys.readouterr()
    assert "jenga_static has no result" in captured.out
    assert captured.err == "jenga-sim: no result for jenga_static\n"
    assert main([*args, "--kv-gib", "2", "--allocators", "vllm_v1,jenga_vmm_group"]) == 0


def test_sweep_reports_allocators_that_cannot_fit(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    args = [
        "--no-progress",
        "--scenario",
        "articles-gemma3",
        "--param",
        "num_articles=2",
        "--param",
        "questions_per_article=2",
        "--allocators",
        "uniform,max_page,jenga_vmm",
        "--sweep-kv-gib",
        "3,8",
        "--json",
        str(out),
        "--plot-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    at_3, at_8 = doc["sweep"]
    assert (at_3["key"], at_3["value"]) == ("kv_gib", 3.0)
    assert "max_page" not in at_3["spreads"] and "max_page" in at_3["not_run"]
    assert at_8["per_seed"]["0"]["max_page"]["allocator"] == "max_page"
    assert "does not fit" in capsys.readouterr().out
    assert (tmp_path / "hit_rate_vs_kv_gib.png").stat().st_size > 1000


def test_list(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "arxiv-ministral" in out and "jenga_vmm" in out and "prefix-repetition" in out


def test_default_run_says_how_jenga_compares_with_todays_vllm(capsys):
    args = ["--no-progress", "--param", "num_clients=2", "--param", "num_rounds=3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "mamba-chat" in out
    # per client: prompts 700, 1,500, 2,300; vllm_v1 hits 0, 0, 1,312 (a Mamba state only at
    # a prompt's end, floored to 1,312 tokens); Jenga 0, 1,024, 2,048 (a state every 512).
    # Two clients fit jenga_static's large pages too; the line names every Jenga row.
    assert (
        "Prefix hit rate vs vllm_v1 (29.2 %): jenga_static 2.34x (68.3 %), jenga_vmm 2.34x "
        "(68.3 %), jenga_vmm_group 2.34x (68.3 %); jenga_static, jenga_vmm and "
        "jenga_vmm_group beat vllm_v1." in out
    )


def test_seeds_report_mean_range_and_per_seed_ratios(tmp_path, capsys):
    out = tmp_path / "seeds.json"
    args = [*SMALL, "--no-progress", "--allocators", "uniform,jenga_vmm", "--seeds", "0-2"]
    assert main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["seeds"] == [0, 1, 2]
    batches = [doc["per_seed"][s]["jenga_vmm"]["avg_decode_batch"] for s in ("0", "1", "2")]
    spread = doc["spreads"]["jenga_vmm"]["avg_decode_batch"]
    assert spread == {"mean": sum(batches) / 3, "min": min(batches), "max": max(batches), "n": 3}
    per_seed = [
        doc["per_seed"][s]["jenga_vmm"]["avg_decode_batch"]
        / doc["per_seed"][s]["uniform"]["avg_decode_batch"]
        for s in ("0", "1", "2")
    ]
    assert doc["ratios"]["jenga_vmm"]["mean"] == sum(per_seed) / 3
    assert "mean (min-max) over 3 seeds" in capsys.readouterr().out


def test_sweep_over_articles(tmp_path):
    out = tmp_path / "articles.json"
    args = [
        "--no-progress",
        "--scenario",
        "articles-gemma3",
        "--param",
        "questions_per_article=2",
        "--param",
        "article_len=2000",
        "--allocators",
        "uniform,jenga_vmm",
        "--rate",
        "0.5",
        "--sweep",
        "articles=1,3",
        "--json",
        str(out),
        "--plot-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    points = json.loads(out.read_text())["sweep"]
    assert [(p["key"], p["value"]) for p in points] == [
        ("num_articles", 1.0),
        ("num_articles", 3.0),
    ]
    one = points[0]["per_seed"]["0"]["uniform"]
    assert one["hit_rate"] == 2000 / (2 * 2064)  # the second question hits the whole article
    # Fig. 17b: throughput = requests / time to finish, per seed, and its ratio to uniform
    assert one["requests_per_s"] == 2 / one["sim_time_s"]
    mine = points[1]["per_seed"]["0"]["jenga_vmm"]["requests_per_s"]
    base = points[1]["per_seed"]["0"]["uniform"]["requests_per_s"]
    assert points[1]["throughput_ratios"]["jenga_vmm"]["mean"] == mine / base
    for metric in ("hit_rate", "requests_per_s"):
        assert (tmp_path / f"{metric}_vs_num_articles.png").stat().st_size > 1000


def test_seed_lists_parse_and_reject_nonsense():
    import pytest
    from jenga.sim.protocol import SimError
    from jenga.sim.seeds import parse_seeds

    assert parse_seeds("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(SimError, match="distinct"):
        parse_seeds("1,1")
    with pytest.raises(SimError, match=r"expects e\.g\. 0-9"):
        parse_seeds("a-b")


def test_overrides_show_in_the_title_and_replace_the_note():
    from jenga.sim.cli import build_parser, scenario_from_args

    from jenga.sim import report

    def scenario(*argv: str):
        return scenario_from_args(build_parser().parse_args(list(argv)))

    own = scenario()
    assert own.overrides == () and own.label == "mamba-chat" and "Mamba-2 hybrid" in own.note
    other = scenario("--model", "gemma-2-9b", "--param", "num_clients=2", "--kv-gib", "4")
    assert other.overrides == ("model=gemma-2-9b", "kv_gib=4.0", "num_clients=2")
    assert other.note == "mamba-chat with model=gemma-2-9b, kv_gib=4.0, num_clients=2"
    title = report.table(other, [], {}).title
    assert title == f"{other.note}: gemma-2-9b on h100-80gb, multi-turn"
    reseeded = scenario("--seed", "3", "--allocators", "vllm_v1")
    assert reseeded.overrides == ("seed=3",) and reseeded.note == own.note
    engine = scenario("--scenario", "arxiv-ministral", "--max-num-seqs", "8", "--no-prefix-cache")
    assert engine.overrides == ("max_num_seqs=8", "prefix_cache=False")
