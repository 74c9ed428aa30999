"""Who may use a shared pool, and when a gone tenant's chunks may be lent again.

Rationale
---------
The pool's socket is reachable by every process on the machine (abstract namespace, no
file permissions), and a tenant receives the owner's memfd, through which it can map
every chunk of the pool. So the owner decides per connection, from the kernel's word
(SO_PEERCRED: pid, uid, gid at connect time), who may join as a tenant and who may
steer the pool as an operator; the peer's own claims (``hello.pid``) are not trusted.

A tenant the owner stops talking to (it broke the protocol, its socket failed, a send
timed out) may still have its chunks mapped: lending them to another tenant at once
would let one engine read or overwrite another's KV cache. So such chunks go to a
*quarantine* tied to the tenant's process, and return to the pool only when that
process has exited (a pidfd becomes readable; the kernel tears down a process's
mappings before it reports the exit).

Approach
--------
* `AccessPolicy`: tenants from the owner's uid, or a uid / gid in `tenant_uids` /
  `tenant_gids`; operators from the owner's uid or `operator_uids`.
* `peer_cred(sock)`: the connecting process's pid / uid / gid.
* `ProcessWatch(pid)`: a pidfd (``os.pidfd_open``) that the owner's selector watches;
  without pidfds (old kernels), the owner polls ``kill(pid, 0)``.

Limitations
-----------
The quarantine follows the process that connected: a child it forked that inherited
the mappings, or a process it passed the memfd to, is not tracked. A peer in another
pid namespace reports pid 0, and a tenant in the owner's own process never exits before
it: their quarantined chunks stay until the owner closes. Pid
reuse between ``connect`` and ``hello`` can only make a quarantine last longer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The kernel's record of the process that connected `sock` (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


@dataclass(frozen=True)
class AccessPolicy:
    """Which uids / gids may join as tenants, and which uids may act as operators. The
    owner's own uid (`owner_uid`, default: the effective uid) may always do both."""

    tenant_uids: frozenset[int] = frozenset()
    tenant_gids: frozenset[int] = frozenset()
    operator_uids: frozenset[int] = frozenset()
    owner_uid: int = field(default_factory=os.geteuid)

    @classmethod
    def of(
        cls,
        tenant_uids: Iterable[int] = (),
        tenant_gids: Iterable[int] = (),
        operator_uids: Iterable[int] = (),
    ) -> AccessPolicy:
        return cls(frozenset(tenant_uids), frozenset(tenant_gids), frozenset(operator_uids))

    def may_tenant(self, cred: PeerCred) -> bool:
        return (
            cred.uid == self.owner_uid
            or cred.uid in self.tenant_uids
            or cred.gid in self.tenant_gids
        )

    def may_operate(self, cred: PeerCred) -> bool:
        return cred.uid == self.owner_uid or cred.uid in self.operator_uids

    def may_connect(self, cred: PeerCred) -> bool:
        return self.may_tenant(cred) or self.may_operate(cred)


class ProcessWatch:
    """Tells when process `pid` has exited: `fd` (a pidfd, readable at exit) for a
    selector, or None where pidfds are missing; `gone()` answers either way."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: int | None = None
        self._gone = False
        if pid <= 0:
            return  # another pid namespace: never known to be gone
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                raise  # EMFILE and the like: the caller refuses the peer

    def gone(self) -> bool:
        if self._gone:
            return True
        if self.pid <= 0:
            return False
        if self.fd is not None:
            ready, _, _ = select.select([self.fd], [], [], 0)
            self._gone = bool(ready)
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
            except PermissionError:
                pass  # alive, another uid's
        return self._gone

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


@dataclass(eq=False)
class Quarantine:
    """Chunks of a tenant the owner dropped while its process may still map them."""

    name: str
    watch: ProcessWatch
    handles: list[int]
