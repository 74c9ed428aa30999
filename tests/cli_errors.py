"""The commands the package installs, run as a user runs them, for the bad-argument tables
of each (`tests/vmm/test_bench_cli_errors.py`, `tests/vmm/shared/test_pool_cli_errors.py`,
`tests/jenga/sim/test_sim_cli_errors.py`, `tests/jenga/test_presets_table_cli_errors.py`): a
child interpreter runs the command's module as ``__main__``; `assert_one_line` checks what a
refusal must look like."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The tables' floor: every CLI is tried with at least this many bad argument sets.
MIN_CASES = 20


def run_cli(
    module: str,
    argv: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    before: str = "",
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """``python -m module *argv`` in `cwd` (the repository on ``PYTHONPATH``); `before`:
    Python run first in the child (e.g. making a package unimportable)."""
    code = f"import runpy, sys\n{before}\nrunpy.run_module({module!r}, run_name='__main__')"
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], prog: str, expected: str) -> None:
    """A refusal: a non-zero exit, no traceback, exactly one non-blank line on stderr that
    starts with `prog` and contains `expected`, nothing on stdout."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith(prog), lines
    assert expected in lines[0], lines
    assert proc.stdout.strip() == "", proc.stdout
