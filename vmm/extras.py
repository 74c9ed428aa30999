"""Optional dependencies: which install extra brings which package, and one clear error.

Rationale
---------
`pip install .` (no extras) gives the vmm core, the jenga allocator and the simulator,
none of which makes a tensor, so torch is an extra. A module that does need torch (or
transformers, vLLM, cuda-bindings) must say which extra to install instead of failing
with a bare `No module named 'torch'` somewhere deep inside.

Approach
--------
`require(module, feature)` imports `module` and, when it is not installed, raises
`MissingExtra` (an `ImportError`) naming the feature, the missing package and the extra
of this distribution that brings it. Modules that import torch at their top call it first
(`integrations.hf`, `integrations.engine`); modules that import torch lazily call it at
the point they first need it (`vmm.tensor` on the first view, the KV caches when built).

Limitations
-----------
Only a missing top-level package is turned into `MissingExtra`; a missing submodule of an
installed package, or an ImportError raised from inside one (a broken install, a version
mismatch), propagates as is.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

#: top-level module -> (distribution to install, extra of jenga-vmm that brings it)
EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "torch"),
    "transformers": ("transformers", "hf"),
    "vllm": ("vllm", "vllm"),
    "cuda": ("cuda-bindings", "cuda"),
    "matplotlib": ("matplotlib", "plot"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def install_hint(extra: str) -> str:
    """How to install `extra` of this distribution, in the words the README uses."""
    return (
        f"install jenga-vmm with the '{extra}' extra "
        f"(from a clone: pip install '.[{extra}]'; from a wheel: pip install 'WHEEL[{extra}]')"
    )


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """`module` imported; `MissingExtra` naming `feature` and the extra to install (`extra`,
    else the one that brings `module`) when it is absent."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return loaded
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != top:
            raise  # something inside an installed package is missing: not ours to rename
        dist, brings = EXTRAS.get(top, (top, top))
        raise MissingExtra(
            f"{feature} needs {dist}, which is not installed: {install_hint(extra or brings)}",
            name=module,
        ) from None
