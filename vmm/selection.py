"""Backend selection: `get_backend("host" | "cuda" | "auto", **opts)`.

Rationale
---------
The same program runs on a GPU machine and on a laptop; choosing the backend should be
one argument, and falling back should say why instead of failing silently.

Approach
--------
`auto` picks the CUDA backend when torch sees a device and cuda-python imports, else the
host backend, and logs which it chose and why. The CUDA backend (`vmm.cuda.CudaBackend`)
is imported only when asked for, so importing `vmm` never needs a driver.

Limitations
-----------
`auto` trusts torch's view of the devices; it does not probe the driver's VMM support
(`CudaBackend` checks that when constructed and raises `BackendUnavailable`).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from vmm.backend import Backend
from vmm.errors import BackendUnavailable
from vmm.extras import install_hint

_log = logging.getLogger("vmm")
BACKEND_KINDS = ("host", "cuda", "auto")


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None if it can."""
    try:
        import torch
    except ImportError:
        return f"torch is not installed ({install_hint('cuda')})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        found = importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"cuda-python (cuda-bindings) is not installed ({install_hint('cuda')})"
    return None


def _cuda_backend(**opts: Any) -> Backend:
    try:
        from vmm.cuda import CudaBackend
    except ImportError as exc:
        raise BackendUnavailable(f"the cuda backend cannot be imported: {exc}") from exc
    backend: Backend = CudaBackend(**opts)
    return backend


def get_backend(kind: str = "auto", **opts: Any) -> Backend:
    """A backend of `kind`; `opts` go to its constructor (e.g. granularity=64 << 10)."""
    if kind == "host":
        from vmm.host import HostBackend

        return HostBackend(**opts)
    if kind == "cuda":
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(f"cuda backend unavailable: {reason}")
        return _cuda_backend(**opts)
    if kind == "auto":
        reason = cuda_unavailable_reason()
        if reason is None:
            _log.info("vmm: auto-selected the cuda backend")
            return _cuda_backend(**opts)
        _log.info("vmm: auto-selected the host backend (%s)", reason)
        return get_backend("host", **opts)
    raise ValueError(f"unknown backend {kind!r}; expected one of {BACKEND_KINDS}")
