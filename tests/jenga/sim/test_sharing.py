"""Parallel-sampling and beam-search scenarios (`jenga.sim.sharing`): block counts by hand,
the Jenga allocator's forks equal to vLLM's block manager, and the CLI."""

from __future__ import annotations

import json

import pytest
from jenga.sim.cli import main
from jenga.sim.protocol import SimError
from jenga.sim.sharing import SCENARIOS, SharingScenario, VllmBlocks, run_width


def test_two_samples_of_a_20_token_prompt_by_hand():
    """Block 16, prompt 20: the samples share the full block and the partial one until the
    first token; one copies it (3 blocks held), the other writes in place, three steps
    with no new block: 9 blocks held against 4 x 3 without sharing."""
    sc = SharingScenario("t", "alpaca", "sample", widths=(2,))
    r = run_width(sc, 2, trace=[(20, 3)])
    assert (r.steps, r.blocks) == (3, {"none": 12, "vllm": 9, "jenga": 9})
    assert r.saving("jenga") == pytest.approx(25.0)


def test_beams_at_a_block_boundary_copy_nothing_and_free_the_dead():
    blocks = VllmBlocks(4)
    blocks.add("p", 8)  # two full blocks
    blocks.fork("p", ["b1", "b2"])
    assert blocks.used == 2
    for seq in ("p", "b1", "b2"):
        blocks.append(seq)  # a new block each, nothing copied
    assert blocks.used == 5
    blocks.fork("b1", ["b3"])
    blocks.free("b2")  # the dead beam's own block goes, the shared ones stay
    assert blocks.used == 4
    blocks.append("b3")  # shares b1's partly filled block: copied
    blocks.append("b1")  # now alone in it: in place
    assert blocks.used == 5 and blocks.lengths == {"p": 9, "b1": 10, "b3": 10}
    for seq in ("p", "b1", "b3"):
        blocks.free(seq)
    assert blocks.used == 0 and not blocks.refs


@pytest.mark.parametrize("mode", ["sample", "beam"])
def test_jenga_forks_hold_exactly_the_blocks_vllm_holds(mode: str):
    sc = SharingScenario("t", "sharegpt", mode, widths=(3,), num_requests=12, max_num_seqs=16)
    r = run_width(sc, 3)
    assert r.blocks["jenga"] == r.blocks["vllm"] < r.blocks["none"]
    assert r.saving("jenga") > (30.0 if mode == "beam" else 5.0)


def test_beams_save_more_than_samples_and_more_with_width():
    beam = {w: run_width(SCENARIOS["beam-alpaca"], w) for w in (2, 6)}
    sample = {w: run_width(SCENARIOS["sampling-alpaca"], w) for w in (2, 6)}
    assert sample[2].saving("vllm") < sample[6].saving("vllm") < beam[2].saving("vllm")
    assert beam[2].saving("vllm") < beam[6].saving("vllm")
    assert beam[2].blocks["none"] == sample[2].blocks["none"]  # same trace, same lengths


def test_cli_reports_each_width_beside_the_paper(capsys):
    args = ["--scenario", "beam-alpaca", "--param", "num_requests=30", "--param", "widths=2/4"]
    assert main([*args, "--seed", "3", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scenario"]["seed"] == 3 and doc["scenario"]["num_requests"] == 30
    assert list(doc["widths"]) == ["2", "4"]
    two = doc["widths"]["2"]
    assert two["paper"] == "37.6 %"
    assert two["saving_pct"]["jenga"] == two["saving_pct"]["vllm"] > 0
    assert main(["--scenario", "sampling-sharegpt", "--param", "num_requests=5"]) == 0
    out = capsys.readouterr().out
    assert "16.2-30.5 % (2-6)" in out and "jenga forks" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "h100"], "--scenario beam-alpaca does not take --gpu"),
        (["--param", "rate=2"], "--param 'rate': beam-alpaca takes"),
        (["--param", "widths=0/2"], "widths must be ints in [1, max_num_seqs=256], got [0]"),
        (["--param", "widths=a"], "widths must look like 2/4/6, got 'a'"),
        (["--param", "beam_skew=2"], "beam_skew must be in (0, 1], got 2.0"),
    ],
)
def test_cli_refuses_what_the_scenario_does_not_take(args, message, capsys):
    assert main(["--scenario", "beam-alpaca", *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_bad_scenarios_are_refused():
    with pytest.raises(SimError, match="dataset must be one of"):
        SharingScenario("x", "lmsys", "beam")
    with pytest.raises(SimError, match="mode must be 'sample' or 'beam', got 'greedy'"):
        SharingScenario("x", "alpaca", "greedy")
    with pytest.raises(SimError, match="num_requests must be an int > 0, got 0"):
        SharingScenario("x", "alpaca", "beam", num_requests=0)
