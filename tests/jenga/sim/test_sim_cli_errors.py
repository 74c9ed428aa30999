"""jenga-sim on bad flags and unusable outputs, run as a user runs it: one line on stderr,
exit 2, no traceback, and nothing simulated first (stdout stays empty, no file is written)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.cli_errors import MIN_CASES, assert_one_line, run_cli

MISSING = "/nonexistent-jenga-sim-folder"
NO_MATPLOTLIB = "sys.modules['matplotlib'] = None  # as if it were not installed"

BAD: dict[str, tuple[list[str], str]] = {
    # name: (argv, a piece of the one line)
    "kv-gib nan": (["--kv-gib", "nan"], "--kv-gib: expects a finite number > 0, got 'nan'"),
    "kv-gib inf": (["--kv-gib", "inf"], "--kv-gib: expects a finite number > 0, got 'inf'"),
    "kv-gib zero": (["--kv-gib", "0"], "--kv-gib: expects a finite number > 0, got '0'"),
    "block-size zero": (["--block-size", "0"], "--block-size: expects an integer > 0, got '0'"),
    "block-size negative": (["--block-size", "-16"], "expects an integer > 0, got '-16'"),
    "reserved share of one": (["--reserved", "1"], "reserved share must be in [0, 1), got 1.0"),
    "reserved-gib negative": (["--reserved-gib", "-1"], "a finite number >= 0, got '-1'"),
    "rate nan": (["--rate", "nan"], "--rate: expects a finite number > 0, got 'nan'"),
    "seed negative": (["--seed", "-1"], "--seed: expects an integer >= 0, got '-1'"),
    "max-num-seqs zero": (["--max-num-seqs", "0"], "expects an integer > 0, got '0'"),
    "max-num-batched-tokens text": (["--max-num-batched-tokens", "many"], "got 'many'"),
    "unknown admission": (["--admission", "eager"], "invalid choice: 'eager'"),
    "unknown prefill": (["--prefill", "fused"], "invalid choice: 'fused'"),
    "unknown scenario": (["--scenario", "nope"], "unknown scenario 'nope'"),
    "unknown model": (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    "unknown gpu": (["--gpu", "tpu-v5"], "unknown GPU 'tpu-v5'"),
    "unknown workload": (["--workload", "poetry"], "unknown workload 'poetry'"),
    "unknown allocator": (["--allocators", "vllm_v1,bogus"], "unknown allocators ['bogus']"),
    "param without a value": (["--param", "oops"], "--param expects key=value, got 'oops'"),
    "param the workload lacks": (["--param", "num_requests=3"], "'num_requests'"),
    "seeds not a list": (["--seeds", "abc"], "--seeds expects e.g. 0-9 or 0,3,7, got 'abc'"),
    "sweep not key=list": (["--sweep", "foo"], "--sweep expects KEY=V1,V2,..."),
    "grid scale inf": (["--sweep", "--sweep-kv-scales", "1,inf"], "distinct finite numbers > 0"),
    "run flag given to the grid": (["--sweep", "--kv-gib", "4"], "--kv-gib does not apply"),
    "grid flag given to a run": (["--markdown", "x.md"], "--markdown does not apply"),
    "json into a missing folder": (
        ["--json", f"{MISSING}/out.json"],
        f"--json {MISSING}/out.json: folder {MISSING} does not exist",
    ),
    "json onto a folder": (["--json", "/tmp"], "--json /tmp: is a folder"),
    "markdown into a missing folder": (
        ["--sweep", "--markdown", f"{MISSING}/grid.md"],
        f"folder {MISSING} does not exist",
    ),
    "plot-dir onto a file": (["--plot-dir", "/etc/hostname"], "exists and is not a folder"),
    "timelines without json": (["--timelines"], "--timelines adds to --json"),
    "unknown flag": (["--fast"], "unrecognized arguments: --fast"),
    "stray positional": (["mamba-chat"], "unrecognized arguments: mamba-chat"),
}


def _sim(argv: list[str], cwd: Path, before: str = "") -> subprocess.CompletedProcess[str]:
    return run_cli("jenga.sim.cli", ["--no-progress", *argv], cwd, before=before)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments_end_in_one_line(name: str, tmp_path: Path) -> None:
    argv, expected = BAD[name]
    assert_one_line(_sim(argv, tmp_path), "jenga-sim", expected)
    assert list(tmp_path.iterdir()) == []


def test_plot_dir_without_matplotlib_is_refused_before_the_run(tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    proc = _sim(["--plot-dir", str(plots)], tmp_path, before=NO_MATPLOTLIB)
    assert_one_line(proc, "jenga-sim", "--plot-dir needs matplotlib, which is not installed")
    assert "pip install '.[plot]'" in proc.stderr
    assert not plots.exists()


def test_the_table_is_large_enough() -> None:
    assert len(BAD) + 1 >= MIN_CASES
