"""The mini engine's side of the host tier: CaR's scheduler window, prefetch and scores.

Rationale
    A host tier only pays when the copy back is off the critical path: the scheduler knows
    which requests run next, so it can start their reloads while the GPU serves others
    (CaR's prefetcher), and it feeds the tier's score policy with what it knows (which
    requests wait, which run, which are done).

Approach
    The window is the first ``EngineConfig.tier_window`` waiting requests (CaR's Shuffled
    Window: fixed-size, at the front of the queue, so no request starves and the prefetcher
    has a stable set to work on). Each step, before scheduling:

    - a request entering the window scores its prompt's blocks +1 (`HostTable.on_window`);
    - background offload runs when GPU use is above the high-water mark;
    - for each window request without a reload whose prompt the host extends beyond its
      GPU hit, CaR's timing rule (`jenga.tier.should_prefetch`) decides whether to start
      the reload now: once the soonest-finishing running request (remaining tokens x the
      measured time per step) ends within the transfer time (reload bytes / measured
      bandwidth), or when nothing runs.

    Admission (``overlap``, the default) takes the window's first request; its reload
    (started now if the window had not started it) is opened just before its
    `add_request` (`HostTier.open_reload`: the staging blocks are committed to the prefix
    cache while their copies run), so the request is admitted on them and its step starts
    at once: the forward waits for layer i's copies just before it reads layer i
    (`HostTier.wait_layer`), so layer i's copy overlaps the compute of layers < i. After
    the step, `settle` finishes the open reloads (hits counted, host entries touched and
    unpinned, staging requests freed). A copy that failed is raised where the forward
    waits for it (`ReloadFailed`) or found by `settle`: the engine drops the reloaded
    blocks from the prefix cache and requeues every request that holds one (recomputed,
    never served half-loaded data). Without ``overlap``, admission takes the first window
    request whose reload is not still copying and waits for the whole reload before its
    `add_request`. Admission scores +1 (sent), completion -2.

Limitations
    Remaining service time uses each request's ``max_new_tokens`` (CaR predicts the
    output length with a model). Every forward of a step waits at layer i for the open
    reloads' layer-i copies, also the forwards of requests that do not read them.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

from jenga.tier import Key, should_prefetch

from integrations.kvcache.tier import HostTier, Reload

_BANDWIDTH_GUESS = 4e9  # bytes/s before the first reload is measured


class EngineTier:
    """Window, prefetch and score events for one `MiniEngine` whose KV cache has a tier."""

    def __init__(
        self, engine: Any, tier: HostTier, window: int, prefetch: bool, overlap: bool = True
    ) -> None:
        self.engine, self.tier, self.window, self.prefetch = engine, tier, window, prefetch
        self.overlap = overlap
        self.keys: dict[Hashable, list[Key]] = {}  # a window request's prompt blocks
        self.reloads: dict[Hashable, Reload] = {}
        self.opened: dict[Hashable, tuple[Reload, int]] = {}  # admitted on an open reload
        self.step_seconds = 0.0  # moving average of one step
        self.bandwidth = _BANDWIDTH_GUESS
        self.stats = {"tier.hits": 0, "tier.hit_tokens": 0, "tier.prefetch.started": 0,
                      "tier.prefetch.deferred": 0, "tier.reload.wait_us": 0,
                      "tier.overlap.in_flight_us": 0, "tier.overlap.stall_us": 0}  # fmt: skip

    def _in_window(self) -> list[Any]:
        return list(self.engine.waiting)[: self.window]

    def before_schedule(self) -> None:
        """Score new window entries, offload above the high-water mark, start reloads."""
        for req in self._in_window():
            if req.request_id not in self.keys:
                _, per_group = self.tier.keys(req.sequence)
                self.keys[req.request_id] = [k for keys in per_group for k in keys]
                self.tier.table.on_window(self.keys[req.request_id])
        self.tier.background()
        for req in self._in_window():
            if req.request_id not in self.reloads:
                self._maybe_reload(req)

    def _maybe_reload(self, req: Any) -> None:
        hit, tokens = self.tier.host_extension(req.sequence)
        if tokens <= hit:
            return
        if self.prefetch:
            size = (tokens - hit) // self.tier.tokens_per_block * self.tier.slot_bytes
            remaining = [
                (r.max_new_tokens - len(r.output)) * self.step_seconds for r in self.engine.running
            ]
            if not should_prefetch(remaining, size / self.bandwidth):
                self.stats["tier.prefetch.deferred"] += 1
                return
        elif self.engine.waiting[0] is not req:
            return  # without prefetch a reload starts when its request is next
        job = self.tier.start_reload(req.sequence)
        if job is not None:
            self.reloads[req.request_id] = job
            self.stats["tier.prefetch.started"] += 1

    def pick(self) -> Any:
        """With overlap, the window's first request (its reload copies under its step);
        else the first window request not waiting for a copy (the head when all are, and
        nothing runs: then its reload is waited for)."""
        window = self._in_window()
        if self.overlap:
            return window[0] if window else None
        for req in window:
            job = self.reloads.get(req.request_id)
            if job is None or job.done():
                return req
        return window[0] if window and not self.engine.running else None

    def before_admit(self, req: Any) -> None:
        job = self.reloads.get(req.request_id)
        if job is None:  # what the host holds is reloaded, not recomputed
            job = self.tier.start_reload(req.sequence)
            if job is not None:
                self.reloads[req.request_id] = job
        if job is None:
            return
        if self.overlap:
            self.tier.open_reload(job)
            return
        start = time.perf_counter()
        ok = self.tier.finish_reload(job)
        self.stats["tier.reload.wait_us"] += int((time.perf_counter() - start) * 1e6)
        if ok and job.nbytes and self.tier.copy_seconds > 0:
            seconds = time.perf_counter() - job.started
            self.bandwidth = 0.5 * self.bandwidth + 0.5 * job.nbytes / max(seconds, 1e-9)
        if not ok:
            del self.reloads[req.request_id]

    def after_admit(self, req: Any, hit: int, admitted: bool) -> None:
        """The request's reload (if any) is released: its blocks stay cached (and are held
        by the request when it was admitted)."""
        job = self.reloads.pop(req.request_id, None)
        if job is not None:
            self.tier.release(job)
        if not admitted:
            return
        if job is not None and job in self.tier.open_reloads():
            self.opened[req.request_id] = (job, hit)  # hits counted once its copies landed
        elif job is not None and hit > job.gpu_hit:
            self.stats["tier.hits"] += 1
            self.stats["tier.hit_tokens"] += min(hit, job.tokens) - job.gpu_hit
        self.tier.table.on_sent(self.keys.get(req.request_id, ()))

    def settle(self) -> list[list[list[int]]]:
        """After a step's forward: finish the open reloads (`HostTier.settle`); returns the
        dropped blocks (per group) of each one that failed."""
        failed = self.tier.settle()
        for rid, (job, hit) in list(self.opened.items()):
            if job in failed:
                del self.opened[rid]
            elif job not in self.tier.open_reloads():
                del self.opened[rid]
                self._count_open(job, hit)
        return [job.dropped for job in failed]

    def _count_open(self, job: Reload, hit: int) -> None:
        if hit > job.gpu_hit:
            self.stats["tier.hits"] += 1
            self.stats["tier.hit_tokens"] += min(hit, job.tokens) - job.gpu_hit
        self.stats["tier.overlap.in_flight_us"] += int(1e6 * job.in_flight_after_open_s())
        self.stats["tier.overlap.stall_us"] += int(1e6 * job.stall_s)

    def fail(self, job: Reload) -> list[list[int]]:
        """``job``'s copy failed during the forward: its blocks leave the prefix cache."""
        self.tier.fail_open(job)
        for rid, (opened, _) in list(self.opened.items()):
            if opened is job:
                del self.opened[rid]
        return job.dropped

    def on_finished(self, req: Any) -> None:
        self.tier.table.on_complete(self.keys.pop(req.request_id, ()))

    def on_step(self, seconds: float) -> None:
        self.step_seconds = (
            seconds if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * seconds
        )

    def drop_reloads(self) -> bool:
        """Finish and release every reload (their blocks become cached, evictable); returns
        whether there was one."""
        for job in self.reloads.values():
            if self.tier.finish_reload(job):
                self.tier.release(job)
        had = bool(self.reloads) or bool(self.tier.open_reloads())
        self.reloads.clear()
        self.settle()  # open ones: nothing runs, so no request holds their blocks
        return had

    def close(self) -> None:
        self.drop_reloads()
