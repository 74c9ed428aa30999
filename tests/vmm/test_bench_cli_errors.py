"""vmm-bench on bad flags and unusable resources: one line on stderr, non-zero exit, no
traceback, and nothing measured first (each case would otherwise run the tiny bench)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cli_errors import MIN_CASES, assert_one_line, run_cli

TINY = ["--backend", "host", "--chunk-sizes", "64K", "--counts", "4", "--rounds", "1",
        "--map-rounds", "1", "--create-count", "2", "--views", "5", "--no-progress"]  # fmt: skip


def _with(**flags: str) -> list[str]:
    """TINY with some flags replaced (`chunk_sizes="3000"` -> `--chunk-sizes 3000`)."""
    argv = list(TINY)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


MISSING = "/nonexistent-vmm-bench-folder/out.json"

BAD: dict[str, tuple[list[str], str]] = {
    # name: (argv, a piece of the one line)
    "chunk size not a page multiple": (_with(chunk_sizes="3000"), "not a multiple of the"),
    "chunk size unit unknown": (_with(chunk_sizes="2X"), "bad size '2X'"),
    "chunk size zero": (_with(chunk_sizes="0"), "bad size '0'"),
    "chunk size negative": ([*TINY, "--chunk-sizes=-2M"], "bad size '-2M'"),
    "chunk size empty list": (_with(chunk_sizes=","), "lists non-empty"),
    "chunk size over max-mib": (_with(chunk_sizes="8M", max_mib="4"), "larger than --max-mib 4"),
    "count zero": (_with(counts="0"), "must be >= 1"),
    "count negative": (_with(counts="-5"), "must be >= 1"),
    "count not a number": (_with(counts="lots"), "not an integer: 'lots'"),
    "rounds zero": (_with(rounds="0"), "must be >= 1"),
    "rounds not a number": (_with(rounds="x"), "invalid int value: 'x'"),
    "map-rounds negative": (_with(map_rounds="-1"), "must be >= 1"),
    "views zero": (_with(views="0"), "must be >= 1"),
    "create-count zero": (_with(create_count="0"), "must be >= 1"),
    "unknown mode": (_with(modes="sideways"), "unknown mode 'sideways'"),
    "unknown layout": (_with(layouts="diagonal"), "unknown layout 'diagonal'"),
    "empty modes": (_with(modes=","), "lists non-empty"),
    "unknown backend": (_with(backend="tpu"), "invalid choice: 'tpu'"),
    "cuda without a driver": (_with(backend="cuda"), "cuda"),
    "max-mib zero": (_with(max_mib="0"), "--max-mib must be >= 1"),
    "device negative": (_with(device="-1"), "--device must be a device ordinal >= 0"),
    "json into a missing folder": (_with(json=MISSING), "does not exist"),
    "json onto a folder": (_with(json="/tmp"), "is a folder"),
    "json without a path": ([*TINY, "--json"], "expected one argument"),
    "unknown flag": ([*TINY, "--fast"], "unrecognized arguments: --fast"),
    "stray positional": ([*TINY, "quick"], "unrecognized arguments: quick"),
}


def _no_driver_env() -> dict[str, str]:
    """This environment without the CUDA emulator (so `--backend cuda` has no driver)."""
    env = dict(os.environ)
    env.pop("JENGA_VMM_CUDA_EMULATOR", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments_end_in_one_line(name: str, tmp_path: Path) -> None:
    argv, expected = BAD[name]
    proc = run_cli("vmm.bench", argv, tmp_path, env=_no_driver_env())
    assert_one_line(proc, "vmm-bench", expected)  # stdout empty: nothing was measured
    assert list(tmp_path.iterdir()) == []


def test_the_table_is_large_enough() -> None:
    assert len(BAD) >= MIN_CASES
