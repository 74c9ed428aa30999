"""Strict argument checks shared by every public entry of `vmm` (and the KV cache).

Rationale
---------
The C++ bindings coerce or reject arguments on their own terms: pybind11 raises a bare
`TypeError` for a float, truncates nothing but overflows past 2**64, and Python's `//`
happily turns a float budget into a float chunk count. A public call must instead refuse
a bad argument before any state changes, with a `vmm.errors` class and the numbers.

Approach
--------
`as_index` accepts exactly what `operator.index` accepts (int, bool aside, numpy ints)
and bounds it; `as_indices` does the same for a sequence. Both raise `InputError`
naming the argument, the value and the bounds.

Limitations
-----------
Bools are refused (they are ints to `operator.index`, never a size). The hot slot paths
of `VirtualRange` do their own cheaper type check.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from vmm.errors import InputError

#: Largest byte size or count any public call accepts (the 48-bit user address space).
MAX_BYTES = 1 << 47
#: Largest number the C++ bindings take (int64_t); shapes and offsets past the range they
#: view but inside this get the range's own RangeError.
INT64_MAX = (1 << 63) - 1


def as_index(value: object, what: str, *, low: int = 0, high: int = MAX_BYTES) -> int:
    """`value` as an int in [low, high], else InputError naming `what` and the numbers."""
    if isinstance(value, bool):
        raise InputError(f"{what} must be an integer, got the bool {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InputError(
            f"{what} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if not low <= number <= high:
        raise InputError(f"{what} {number} is outside [{low}, {high}]")
    return number


def as_indices(
    values: Iterable[object], what: str, *, low: int = 0, high: int = MAX_BYTES
) -> tuple[int, ...]:
    """Every item of `values` through `as_index` (the error names the position)."""
    if isinstance(values, (str, bytes)):
        raise InputError(f"{what} must be a sequence of integers, got {values!r}")
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        ints: tuple[int, ...] = tuple(values)
        if ints and low <= min(ints) and max(ints) <= high:
            return ints
    try:
        items = list(values)
    except TypeError:
        raise InputError(
            f"{what} must be a sequence of integers, got {type(values).__name__} {values!r}"
        ) from None
    return tuple(as_index(v, f"{what}[{i}]", low=low, high=high) for i, v in enumerate(items))
