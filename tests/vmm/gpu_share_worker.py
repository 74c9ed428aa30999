"""The importing process of test_gpu's two-process test (run as a script, needs a GPU).

Reads one JSON line ``{"fds": [fd0, fd1], "granularity": g}`` (the fds inherited from the
owner), imports both chunks into its own `CudaBackend`, maps them, answers with the first
8 bytes of chunk 0 (the owner's write) after filling chunk 1 with 0x22 on the GPU, then
waits for a line ``done`` and gives everything back.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import torch
    from vmm.backend import SharedChunks
    from vmm.cuda import CudaBackend

    request = json.loads(sys.stdin.readline())
    fds, g = request["fds"], request["granularity"]
    backend = CudaBackend(granularity=g)
    handles = backend.import_handles(SharedChunks(tuple(fds), tuple((i, 0) for i in range(2))))
    for fd in fds:
        os.close(fd)
    va = backend.reserve(2 * g)
    backend.map([va, va + g], handles)

    class _Raw:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "shape": (2 * g,), "typestr": "|u1", "data": (va, False), "version": 3,
                "strides": None,
            }  # fmt: skip

    view = torch.as_tensor(_Raw(), device="cuda")
    view[g:].fill_(0x22)
    torch.cuda.synchronize()
    print(json.dumps({"first_chunk_bytes": view[:8].tolist(), "error": None}), flush=True)
    sys.stdin.readline()  # "done": the owner has read our write
    del view
    backend.unmap([va, va + g])
    backend.free_reservation(va, 2 * g)
    backend.release(handles)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
