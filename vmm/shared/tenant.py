"""A tenant of a shared pool: a lease of ready chunks, refilled from the owner in batches.

Rationale
---------
The engine's hot path (map/unmap through a `ChunkPool`) must not wait on another
process. So a tenant keeps a *lease* of chunks imported from the owner and unmapped;
`TenantBackend.create` takes from it and `release` returns to it, and only an empty
lease (a batch request) or a full one (handing the excess back) talks to the owner.

Approach
--------
* `Tenant` connects, sends ``hello`` with its limits, receives the owner's memfd and builds
  a host backend over it (`HostBackend(import_fd=...)`): chunks arrive as (fd, offset) and
  are adopted with `import_handles`; mapping them is this process's own business.
* A reader thread answers the owner at any time, even while the engine is idle:
  ``reclaim{n}`` gives back up to n lease chunks (always answered, maybe with none), and
  ``limits`` updates the limits. It checks every message against the protocol's schema
  (a malformed one ends the connection: the pool counts as gone) and joins a grant's
  parts. Replies to ``want`` go to the waiting caller, matched by request id: a grant
  that arrives after its caller gave up (the owner stalled) joins the lease, and is
  never taken for the answer to a later request.
* The owner gone (connection refused or closed, a send failing) is `PoolRefused`.
* `TenantBackend` is a `vmm.backend.Backend` (a `ChunkPool` runs on it unchanged): physical
  calls go to the lease, virtual ones to the local host backend.

Limitations
-----------
Host backend only for now. Chunks the `ChunkPool` keeps free and pages the KV cache keeps
for its prefix cache are returned only when the engine moves them to the lease
(`ChunkPool.set_budget` shrink, e.g. `KVCache.release_free_chunks` after a step), or when
a reclaim asks for more than the lease holds and `reclaim_handler` frees them (the mini
engine evicts prefix-cache pages there, unless a step is running).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vmm.backend import Backend, SharedChunks, ViewFactory
from vmm.errors import OutOfMemory, VmmError
from vmm.host import HostBackend
from vmm.shared.protocol import FROM_OWNER, ProtocolError, connect, recv, send

_log = logging.getLogger(__name__)


class PoolRefused(VmmError):
    """The owner refused this tenant (limits over the budget), or the pool is gone."""


class Tenant:
    """A connection to pool `pool` as tenant `name` with byte limits `min_bytes`/`max_bytes`.

    Args:
        batch_chunks: chunks asked for at once when the lease runs dry.
        keep_chunks: lease size above which released chunks go back to the owner at once.
        timeout: seconds to wait for the owner's answer to a request.
    """

    def __init__(
        self,
        pool: str,
        name: str,
        *,
        min_bytes: int = 0,
        max_bytes: int | None = None,
        batch_chunks: int = 8,
        keep_chunks: int = 16,
        timeout: float = 10.0,
    ) -> None:
        if batch_chunks < 1 or keep_chunks < 0:
            raise ValueError(f"batch_chunks {batch_chunks} must be >= 1, keep_chunks >= 0")
        self.pool, self.name = pool, name
        self.batch_chunks, self.keep_chunks, self.timeout = batch_chunks, keep_chunks, timeout
        try:
            self._sock = connect(pool, timeout)
        except OSError as exc:
            raise PoolRefused(f"no owner serves pool {pool!r}: {exc}") from None
        hello = {"op": "hello", "role": "tenant", "tenant": name, "min": min_bytes,
                 "max": max_bytes}  # fmt: skip
        try:
            send(self._sock, hello)
            msg, fds = recv(self._sock, FROM_OWNER)
        except (OSError, ProtocolError) as exc:
            self._sock.close()
            raise PoolRefused(f"pool {pool!r} did not welcome {name!r}: {exc}") from None
        try:
            if msg["op"] != "welcome" or len(fds) != 1 or "granularity" not in msg:
                raise PoolRefused(msg.get("error", f"pool {pool!r} answered {msg['op']!r} "
                                                   f"with {len(fds)} fds"))  # fmt: skip
            self.granularity = msg["granularity"]
            self.budget_bytes = msg["budget"]
            self.min_bytes, self.max_bytes = msg["min"], msg["max"]
            self.local = HostBackend(self.granularity, import_fd=fds[0])
        except BaseException:
            self._sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self._sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._lease: list[int] = []  # local handles, imported and unmapped
        self._pinned = 0  # lease chunks a reclaim may not take (an allocation counts on them)
        self._owner_id: dict[int, int] = {}  # local handle -> owner's id
        self._replies: queue.Queue[tuple[dict[str, Any], list[int]]] = queue.Queue()
        self._parts: dict[int, tuple[list[int], list[list[int]], list[int]]] = {}  # by req
        self._next_req = 1
        self._waiting_req = 0  # the want `acquire` waits on (0: none)
        self._closed = False
        self._gone = ""  # why the pool is gone ('' while connected)
        # called by the reader thread with the chunks a reclaim asks for beyond what the
        # lease can give; it may free more into the lease (the engine evicts cached pages)
        self.reclaim_handler: Callable[[int], None] | None = None
        self.counters = {"wants": 0, "grants": 0, "denials": 0, "chunks.in": 0,
                         "chunks.out": 0, "reclaims": 0, "replies.late": 0}  # fmt: skip
        self._reader = threading.Thread(target=self._read_loop, name=f"tenant-{name}", daemon=True)
        self._reader.start()

    # ---- lease -----------------------------------------------------------------------------
    @property
    def held_chunks(self) -> int:
        """Chunks this tenant holds from the owner (lease + in use)."""
        return len(self._owner_id)

    @property
    def lease_chunks(self) -> int:
        return len(self._lease)

    def take(self, count: int) -> list[int]:
        """`count` ready chunks from the lease, asking the owner for a batch when short."""
        with self._lease_lock:
            short = count - len(self._lease)
        if short > 0:
            self.acquire(short)
        with self._lease_lock:
            if len(self._lease) < count:  # a reclaim took them meanwhile
                raise OutOfMemory(
                    f"tenant {self.name!r}: needs {count} chunks, lease has {len(self._lease)}",
                    needed=count, free=len(self._lease),
                )  # fmt: skip
            self._lease.sort()
            taken, self._lease = self._lease[:count], self._lease[count:]
        return taken

    def put(self, handles: Sequence[int]) -> None:
        """Chunks back into the lease; the excess over `keep_chunks` goes to the owner
        (with the owner gone they are only forgotten here)."""
        with self._lease_lock:
            self._lease.extend(handles)
            excess = len(self._lease) - self.keep_chunks
            if excess > 0:
                self._lease.sort()
                back, self._lease = self._lease[-excess:], self._lease[:-excess]
                self._give_quietly(back, None)

    def acquire(self, need: int) -> None:
        """Ask the owner for a batch of at least `need` chunks into the lease; raises
        OutOfMemory with the owner's numbers when refused or when it does not answer
        within `timeout`, PoolRefused when the pool is gone."""
        self._check_open()
        self.counters["wants"] += 1
        req, self._next_req = self._next_req, self._next_req + 1
        self._waiting_req = req
        try:
            msg, fds = self._await_reply(req, need)
        finally:
            self._waiting_req = 0
        if msg["op"] == "deny":
            self.counters["denials"] += 1
            raise OutOfMemory(msg["error"], needed=need)
        self._adopt(msg, fds)

    def _await_reply(self, req: int, need: int) -> tuple[dict[str, Any], list[int]]:
        self._send({"op": "want", "req": req, "n": max(need, self.batch_chunks), "need": need})
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                msg, fds = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = f"pool {self.pool!r} did not answer want {req} within {self.timeout} s"
                raise OutOfMemory(f"tenant {self.name!r}: {late}", needed=need) from None
            if msg["op"] == "closed":
                self._replies.put((msg, fds))  # every later request sees it too
                raise PoolRefused(f"pool {self.pool!r} is gone: {self._gone}")
            if msg.get("req") == req:
                return msg, fds
            self._late(msg, fds)

    def _late(self, msg: dict[str, Any], fds: list[int]) -> None:
        """A reply to a want whose caller gave up: a grant's chunks (the owner counts them
        as this tenant's) join the lease; a denial is dropped."""
        self.counters["replies.late"] += 1
        if msg["op"] == "grant":
            self._adopt(msg, fds)

    def _adopt(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Import a (joined) grant's chunks into the lease."""
        try:
            shared = SharedChunks(tuple(fds), tuple((i, o) for i, o in msg["where"]))
            local = self.local.import_handles(shared)
        finally:
            for fd in fds:
                os.close(fd)
        with self._lease_lock:
            self._owner_id.update(zip(local, msg["ids"], strict=True))
            self._lease.extend(local)
        self.counters["grants"] += 1
        self.counters["chunks.in"] += len(local)

    def ensure_free(self, count: int, free_elsewhere: int = 0) -> bool:
        """Make lease + `free_elsewhere` >= `count` (asking the owner); False if refused.
        The lease chunks counted on stay pinned (no reclaim takes them) until `unpin`."""
        with self._lease_lock:
            self._pinned = max(0, count - free_elsewhere)
            short = self._pinned - len(self._lease)
        if short <= 0:
            return True
        try:
            self.acquire(short)
        except OutOfMemory:
            self.unpin()
            return False
        return True

    def unpin(self) -> None:
        with self._lease_lock:
            self._pinned = 0

    def report(self, cached: int, mapped: int) -> None:
        """Tell the owner (for `vmm-pool ls`) how many bytes are cached / mapped here."""
        self._send({"op": "report", "cached": int(cached), "mapped": int(mapped)})

    def _give(self, handles: list[int], reclaim: Any) -> None:
        """Return lease chunks (caller holds the lease lock); forget them locally first."""
        ids = [self._owner_id.pop(h) for h in handles]
        if handles:
            self.local.release(handles)
        self.counters["chunks.out"] += len(handles)
        self._send({"op": "give", "ids": ids, "reclaim": reclaim})

    # ---- owner messages ----------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                msg, fds = recv(self._sock, FROM_OWNER)
                if msg["op"] == "grant":
                    msg, fds = self._join_parts(msg, fds)
                    if not msg:
                        continue
            except (OSError, ProtocolError) as exc:
                self._gone = str(exc)
                for _, (_, _, part_fds) in self._parts.items():
                    for fd in part_fds:
                        os.close(fd)
                self._parts.clear()
                self._replies.put(({"op": "closed"}, []))
                return
            op = msg["op"]
            if op in ("grant", "deny") and msg["req"] != self._waiting_req:
                self._late_quietly(msg, fds)
            elif op == "reclaim":
                self.counters["reclaims"] += 1
                asked = int(msg["n"]) - self._run_reclaim_handler(int(msg["n"]))
                with self._lease_lock:
                    self._lease.sort()
                    n = max(0, min(asked, len(self._lease) - self._pinned))
                    back = self._lease[len(self._lease) - n :]
                    del self._lease[len(self._lease) - n :]
                    self._give_quietly(back, msg.get("id"))
            elif op == "limits":
                self.min_bytes, self.max_bytes = int(msg["min"]), int(msg["max"])
            else:
                self._replies.put((msg, fds))

    def _join_parts(self, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """Collect a grant's parts; the whole grant once its last part arrived, else {}."""
        if len(msg["ids"]) != len(msg["where"]) or any(i >= len(fds) for i, _ in msg["where"]):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"grant {msg['req']}: ids, where and fds disagree")
        ids, where, all_fds = self._parts.pop(msg["req"], ([], [], []))
        where += [[i + len(all_fds), off] for i, off in msg["where"]]
        ids += msg["ids"]
        all_fds += fds
        if not msg["last"]:
            self._parts[msg["req"]] = (ids, where, all_fds)
            return {}, []
        return {"op": "grant", "req": msg["req"], "ids": ids, "where": where}, all_fds

    def _late_quietly(self, msg: dict[str, Any], fds: list[int]) -> None:
        try:
            self._late(msg, fds)
        except VmmError as exc:  # a grant this backend cannot import: the pool is broken
            _log.error("tenant %s: late grant %s not imported: %s", self.name, msg["req"], exc)

    def _run_reclaim_handler(self, asked: int) -> int:
        """Let `reclaim_handler` free what the lease lacks of `asked` chunks; returns the
        chunks it already gave back meanwhile (a lease over `keep_chunks` overflows)."""
        with self._lease_lock:
            short = asked - (len(self._lease) - self._pinned)
        if self.reclaim_handler is None or short <= 0:
            return 0
        before = self.counters["chunks.out"]
        try:
            self.reclaim_handler(short)
        except Exception as exc:  # the reader must keep answering the owner
            _log.warning("tenant %s: reclaim handler failed: %s", self.name, exc)
        return self.counters["chunks.out"] - before

    def _give_quietly(self, handles: list[int], reclaim: Any) -> None:
        try:
            self._give(handles, reclaim)
        except (OSError, VmmError) as exc:
            _log.info("tenant %s: give failed: %s", self.name, exc)

    def _send(self, msg: dict[str, Any]) -> None:
        """Send to the owner; PoolRefused if it is gone."""
        try:
            with self._send_lock:
                send(self._sock, msg)
        except (OSError, ProtocolError) as exc:
            self._gone = self._gone or f"send failed: {exc}"
            raise PoolRefused(f"pool {self.pool!r} is gone: {self._gone}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise PoolRefused(f"tenant {self.name!r} is closed")
        if self._gone:
            raise PoolRefused(f"pool {self.pool!r} is gone: {self._gone}")

    def close(self) -> None:
        """Give the lease back and leave the pool (chunks still mapped return with the
        connection). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            with self._lease_lock:
                if self._lease:
                    self._give(sorted(self._lease), None)
                    self._lease.clear()
        except (OSError, VmmError):
            pass
        with contextlib.suppress(OSError):
            self._sock.shutdown(2)
        self._reader.join(timeout=5.0)
        self._sock.close()


class TenantBackend(Backend):
    """A `Backend` whose physical chunks come from a `Tenant`'s lease (see module note).

    `ChunkPool(TenantBackend(tenant), budget_bytes=tenant.max_bytes)` is a pool that grows
    and shrinks against the other tenants of the shared pool. Closing it closes the tenant.
    """

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.local = tenant.local
        self.name = "host"
        self.device = tenant.local.device

    @property
    def granularity(self) -> int:
        return self.tenant.granularity

    def create(self, count: int) -> list[int]:
        if count < 1:
            raise ValueError(f"create needs count >= 1, got {count}")
        return self.tenant.take(count)

    def release(self, handles: Sequence[int]) -> None:
        self.tenant.put(list(handles))

    def reserve(self, size: int, *, zero: bool = False) -> int:
        return self.local.reserve(size, zero=zero)

    def free_reservation(self, va: int, size: int) -> None:
        self.local.free_reservation(va, size)

    def map(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        self.local.map(vas, handles)

    def unmap(self, vas: Sequence[int], *, to_zero: bool = False) -> None:
        self.local.unmap(vas, to_zero=to_zero)

    @property
    def zero_handle(self) -> int | None:
        return self.local.zero_handle

    def view_factory(self, va: int, size: int) -> ViewFactory | None:
        return self.local.view_factory(va, size)

    @property
    def num_chunks(self) -> int:
        """Chunks handed to the pool (held minus the lease)."""
        return self.tenant.held_chunks - self.tenant.lease_chunks

    def stats(self) -> dict[str, int]:
        out = self.local.stats()
        out["bytes.lease.current"] = self.tenant.lease_chunks * self.granularity
        out["bytes.held.current"] = self.tenant.held_chunks * self.granularity
        return out

    def close(self) -> None:
        self.tenant.close()
        self.local.close()


def join_pool(
    pool: str,
    name: str,
    *,
    min_bytes: int = 0,
    max_bytes: int | None = None,
    batch_chunks: int = 8,
    keep_chunks: int = 16,
) -> TenantBackend:
    """Join shared pool `pool` as tenant `name`; returns the backend to build a
    `ChunkPool` on (its budget: ``backend.tenant.max_bytes``)."""
    tenant = Tenant(pool, name, min_bytes=min_bytes, max_bytes=max_bytes,
                    batch_chunks=batch_chunks, keep_chunks=keep_chunks)  # fmt: skip
    return TenantBackend(tenant)
