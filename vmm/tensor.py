"""Zero-copy torch tensors over virtual ranges.

Rationale
---------
Unmodified kernels must read a layer's KV cache as an ordinary tensor, and a view must
be cheap enough to make per step (target: <= 2 µs median). Both exchange protocols torch
understands are zero-copy: DLPack (any device) and `__cuda_array_interface__` (CUDA).

Approach
--------
* Host (and any backend with a `view_factory`): C++ builds a DLPack capsule whose deleter
  holds a C++ reference on the reservation, so the tensor keeps the address range
  reserved without Python being called when it dies; `torch.from_dlpack` adopts it.
  Dtypes DLPack cannot name (float8 ...) travel as the unsigned int of the same width
  and are reinterpreted with `Tensor.view(dtype)` (still no copy).
  The CUDA backend's factory makes the same capsules with device type kDLCUDA.
* A backend without a factory (CUDA device memory): an owner object exposes
  `__cuda_array_interface__` over the viewed bytes as uint8; torch keeps the owner (and
  through it the range) alive; the bytes are reinterpreted with `view(dtype)` and
  `as_strided`.

Limitations
-----------
Strides are non-negative element strides. torch adopts CUDA capsules (and
`__cuda_array_interface__` owners) only with CUDA, so those tensors are made on a GPU only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from vmm._core import host as _h
from vmm.checks import INT64_MAX, as_index, as_indices
from vmm.errors import AlignmentError, ClosedError, RangeError
from vmm.extras import require

#: The C++ host error base class (what a view capsule raises on bad input).
HostError = _h.HostError

if TYPE_CHECKING:
    import torch

    from vmm.backend import ViewFactory


class ViewedRange(Protocol):
    """What a view needs of its range (`vmm.range.VirtualRange`, which imports this module)."""

    va: int
    size: int
    device: str

    @property
    def view_factory(self) -> ViewFactory | None: ...


# torch.dtype -> (DLPack code, bits, itemsize, reinterpret-as dtype or None); built lazily
DTYPES: dict[Any, tuple[int, int, int, Any]] = {}
#: torch's capsule importer, bound on first use (torch is never imported with `vmm`).
adopt_capsule: Any = None


def _init_dtypes() -> None:
    require("torch", "a tensor view (vmm.tensor)")
    import torch

    global adopt_capsule
    table = {  # DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool
        torch.int8: (0, 8),
        torch.int16: (0, 16),
        torch.int32: (0, 32),
        torch.int64: (0, 64),
        torch.uint8: (1, 8),
        torch.float16: (2, 16),
        torch.float32: (2, 32),
        torch.float64: (2, 64),
        torch.bfloat16: (4, 16),
        torch.complex64: (5, 64),
        torch.complex128: (5, 128),
        torch.bool: (6, 8),
    }
    for dtype, (code, bits) in table.items():
        DTYPES[dtype] = (code, bits, bits // 8, None)
    # torch._C._from_dlpack takes the capsule as is; torch.from_dlpack adds ~0.3 µs of checks
    adopt_capsule = getattr(torch._C, "_from_dlpack", torch.from_dlpack)


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` ("float16" or "torch.float16"); TypeError if none."""
    require("torch", "a tensor view (vmm.tensor)")
    import torch

    resolved = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise TypeError(f"unknown dtype name {name!r}")
    return resolved


def dtype_info(dtype: Any) -> tuple[int, int, int, Any]:
    """(DLPack code, bits, itemsize, reinterpret-as dtype or None) of `dtype`; a dtype
    DLPack cannot name travels as the unsigned int of its width."""
    info = DTYPES.get(dtype)
    if info is not None:
        return info
    if not DTYPES:
        _init_dtypes()
        return dtype_info(dtype)
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(itemsize)
    if carrier is None:
        raise TypeError(f"no zero-copy view for dtype {dtype} of {itemsize} bytes")
    code, bits, _, _ = dtype_info(carrier)
    DTYPES[dtype] = info = (code, bits, itemsize, dtype)
    return info


def view(
    rng: ViewedRange,
    shape: Sequence[int] | int,
    dtype: torch.dtype | str,
    offset: int,
    strides: Sequence[int] | None,
) -> torch.Tensor:
    """See `VirtualRange.tensor`."""
    dims: Sequence[object] = shape if isinstance(shape, (list, tuple)) else (shape,)
    shape = as_indices(dims, "view shape", low=-INT64_MAX, high=INT64_MAX)  # C++ checks bounds
    offset = as_index(offset, "view offset", high=INT64_MAX)
    if strides is not None:
        strides = as_indices(strides, "view strides", low=-INT64_MAX, high=INT64_MAX)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    code, bits, itemsize, reinterpret = dtype_info(dtype)
    factory = rng.view_factory
    if factory is None:
        return _cuda_view(rng, shape, dtype, itemsize, offset, strides)
    try:
        capsule = factory.capsule(offset, shape, strides or (), code, bits, 1)
    except _h.HostError as exc:
        _raise_view_error(exc)
    tensor = adopt_capsule(capsule)
    return tensor if reinterpret is None else tensor.view(reinterpret)


def _raise_view_error(exc: Exception) -> None:
    message = exc.args[0]
    if isinstance(exc, _h.HostRangeError):
        raise RangeError(message) from None
    if isinstance(exc, _h.HostStateError):
        raise ClosedError(message) from None
    raise AlignmentError(message) from None


def span_bytes(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int) -> int:
    """Bytes from a view's first element to past its last (0 for an empty view)."""
    if strides is None:
        numel = 1
        for dim in shape:
            if dim < 0:
                raise AlignmentError(f"view shape {tuple(shape)} has a negative size")
            numel *= dim
        return numel * itemsize
    if len(strides) != len(shape):
        raise AlignmentError(f"view got {len(shape)} dims but {len(strides)} strides")
    if any(dim == 0 for dim in shape):
        return 0
    if any(dim < 0 for dim in shape) or any(stride < 0 for stride in strides):
        raise AlignmentError(f"view shape {tuple(shape)} / strides {tuple(strides)} negative")
    return (sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1) * itemsize


class _CudaArray:
    """Owner exposing raw device bytes through `__cuda_array_interface__` (version 3)."""

    def __init__(self, ptr: int, nbytes: int, owner: ViewedRange) -> None:
        self.owner = owner  # keeps the range (and its reservation) alive with the tensor
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _cuda_view(
    rng: ViewedRange,
    shape: Sequence[int],
    dtype: torch.dtype,
    itemsize: int,
    offset: int,
    strides: Sequence[int] | None,
) -> torch.Tensor:
    import torch

    nbytes = span_bytes(shape, strides, itemsize)
    if offset < 0 or offset + nbytes > rng.size:
        raise RangeError(
            f"view of {nbytes} bytes at offset {offset} leaves the {rng.size}-byte range"
        )
    if offset % itemsize:
        raise AlignmentError(f"view offset {offset} is not a multiple of item size {itemsize}")
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=rng.device)
    raw = torch.as_tensor(_CudaArray(rng.va + offset, nbytes, rng), device=rng.device)
    flat = raw.view(dtype)
    if strides is None:
        return flat.view(tuple(shape))
    return flat.as_strided(tuple(shape), tuple(strides))
