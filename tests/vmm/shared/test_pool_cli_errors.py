"""vmm-pool on bad flags, a pool with no owner and an owner that does not answer: one line
on stderr, a non-zero exit, no traceback; `vmm-pool stop` stops a real owner."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.cli_errors import MIN_CASES, assert_one_line, run_cli
from tests.vmm.shared.pool_helpers import owner_process, pool_name

NOBODY = pool_name()  # no owner serves it
START = ["start", NOBODY, "--budget", "64K", "--chunk", "4K"]

BAD: dict[str, tuple[list[str], str]] = {
    # name: (argv, a piece of the one line)
    "budget zero": (["start", NOBODY, "--budget", "0"], "size '0': expected a size > 0"),
    "budget negative": (["start", NOBODY, "--budget=-5M"], "size '-5M': expected a size >= 0"),
    "budget nan": (["start", NOBODY, "--budget", "nan"], "size 'nan': expected e.g. 512M"),
    "budget inf": (["start", NOBODY, "--budget", "inf"], "size 'inf': expected e.g. 512M"),
    "budget unit unknown": (["start", NOBODY, "--budget", "8X"], "size '8X'"),
    "budget missing": (["start", NOBODY], "the following arguments are required: --budget"),
    "chunk zero": ([*START, "--chunk", "0"], "argument --chunk: size '0'"),
    "chunk does not divide the budget": (
        ["start", NOBODY, "--budget", "64K", "--chunk", "3000"],
        "not a positive multiple of 3000",
    ),
    "budget below one chunk": (
        ["start", NOBODY, "--budget", "1M", "--chunk", "2M"],
        "budget 1048576 bytes is not a positive multiple of 2097152",
    ),
    "pool name with a slash": (["start", "a/b", "--budget", "64K", "--chunk", "4K"], "'/'"),
    "path pool in a missing folder": (
        ["start", "/nonexistent-vmm-pool-folder/gpu0.sock", "--budget", "64K", "--chunk", "4K"],
        "folder /nonexistent-vmm-pool-folder does not exist",
    ),
    "socket mode not octal": ([*START, "--socket-mode", "999"], "octal mode bits"),
    "socket mode too large": ([*START, "--socket-mode", "7777"], "got '7777'"),
    "allow-uid negative": ([*START, "--allow-uid", "-1"], "uid/gid (an integer >= 0), got '-1'"),
    "allow-gid not a number": ([*START, "--allow-gid", "wheel"], "got 'wheel'"),
    "operator-uid negative": ([*START, "--operator-uid", "-7"], "got '-7'"),
    "max-conns-per-uid zero": ([*START, "--max-conns-per-uid", "0"], "integer >= 1, got '0'"),
    "reclaim-timeout nan": (
        [*START, "--reclaim-timeout", "nan"],
        "--reclaim-timeout must be a finite number of seconds > 0, got nan",
    ),
    "idle-timeout zero": ([*START, "--idle-timeout", "0"], "--idle-timeout must be a finite"),
    "ls with no owner": (["ls", NOBODY], f"no owner serves pool {NOBODY!r}"),
    "ls --watch zero": (["ls", NOBODY, "--watch", "0"], "seconds > 0, got '0'"),
    "ls --watch nan": (["ls", NOBODY, "--watch", "nan"], "seconds > 0, got 'nan'"),
    "ls --count zero": (["ls", NOBODY, "--watch", "1", "--count", "0"], ">= 1, got '0'"),
    "ls --count without --watch": (["ls", NOBODY, "--count", "3"], "--count applies to --watch"),
    "ls --watch with --json": (["ls", NOBODY, "--watch", "1", "--json"], "do not go together"),
    "ls --timeout negative": (["ls", NOBODY, "--timeout", "-1"], "seconds > 0, got '-1'"),
    "limits without a limit": (["limits", NOBODY, "llama"], "give --min, --max or both"),
    "limits min above max": (
        ["limits", NOBODY, "llama", "--min", "4G", "--max", "1G"],
        "--min 4294967296 bytes is above --max 1073741824 bytes",
    ),
    "limits max nan": (["limits", NOBODY, "llama", "--max", "nan"], "size 'nan'"),
    "limits with no owner": (["limits", NOBODY, "llama", "--max", "1G"], "no owner serves"),
    "stop with no owner": (["stop", NOBODY], f"no owner serves pool {NOBODY!r}"),
    "stop --timeout inf": (["stop", NOBODY, "--timeout", "inf"], "seconds > 0, got 'inf'"),
    "unknown command": (["frob", NOBODY], "invalid choice: 'frob'"),
    "no command": ([], "the following arguments are required: cmd"),
    "unknown flag": (["ls", NOBODY, "--fast"], "unrecognized arguments: --fast"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments_end_in_one_line(name: str, tmp_path: Path) -> None:
    argv, expected = BAD[name]
    assert_one_line(run_cli("vmm.shared.cli", argv, tmp_path, timeout=60), "vmm-pool", expected)
    assert list(tmp_path.iterdir()) == []


def test_the_table_is_large_enough() -> None:
    assert len(BAD) >= MIN_CASES


def test_a_stopped_owner_is_one_line_then_stop_ends_it(tmp_path: Path) -> None:
    name = pool_name()
    with owner_process(name, 64 << 10, 4 << 10) as owner:
        os.kill(owner.pid, signal.SIGSTOP)  # accepts connections (backlog), answers nothing
        try:
            for cmd in (["ls", name], ["limits", name, "llama", "--max", "8K"], ["stop", name]):
                proc = run_cli("vmm.shared.cli", [*cmd, "--timeout", "0.5"], tmp_path)
                assert_one_line(proc, "vmm-pool", "the owner did not answer within 0.5 s")
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        proc = run_cli("vmm.shared.cli", ["stop", name], tmp_path)
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
        assert proc.stdout == f"vmm-pool: pool {name!r} stopped\n"
        assert owner.wait(10.0) == 0  # gone by the time stop returned: it waits for that
        assert_one_line(run_cli("vmm.shared.cli", ["ls", name], tmp_path), "vmm-pool", "no owner")
