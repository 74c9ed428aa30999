"""pytest plugin for the conformance suite: records outcomes, optionally swaps in jenga.

Rationale
    vLLM's own ``tests/v1/core`` must run unedited. With ``--conformance-manager=jenga``
    this plugin makes every KV-cache manager those tests build a `JengaKVCacheManager`:
    the class name the tests import from ``vllm.v1.core.kv_cache_manager`` becomes
    `integrations.vllm.drop_in.jenga_kv_cache_manager`, and vLLM's `Scheduler` (and so
    `AsyncScheduler`) gets `JengaScheduler`'s construction (config refusals, vLLM's own
    set-up, then `install_jenga_manager`). With ``vllm`` nothing is patched.

Approach
    Patching happens in ``pytest_configure``, before the test modules are imported, so
    their ``from ... import KVCacheManager`` binds the jenga constructor. The scheduler
    module is imported first so that it keeps vLLM's class for the construction that
    `install_jenga_manager` replaces. Every test's outcome (passed / failed / skipped),
    the failure's exception lines and whether it built a manager go to
    ``--conformance-out`` as JSON for ``run_conformance.py`` to compare.

Limitations
    Loaded by module name (``-p jenga_conformance_plugin`` with this folder on
    ``PYTHONPATH``): vLLM's test package is also called ``tests``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance")
    group.addoption("--conformance-manager", choices=("vllm", "jenga"), default="vllm")
    group.addoption("--conformance-out", default=None, help="JSON file of outcomes")


def _swap_in_jenga() -> None:
    import vllm.v1.core.kv_cache_manager as kvm
    import vllm.v1.core.sched.scheduler as sched  # binds vLLM's class before the patch
    from integrations.vllm.drop_in import jenga_kv_cache_manager
    from integrations.vllm.scheduler import install_jenga_manager
    from integrations.vllm.version import check_vllm_version

    def counted_manager(*args: Any, **kwargs: Any) -> Any:
        _BUILT.append(1)
        return jenga_kv_cache_manager(*args, **kwargs)

    kvm.KVCacheManager = counted_manager  # type: ignore[assignment,misc]
    original = sched.Scheduler.__init__

    def jenga_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _BUILT.append(1)
        check_vllm_version()
        original(self, *args, **kwargs)
        install_jenga_manager(self)

    sched.Scheduler.__init__ = jenga_init  # type: ignore[method-assign]


_BUILT: list[int] = []
"""One entry per jenga manager (or jenga-patched scheduler) construction attempt."""


class _Recorder:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.results: dict[str, dict[str, str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "error": ""})
        if _BUILT:  # the test built a manager or scheduler in this phase
            entry["built"] = "yes"
            _BUILT.clear()
        if report.failed:
            entry["outcome"] = "failed"
            if not entry["error"]:
                entry["error"] = _error_text(report)
        elif report.skipped and entry["outcome"] != "failed":
            entry["outcome"] = "skipped"

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.results[report.nodeid] = {"outcome": "error", "error": _error_text(report)}

    def pytest_sessionfinish(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=0, sort_keys=True))


def _error_text(report: Any) -> str:
    """The exception lines of a failure (pytest's ``E`` lines, at most 4000 characters),
    then ``crash: PATH:LINE`` where it was raised when pytest knows it."""
    text = str(report.longreprtext)
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    out = "\n".join(lines)[-4000:] or text[-4000:]
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        out += f"\ncrash: {crash.path}:{crash.lineno}"
    return out


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--conformance-manager") == "jenga":
        _swap_in_jenga()
    out = config.getoption("--conformance-out")
    if out:
        config.pluginmanager.register(_Recorder(Path(out)), "conformance-recorder")
