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
Bound on the chunks one ``allocate(n tokens)`` maps, per group g:
``(ceil((ceil(n / tokens_per_block) + 1) / blocks_per_page) + 1) * units_per_page``
(the new blocks, one straddled block, one partly filled page). `after_step` moves chunks
the pool keeps free into the tenant's lease (`KVCache.release_free_chunks`), from where
the owner can reclaim them at any time, and reports cached / mapped bytes.

Limitations
-----------
Pages held for the prefix cache stay mapped until jenga evicts them for its own
allocations; the owner's reclaim cannot evict them (run shared tenants without the
prefix cache, or accept that cached pages are kept).
"""

from __future__ import annotations

import time
from typing import Any

from integrations.kvcache.cache import KVCache


class SharedPoolGate:
    """Gatekeeper between a `KVCache` and the `vmm.shared.Tenant` behind its pool."""

    def __init__(self, kv: KVCache, tenant: Any, *, report_every: float = 0.2) -> None:
        self.kv = kv
        self.tenant = tenant
        self.report_every = report_every
        self._last_report = 0.0
        groups = kv.allocator.config.groups
        self._groups = [
            (g.tokens_per_block, g.blocks_per_large_page, g.units_per_large_page) for g in groups
        ]
        self.refused = 0

    def units_bound(self, num_new_tokens: int) -> int:
        """Most chunks one allocation of `num_new_tokens` tokens can map."""
        total = 0
        for tokens_per_block, blocks_per_page, units_per_page in self._groups:
            blocks = -(-num_new_tokens // tokens_per_block) + 1
            total += (-(-blocks // blocks_per_page) + 1) * units_per_page
        return total

    def allow(self, num_new_tokens: int) -> bool:
        """Whether the allocation may run: the lease (+ the pool's free chunks) covers its
        bound, after asking the owner if needed. The lease stays pinned (safe from the
        owner's reclaim) until `done`."""
        need = self.units_bound(num_new_tokens)
        ok = bool(self.tenant.ensure_free(need, self.kv.pool.num_free))
        self.refused += not ok
        return ok

    def done(self) -> None:
        """The allocation `allow` admitted has run: the lease may be reclaimed again."""
        self.tenant.unpin()

    def after_step(self) -> None:
        """Free chunks to the lease (reclaimable), and a report to the owner now and then."""
        self.kv.release_free_chunks()
        now = time.monotonic()
        if now - self._last_report >= self.report_every:
            self._last_report = now
            pool = self.kv.pool
            self.tenant.report(self._cached_bytes(), pool.num_mapped * pool.granularity)

    def _cached_bytes(self) -> int:
        """Bytes of mapped pages beyond what live requests use (prefix-cache pages)."""
        mapped = self.kv.pool.num_mapped * self.kv.pool.granularity
        return max(0, mapped - self.kv.live_bytes())
