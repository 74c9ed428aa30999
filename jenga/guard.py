"""One thread at a time inside a `JengaAllocator`.

Rationale
    The allocator's Python request tables are not thread-safe (the C++ core is: it holds
    its own mutex). Two scheduler threads calling one allocator interleave table updates
    with core calls and leave bookkeeping that no longer matches the core, silently. The
    KV cache above refuses such calls (`vmm.ConcurrentUse`); this is the same rule one
    floor down, so an engine that drives the allocator directly gets it too.

Approach
    A non-blocking lock per allocator, taken by every public call that changes its tables
    (as the KV cache guards its changing calls): a second thread entering while one is
    inside raises `ConcurrentUse` at once, before touching anything; the same thread
    re-entering passes. Each guarded call costs one uncontended lock and a wrapper
    (~0.5 µs); queries (`prefix_match`, `fits`, `units_needed`, tables) are not guarded.
    The wrappers are per instance: an engine whose own design has one caller (vLLM's
    scheduler runs the manager on its one thread) builds its allocator with
    ``guard_threads=False`` and pays nothing.

Limitations
    It detects overlap; it does not serialize. An engine with several threads must give
    each its own allocator or hold its own lock around calls.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from jenga.errors import ConcurrentUse

_F = TypeVar("_F", bound=Callable[..., Any])


class Entry:
    """The lock a guarded object holds and the thread inside it."""

    __slots__ = ("lock", "owner")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None


def one_thread_guard(error: type[Exception], taker: str) -> Callable[[_F], _F]:
    """A decorator: the method (of an object with an `Entry` at ``_entry``) runs as the only
    call in progress; another thread's overlapping call raises ``error`` naming ``taker``
    (who takes one thread at a time) before anything changes."""

    def decorate(method: _F) -> _F:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            entry: Entry = self._entry
            if not entry.lock.acquire(blocking=False):
                me = threading.get_ident()
                if entry.owner == me:
                    return method(self, *args, **kwargs)
                raise error(
                    f"{type(self).__name__}.{method.__name__} called from thread {me} while "
                    f"thread {entry.owner} is inside another call; {taker} takes its calls "
                    "from one thread at a time (nothing was changed)"
                )
            entry.owner = threading.get_ident()
            try:
                return method(self, *args, **kwargs)
            finally:
                entry.owner = None
                entry.lock.release()

        return cast(_F, guarded)

    return decorate


one_thread = one_thread_guard(ConcurrentUse, "an allocator")


def guard_methods(obj: object, names: tuple[str, ...]) -> None:
    """Wrap each named method of ``obj`` (this instance only) with `one_thread`."""
    cls = type(obj)
    for name in names:
        setattr(obj, name, one_thread(getattr(cls, name)).__get__(obj, cls))
