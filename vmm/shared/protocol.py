"""Wire protocol of a shared chunk pool: JSON messages (+ fds) over a SOCK_SEQPACKET socket.

Rationale
---------
Budget decisions are rare (a tenant asks for chunks in batches), so the protocol favours
being readable and debuggable over speed: one JSON object per datagram. SOCK_SEQPACKET
keeps message boundaries and the fds (SCM_RIGHTS) attached to the message they belong
to, and a peer that dies closes its end, which is how the owner learns a tenant is gone.

Approach
--------
A pool is named; its socket lives in the abstract namespace (``\\0jenga-vmm-pool/NAME``),
so nothing is left on disk when the owner dies. Messages (``op`` field)::

    tenant -> owner   hello{role, tenant, min, max, pid}   want{n, need}   give{ids, reclaim}
                      report{cached, mapped}
    owner -> tenant   welcome{tenant, granularity, budget, min, max} + [memfd]
                      grant{ids, offsets} + fds   deny{error}   reclaim{n, id}   limits{min, max}
                      refused{error}   (hello over the budget; the socket then closes)
    operator -> owner hello{role: "operator"}   list{}   set_limits{tenant, min, max}
    owner -> operator state{...}   ok{}   error{error}

Limitations
-----------
Linux only (abstract Unix sockets). A message is at most `MAX_MESSAGE` bytes (a grant of
~20,000 chunks); larger batches must be split by the caller.
"""

from __future__ import annotations

import contextlib
import json
import socket
from typing import Any

#: Largest datagram read (bytes).
MAX_MESSAGE = 1 << 20
#: Most fds one message carries.
MAX_FDS = 253


class ProtocolError(RuntimeError):
    """A malformed message, or the peer closed the connection."""


def address(name: str) -> str:
    """The abstract-namespace address of pool `name`."""
    if not name or "/" in name or "\0" in name or len(name) > 80:
        raise ValueError(f"pool name {name!r} must be 1..80 characters without '/' or NUL")
    return "\0jenga-vmm-pool/" + name


def listen(name: str) -> socket.socket:
    """The owner's listening socket for pool `name` (OSError EADDRINUSE: already running)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(address(name))
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(name: str, timeout: float = 5.0) -> socket.socket:
    """A connection to pool `name` (ConnectionRefusedError / FileNotFoundError: no owner)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(address(name))
    except BaseException:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one message (and `fds`, duplicated into the receiver by the kernel)."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE or len(fds) > MAX_FDS:
        raise ProtocolError(
            f"message of {len(data)} bytes and {len(fds)} fds exceeds {MAX_MESSAGE} / {MAX_FDS}"
        )
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Receive one message and the fds it carries (the caller owns and closes them)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if not data:
        for fd in fds:
            _close_fd(fd)
        raise ProtocolError("peer closed the connection")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            _close_fd(fd)
        raise ProtocolError(f"message truncated (flags {flags:#x})")
    try:
        msg = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"malformed message: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError(f"message without an 'op': {data[:80]!r}")
    return msg, fds


def _close_fd(fd: int) -> None:
    import os

    with contextlib.suppress(OSError):
        os.close(fd)
