"""Where the time of `VirtualRange.tensor` goes (host backend), step by step.

    .venv/bin/python benchmarks/profile_tensor_view.py [--calls N]

Prints the median ns of each stage of the view path and of two candidate fixes, measured
in one process: the per-call `from vmm.tensor import view` inside `VirtualRange.tensor`,
and `torch.from_dlpack` (a Python wrapper) against `torch._C._from_dlpack` (what that
wrapper calls for a capsule). The fixes are applied to a copy of the path here, not to
the library: they are evidence for the vmm layer's owners, see docs/vmm-bench.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


def median_ns(fn: Callable[[], Any], calls: int) -> int:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    calls = parser.parse_args().calls

    import torch
    from torch._C import _from_dlpack as c_from_dlpack
    from vmm._core import bench
    from vmm.tensor import _dtype_info, view

    import vmm

    size = 2 << 20
    pool = vmm.ChunkPool(vmm.HostBackend(), size)
    rng = pool.reserve(size)
    rng.map([0])
    factory = rng._views  # the range's C++ DLPack factory

    def capsule() -> object:
        return factory.capsule(0, (size,), (), 1, 8, 1)

    def import_view() -> None:
        from vmm.tensor import view  # noqa: F401 - the statement is what is timed

    def tensor_with_module_import() -> object:
        rng._check_open()
        return view(rng, (size,), torch.uint8, 0, None)

    stages = {
        "VirtualRange.tensor (as shipped)": lambda: rng.tensor((size,), torch.uint8),
        "  function-level `from vmm.tensor import view`": import_view,
        "  VirtualRange._check_open": rng._check_open,
        "  vmm.tensor.view": lambda: view(rng, (size,), torch.uint8, 0, None),
        "    _dtype_info": lambda: _dtype_info(torch.uint8),
        "    factory.capsule": capsule,
        "    torch.from_dlpack(capsule)": lambda: torch.from_dlpack(capsule()),
        "    torch._C._from_dlpack(capsule)": lambda: c_from_dlpack(capsule()),
        "raw: bare capsule": lambda: bench.raw_view_capsule(rng.va, size),
        "raw: torch.from_dlpack(bare capsule)": lambda: torch.from_dlpack(
            bench.raw_view_capsule(rng.va, size)
        ),
        "fix 1: module-level import": tensor_with_module_import,
    }
    for name, fn in stages.items():
        print(f"{median_ns(fn, calls):>7} ns  {name}")
    import vmm.tensor as vt

    saved = vt._from_dlpack
    vt._from_dlpack = c_from_dlpack
    try:
        ns = median_ns(tensor_with_module_import, calls)
        print(f"{ns:>7} ns  fix 1 + 2: and torch._C._from_dlpack")
    finally:
        vt._from_dlpack = saved
        rng.unmap([0])
        pool.close()


if __name__ == "__main__":
    main()
