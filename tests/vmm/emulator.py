"""The CUDA driver emulator (tests/vmm/cuda_emulator, built as libcuda.so.1) seen from Python.

Selection: `make test-cuda-emulated` builds the library and sets
`JENGA_VMM_CUDA_EMULATOR=/abs/path/libcuda.so.1`. tests/conftest.py then calls `preload()`
before anything imports cuda-bindings, so the bindings' loader finds our library already
loaded under the soname `libcuda.so.1` and takes it as the driver. Only the test suite
reads that variable; the package never does.

`Emulator` wraps the library's `emu_*` controls (ctypes): fault injection, counters, the
device size. `host_view` reads "device memory" at a device address, which works because
the emulator's device pointers are host addresses (see emu.h); it checks the emulated
access first, so a test that would touch an inaccessible slot fails with a message
instead of a segfault.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

ENV_VAR = "JENGA_VMM_CUDA_EMULATOR"
POISON_BYTE = 0xA5  # emu.h: the first and last 4 KiB of a new allocation hold this
ACCESS_NONE, ACCESS_READ, ACCESS_READWRITE = 0, 1, 3
UNMAPPED, UNRESERVED = -1, -2
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_NOT_SUPPORTED = 801

_loaded: Emulator | None = None


def selected_path() -> str | None:
    """The emulator library named by the environment, or None."""
    path = os.environ.get(ENV_VAR, "").strip()
    return path or None


class Emulator:
    """ctypes handle on the loaded emulator library."""

    def __init__(self, path: str):
        self.path = path
        self.lib = lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        lib.emu_fail_after.argtypes = [ctypes.c_longlong, ctypes.c_int]
        lib.emu_count.argtypes = [ctypes.c_char_p]
        lib.emu_count.restype = ctypes.c_longlong
        lib.emu_access.argtypes = [ctypes.c_ulonglong]
        lib.emu_set_device_bytes.argtypes = [ctypes.c_ulonglong]
        lib.emu_set_read_only_access.argtypes = [ctypes.c_int]
        lib.emu_reset.restype = ctypes.c_longlong

    def fail_after(self, k: int, code: int = CUDA_ERROR_OUT_OF_MEMORY) -> None:
        """The k-th memory call from now returns `code` (one shot; k <= 0 cancels)."""
        self.lib.emu_fail_after(k, code)

    def count(self, what: str) -> int:
        value = int(self.lib.emu_count(what.encode()))
        if value == -1 and what != "pending_fault":
            raise KeyError(f"the emulator has no counter {what!r}")
        return value

    def live_objects(self) -> dict[str, int]:
        """What the process still holds in the emulated driver (all zero when clean)."""
        keys = ("handles", "released_mapped", "reservations", "mappings", "streams",
                "ctx_retains", "ctx_depth", "bytes_used")  # fmt: skip
        return {k: self.count(k) for k in keys}

    def access(self, va: int) -> int:
        """CU_MEM_ACCESS_FLAGS_* of the mapping at `va`, UNMAPPED or UNRESERVED."""
        return int(self.lib.emu_access(va))

    def set_device_bytes(self, n: int) -> None:
        self.lib.emu_set_device_bytes(n)

    def set_read_only_access(self, supported: bool) -> None:
        self.lib.emu_set_read_only_access(int(supported))

    def reset(self) -> int:
        """Destroy everything; returns how many objects were still alive."""
        return int(self.lib.emu_reset())

    def host_view(self, va: int, nbytes: int, granularity: int, *, write: bool = False) -> Any:
        """A CPU uint8 tensor over [va, va + nbytes) of emulated device memory."""
        import torch

        need = ACCESS_READWRITE if write else ACCESS_READ
        page = va - va % granularity
        while page < va + nbytes:
            got = self.access(page)
            if got < need:
                raise AssertionError(
                    f"emulated device memory at {page:#x} has access {got} "
                    f"(needs {need}): a GPU kernel touching it would fault"
                )
            page += granularity
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_ubyte * nbytes).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8)


def preload() -> Emulator | None:
    """Load the selected emulator (once) so cuda-bindings adopts it as libcuda.so.1."""
    global _loaded
    path = selected_path()
    if path is None:
        return None
    if _loaded is None:
        if not os.path.isfile(path):
            raise RuntimeError(f"{ENV_VAR}={path}: no such file (run make test-cuda-emulated)")
        _loaded = Emulator(path)
    return _loaded


def loaded() -> Emulator | None:
    """The emulator this process runs on, or None (a real driver, or none)."""
    return _loaded
