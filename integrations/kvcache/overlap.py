"""Overlap: apply the next step's mapping plans while the current step computes.

Rationale
    Mapping is off the critical path if the plan for step t+1 runs while step t's
    kernels run (vAttention's eager mapping, vTensor's pre-extend). Decode growth is
    predictable (one token per running request), so an engine can allocate step t+1's
    blocks before step t's forward and let a worker map them meanwhile.

Approach
    ::

        main:    allocate_ahead(t+1) ─ launch ─ forward(t) ──────────── sync ─ schedule(t+1)
        worker:                          └─ apply map-only plans ─┘   ^ stall if not done

    * Only plans made of fresh *maps* go to the worker: they touch no slot step t can
      read. A plan that unmaps or remaps (a page released out of a sliding window, an
      eviction) may pull memory from under step t's reads, so it — and every plan after
      it, whose unit accounting assumes it — is applied synchronously at `sync`.
    * The worker is one thread running `MappingPlan.apply`; the host backend's batched
      map calls release the GIL (C++, `py::gil_scoped_release`), so the syscalls overlap
      torch compute, which also runs without the GIL.
    * `stats`: ``overlap.launched`` (jobs), ``overlap.plans.async`` / ``.sync``,
      ``overlap.stalls`` (sync found the job unfinished), ``overlap.stall_ns``.

Limitations
    A Python thread, not a C++ worker: the plan bookkeeping in Python holds the GIL
    between backend calls. Callers must not touch the pool between `launch` and `sync`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class OverlapWorker:
    """One background thread that runs one job at a time; `wait` reports stalls."""

    def __init__(self) -> None:
        self._job: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._has_job = threading.Condition()
        self._done = threading.Event()
        self._done.set()
        self._closed = False
        self.stats = {"overlap.launched": 0, "overlap.stalls": 0, "overlap.stall_ns": 0}
        self._thread = threading.Thread(target=self._loop, name="vmm-overlap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._has_job:
                while self._job is None and not self._closed:
                    self._has_job.wait()
                if self._closed:
                    return
                job, self._job = self._job, None
            try:
                assert job is not None
                job()
            except BaseException as exc:
                self._error = exc
            finally:
                self._done.set()

    def launch(self, job: Callable[[], None]) -> None:
        """Start `job` on the worker (the previous one must have been waited for)."""
        if not self._done.is_set():
            raise RuntimeError("OverlapWorker.launch while a job is running; wait() first")
        self._done.clear()
        with self._has_job:
            self._job = job
            self._has_job.notify()
        self.stats["overlap.launched"] += 1

    def wait(self) -> None:
        """Block until the current job is done; count a stall if it was not yet. Re-raises
        the job's exception."""
        if not self._done.is_set():
            start = time.perf_counter_ns()
            self._done.wait()
            self.stats["overlap.stalls"] += 1
            self.stats["overlap.stall_ns"] += time.perf_counter_ns() - start
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self.wait()
        with self._has_job:
            self._closed = True
            self._has_job.notify()
        self._thread.join()
