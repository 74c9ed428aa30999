"""jenga-sim --sweep alone: scenarios x KV sizes x seeds, every Jenga row / vllm_v1."""

import json
import math
from dataclasses import replace

import pytest
from jenga.sim.cli import main
from jenga.sim.metrics import summarize
from jenga.sim.protocol import SimError
from jenga.sim.scenarios import SCENARIOS, get_scenario, run_scenario

from jenga.sim import grid

LLAMA = ["--sweep", "--sweep-scenarios", "multiturn-llama", "--no-progress"]


def test_grid_writes_one_json_and_a_ratio_table(tmp_path, capsys):
    out, md = tmp_path / "grid.json", tmp_path / "grid.md"
    args = [*LLAMA, "--sweep-kv-scales", "1,0.5", "--allocators", "jenga_vmm,jenga_vmm_group"]
    assert main([*args, "--seeds", "0,1", "--json", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["baseline"] == "vllm_v1"
    assert doc["metrics"] == ["avg_decode_batch", "hit_rate", "preemptions", "mean_committed_gib"]
    cells = doc["cells"]
    assert [(c["kv"].split()[0], c["seed"]) for c in cells] == [
        ("x1", 0),
        ("x1", 1),
        ("x0.5", 0),
        ("x0.5", 1),
    ]
    scenario = get_scenario("multiturn-llama")
    own = scenario.kv_bytes(scenario.model_spec()) / 2**30
    assert cells[0]["kv_gib"] == own and cells[2]["kv_gib"] == own / 2
    for cell in cells:
        assert list(cell["summaries"]) == ["vllm_v1", "jenga_vmm", "jenga_vmm_group"]
        base = cell["summaries"]["vllm_v1"]
        for name in ("jenga_vmm", "jenga_vmm_group"):
            mine, got = cell["summaries"][name], cell["ratios_vs_vllm_v1"][name]
            assert (
                got["mean_committed_gib"] == mine["mean_committed_gib"] / base["mean_committed_gib"]
            )
            assert got["avg_decode_batch"] == mine["avg_decode_batch"] / base["avg_decode_batch"]
    # the x1 cell is the scenario as shipped: the same summaries as a plain run
    shipped = replace(scenario, allocators=("vllm_v1", "jenga_vmm", "jenga_vmm_group"))
    results, _ = run_scenario(shipped)
    plain = summarize(results[1]).as_dict()
    simulated = [k for k in plain if not k.startswith("alloc_us")]  # not wall-clock times
    assert {k: cells[0]["summaries"]["jenga_vmm"][k] for k in simulated} == {
        k: plain[k] for k in simulated
    }
    lines = md.read_text().splitlines()
    assert (
        lines[0] == "| scenario | KV | seed | allocator | batch x | hit x | preempt x | commit x |"
    )
    assert len(lines) == 2 + 4 * 2  # header, rule, 4 cells x 2 Jenga rows
    assert "ours / vllm_v1 per cell" in capsys.readouterr().out


def test_a_cell_where_nothing_fits_says_so_and_exits_1(tmp_path, capsys):
    md = tmp_path / "grid.md"
    args = [*LLAMA, "--sweep-kv-gib", "0.01", "--allocators", "jenga_vmm_group"]
    assert main([*args, "--markdown", str(md)]) == 1
    assert md.read_text().splitlines()[2] == (
        "| multiturn-llama | 0.01 GiB | 0 | every row | does not fit | does not fit "
        "| does not fit | does not fit |"
    )
    assert capsys.readouterr().err == "jenga-sim: no result for jenga_vmm_group, vllm_v1\n"


def test_ratio_reads_zero_over_zero_as_equal_and_x_over_zero_as_infinite():
    assert grid.ratio(0, 0) == 1.0
    assert grid.ratio(3, 0) == math.inf
    assert grid.ratio(3, 6) == 0.5
    assert grid._ratio_text("preemptions", 3, 0) == "3 vs 0"
    assert grid._ratio_text("hit_rate", 0.25, 0) == "25.0 % vs 0"


def test_defaults_and_parsing():
    assert grid.parse_scenarios(None) == sorted(set(SCENARIOS) - {"mmmu-llama-vision"})
    assert grid.parse_scenarios("all") == sorted(SCENARIOS)
    assert grid.parse_sizes(None, "--x", (1.0, 0.5)) == [1.0, 0.5]
    with pytest.raises(SimError, match="distinct finite numbers > 0"):
        grid.parse_sizes("1,nan", "--x")
    with pytest.raises(SimError, match="distinct"):
        grid.parse_scenarios("mamba-chat,mamba-chat")
    # the default rows: the scenario's Jenga rows (no max_page) and the recommended geometry
    paper = get_scenario("arxiv-ministral")
    assert grid.allocators_for(paper, None)[0] == "vllm_v1"
    assert "max_page" not in grid.allocators_for(paper, None)
    assert grid.allocators_for(paper, None)[-1] == "jenga_vmm_group"
    assert grid.allocators_for(paper, ["vllm_v1", "jenga_vmm"]) == ("vllm_v1", "jenga_vmm")
