"""jenga-sim end to end: table, JSON, plots, errors."""

import json

from jenga.sim.cli import main

SMALL = ["--param", "num_requests=3", "--param", "min_input=2000", "--param", "max_input=3000"]


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
        "jenga_static",
        "jenga_vmm",
        "jenga_vmm_compact",
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
    assert written == [
        "decode_batch.png",
        "hit_rate.png",
        "memory_jenga_vmm.png",
        "memory_uniform.png",
    ]
    assert all(p.stat().st_size > 1000 for p in tmp_path.iterdir())


def test_bad_input_exits_2_with_reason(capsys):
    assert main(["--no-progress", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().out
    assert main(["--no-progress", "--allocators", "uniform,bogus"]) == 2
    assert "unknown allocators ['bogus']" in capsys.readouterr().out
    assert main(["--no-progress", "--param", "oops"]) == 2
    assert "--param expects key=value, got 'oops'" in capsys.readouterr().out


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
    assert at_3["kv_gib"] == 3.0 and at_3["summaries"]["max_page"] is None
    assert at_8["summaries"]["max_page"]["allocator"] == "max_page"
    assert "does not fit" in capsys.readouterr().out
    assert (tmp_path / "hit_rate_vs_kv.png").stat().st_size > 1000


def test_list(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "arxiv-ministral" in out and "jenga_vmm" in out and "prefix-repetition" in out
