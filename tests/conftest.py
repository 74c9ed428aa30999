"""Test-wide setup: which `cuda`-marked tests run, and against what driver.

* Real GPU (torch sees CUDA and cuda-bindings is installed): every `cuda` test runs.
* CUDA driver emulator selected (`JENGA_VMM_CUDA_EMULATOR=/abs/path/libcuda.so.1`, set by
  `make test-cuda-emulated`; cuda-bindings installed): the emulator is loaded before
  cuda-bindings looks for a driver, `cuda` tests run on it through the real bindings, and
  those also marked `gpu` (torch CUDA tensors, kernels) skip. Under the emulator a `cuda`
  test that is not `gpu` must run: a skip fails the session, and so does a test that
  leaves handles, mappings, reservations, streams or context retains behind.
* Otherwise `cuda` tests skip with the reason. `emulator` tests (the emulator's own rules)
  run only when it is selected.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.vmm import emulator as _emulator

EMULATOR = _emulator.preload()  # before any test imports cuda-bindings
_unexpected_skips: list[str] = []


def _bindings_missing() -> str | None:
    try:
        if importlib.util.find_spec("cuda.bindings") is None:
            return "cuda-bindings is not installed"
    except ModuleNotFoundError:
        return "cuda-bindings is not installed"
    return None


def _gpu_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return _bindings_missing()


def _skip_reason(item: pytest.Item) -> str | None:
    if item.get_closest_marker("emulator") and EMULATOR is None:
        return f"emulator test: {_emulator.ENV_VAR} is not set (make test-cuda-emulated)"
    if not item.get_closest_marker("cuda"):
        return None
    if EMULATOR is None:
        missing = _gpu_missing()
        return None if missing is None else f"cuda test: {missing}"
    if item.get_closest_marker("gpu"):
        return "cuda test needs a real GPU (torch CUDA tensors or kernels); emulator selected"
    missing = _bindings_missing()
    return None if missing is None else f"cuda test on the emulator: {missing}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = _skip_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if EMULATOR is None or not report.skipped or hasattr(report, "wasxfail"):
        return
    if "cuda" in report.keywords and "gpu" not in report.keywords:
        _unexpected_skips.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected_skips:
        names = ", ".join(_unexpected_skips)
        print(f"\n{len(_unexpected_skips)} cuda test(s) skipped under the emulator: {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _emulator_left_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under the emulator, a cuda test must give back everything it took from the driver,
    and no stream work of it may have touched memory it could not (a GPU would fault)."""
    checked = EMULATOR is not None and request.node.get_closest_marker("cuda") is not None
    faults = EMULATOR.count("device_faults") if checked and EMULATOR else 0
    yield
    if not checked or EMULATOR is None:
        return
    live = EMULATOR.live_objects()
    new_faults = EMULATOR.count("device_faults") - faults
    if any(live.values()) or new_faults:
        EMULATOR.reset()
        pytest.fail(
            f"test left objects in the emulated CUDA driver: {live}; "
            f"{new_faults} stream operation(s) hit an address that was not mapped read-write"
        )
