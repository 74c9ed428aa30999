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
* On a real GPU every `cuda` test is checked for leaks (`_gpu_left_clean`): each
  `CudaBackend` it created is closed by its end, and its driver released every chunk
  handle and freed every reservation it made. A `cuda` test that runs no torch kernel
  also leaves the device's free memory (`cuMemGetInfo`, through `torch.cuda.mem_get_info`,
  after torch's caches are emptied) where it started, within `GPU_LEAK_SLACK_BYTES`; for a
  `gpu` test the figure is recorded only (kernel modules torch loads on first use and its
  library handles take device memory that is never given back: 32-190 MiB per new
  attention kernel on an H200).
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vmm import emulator as _emulator

EMULATOR = _emulator.preload()  # before any test imports cuda-bindings
GPU_LEAK_SLACK_BYTES = int(os.environ.get("JENGA_VMM_GPU_LEAK_SLACK_MIB", "16")) << 20
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


def _settled_free_bytes() -> int:
    """Free device memory once torch has given back what it caches."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return int(torch.cuda.mem_get_info()[0])


def _succeeded(drv: Any) -> dict[str, int]:
    """Per driver function, the calls of `drv` that returned CUDA_SUCCESS."""
    return {k: n - drv.num_failed.get(k, 0) for k, n in drv.num_calls.items()}


# driver calls that make (+1) or free (-1) what a closed backend must have given back
_BALANCED_CALLS = {
    "cuMemCreate": ("handles", 1),
    "cuMemImportFromShareableHandle": ("handles", 1),
    "cuMemRelease": ("handles", -1),
    "cuMemAddressReserve": ("reservations", 1),
    "cuMemAddressFree": ("reservations", -1),
}


def _driver_balance(drivers: list[Any], start: dict[int, dict[str, int]]) -> dict[str, int]:
    """What the drivers were asked to create less what they freed since `start` (per
    driver id; a driver made during the test starts at zero): chunk handles made or
    imported vs released, reservations vs freed."""
    balance = {"handles": 0, "reservations": 0}
    for drv in {id(d): d for d in drivers}.values():
        before, ok = start.get(id(drv), {}), _succeeded(drv)
        for name, (kind, sign) in _BALANCED_CALLS.items():
            balance[kind] += sign * (ok.get(name, 0) - before.get(name, 0))
    return balance


@pytest.fixture(autouse=True)
def _gpu_left_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """On a real GPU, a cuda test closes every `CudaBackend` it opened, its backends' driver
    calls free every chunk handle and reservation they made, and (unless the test also runs
    torch kernels, marker `gpu`) the device's free memory is back where it was, within
    `GPU_LEAK_SLACK_BYTES`. A `gpu` test's device figure is recorded, not judged: kernels
    torch loads on first use and its library handles hold device memory for good."""
    checked = EMULATOR is None and request.node.get_closest_marker("cuda") is not None
    if not checked or _gpu_missing() is not None:
        yield
        return
    from vmm.cuda import CudaBackend

    opened: list[Any] = []
    init = CudaBackend.__init__
    start: dict[int, dict[str, int]] = {}

    def tracking_init(self: Any, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("driver")
        if given is not None and id(given) not in start:  # a driver made before the test
            start[id(given)] = _succeeded(given)
        init(self, *args, **kwargs)
        opened.append(self)

    free_before = _settled_free_bytes()
    CudaBackend.__init__ = tracking_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        CudaBackend.__init__ = init  # type: ignore[method-assign]
    left_open = [b for b in opened if not b._closed]
    for backend in left_open:
        backend.close()
    lost = free_before - _settled_free_bytes()
    request.node.user_properties.append(("gpu_free_bytes_lost", lost))
    balance = _driver_balance([b.driver for b in opened], start)
    judged = request.node.get_closest_marker("gpu") is None
    if left_open or any(balance.values()) or (judged and lost > GPU_LEAK_SLACK_BYTES):
        pytest.fail(
            f"GPU leak: {len(left_open)} of {len(opened)} CudaBackend(s) left open; driver "
            f"handles made - released {balance['handles']}, reservations made - freed "
            f"{balance['reservations']}; device free memory {lost} bytes below the start "
            f"(slack {GPU_LEAK_SLACK_BYTES}{'' if judged else ', not judged: gpu test'})"
        )
