"""Checked access to the CUDA driver through cuda-python, loaded only when asked for.

Rationale
---------
`import vmm` must work on machines with no GPU, no driver and no cuda-python, so the
driver module is imported inside `load_driver()`, never at module import. Every driver
call returns a `CUresult` first; `Driver.call` turns anything but `CUDA_SUCCESS` into a
`vmm.errors` exception that names the call and the code, so no result goes unchecked.

Approach
--------
`cuda.bindings.driver` (package `cuda-bindings`, cuda-python >= 12.6) is tried first, then
the older `cuda.cuda` name. A missing package, a missing `libcuda.so` (cuda-python raises
when it first loads the library) or `cuInit` failing all become `BackendUnavailable` with
the reason. `CUDA_ERROR_OUT_OF_MEMORY` becomes `OutOfMemory` carrying the device's free
and total bytes (`cuMemGetInfo`); every other code becomes `BackendError(op, code)`.

Limitations
-----------
Only the calls the VMM backend and vmm-bench use are named here; others go through
`Driver.call` by name.
"""

from __future__ import annotations

import importlib
import time
from types import ModuleType
from typing import Any

from vmm.errors import BackendError, BackendUnavailable, OutOfMemory
from vmm.extras import install_hint

_MODULE_NAMES = ("cuda.bindings.driver", "cuda.cuda")
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
#: The CUDA driver emulator of the test suite names its device with this word; figures
#: taken on it are host mmap costs and are labelled emulated, never GPU figures.
EMULATOR_MARK = "emulator"


def import_driver_module() -> ModuleType:
    """The cuda-python driver module, or BackendUnavailable naming what is missing."""
    reasons = []
    for name in _MODULE_NAMES:
        try:
            return importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken install raising anything
            reasons.append(f"{name}: {type(exc).__name__}: {exc}")
    raise BackendUnavailable(
        f"cuda backend needs cuda-python ({install_hint('cuda')}); " + "; ".join(reasons)
    )


class Driver:
    """A cuda-python driver module whose calls are checked.

    Invariant: `call` returns only the outputs of a call that returned CUDA_SUCCESS.
    """

    def __init__(self, module: ModuleType):
        self.mod = module
        self.num_calls: dict[str, int] = {}
        #: of those, the calls that returned an error (so made nothing)
        self.num_failed: dict[str, int] = {}
        #: when a dict, `call` appends each call's wall time (ns) under its name (vmm-bench)
        self.timings: dict[str, list[int]] | None = None
        self._functions: dict[str, Any] = {}  # name -> the module's function, looked up once

    def call(self, name: str, *args: Any) -> Any:
        """Run driver function `name`; return its single output, a tuple of several, or None."""
        num_calls = self.num_calls
        num_calls[name] = num_calls.get(name, 0) + 1
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = getattr(self.mod, name)
        if self.timings is None:
            result = function(*args)
        else:
            t0 = time.perf_counter_ns()
            result = function(*args)
            self.timings.setdefault(name, []).append(time.perf_counter_ns() - t0)
        if result[0]:
            self.num_failed[name] = self.num_failed.get(name, 0) + 1
            raise self.error(name, result[0])
        num_outputs = len(result)
        if num_outputs == 2:
            return result[1]
        return None if num_outputs == 1 else tuple(result[1:])

    def error(self, name: str, err: Any) -> BackendError | OutOfMemory:
        """The exception for `name` having returned `err` (never raises itself)."""
        code = int(err)
        label = self.error_name(err)
        if code == _OUT_OF_MEMORY:
            free, total = self.mem_info()
            return OutOfMemory(
                f"{name} failed: {label} ({code}); device has {free} bytes free of {total}",
                free=free,
                total=total,
            )
        return BackendError(f"{name} failed: {label} ({code})", op=name, code=code)

    def error_name(self, err: Any) -> str:
        try:
            res, raw = self.mod.cuGetErrorName(err)
            if not res and raw:
                return raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception:
            pass
        return getattr(err, "name", str(err))

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device bytes, or (0, 0) if the driver cannot say."""
        try:
            res, free, total = self.mod.cuMemGetInfo()
            if not res:
                return int(free), int(total)
        except Exception:
            pass
        return 0, 0


def device_name(driver: Driver, ordinal: int) -> str:
    """The name the driver reports for device `ordinal` (e.g. "NVIDIA A100-SXM4-80GB")."""
    dev = driver.call("cuDeviceGet", ordinal)
    raw = driver.call("cuDeviceGetName", 256, dev)
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return text.split("\0", 1)[0].strip()


def is_emulated(name: str) -> bool:
    """Whether a device name is the test suite's CUDA driver emulator."""
    return EMULATOR_MARK in name.lower()


def load_driver(module: ModuleType | None = None) -> Driver:
    """Initialise the driver of `module` (default: cuda-python's, imported now);
    BackendUnavailable with the reason if it cannot run."""
    module = import_driver_module() if module is None else module
    driver = Driver(module)
    try:
        driver.call("cuInit", 0)
    except BackendError as exc:
        raise BackendUnavailable(f"CUDA driver present but cuInit failed: {exc}") from exc
    except Exception as exc:  # cuda-python raises when libcuda.so cannot be loaded
        raise BackendUnavailable(
            f"no usable CUDA driver: {type(exc).__name__}: {exc}".rstrip()
        ) from exc
    num_devices = driver.call("cuDeviceGetCount")
    if int(num_devices) < 1:
        raise BackendUnavailable("CUDA driver loaded but it reports 0 devices")
    return driver
