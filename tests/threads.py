"""Helpers of the multi-thread stress tests (tests/vmm/test_threads.py,
tests/jenga/test_core_threads.py): run a body on several threads and collect what they
raise; a tiny GIL switch interval makes racy interleavings likely."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(work: Callable[[int], None], n: int) -> None:
    """Run ``work(0) .. work(n - 1)`` on n threads; fail with every exception they raised."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
