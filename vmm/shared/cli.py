"""`vmm-pool`: run a shared pool's owner and watch / steer it.

Rationale
---------
An operator sharing one device between engines needs to start the owner, see who holds
what (held / limits / cached bytes per tenant), and move limits while engines run, from a
shell or a script (``--json``).

Approach
--------
``start NAME --budget SIZE`` runs `PoolOwner` in the foreground. ``ls NAME`` asks the owner
for its state over the pool's socket (as an ``operator`` peer) and prints a table, or the
state as JSON with ``--json``, or refreshes it live with ``--watch`` (a `rich` live view).
``limits NAME TENANT --min/--max`` changes a tenant's limits at run time. ``stop NAME`` asks
the owner to stop and waits until the pool no longer answers. Sizes accept K/M/G suffixes
(powers of 1024).

A wrong flag, a pool with no owner, or an owner that does not answer within ``--timeout``
seconds (a stopped or hung process) prints one line on stderr and exits 2.

Limitations
-----------
The owner serves one operator request at a time within its loop (fine for a few per second).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from typing import Any, NoReturn

from vmm.shared.protocol import (
    FROM_OWNER,
    ProtocolError,
    connect,
    is_finite_positive,
    recv,
    send,
)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'64M' -> 67108864; plain integers are bytes. Zero and negative sizes are refused
    (`parse_limit` admits zero)."""
    size = parse_limit(text)
    if size == 0:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a size > 0")
    return size


def parse_limit(text: str) -> int:
    """A size >= 0 ('0' is a valid tenant minimum)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        size = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"size {text!r}: expected e.g. 512M, 8G, 4096") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a size >= 0")
    return size


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not is_finite_positive(value):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def _id(text: str) -> int:
    """An argparse type: a uid or gid (an integer >= 0)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 1 << 32:
        raise argparse.ArgumentTypeError(f"expected a uid/gid (an integer >= 0), got {text!r}")
    return value


def _count(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _mode(text: str) -> int:
    """An argparse type: octal mode bits (600, 660, 0o666)."""
    try:
        value = int(text, 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"expected octal mode bits such as 600, got {text!r}")
    return value


def fmt_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if abs(n) >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f}{unit}"
    return str(n)


class OwnerRefused(RuntimeError):
    """The owner refused this operator (its uid), or answered out of protocol."""


class OwnerSilent(RuntimeError):
    """The owner accepted the connection but did not answer in time (stopped or hung)."""


def _request(pool: str, msg: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send `msg` (request id 1) as an operator; the reply, its parts joined."""
    sock = connect(pool, timeout=timeout)
    try:
        return _exchange(sock, msg)
    except TimeoutError:
        raise OwnerSilent(
            f"the owner did not answer within {timeout:g} s (a stopped or hung process?)"
        ) from None
    finally:
        sock.close()


def _exchange(sock: Any, msg: dict[str, Any]) -> dict[str, Any]:
    send(sock, {"op": "hello", "role": "operator"})
    welcome, _ = recv(sock, FROM_OWNER)
    if welcome["op"] != "welcome":
        raise OwnerRefused(str(welcome.get("error", welcome["op"])))
    send(sock, {**msg, "req": 1})
    reply, _ = recv(sock, FROM_OWNER)
    while reply["op"] == "state" and not reply["last"]:  # tenants come in parts
        more, _ = recv(sock, FROM_OWNER)
        if more["op"] != "state":
            raise OwnerRefused(f"state part expected, got {more['op']!r}")
        more["tenants"] = reply["tenants"] + more["tenants"]
        reply = more
    if reply.get("req") != 1:
        raise OwnerRefused(f"reply to request {reply.get('req')}, expected 1")
    return reply


def pool_state(pool: str, timeout: float = 5.0) -> dict[str, Any]:
    """The owner's state (see `PoolOwner.state`)."""
    state = _request(pool, {"op": "list"}, timeout)
    for key in ("op", "req", "last"):
        state.pop(key, None)
    return state


def set_limits(pool: str, tenant: str, lo: int | None, hi: int | None, timeout: float = 5.0) -> str:
    """'' on success, else the owner's reason."""
    reply = _request(pool, {"op": "set_limits", "tenant": tenant, "min": lo, "max": hi}, timeout)
    return str(reply.get("error", "")) if reply["op"] == "error" else ""


def stop_pool(pool: str, timeout: float = 5.0) -> None:
    """Ask the owner to stop; return once the pool no longer answers (OwnerSilent when it
    still does after `timeout` seconds)."""
    _request(pool, {"op": "stop"}, timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            connect(pool, timeout=timeout).close()
        except (ConnectionRefusedError, FileNotFoundError):
            return
        time.sleep(0.02)
    raise OwnerSilent(f"the owner still serves the pool {timeout:g} s after it agreed to stop")


_COLUMNS = ("id", "name", "pid", "held", "min", "max", "cached", "mapped", "wants", "denied")


def render_text(state: dict[str, Any]) -> str:
    head = (f"pool {state['pool']}: budget {fmt_size(state['budget'])}, lent "
            f"{fmt_size(state['lent'])}, chunk {fmt_size(state['granularity'])}")  # fmt: skip
    rows = [_COLUMNS] + [_row(t) for t in state["tenants"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _row(t: dict[str, Any]) -> tuple[str, ...]:
    sizes = ("held", "min", "max", "cached", "mapped")
    return tuple(fmt_size(t[c]) if c in sizes else str(t[c]) for c in _COLUMNS)


def _rich_table(state: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=render_text(state).splitlines()[0])
    for col in _COLUMNS:
        table.add_column(col, justify="right")
    for t in state["tenants"]:
        table.add_row(*_row(t))
    return table


def watch(pool: str, interval: float, count: int | None, timeout: float = 5.0) -> None:
    """A live `top`-like view with `rich`; `count` refreshes, None: until interrupted."""
    from rich.live import Live

    n = 0
    with Live(_rich_table(pool_state(pool, timeout)), refresh_per_second=4) as live:
        while count is None or n < count:
            time.sleep(interval)
            live.update(_rich_table(pool_state(pool, timeout)))
            n += 1


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line on stderr (exit 2), subcommands too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="vmm-pool", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="run the owner of pool NAME in the foreground")
    st.add_argument("name")
    st.add_argument("--budget", type=parse_size, required=True, help="bytes lent, e.g. 8G")
    st.add_argument("--chunk", type=parse_size, default=2 << 20, help="chunk size (2M)")
    st.add_argument("--reclaim-timeout", type=float, default=2.0, help="seconds (> 0)")
    st.add_argument("--check", action="store_true", help="check invariants after each message")
    st.add_argument("--allow-uid", type=_id, action="append", default=[],
                    help="another uid whose processes may join as tenants")  # fmt: skip
    st.add_argument("--allow-gid", type=_id, action="append", default=[],
                    help="a gid whose processes may join as tenants")  # fmt: skip
    st.add_argument("--operator-uid", type=_id, action="append", default=[],
                    help="another uid that may list, change limits and stop")  # fmt: skip
    st.add_argument("--idle-timeout", type=float, default=10.0,
                    help="seconds a connection that is not a tenant may stay idle")  # fmt: skip
    st.add_argument("--max-conns-per-uid", type=_count, default=128,
                    help="connections one uid may hold open (128)")  # fmt: skip
    st.add_argument("--socket-mode", type=_mode, default=0o600,
                    help="mode bits of a pool named by an absolute path (octal, default 600: "
                    "the owner's uid only; 660 lets its group connect)")  # fmt: skip
    ls = sub.add_parser("ls", help="list tenants: held / limits / cached bytes")
    ls.add_argument("name")
    ls.add_argument("--json", action="store_true", help="print the state as JSON")
    ls.add_argument("--watch", type=_seconds, default=None, metavar="SECONDS",
                    help="live view, refreshed every SECONDS")  # fmt: skip
    ls.add_argument("--count", type=_count, default=None, help="refreshes of --watch")
    lim = sub.add_parser("limits", help="change a tenant's limits at run time")
    lim.add_argument("name")
    lim.add_argument("tenant", help="tenant name or id")
    lim.add_argument("--min", type=parse_limit, default=None, help="bytes, e.g. 1G")
    lim.add_argument("--max", type=parse_limit, default=None, help="bytes, e.g. 6G")
    lim.add_argument("--json", action="store_true", help="print {ok, error} as JSON")
    stop = sub.add_parser("stop", help="stop the owner of pool NAME (waits until it is gone)")
    stop.add_argument("name")
    for cmd in (ls, lim, stop):
        cmd.add_argument("--timeout", type=_seconds, default=5.0,
                         help="seconds to wait for the owner's answer (5)")  # fmt: skip
    return ap


def _usage_error(args: argparse.Namespace) -> str:
    """A mistake argparse cannot see (flags that do not go together); '' if none."""
    if args.cmd == "ls" and args.count is not None and args.watch is None:
        return "--count applies to --watch only"
    if args.cmd == "ls" and args.watch is not None and args.json:
        return "--watch and --json do not go together"
    if args.cmd == "limits":
        if args.min is None and args.max is None:
            return "limits: give --min, --max or both"
        if None not in (args.min, args.max) and args.min > args.max:
            return f"--min {args.min} bytes is above --max {args.max} bytes"
    if args.cmd == "start" and args.name.startswith("/"):
        folder = os.path.dirname(args.name) or "/"
        if not os.path.isdir(folder):
            return f"cannot start pool {args.name!r}: folder {folder} does not exist"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if error := _usage_error(args):
        print(f"vmm-pool {args.cmd}: error: {error}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (ConnectionRefusedError, FileNotFoundError):
        print(f"vmm-pool: no owner serves pool {args.name!r}", file=sys.stderr)
        return 2
    except (OwnerRefused, OwnerSilent, ProtocolError, OSError, ValueError) as exc:
        print(f"vmm-pool: pool {args.name!r}: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "start":
        return _start(args)
    if args.cmd == "stop":
        stop_pool(args.name, args.timeout)
        print(f"vmm-pool: pool {args.name!r} stopped")
        return 0
    if args.cmd == "ls":
        if args.watch is not None:
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends the live view
                watch(args.name, args.watch, args.count, args.timeout)
            return 0
        state = pool_state(args.name, args.timeout)
        print(json.dumps(state, indent=1) if args.json else render_text(state))
        return 0
    error = set_limits(args.name, args.tenant, args.min, args.max, args.timeout)
    if args.json:
        print(json.dumps({"ok": not error, "error": error}))
    elif error:
        print(f"vmm-pool: {error}", file=sys.stderr)
    return 1 if error else 0


def _start(args: argparse.Namespace) -> int:
    from vmm.shared.guard import AccessPolicy
    from vmm.shared.owner import PoolOwner

    for flag, value in (("--reclaim-timeout", args.reclaim_timeout),
                        ("--idle-timeout", args.idle_timeout)):  # fmt: skip
        if not is_finite_positive(value):
            print(f"vmm-pool: {flag} must be a finite number of seconds > 0, got {value}",
                  file=sys.stderr)  # fmt: skip
            return 2
    policy = AccessPolicy.of(args.allow_uid, args.allow_gid, args.operator_uid)
    try:
        owner = PoolOwner(args.name, args.budget, args.chunk, reclaim_timeout=args.reclaim_timeout,
                          check=args.check, policy=policy, idle_timeout=args.idle_timeout,
                          max_conns_per_uid=args.max_conns_per_uid,
                          socket_mode=args.socket_mode)  # fmt: skip
    except (ValueError, OSError) as exc:
        print(f"vmm-pool: cannot start pool {args.name!r}: {exc}", file=sys.stderr)
        return 2
    print(f"vmm-pool: serving {args.name!r}, budget {fmt_size(args.budget)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: owner.stop())
    with contextlib.suppress(KeyboardInterrupt):
        owner.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
