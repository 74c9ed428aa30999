"""The owner of a shared pool: one device's chunk budget, lent to tenant processes.

Rationale
---------
Several engines on one device should not split its memory statically: the owner holds
the budget and lends chunks to whichever tenant needs them, within per-tenant limits
(``min``: guaranteed, counted against the budget at join; ``max``: never exceeded). Only
budget decisions cross processes; each tenant maps the chunks itself.

Every peer may be hostile or broken (see docs/multi-tenant.md, threat model): whatever
goes wrong while handling one peer drops that peer only, and the owner keeps serving.

Approach
--------
One thread, one `selectors` loop over the listening socket, every connection and the
pidfds of quarantined tenants.

* Connections: SO_PEERCRED is checked against the `AccessPolicy` at accept (and the
  role at hello); at most `max_conns_per_uid` per uid (the oldest idle non-tenant
  connection of that uid makes room); a connection that is not a tenant and stays idle
  `idle_timeout` seconds is closed. When accept fails for want of fds (EMFILE), the
  oldest idle non-tenant connection is closed, or accepting pauses briefly.
* ``want{req, n, need}``: denied at once when ``held + need > max``; granted (up to ``n``,
  at least ``need``) from the unlent budget; otherwise the owner sends ``reclaim`` to the
  tenants holding more than their ``min`` (largest surplus first) and grants when their
  ``give`` replies free enough, or denies with the numbers once every asked tenant has
  answered (or was dropped) or `reclaim_timeout` has passed. Grants go out in parts.
* A peer is never dropped in the middle of handling another: a failed send marks it
  dead, and dead peers are dropped after the current event (`_reap`), so the reclaim
  bookkeeping never sees a peer vanish under it.
* Chunks are created (zero-filled) when granted and released when given back, so a chunk
  never carries one tenant's data to another, and the memory really returns to the OS.
* A tenant whose connection ends while it holds chunks: if its process has exited
  (killed, crashed) they are released; otherwise (the owner dropped a live tenant) they
  are quarantined until the process exits (`vmm.shared.guard`), never lent meanwhile.

Invariant: lent + quarantined <= budget; every lent or quarantined chunk is created in
the backend, and belongs to exactly one tenant or quarantine.

Limitations
-----------
Host backend here (CUDA: an owner over `CudaBackend` with exportable chunks would use the
same loop; not run, no GPU). Sends block up to `send_timeout` seconds per message (a
tenant that stops reading is dropped then). Reclaim takes what tenants can give.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vmm.backend import Backend
from vmm.errors import VmmError
from vmm.host import HostBackend
from vmm.shared.guard import AccessPolicy, PeerCred, ProcessWatch, Quarantine, peer_cred
from vmm.shared.protocol import (
    MAX_FDS,
    TO_OWNER,
    ProtocolError,
    grant_parts,
    is_finite_positive,
    is_path,
    listen,
    recv,
    send,
    split_rows,
)

_log = logging.getLogger(__name__)
_FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass
class _Want:
    req: int
    n: int
    need: int
    deadline: float
    asked: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Peer:
    sock: socket.socket
    cred: PeerCred
    last: float  # monotonic time of its last message (idle expiry)
    role: str = ""  # "" until hello; "tenant" | "operator"
    id: int = 0
    name: str = ""
    watch: ProcessWatch | None = None  # tenants: tells when its process exited
    min_chunks: int = 0
    max_chunks: int = 0
    held: set[int] = field(default_factory=set)
    cached: int = 0
    mapped: int = 0
    want: _Want | None = None
    wants: int = 0
    denied: int = 0
    reclaimed: int = 0
    dead: str = ""  # why it is being dropped (then nothing more is sent to it)


class PoolOwner:
    """Serves pool `name`: `budget_bytes` of `granularity`-byte chunks.

    Args:
        name: the pool's name (tenants join by it).
        budget_bytes: the device memory lent out, a multiple of the granularity.
        granularity: chunk size (host backend).
        reclaim_timeout: seconds a want waits for reclaim answers before it is refused
            (finite, > 0).
        backend: the backend whose chunks are lent (default: a host backend of the budget).
        check: run `check_invariants` after every event (tests).
        policy: who may join / operate (default: the owner's uid only).
        idle_timeout: seconds a connection that is not a tenant may stay idle.
        max_conns_per_uid: connections one uid may hold at once.
        send_timeout: seconds one send may block before the peer is dropped.
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
        policy: AccessPolicy | None = None,
        idle_timeout: float = 10.0,
        max_conns_per_uid: int = 128,
        send_timeout: float = 2.0,
        socket_mode: int = 0o600,
    ) -> None:
        if budget_bytes <= 0 or budget_bytes % granularity:
            raise ValueError(
                f"budget {budget_bytes} bytes is not a positive multiple of {granularity}"
            )
        for what, value in (("reclaim_timeout", reclaim_timeout), ("idle_timeout",
                            idle_timeout), ("send_timeout", send_timeout)):  # fmt: skip
            if not is_finite_positive(float(value)):
                raise ValueError(f"{what} must be a finite number of seconds > 0, got {value}")
        if max_conns_per_uid < 1:
            raise ValueError(f"max_conns_per_uid must be >= 1, got {max_conns_per_uid}")
        self.name = name
        self.granularity = granularity
        self.budget_chunks = budget_bytes // granularity
        self.reclaim_timeout = float(reclaim_timeout)
        self.idle_timeout, self.send_timeout = float(idle_timeout), float(send_timeout)
        self.max_conns_per_uid = max_conns_per_uid
        self.policy = policy or AccessPolicy()
        self.check = check
        self.backend = backend or HostBackend(granularity, capacity=budget_bytes)
        self._listener = listen(name, socket_mode)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._accept_paused_until = 0.0
        self._peers: dict[int, _Peer] = {}  # by fd
        self._dying: list[_Peer] = []  # marked dead, dropped after the current event
        self._quarantine: list[Quarantine] = []
        self._next_id = 1
        self._queue: list[_Peer] = []  # tenants with a pending want, in arrival order
        self._stop = False
        self.counters = {"grants": 0, "denials": 0, "reclaims": 0, "chunks.granted": 0,
                         "chunks.returned": 0, "chunks.quarantined": 0, "tenants.died": 0,
                         "peers.dropped": 0, "connections.refused": 0,
                         "accept.fds_exhausted": 0, "errors.unexpected": 0}  # fmt: skip

    # ---- loop ----------------------------------------------------------------------------
    def serve(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Run until `stop()` (or `should_stop()` returns True); then close."""
        try:
            while not self._stop and not (should_stop and should_stop()):
                for key, _ in self._sel.select(timeout=0.1):
                    self._on_event(key.data)
                self._expire_wants()
                self._expire_idle()
                self._poll_quarantine()
                self._maybe_resume_accept()
                self._reap()
                if self.check:
                    self.check_invariants()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop = True

    def _on_event(self, data: Any) -> None:
        if data is None:
            self._accept()
        elif isinstance(data, Quarantine):
            if data.watch.gone():
                self._release_quarantine(data)
        elif data.dead == "":
            self._on_readable(data)
        self._reap()
        if self.check:
            self.check_invariants()

    def _on_readable(self, peer: _Peer) -> None:
        try:
            msg, fds = recv(peer.sock, TO_OWNER)
            _close_all(fds)
            peer.last = time.monotonic()
            self._dispatch(peer, msg)
        except ProtocolError as exc:
            if peer.role == "" and not peer.dead:  # tell a client why it was not welcome
                self._send(peer, {"op": "refused", "error": str(exc)[:1000]})
            self._kill(peer, str(exc))
        except (OSError, VmmError) as exc:
            self._kill(peer, str(exc))
        except Exception as exc:  # a bug shown by one peer drops that peer, not the pool
            self.counters["errors.unexpected"] += 1
            _log.exception("pool %s: handling peer %s (%s)", self.name, peer.id, peer.name)
            self._kill(peer, f"{type(exc).__name__}: {exc}")

    def _dispatch(self, peer: _Peer, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if peer.role == "":
            if op != "hello":
                raise ProtocolError(f"expected hello, got {op!r}")
            self._hello(peer, msg)
        elif op == "hello":
            raise ProtocolError("a second hello")
        elif peer.role == "operator":
            self._operator(peer, op, msg)
        elif op == "want":
            self._want(peer, msg["req"], msg["n"], msg["need"])
        elif op == "give":
            self._give(peer, msg["ids"], msg.get("reclaim"))
        elif op == "report":
            peer.cached, peer.mapped = msg["cached"], msg["mapped"]
        else:
            raise ProtocolError(f"op {op!r} is not for tenants ({peer.name!r})")

    # ---- connections ---------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno not in _FD_EXHAUSTED:  # ECONNABORTED and the like: that one is gone
                _log.info("pool %s: accept failed: %s", self.name, exc)
                return
            self.counters["accept.fds_exhausted"] += 1
            if not self._evict_idle(None):
                self._pause_accept()
            return
        try:
            cred = peer_cred(conn)
        except OSError:
            conn.close()
            return
        why = self._admission_error(cred)
        if why:
            self.counters["connections.refused"] += 1
            _refuse(conn, why)
            return
        conn.settimeout(self.send_timeout)  # a peer that stops reading stalls us this long
        peer = _Peer(conn, cred, time.monotonic())
        self._peers[conn.fileno()] = peer
        self._sel.register(conn, selectors.EVENT_READ, peer)

    def _admission_error(self, cred: PeerCred) -> str:
        if not self.policy.may_connect(cred):
            return f"pool {self.name!r}: uid {cred.uid} / gid {cred.gid} may not connect"
        same = sum(1 for p in self._peers.values() if p.cred.uid == cred.uid and not p.dead)
        if same >= self.max_conns_per_uid and not self._evict_idle(cred.uid):
            return (f"pool {self.name!r}: uid {cred.uid} holds {same} connections, the most "
                    f"allowed ({self.max_conns_per_uid})")  # fmt: skip
        return ""

    def _evict_idle(self, uid: int | None) -> bool:
        """Close the longest-idle connection that is not a tenant (of `uid` if given, and
        dropped at once: its fd is needed now); False if there is none."""
        idle = [p for p in self._peers.values() if p.role != "tenant" and not p.dead
                and (uid is None or p.cred.uid == uid)]  # fmt: skip
        if not idle:
            return False
        self._kill(min(idle, key=lambda p: p.last), "evicted: too many connections")
        self._reap()
        return True

    def _pause_accept(self) -> None:
        if self._accept_paused_until == 0.0:
            self._sel.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + 0.1

    def _maybe_resume_accept(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _expire_idle(self) -> None:
        limit = time.monotonic() - self.idle_timeout
        for peer in list(self._peers.values()):
            if peer.role != "tenant" and peer.last < limit and not peer.dead:
                self._kill(peer, f"idle for more than {self.idle_timeout} s")

    # ---- joining -------------------------------------------------------------------------
    def _hello(self, peer: _Peer, msg: dict[str, Any]) -> None:
        if msg.get("role") == "operator":
            if not self.policy.may_operate(peer.cred):
                self._refuse_hello(peer, f"uid {peer.cred.uid} may not operate pool {self.name!r}")
                return
            peer.role = "operator"
            self._send(peer, {"op": "welcome", "budget": self.budget_chunks * self.granularity})
            return
        gran = self.granularity
        name = msg.get("tenant")
        lo = msg.get("min", 0)
        hi = self.budget_chunks * gran if msg.get("max") is None else msg["max"]
        error = self._hello_error(peer, name, lo, hi)
        if error:
            self._refuse_hello(peer, error)
            return
        assert isinstance(name, str)
        watch = ProcessWatch(peer.cred.pid)  # OSError (EMFILE): this peer is dropped
        peer.role, peer.id, peer.name, peer.watch = "tenant", self._next_id, name, watch
        peer.min_chunks, peer.max_chunks = lo // gran, hi // gran
        self._next_id += 1
        shared = self.backend.export_handles([])
        welcome = {"op": "welcome", "tenant": peer.id, "granularity": gran,
                   "budget": self.budget_chunks * gran, "min": lo, "max": hi}  # fmt: skip
        try:
            self._send(peer, welcome, shared.fds)
        finally:
            _close_all(shared.fds)

    def _hello_error(self, peer: _Peer, name: str | None, lo: int, hi: int) -> str:
        if not self.policy.may_tenant(peer.cred):
            return f"uid {peer.cred.uid} / gid {peer.cred.gid} may not join pool {self.name!r}"
        if name is None:
            return "a tenant's hello needs a name ('tenant')"
        if any(p.name == name for p in self._tenants()):
            return f"pool {self.name!r} already has a tenant named {name!r}"
        return self._limits_error(name, lo, hi, exclude=None)

    def _refuse_hello(self, peer: _Peer, error: str) -> None:
        self._send(peer, {"op": "refused", "error": error})
        self._kill(peer, f"refused: {error}")

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
        """Live tenants (a dead one's chunks still count as lent until it is dropped)."""
        return [p for p in self._peers.values() if p.role == "tenant" and not p.dead]

    # ---- lending -------------------------------------------------------------------------
    @property
    def lent_chunks(self) -> int:
        return sum(len(p.held) for p in self._peers.values() if p.role == "tenant")

    @property
    def quarantined_chunks(self) -> int:
        return sum(len(q.handles) for q in self._quarantine)

    def _free_chunks(self) -> int:
        return self.budget_chunks - self.lent_chunks - self.quarantined_chunks

    def _want(self, peer: _Peer, req: int, n: int, need: int) -> None:
        peer.wants += 1
        if n < need:
            raise ProtocolError(f"want n={n} < need={need}")
        if peer.want is not None:
            self._deny(peer, req, f"tenant {peer.name!r}: want {peer.want.req} still pends "
                                  f"(one at a time)")  # fmt: skip
            return
        if len(peer.held) + need > peer.max_chunks:
            self._deny(peer, req, f"tenant {peer.name!r} holds {len(peer.held)} chunks and "
                       f"needs {need} more: above its max of {peer.max_chunks} chunks")  # fmt: skip
            return
        peer.want = _Want(req, n, need, time.monotonic() + self.reclaim_timeout)
        self._queue.append(peer)
        self._serve_queue()
        if peer.want is not None and not peer.want.asked:
            self._ask_victims(peer)

    def _serve_queue(self) -> None:
        """Grant pending wants in arrival order while the unlent budget covers them."""
        while self._queue:
            peer = self._queue[0]
            want = peer.want
            if want is None or peer.dead:
                self._queue.pop(0)
                continue
            free = self._free_chunks()
            if free < want.need:
                return
            self._queue.pop(0)
            peer.want = None
            self._grant(peer, want.req, min(want.n, free, peer.max_chunks - len(peer.held)))

    def _ask_victims(self, peer: _Peer) -> None:
        want = peer.want
        if want is None:
            return
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
        if want is None:
            return
        if peer in self._queue:
            self._queue.remove(peer)
        peer.want = None
        others = self.lent_chunks - len(peer.held)
        self._deny(peer, want.req, f"pool {self.name!r} full: tenant {peer.name!r} needs "
                   f"{want.need} chunks, {self._free_chunks()} of {self.budget_chunks} unlent "
                   f"({self.quarantined_chunks} quarantined); it holds {len(peer.held)}, the "
                   f"others {others} and give back no more above their mins")  # fmt: skip

    def _grant(self, peer: _Peer, req: int, count: int) -> None:
        try:
            handles = self.backend.create(count)
        except VmmError as exc:  # the device / OS is out of memory below the budget
            self._deny(peer, req, f"pool {self.name!r}: creating {count} chunks failed: {exc}")
            return
        try:
            shared = self.backend.export_handles(handles)
        except (OSError, VmmError) as exc:  # out of fds: nothing was lent
            self.backend.release(handles)
            self._deny(peer, req, f"pool {self.name!r}: exporting {count} chunks failed: {exc}")
            return
        peer.held.update(handles)
        self.counters["grants"] += 1
        self.counters["chunks.granted"] += count
        try:
            for msg, fds in grant_parts(req, handles, shared):
                self._send(peer, msg, fds)
        finally:
            _close_all(shared.fds)

    def _deny(self, peer: _Peer, req: int, error: str) -> None:
        peer.denied += 1
        self.counters["denials"] += 1
        self._send(peer, {"op": "deny", "req": req, "error": error})

    def _give(self, peer: _Peer, ids: list[int], reclaim: int | None) -> None:
        unknown = [h for h in ids if h not in peer.held]
        if unknown or len(set(ids)) != len(ids):
            raise ProtocolError(
                f"tenant {peer.name!r} gives chunks it does not hold: {unknown[:8]} "
                f"({len(ids)} given, {len(set(ids))} distinct)"
            )
        if ids:
            self.backend.release(ids)
            peer.held.difference_update(ids)
            self.counters["chunks.returned"] += len(ids)
        if reclaim is not None:
            peer.reclaimed += len(ids)
            for waiter in self._queue:
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

    # ---- dropping ------------------------------------------------------------------------
    def _send(self, peer: _Peer, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """Send to `peer`; on failure it is marked dead (dropped after this event)."""
        if peer.dead:
            return
        try:
            send(peer.sock, msg, fds)
        except (OSError, ProtocolError) as exc:
            self._kill(peer, f"send failed: {exc}")

    def _kill(self, peer: _Peer, why: str) -> None:
        if not peer.dead:
            peer.dead = why or "dropped"
            self._dying.append(peer)

    def _reap(self) -> None:
        """Drop the peers marked dead (each drop may free chunks, grant and kill more)."""
        while self._dying:
            self._drop(self._dying.pop(0))

    def _drop(self, peer: _Peer) -> None:
        """Forget a peer; a tenant's chunks return to the pool, or to quarantine while its
        process may still map them."""
        if self._peers.pop(peer.sock.fileno(), None) is None:
            return
        _log.info("pool %s: peer %s (%s) dropped: %s", self.name, peer.id, peer.name, peer.dead)
        self.counters["peers.dropped"] += 1
        self._sel.unregister(peer.sock)
        _discard_and_close(peer.sock)
        if peer.role != "tenant":
            return
        if peer in self._queue:
            self._queue.remove(peer)
        peer.want = None
        watch = peer.watch or ProcessWatch(0)
        if peer.held and not self._stop and not watch.gone():
            self._quarantine_chunks(peer.name, watch, sorted(peer.held))
        else:
            self._release(peer.name, sorted(peer.held))
            watch.close()
        peer.held.clear()
        self.counters["tenants.died"] += 1
        for waiter in self._queue:
            if waiter.want is not None:
                waiter.want.asked.discard(peer.id)
        if not self._stop:
            self._after_change()

    def _quarantine_chunks(self, name: str, watch: ProcessWatch, handles: list[int]) -> None:
        entry = Quarantine(name, watch, handles)
        self._quarantine.append(entry)
        self.counters["chunks.quarantined"] += len(handles)
        if watch.fd is not None:
            self._sel.register(watch.fd, selectors.EVENT_READ, entry)
        _log.warning("pool %s: %d chunks of %s quarantined until pid %d exits",
                     self.name, len(handles), name, watch.pid)  # fmt: skip

    def _release_quarantine(self, entry: Quarantine) -> None:
        self._quarantine.remove(entry)
        if entry.watch.fd is not None:
            self._sel.unregister(entry.watch.fd)
        entry.watch.close()
        self._release(entry.name, entry.handles)
        self._after_change()

    def _poll_quarantine(self) -> None:
        """Quarantines without a pidfd (old kernels) are polled."""
        for entry in list(self._quarantine):
            if entry.watch.fd is None and entry.watch.gone():
                self._release_quarantine(entry)

    def _release(self, name: str, handles: list[int]) -> None:
        if not handles:
            return
        try:
            self.backend.release(handles)
        except VmmError as exc:  # they stay created (leaked), and logged
            _log.error("pool %s: releasing %s's chunks failed: %s", self.name, name, exc)
        self.counters["chunks.returned"] += len(handles)

    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree: lent + quarantined <= budget, no
        chunk lent twice, every lent or quarantined chunk created in the backend, mins
        within the budget, tenant names unique, no stale pending request."""
        tenants = [p for p in self._peers.values() if p.role == "tenant"]
        owned = [h for p in tenants for h in p.held] + [
            h for q in self._quarantine for h in q.handles
        ]
        assert len(owned) <= self.budget_chunks, f"owned {len(owned)} > {self.budget_chunks}"
        assert len(set(owned)) == len(owned), "a chunk is lent or quarantined twice"
        created = getattr(self.backend, "num_chunks", None)
        assert created is None or created == len(owned), f"backend {created} != {len(owned)}"
        mins = sum(p.min_chunks for p in tenants)
        assert mins <= self.budget_chunks, f"mins {mins} > budget {self.budget_chunks}"
        names = [p.name for p in self._tenants()]
        assert len(set(names)) == len(names), f"tenant names not unique: {names}"
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
                "pid": p.cred.pid,
                "uid": p.cred.uid,
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
                "lent": self.lent_chunks * gran, "quarantined": self.quarantined_chunks * gran,
                "tenants": tenants,
                "physical": self.backend.stats().get("bytes.physical.current", 0),
                "counters": dict(self.counters)}  # fmt: skip

    def _operator(self, peer: _Peer, op: str, msg: dict[str, Any]) -> None:
        req = msg.get("req", 0)
        if op == "list":
            state = self.state()
            tenants = state.pop("tenants")
            parts = list(split_rows(tenants))
            for i, (start, stop) in enumerate(parts):
                last = i == len(parts) - 1
                part = {"op": "state", "req": req, **state, "tenants": tenants[start:stop]}
                self._send(peer, {**part, "last": last})
        elif op == "set_limits":
            error = self.set_limits(msg["tenant"], msg.get("min"), msg.get("max"))
            reply = (
                {"op": "error", "req": req, "error": error} if error else {"op": "ok", "req": req}
            )
            self._send(peer, reply)
        elif op == "stop":  # `vmm-pool stop`: the loop ends after this event, then `close`
            self._send(peer, {"op": "ok", "req": req})
            self.stop()
        else:
            raise ProtocolError(f"op {op!r} is not for operators")

    def set_limits(self, tenant: str, lo: int | None, hi: int | None) -> str:
        """Change a tenant's limits (bytes; None keeps one); '' or why it was refused. A max
        below what the tenant holds asks it to give back the difference. `tenant` is a
        name (unique) or, when no tenant has that name, an id."""
        tenants = self._tenants()
        match = [p for p in tenants if p.name == tenant] or [
            p for p in tenants if str(p.id) == tenant
        ]
        if not match:
            names = sorted(p.name for p in tenants)[:20]
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
        """Close every connection and the backend. Chunks still lent are not released
        (no hole is punched under a tenant that still maps them): closing the backend
        drops the owner's reference to the memory, which lives on while tenants map it."""
        self._stop = True
        for peer in list(self._peers.values()):
            self._kill(peer, "the owner is closing")
        while self._dying:
            peer = self._dying.pop(0)
            peer.held.clear()
            self._drop(peer)
        for entry in self._quarantine:
            entry.watch.close()
        self._quarantine.clear()
        self._sel.close()
        self._listener.close()
        if is_path(self.name):  # a named socket: the file goes with the owner
            with contextlib.suppress(OSError):
                os.unlink(self.name)
        self.backend.close()


def _refuse(conn: socket.socket, error: str) -> None:
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"op": "refused", "error": error}).encode(), socket.MSG_DONTWAIT)
    _discard_and_close(conn)


def _discard_and_close(sock: socket.socket) -> None:
    """Close `sock` after discarding what the peer sent and we did not read (closing over
    unread data resets the peer's side: it would get ECONNRESET before our last reply)."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        for _ in range(256):
            data, anc, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, payload in anc:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    whole = len(payload) - len(payload) % 4
                    _close_all([int.from_bytes(payload[i : i + 4], sys.byteorder)
                                for i in range(0, whole, 4)])  # fmt: skip
            if not data:
                break
    sock.close()


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
