"""The errors the allocator raises on purpose.

Rationale
    Bad input gets a specific exception with the numbers in its message, and a call that
    raises leaves the allocator unchanged, so an engine can catch one class and go on.

Approach
    Every error derives from `AllocatorError` and from the builtin a caller would expect
    (`ValueError` for sizes, `KeyError` for request ids), so ``except ValueError`` code
    keeps working.

Limitations
    Errors of the C++ core itself (a release of a block not in use, a bad group index)
    surface as the builtins pybind11 maps them to (`ValueError`, `IndexError`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np


class AllocatorError(Exception):
    """Base class of every error the allocator raises on purpose (state is unchanged)."""


class InvalidSize(AllocatorError, ValueError):
    """A count, size or length is zero/negative or out of range."""


class InvalidInput(AllocatorError, TypeError, ValueError):
    """A count or token id that is not an integer (a float, a digit string, a bool), or a
    token id below 0. Both a `TypeError` and a `ValueError`."""


class UnknownRequest(AllocatorError, KeyError):
    """The request id was never added, or was already freed."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRequest(AllocatorError, ValueError):
    """`add_request` with an id that is live."""


class DoubleFree(UnknownRequest):
    """`free` of a request that was already freed."""


class PageTooLarge(AllocatorError, ValueError):
    """A group's large page costs more units than the whole pool holds."""


class CapacityInUse(AllocatorError, ValueError):
    """A shrink below the units live requests hold (nothing was changed)."""


class ConcurrentUse(AllocatorError, RuntimeError):
    """A second thread called into an allocator while another was inside (nothing changed)."""


def as_count(value: object, what: str) -> int:
    """`value` as an int (`operator.index`: numpy ints pass; floats, strings, bools do not)."""
    if isinstance(value, bool):
        raise InvalidInput(f"{what} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInput(
            f"{what} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


#: Most token ids one call may carry when the model sets no max_model_len.
MAX_TOKEN_ID = (1 << 63) - 1  # ids are stored as int64
MAX_TOKENS = 1 << 31


def checked_token_ids(values: Any, what: str, max_len: int = MAX_TOKENS) -> Any:
    """`values` (a list/tuple of ints or an integer numpy array) unchanged when every item is
    an int >= 0, else InvalidInput naming the first bad item and its position; InvalidSize
    past `max_len` items (checked before any item is read)."""
    sized = hasattr(values, "__len__") and not isinstance(values, (str, bytes))
    if sized and len(values) > max_len:
        raise InvalidSize(f"{what}: {len(values)} tokens exceed max_model_len {max_len}")
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu" or values.ndim != 1:
            raise InvalidInput(
                f"{what} must be a 1-D integer array, got {values.dtype} {values.shape}"
            )
        if len(values) and int(values.min()) < 0:
            at = int(np.argmax(values < 0))
            raise InvalidInput(f"{what}[{at}] is {int(values[at])}, token ids must be >= 0")
        if len(values) and int(values.max()) > MAX_TOKEN_ID:  # uint64 past int64
            at = int(np.argmax(values > MAX_TOKEN_ID))
            raise InvalidInput(
                f"{what}[{at}] is {int(values[at])}, token ids must be <= {MAX_TOKEN_ID}"
            )
        return values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidInput(
            f"{what} must be a sequence of token ids, got {type(values).__name__} {values!r}"
        )
    if all(type(v) is int for v in values) and (
        not values or (min(values) >= 0 and max(values) <= MAX_TOKEN_ID)
    ):
        return values
    for at, v in enumerate(values):
        n = as_count(v, f"{what}[{at}]")
        if n < 0:
            raise InvalidInput(f"{what}[{at}] is {v}, token ids must be >= 0")
        if n > MAX_TOKEN_ID:
            raise InvalidInput(f"{what}[{at}] is {v}, token ids must be <= {MAX_TOKEN_ID}")
    return [operator.index(v) for v in values]
