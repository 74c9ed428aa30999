"""The owner of a shared pool: one device's chunk budget, lent to tenant processes.

Rationale
---------
Several engines on one device should not split its memory statically: the owner holds
the budget and lends chunks to whichever tenant needs them, within per-tenant limits
(``min``: guaranteed, counted against the budget at join; ``max``: never exceeded). Only
budget decisions cross processes; each tenant maps the chunks itself.

Approach
--------
One thread, one `selectors` loop over the listening socket and every connection.

* ``want{n, need}``: refused at once when ``held + need > max``; granted (up to ``n``,
  at least ``need``) from the unlent budget; otherwise the owner sends ``reclaim`` to the
  tenants holding more than their ``min`` (largest surplus first) and grants when their
  ``give`` replies free enough, or refuses with the numbers once every asked tenant has
  answered or `reclaim_timeout` has passed.
* Chunks are created (zero-filled) when granted and released when given back, so a chunk
  never carries one tenant's data to another, and the memory really returns to the OS.
* A connection that closes (the tenant exited or was killed) returns all its chunks.

Invariant: sum of held chunks <= budget; every held chunk is created in the owner's backend.

Limitations
-----------
Host backend here (CUDA: an owner over `CudaBackend` with exportable chunks would use the
same loop; not run, no GPU). Reclaim takes what tenants can give: their lease and free
chunks, and what a tenant's `reclaim_handler` frees (the mini engine evicts prefix-cache
pages there; a tenant without one keeps them).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vmm.backend import Backend
from vmm.errors import VmmError
from vmm.host import HostBackend
from vmm.shared.protocol import ProtocolError, listen, recv, send

_log = logging.getLogger(__name__)


@dataclass
class _Want:
    n: int
    need: int
    deadline: float
    asked: set[int] = field(default_factory=set)


@dataclass
class _Peer:
    sock: socket.socket
    role: str = ""  # "" until hello; "tenant" | "operator"
    id: int = 0
    name: str = ""
    pid: int = 0
    min_chunks: int = 0
    max_chunks: int = 0
    held: set[int] = field(default_factory=set)
    cached: int = 0
    mapped: int = 0
    want: _Want | None = None
    wants: int = 0
    denied: int = 0
    reclaimed: int = 0


class PoolOwner:
    """Serves pool `name`: `budget_bytes` of `granularity`-byte chunks.

    Args:
        name: the pool's name (tenants join by it).
        budget_bytes: the device memory lent out, a multiple of the granularity.
        granularity: chunk size (host backend).
        reclaim_timeout: seconds a want waits for reclaim answers before it is refused.
        backend: the backend whose chunks are lent (default: a host backend of the budget).
        check: run `check_invariants` after every message (tests).
    """

    def __init__(
        self,
        name: str,
        budget_bytes: int,
        granularity: int = 2 << 20,
        *,
        reclaim_timeout: float = 2.0,
        backend: Backend | None = None,
        check: bool = False,
    ) -> None:
        if budget_bytes <= 0 or budget_bytes % granularity:
            raise ValueError(
                f"budget {budget_bytes} bytes is not a positive multiple of {granularity}"
            )
        self.name = name
        self.granularity = granularity
        self.budget_chunks = budget_bytes // granularity
        self.reclaim_timeout = reclaim_timeout
        self.check = check
        self.backend = backend or HostBackend(granularity, capacity=budget_bytes)
        self._listener = listen(name)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[int, _Peer] = {}  # by fd
        self._next_id = 1
        self._queue: list[_Peer] = []  # tenants with a pending want, in arrival order
        self._stop = False
        self.counters = {"grants": 0, "denials": 0, "reclaims": 0, "chunks.granted": 0,
                         "chunks.returned": 0, "tenants.died": 0}  # fmt: skip

    # ---- loop ----------------------------------------------------------------------------
    def serve(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Run until `stop()` (or `should_stop()` returns True); then close."""
        try:
            while not self._stop and not (should_stop and should_stop()):
                for key, _ in self._sel.select(timeout=0.1):
                    if key.data is None:
                        self._accept()
                    else:
                        self._on_readable(key.data)
                self._expire_wants()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop = True

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        conn.settimeout(2.0)  # a tenant that stops reading cannot stall the owner for long
        peer = _Peer(conn)
        self._peers[conn.fileno()] = peer
        self._sel.register(conn, selectors.EVENT_READ, peer)

    def _on_readable(self, peer: _Peer) -> None:
        try:
            msg, fds = recv(peer.sock)
            for fd in fds:
                os.close(fd)
            self._dispatch(peer, msg)
            if self.check:
                self.check_invariants()
        except (ProtocolError, OSError, VmmError) as exc:
            _log.info("pool %s: peer %s (%s) gone: %s", self.name, peer.id, peer.name, exc)
            self._drop(peer)

    def _dispatch(self, peer: _Peer, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if peer.role == "":
            if op != "hello":
                raise ProtocolError(f"expected hello, got {op!r}")
            self._hello(peer, msg)
        elif peer.role == "operator":
            self._operator(peer, op, msg)
        elif op == "want":
            self._want(peer, int(msg["n"]), int(msg["need"]))
        elif op == "give":
            self._give(peer, [int(i) for i in msg["ids"]], msg.get("reclaim"))
        elif op == "report":
            peer.cached, peer.mapped = int(msg["cached"]), int(msg["mapped"])
        else:
            raise ProtocolError(f"unknown op {op!r} from tenant {peer.name!r}")

    # ---- joining -------------------------------------------------------------------------
    def _hello(self, peer: _Peer, msg: dict[str, Any]) -> None:
        if msg.get("role") == "operator":
            peer.role = "operator"
            send(peer.sock, {"op": "welcome", "budget": self.budget_chunks * self.granularity})
            return
        gran = self.granularity
        name = str(msg.get("tenant", ""))
        lo = int(msg.get("min", 0))
        hi = self.budget_chunks * gran if msg.get("max") is None else int(msg["max"])
        error = self._limits_error(name, lo, hi, exclude=None)
        if error:
            send(peer.sock, {"op": "refused", "error": error})
            raise ProtocolError(f"refused tenant {name!r}: {error}")
        peer.role, peer.id, peer.name = "tenant", self._next_id, name
        peer.pid, peer.min_chunks, peer.max_chunks = int(msg.get("pid", 0)), lo // gran, hi // gran
        self._next_id += 1
        shared = self.backend.export_handles([])
        welcome = {"op": "welcome", "tenant": peer.id, "granularity": gran,
                   "budget": self.budget_chunks * gran, "min": lo, "max": hi}  # fmt: skip
        try:
            send(peer.sock, welcome, shared.fds)
        finally:
            _close_all(shared.fds)

    def _limits_error(self, name: str, lo: int, hi: int, exclude: _Peer | None) -> str:
        """Why limits (bytes) are refused for tenant `name`, or ''."""
        gran, budget = self.granularity, self.budget_chunks * self.granularity
        if lo < 0 or hi < lo or lo % gran or hi % gran:
            return (
                f"tenant {name!r}: limits min {lo} / max {hi} bytes must satisfy "
                f"0 <= min <= max, both multiples of the {gran}-byte chunk"
            )
        if hi > budget:
            return f"tenant {name!r}: max {hi} bytes exceeds the pool budget of {budget} bytes"
        others = sum(p.min_chunks for p in self._tenants() if p is not exclude) * gran
        if others + lo > budget:
            return (
                f"tenant {name!r}: min {lo} bytes does not fit: budget {budget} bytes, "
                f"{others} bytes already guaranteed to other tenants, {budget - others} left"
            )
        return ""

    def _tenants(self) -> list[_Peer]:
        return [p for p in self._peers.values() if p.role == "tenant"]

    # ---- lending -------------------------------------------------------------------------
    @property
    def lent_chunks(self) -> int:
        return sum(len(p.held) for p in self._tenants())

    def _want(self, peer: _Peer, n: int, need: int) -> None:
        peer.wants += 1
        if need < 1 or n < need or peer.want is not None:
            raise ProtocolError(f"bad want n={n} need={need} (one at a time)")
        if len(peer.held) + need > peer.max_chunks:
            self._deny(peer, f"tenant {peer.name!r} holds {len(peer.held)} chunks and needs "
                             f"{need} more: above its max of {peer.max_chunks} chunks")  # fmt: skip
            return
        peer.want = _Want(n, need, time.monotonic() + self.reclaim_timeout)
        self._queue.append(peer)
        if self._serve_queue():
            return
        if peer.want is not None and not peer.want.asked:
            self._ask_victims(peer)

    def _free_chunks(self) -> int:
        return self.budget_chunks - self.lent_chunks

    def _serve_queue(self) -> bool:
        """Grant pending wants in arrival order while the unlent budget covers them;
        True if the queue emptied."""
        while self._queue:
            peer = self._queue[0]
            want = peer.want
            assert want is not None
            free = self._free_chunks()
            if free < want.need:
                return False
            self._queue.pop(0)
            peer.want = None
            self._grant(peer, min(want.n, free, peer.max_chunks - len(peer.held)))
        return True

    def _ask_victims(self, peer: _Peer) -> None:
        want = peer.want
        assert want is not None
        short = want.need - self._free_chunks()
        victims = sorted(
            (p for p in self._tenants() if p is not peer and len(p.held) > p.min_chunks),
            key=lambda p: p.min_chunks - len(p.held),  # largest surplus first
        )
        for victim in victims:
            if short <= 0:
                break
            ask = min(len(victim.held) - victim.min_chunks, short)
            short -= ask
            want.asked.add(victim.id)
            self.counters["reclaims"] += 1
            self._send(victim, {"op": "reclaim", "n": ask, "id": peer.id})
        if not want.asked:
            self._refuse_want(peer)

    def _refuse_want(self, peer: _Peer) -> None:
        want = peer.want
        assert want is not None
        if peer in self._queue:
            self._queue.remove(peer)
        peer.want = None
        others = self.lent_chunks - len(peer.held)
        self._deny(peer, f"pool {self.name!r} full: tenant {peer.name!r} needs {want.need} "
                         f"chunks, {self._free_chunks()} of {self.budget_chunks} unlent; "
                         f"it holds {len(peer.held)}, the others {others} and give back no "
                         f"more above their mins")  # fmt: skip

    def _grant(self, peer: _Peer, count: int) -> None:
        try:
            handles = self.backend.create(count)
        except VmmError as exc:  # the device / OS is out of memory below the budget
            self._deny(peer, f"pool {self.name!r}: creating {count} chunks failed: {exc}")
            return
        shared = self.backend.export_handles(handles)
        peer.held.update(handles)
        self.counters["grants"] += 1
        self.counters["chunks.granted"] += count
        msg = {"op": "grant", "ids": handles, "where": [list(w) for w in shared.where]}
        try:
            self._send(peer, msg, shared.fds)
        finally:
            _close_all(shared.fds)

    def _deny(self, peer: _Peer, error: str) -> None:
        peer.denied += 1
        self.counters["denials"] += 1
        self._send(peer, {"op": "deny", "error": error})

    def _give(self, peer: _Peer, ids: list[int], reclaim: Any) -> None:
        unknown = [h for h in ids if h not in peer.held]
        if unknown or len(set(ids)) != len(ids):
            raise ProtocolError(f"tenant {peer.name!r} gives chunks it does not hold: {unknown}")
        if ids:
            self.backend.release(ids)
            peer.held.difference_update(ids)
            self.counters["chunks.returned"] += len(ids)
        peer.reclaimed += len(ids) if reclaim is not None else 0
        if reclaim is not None:
            for waiter in list(self._queue):
                if waiter.want is not None:
                    waiter.want.asked.discard(peer.id)
        self._after_change()

    def _after_change(self) -> None:
        self._serve_queue()
        for waiter in list(self._queue):
            want = waiter.want
            if want is not None and not want.asked and self._free_chunks() < want.need:
                self._refuse_want(waiter)

    def _expire_wants(self) -> None:
        now = time.monotonic()
        for waiter in list(self._queue):
            if waiter.want is not None and waiter.want.deadline < now:
                self._refuse_want(waiter)

    def _send(self, peer: _Peer, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        try:
            send(peer.sock, msg, fds)
        except OSError as exc:
            _log.info("pool %s: send to %s failed: %s", self.name, peer.name, exc)
            self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        """Forget a closed peer; a tenant's chunks return to the pool."""
        if self._peers.pop(peer.sock.fileno(), None) is None:
            return
        self._sel.unregister(peer.sock)
        peer.sock.close()
        if peer.role != "tenant":
            return
        if peer in self._queue:
            self._queue.remove(peer)
        if peer.held:
            try:
                self.backend.release(sorted(peer.held))
            except VmmError as exc:  # they stay created (leaked), and logged
                _log.error("pool %s: releasing %s's chunks failed: %s", self.name, peer.name, exc)
            self.counters["chunks.returned"] += len(peer.held)
            peer.held.clear()
        self.counters["tenants.died"] += 1
        for waiter in self._queue:
            if waiter.want is not None:
                waiter.want.asked.discard(peer.id)
        if not self._stop:
            self._after_change()

    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree: lent <= budget, no chunk lent twice,
        every lent chunk created in the backend, every tenant within its max unless a
        limit was lowered under it, mins within the budget."""
        tenants = self._tenants()
        lent = [h for p in tenants for h in p.held]
        assert len(lent) <= self.budget_chunks, f"lent {len(lent)} > {self.budget_chunks}"
        assert len(set(lent)) == len(lent), "a chunk is lent to two tenants"
        created = getattr(self.backend, "num_chunks", None)
        assert created is None or created == len(lent), f"backend {created} != lent {len(lent)}"
        mins = sum(p.min_chunks for p in tenants)
        assert mins <= self.budget_chunks, f"mins {mins} > budget {self.budget_chunks}"
        for p in self._queue:
            assert p.want is not None and p in tenants, f"stale want of {p.name!r}"

    # ---- operator ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What `vmm-pool ls` shows: the budget and, per tenant, held/limits/cached bytes."""
        gran = self.granularity
        tenants = [
            {
                "id": p.id,
                "name": p.name,
                "pid": p.pid,
                "held": len(p.held) * gran,
                "min": p.min_chunks * gran,
                "max": p.max_chunks * gran,
                "cached": p.cached,
                "mapped": p.mapped,
                "wants": p.wants,
                "denied": p.denied,
                "reclaimed": p.reclaimed * gran,
            }
            for p in sorted(self._tenants(), key=lambda p: p.id)
        ]
        return {"pool": self.name, "granularity": gran, "budget": self.budget_chunks * gran,
                "lent": self.lent_chunks * gran, "tenants": tenants,
                "physical": self.backend.stats().get("bytes.physical.current", 0),
                "counters": dict(self.counters)}  # fmt: skip

    def _operator(self, peer: _Peer, op: str, msg: dict[str, Any]) -> None:
        if op == "list":
            send(peer.sock, {"op": "state", **self.state()})
        elif op == "set_limits":
            error = self.set_limits(str(msg["tenant"]), msg.get("min"), msg.get("max"))
            send(peer.sock, {"op": "error", "error": error} if error else {"op": "ok"})
        else:
            raise ProtocolError(f"unknown operator op {op!r}")

    def set_limits(self, tenant: str, lo: int | None, hi: int | None) -> str:
        """Change a tenant's limits (bytes; None keeps one); '' or why it was refused. A max
        below what the tenant holds asks it to give back the difference."""
        match = [p for p in self._tenants() if p.name == tenant or str(p.id) == tenant]
        if not match:
            names = sorted(p.name for p in self._tenants())
            return f"no tenant {tenant!r} in pool {self.name!r} (tenants: {names})"
        peer, gran = match[0], self.granularity
        new_lo = peer.min_chunks * gran if lo is None else int(lo)
        new_hi = peer.max_chunks * gran if hi is None else int(hi)
        error = self._limits_error(peer.name, new_lo, new_hi, exclude=peer)
        if error:
            return error
        peer.min_chunks, peer.max_chunks = new_lo // gran, new_hi // gran
        self._send(peer, {"op": "limits", "min": new_lo, "max": new_hi})
        excess = len(peer.held) - peer.max_chunks
        if excess > 0:
            self._send(peer, {"op": "reclaim", "n": excess, "id": None})
        return ""

    def close(self) -> None:
        self._stop = True
        for peer in list(self._peers.values()):
            self._drop(peer)
        self._sel.close()
        self._listener.close()
        self.backend.close()


def _close_all(fds: tuple[int, ...]) -> None:
    for fd in fds:
        os.close(fd)
