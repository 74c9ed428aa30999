"""Wire protocol of a shared chunk pool: JSON messages (+ fds) over a SOCK_SEQPACKET socket.

Rationale
---------
Budget decisions are rare (a tenant asks for chunks in batches), so the protocol favours
being readable and debuggable over speed: one JSON object per datagram. SOCK_SEQPACKET
keeps message boundaries and the fds (SCM_RIGHTS) attached to the message they belong
to, and a peer that dies closes its end, which is how the owner learns a tenant is gone.

Every peer may be hostile or broken, so every message is checked against its schema
(`validate`) before any field is read: the op, each field's type (``true`` is not an
int), integer ranges, string lengths, list lengths, no unknown fields. Parsing refuses
NaN / Infinity and nesting deeper than the parser's recursion limit. A message that
fails is a `ProtocolError`, and the receiver drops that one peer.

Approach
--------
A pool is named; its socket lives in the abstract namespace (``\\0jenga-vmm-pool/NAME``),
so nothing is left on disk when the owner dies. Messages (``op`` field)::

    tenant -> owner   hello{role, tenant, min, max}   want{req, n, need}
                      give{ids, reclaim}   report{cached, mapped}
    owner -> tenant   welcome{tenant, granularity, budget, min, max} + [memfd]
                      grant{req, ids, where, last} + fds   deny{req, error}
                      reclaim{n, id}   limits{min, max}
                      refused{error}   (hello refused; the socket then closes)
    operator -> owner hello{role: "operator"}   list{req}   set_limits{req, tenant, min, max}
                      stop{req}   (the owner answers ok, then stops serving)
    owner -> operator state{req, ..., tenants, last}   ok{req}   error{req, error}

Replies carry the ``req`` of their request, so a reply that arrives after its requester
gave up is recognised as late and never taken for the answer to a later request. A list
that may be long (a grant's chunks, the state's tenants) is sent in parts of at most
`PART_BYTES` bytes each (``last``: false on all but the final part), so no message
outgrows the socket's send buffer (a larger datagram fails with EMSGSIZE).

Limitations
-----------
Linux only (abstract Unix sockets, SO_PEERCRED). A received message is at most
`MAX_MESSAGE` bytes; senders keep under `PART_BYTES`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vmm.backend import SharedChunks

#: Largest datagram read (bytes).
MAX_MESSAGE = 1 << 20
#: Most bytes one sent part carries (the default socket send buffer is ~208 KiB).
PART_BYTES = 48 << 10
#: Most fds one message carries.
MAX_FDS = 253
#: Longest tenant name (UTF-8 bytes).
MAX_NAME_BYTES = 128
#: Largest integer any field may carry.
MAX_INT = (1 << 62) - 1
#: Longest list any field may carry.
MAX_LIST = 1 << 17


class ProtocolError(RuntimeError):
    """A malformed message, or the peer closed the connection."""


# ---- schema ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int:
    """An integer in [lo, hi] (bools refused); `null`: None allowed."""

    lo: int = 0
    hi: int = MAX_INT
    null: bool = False

    def check(self, value: Any) -> str:
        if value is None and self.null:
            return ""
        if type(value) is not int:
            return f"expected an integer, got {type(value).__name__}"
        if not self.lo <= value <= self.hi:
            return f"{value} outside [{self.lo}, {self.hi}]"
        return ""


@dataclass(frozen=True)
class Str:
    """A printable string of 1..`max_bytes` UTF-8 bytes, or one of `choices`."""

    max_bytes: int = MAX_NAME_BYTES
    choices: tuple[str, ...] = ()

    def check(self, value: Any) -> str:
        if type(value) is not str:
            return f"expected a string, got {type(value).__name__}"
        if self.choices:
            return "" if value in self.choices else f"{value[:40]!r} not one of {self.choices}"
        size = len(value.encode("utf-8", "surrogatepass"))
        if not 1 <= size <= self.max_bytes:
            return f"string of {size} bytes, expected 1..{self.max_bytes}"
        if not value.isprintable():
            return f"string {value[:40]!r} has control characters"
        return ""


@dataclass(frozen=True)
class Ints:
    """A list of at most `max_len` items, each an `Int` (or, with `pairs`, [Int, Int])."""

    item: Int = Int()
    pairs: bool = False
    max_len: int = MAX_LIST

    def check(self, value: Any) -> str:
        if type(value) is not list:
            return f"expected a list, got {type(value).__name__}"
        if len(value) > self.max_len:
            return f"list of {len(value)} items, at most {self.max_len}"
        for i, v in enumerate(value):
            if self.pairs and (type(v) is not list or len(v) != 2):
                return f"item {i}: expected a pair of integers"
            for x in v if self.pairs else (v,):
                if error := self.item.check(x):
                    return f"item {i}: {error}"
        return ""


@dataclass(frozen=True)
class Rows:
    """A list of flat objects (the state's tenants) of scalar values."""

    max_len: int = MAX_LIST

    def check(self, value: Any) -> str:
        if type(value) is not list or len(value) > self.max_len:
            return "expected a list of rows"
        scalar = (int, str, float, bool, type(None))
        for i, row in enumerate(value):
            if type(row) is not dict or not all(type(v) in scalar for v in row.values()):
                return f"row {i} is not an object of scalars"
        return ""


@dataclass(frozen=True)
class Flat:
    """An object of scalar values (the state's counters)."""

    def check(self, value: Any) -> str:
        if type(value) is not dict or not all(type(v) is int for v in value.values()):
            return "expected an object of integers"
        return ""


@dataclass(frozen=True)
class Bool:
    def check(self, value: Any) -> str:
        return "" if type(value) is bool else f"expected a boolean, got {type(value).__name__}"


@dataclass(frozen=True)
class Opt:
    """An optional field (absent, or present and valid)."""

    spec: Any


Schema = dict[str, Any]
REQ = Int(0, MAX_INT)
BYTES = Int(0, MAX_INT)
NAME = Str()
ERROR = Str(1 << 15)
ROLE = Str(choices=("tenant", "operator"))

#: What a tenant or operator may send the owner.
TO_OWNER: dict[str, Schema] = {
    "hello": {"role": Opt(ROLE), "tenant": Opt(NAME), "min": Opt(BYTES),
              "max": Opt(Int(0, MAX_INT, null=True)), "pid": Opt(Int(0, MAX_INT))},
    "want": {"req": REQ, "n": Int(1, MAX_INT), "need": Int(1, MAX_INT)},
    "give": {"ids": Ints(), "reclaim": Opt(Int(0, MAX_INT, null=True))},
    "report": {"cached": BYTES, "mapped": BYTES},
    "list": {"req": REQ},
    "set_limits": {"req": REQ, "tenant": NAME, "min": Opt(Int(0, MAX_INT, null=True)),
                   "max": Opt(Int(0, MAX_INT, null=True))},
    "stop": {"req": REQ},
}  # fmt: skip
#: What the owner may send a tenant or an operator.
FROM_OWNER: dict[str, Schema] = {
    "welcome": {"tenant": Opt(Int(1)), "granularity": Opt(Int(1)), "budget": BYTES,
                "min": Opt(BYTES), "max": Opt(BYTES)},
    "refused": {"error": ERROR},
    "grant": {"req": REQ, "ids": Ints(), "where": Ints(pairs=True), "last": Bool()},
    "deny": {"req": REQ, "error": ERROR},
    "reclaim": {"n": Int(0), "id": Int(0, MAX_INT, null=True)},
    "limits": {"min": BYTES, "max": BYTES},
    "state": {"req": REQ, "pool": Str(1 << 10), "granularity": BYTES, "budget": BYTES,
              "lent": BYTES, "quarantined": BYTES, "physical": BYTES, "tenants": Rows(),
              "counters": Flat(), "last": Bool()},
    "ok": {"req": REQ},
    "error": {"req": REQ, "error": ERROR},
}  # fmt: skip


def validate(msg: dict[str, Any], schemas: dict[str, Schema]) -> dict[str, Any]:
    """`msg` if it matches the schema of its op; ProtocolError naming the first bad field."""
    op = msg.get("op")
    schema = schemas.get(op) if type(op) is str else None
    if schema is None:
        raise ProtocolError(f"unknown op {str(op)[:40]!r} (expected one of {sorted(schemas)})")
    unknown = [k for k in msg if k != "op" and k not in schema]
    if unknown:
        raise ProtocolError(f"{op}: unknown fields {[k[:40] for k in unknown[:4]]}")
    for key, spec in schema.items():
        optional = isinstance(spec, Opt)
        if key not in msg:
            if optional:
                continue
            raise ProtocolError(f"{op}: missing field {key!r}")
        if error := (spec.spec if optional else spec).check(msg[key]):
            raise ProtocolError(f"{op}.{key}: {error}")
    return msg


# ---- transport ------------------------------------------------------------------------------
def is_path(name: str) -> bool:
    """A pool named by an absolute path lives at that file (a named socket whose mode bits
    say who may connect); any other name is in the abstract namespace."""
    return name.startswith("/")


def address(name: str) -> str:
    """The socket address of pool `name`: the file itself for a path, else the
    abstract-namespace address ``\\0jenga-vmm-pool/NAME``."""
    if is_path(name):
        if "\0" in name or len(name.encode()) > 107:
            raise ValueError(f"pool path {name!r} must be at most 107 bytes without NUL")
        return name
    if not name or "/" in name or "\0" in name or len(name) > 80:
        raise ValueError(
            f"pool name {name!r} must be 1..80 characters without '/' or NUL, or an absolute path"
        )
    return "\0jenga-vmm-pool/" + name


def listen(name: str, mode: int = 0o600) -> socket.socket:
    """The owner's listening socket for pool `name` (OSError EADDRINUSE: already running).
    A path pool's file gets ``mode`` (default: the owner's uid only) before any peer can
    connect: it is bound under a umask that leaves it unreachable, then chmod-ed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if is_path(name):
            old = os.umask(0o777)
            try:
                sock.bind(address(name))
            finally:
                os.umask(old)
            os.chmod(name, mode)
        else:
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


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()


def send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message (and `fds`, duplicated into the receiver by the kernel)."""
    data = encode(msg)
    if len(data) > MAX_MESSAGE or len(fds) > MAX_FDS:
        raise ProtocolError(
            f"message of {len(data)} bytes and {len(fds)} fds exceeds {MAX_MESSAGE} / {MAX_FDS}"
        )
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def split_rows(rows: Sequence[Any], limit: int = PART_BYTES) -> Iterator[tuple[int, int]]:
    """[start, stop) slices of `rows` whose JSON takes at most ~`limit` bytes each (at
    least one row per slice); yields one empty slice for no rows."""
    start, size = 0, 0
    for i, row in enumerate(rows):
        row_size = len(encode({"r": row})) - 5
        if i > start and size + row_size > limit:
            yield start, i
            start, size = i, 0
        size += row_size + 1
    yield start, len(rows)


def grant_parts(
    req: int, handles: list[int], shared: SharedChunks
) -> Iterator[tuple[dict[str, Any], tuple[int, ...]]]:
    """The grant of `handles` as messages of at most ~`PART_BYTES` bytes and `MAX_FDS`
    fds each; each part carries the fds its chunks refer to, renumbered from 0."""
    rows = list(zip(handles, shared.where, strict=True))
    start = 0
    while True:
        size, fd_index, stop = 0, dict[int, int](), start
        while stop < len(rows):
            h, (fd, off) = rows[stop]
            row_size = len(str(h)) + len(str(off)) + 8
            new_fd = fd not in fd_index
            if stop > start and (size + row_size > PART_BYTES or
                                 (new_fd and len(fd_index) == MAX_FDS)):  # fmt: skip
                break
            if new_fd:
                fd_index[fd] = len(fd_index)
            size += row_size
            stop += 1
        part = rows[start:stop]
        msg = {"op": "grant", "req": req, "ids": [h for h, _ in part],
               "where": [[fd_index[fd], off] for _, (fd, off) in part],
               "last": stop == len(rows)}  # fmt: skip
        yield msg, tuple(shared.fds[fd] for fd in fd_index)
        if stop == len(rows):
            return
        start = stop


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def recv(
    sock: socket.socket, schemas: dict[str, Schema] | None = None
) -> tuple[dict[str, Any], list[int]]:
    """Receive one message and the fds it carries (the caller owns and closes them);
    checked against `schemas` when given."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    try:
        if not data:
            raise ProtocolError("peer closed the connection")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError(f"message truncated (flags {flags:#x})")
        try:
            msg = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"malformed message: {str(exc)[:200]}") from None
        if not isinstance(msg, dict):
            raise ProtocolError(f"message is not an object: {data[:80]!r}")
        if schemas is not None:
            validate(msg, schemas)
    except ProtocolError:
        for fd in fds:
            _close_fd(fd)
        raise
    return msg, fds


def is_finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
