"""The side-by-side sweep: grid parsing, seeded workloads and one real small grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness.side_by_side import Workload, main
from integrations.vllm.harness.sweep import SweepSpecError, parse_grid


def test_grid_takes_lists_ranges_and_the_command_defaults() -> None:
    grid = parse_grid(["requests=8,16", "seeds=0-2"], requests=64, memory_mb=256, seed=5)
    assert (grid.requests, grid.memory_mb, grid.seeds, grid.cells) == (
        (8, 16),
        (256,),
        (0, 1, 2),
        6,
    )
    grid = parse_grid(["memory-gib=20,40"], requests=64, memory_mb=256, seed=0)
    assert (grid.requests, grid.memory_mb, grid.seeds) == ((64,), (20480, 40960), (0,))


@pytest.mark.parametrize(
    ("items", "words"),
    [
        (["requests"], "KEY=VALUES"),
        (["tokens=8"], "KEY=VALUES"),
        (["requests=8,x"], "'x' is not an integer"),
        (["seeds=3-1"], "runs backwards"),
        (["requests=0,8"], "0 is below 1"),
        (["memory-mb=128", "memory-gib=1"], "given twice"),
    ],
)
def test_bad_grid_items_name_the_item(items: list[str], words: str) -> None:
    with pytest.raises(SweepSpecError, match=words):
        parse_grid(items, requests=8, memory_mb=128, seed=0)


def test_seed_zero_is_the_fixed_workload_and_other_seeds_draw() -> None:
    fixed = Workload(requests=16)
    assert [p[512] for p in fixed.prompts()] == [100 + i % 8 for i in range(16)]
    assert fixed.outputs() == [64] * 16 and fixed.longest() == 512 + 256 + 200 + 64
    one, again, two = (
        Workload(requests=16, seed=1),
        Workload(requests=16, seed=1),
        Workload(requests=16, seed=2),
    )
    assert one.prompts() == again.prompts() and one.outputs() == again.outputs()
    assert one.prompts() != two.prompts()
    assert len({len(p) for p in one.prompts()}) > 1 and len(set(one.outputs())) > 1
    assert all(32 <= n <= 96 for n in one.outputs())


def test_a_small_sweep_writes_every_cell_and_its_ratios(tmp_path: Path) -> None:
    out, table = tmp_path / "sweep.json", tmp_path / "sweep.md"
    args = ["--cases", "gemma2", "--managers", "vllm", "jenga-vmm", "--json", str(out)]
    grid = ["--sweep", "requests=8", "memory-mb=128,256", "seeds=0-1"]
    assert main([*args, *grid, "--table", str(table)]) == 0
    payload = json.loads(out.read_text())
    cells = payload["cells"]
    assert [(c["memory_mb"], c["seed"]) for c in cells] == [(128, 0), (128, 1), (256, 0), (256, 1)]
    for cell in cells:
        ours, theirs = cell["rows"]["jenga-vmm"], cell["rows"]["vllm"]
        assert ours["committed_bytes"] > 0 and theirs["committed_bytes"] == cell["memory_mb"] << 20
        assert ours["hit_tokens"] > 0 and theirs["steps"] > 0
    text = table.read_text()
    first = cells[0]["rows"]
    running = first["jenga-vmm"]["avg_running"] / first["vllm"]["avg_running"]
    assert f"| 8 | 0 | {running:.3f} / " in text or f"| 8 | 0 | **{running:.3f} / " in text
