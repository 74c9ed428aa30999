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


class AllocatorError(Exception):
    """Base class of every error the allocator raises on purpose (state is unchanged)."""


class InvalidSize(AllocatorError, ValueError):
    """A count, size or length is zero/negative or out of range."""


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
