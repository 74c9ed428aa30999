"""Where the time of `VirtualRange.tensor` goes (host backend), step by step.

    .venv/bin/python benchmarks/profile_tensor_view.py [--calls N]

Prints the median ns of the view path, of its steps and of the raw floor (a bare C++
capsule adopted by torch), measured in one process. It found the two costs that kept the
view above 2 µs (see docs/vmm-bench.md): a per-call function-level import and torch's
Python-level `from_dlpack` wrapper.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vmm.bench.stats import Summary, time_calls


def median_ns(fn: Callable[[], Any], calls: int) -> float:
    """Median ns of `calls` calls of `fn` (after one untimed warm-up call)."""
    fn()
    return Summary.of(time_calls(lambda _: fn(), calls)).p50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    calls = parser.parse_args().calls

    import torch
    from torch._C import _from_dlpack as c_from_dlpack
    from vmm._core import bench
    from vmm.tensor import dtype_info, view

    import vmm

    size = 2 << 20
    pool = vmm.ChunkPool(vmm.HostBackend(), size)
    rng = pool.reserve(size)
    rng.map([0])
    factory = rng.view_factory  # the range's C++ DLPack factory

    def capsule() -> object:
        return factory.capsule(0, (size,), (), 1, 8, 1)

    def import_view() -> None:
        from vmm.tensor import view  # noqa: F401 - the statement is what is timed

    stages = {
        "VirtualRange.tensor": lambda: rng.tensor((size,), torch.uint8),
        "  a function-level `from vmm.tensor import view` (for scale)": import_view,
        "  VirtualRange.check_open": rng.check_open,
        "  vmm.tensor.view (the general path)": lambda: view(rng, (size,), torch.uint8, 0, None),
        "    dtype_info": lambda: dtype_info(torch.uint8),
        "    factory.capsule": capsule,
        "    torch.from_dlpack(capsule)": lambda: torch.from_dlpack(capsule()),
        "    torch._C._from_dlpack(capsule)": lambda: c_from_dlpack(capsule()),
        "raw: bare capsule": lambda: bench.raw_view_capsule(rng.va, size),
        "raw: torch.from_dlpack(bare capsule)": lambda: torch.from_dlpack(
            bench.raw_view_capsule(rng.va, size)
        ),
    }
    try:
        for name, fn in stages.items():
            print(f"{median_ns(fn, calls):>7.0f} ns  {name}")
    finally:
        rng.unmap([0])
        pool.close()


if __name__ == "__main__":
    main()
