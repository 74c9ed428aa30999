"""A KV cache on a shared pool: allocate only what the owner has lent, give back the rest.

Rationale
---------
The jenga allocator sizes its units once, from the pool's budget; on a shared pool that
budget is the tenant's `max`, while the chunks really available are those lent so far. A
plan that maps more chunks than the tenant can get would fail after the allocator
committed (a broken cache), so the engine asks `allow` before each allocation: it makes
the lease cover the most chunks the allocation can take, asking the owner for a batch if
needed, and says "no room" (the engine waits or preempts, as when the cache is full)
when the owner refuses.

Approach
--------
The allocator answers how many chunks one allocation can map
(`JengaAllocator.units_needed`: the large pages its new blocks would fill). `after_step`
moves chunks the pool keeps free into the tenant's lease (`KVCache.release_free_chunks`), from where
the owner can reclaim them at any time, and reports cached / mapped bytes.

A reclaim that asks for more chunks than the lease holds runs `on_reclaim` (the tenant's
``reclaim_handler``) on the tenant's reader thread: jenga evicts prefix-cache pages first
(`KVCache.evict_cached`, whole evictable pages in LRU order) and the chunks they free go
to the lease, from where the tenant gives them back. The engine holds `lock` for each
step; the handler only tries it, so reads and writes of the cache never race.

Limitations
-----------
A reclaim that arrives while a step runs gets only the lease (the handler does not wait
for the step: the engine may itself be waiting on the owner); cached pages are then kept
until the next reclaim or jenga evicts them for its own allocations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Any

from integrations.kvcache.cache import KVCache


class SharedPoolGate:
    """Gatekeeper between a `KVCache` and the `vmm.shared.Tenant` behind its pool."""

    def __init__(self, kv: KVCache, tenant: Any, *, report_every: float = 0.2) -> None:
        self.kv = kv
        self.tenant = tenant
        self.report_every = report_every
        self._last_report = 0.0
        self.refused = 0
        self.lock = threading.Lock()  # held by the engine for each step
        self.evicted_chunks = 0  # chunks of cached pages given up to the owner's reclaims
        tenant.reclaim_handler = self.on_reclaim

    def allow(self, request_id: Hashable, num_new_tokens: int) -> bool:
        """Whether the allocation may run: the lease (+ the pool's free chunks) covers its
        bound, after asking the owner if needed, and evicting this engine's own cached
        pages if the owner refuses. The lease stays pinned (safe from the owner's reclaim)
        until `done`."""
        need = self.kv.allocator.units_needed(request_id, num_new_tokens)
        ok = bool(self.tenant.ensure_free(need, self.kv.pool.num_free))
        short = need - self.tenant.lease_chunks - self.kv.pool.num_free
        if not ok and short > 0 and self.kv.evict_cached(short):
            # the owner has none to lend: this engine's own cached pages make the room
            ok = bool(self.tenant.ensure_free(need, self.kv.pool.num_free))
        self.refused += not ok
        return ok

    def done(self) -> None:
        """The allocation `allow` admitted has run: the lease may be reclaimed again."""
        self.tenant.unpin()

    def after_step(self) -> None:
        """Free chunks to the lease (reclaimable), and a report to the owner now and then."""
        self.kv.release_free_chunks()
        if time.monotonic() - self._last_report >= self.report_every:
            self.report()

    def report(self) -> None:
        """Tell the owner the cached / mapped bytes now (`vmm-pool ls`)."""
        self._last_report = time.monotonic()
        pool = self.kv.pool
        self.tenant.report(self._cached_bytes(), pool.num_mapped * pool.granularity)

    def on_reclaim(self, num_chunks: int) -> None:
        """The owner wants `num_chunks` more than the lease holds: evict cached pages for
        them and move the freed chunks to the lease (reader thread; skipped mid-step)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            freed = self.kv.evict_cached(num_chunks)
            if freed:
                self.evicted_chunks += freed
                self.kv.release_free_chunks()
                self.report()
        finally:
            self.lock.release()

    def _cached_bytes(self) -> int:
        """Bytes of mapped pages beyond what live requests use (prefix-cache pages)."""
        mapped = self.kv.pool.num_mapped * self.kv.pool.granularity
        return max(0, mapped - self.kv.live_bytes())
