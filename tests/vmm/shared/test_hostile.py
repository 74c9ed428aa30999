"""A shared pool under hostile and broken peers: a real owner process (`vmm-pool start
--check`), raw protocol clients, and real tenants mapping and writing bytes. After every
case the owner is still up, `ls` answers, no handler failed unexpectedly, and the lent,
quarantined and physical bytes return to 0."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from vmm.shared.cli import pool_state
from vmm.shared.protocol import connect

import vmm
from tests.vmm.shared.pool_helpers import ROOT, Worker, owner_process, pool_name, wait_until
from vmm.shared import PoolOwner, PoolRefused, Tenant, join_pool

G = 4096
BUDGET = 64 * G


def settled(pool: str) -> dict:
    """Wait until nothing is lent, quarantined or physical; the owner's state then."""

    def empty() -> dict | None:
        state = pool_state(pool)
        done = state["lent"] == state["quarantined"] == state["physical"] == 0
        return state if done and not state["tenants"] else None

    state = wait_until(empty, 10.0, "the pool to empty")
    assert isinstance(state, dict)
    assert state["counters"]["errors.unexpected"] == 0, state["counters"]
    return state


@pytest.fixture
def pool() -> Iterator[str]:
    name = pool_name()
    with owner_process(name, BUDGET, G):
        yield name
        settled(name)


class Raw:
    """A raw protocol client: sends whatever it is given."""

    def __init__(self, pool: str) -> None:
        self.sock = connect(pool, 5.0)

    def send(self, msg: dict | bytes) -> None:
        data = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)  # (the owner may have closed it already: recv says why)

    def recv(self) -> dict | None:
        """The next message (its fds closed; a grant's parts joined), None once closed."""
        msg: dict | None = None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 253)
            except (ConnectionResetError, BrokenPipeError):
                return None
            for fd in fds:
                os.close(fd)
            if not data:
                return None
            part = json.loads(data)
            if msg is not None and part["op"] == "grant":
                part["ids"] = msg["ids"] + part["ids"]
            msg = part
            if msg["op"] not in ("grant", "state") or msg["last"]:
                return msg

    def hello(self, name: str, **limits: int) -> dict | None:
        self.send({"op": "hello", "role": "tenant", "tenant": name, **limits})
        return self.recv()

    def close(self) -> None:
        self.sock.close()


def in_child(fn: Callable[[int], None]) -> tuple[int, int]:
    """Fork; the child runs fn(write end of a pipe) then exits. (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            fn(w)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    return pid, r


def reap(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


MALFORMED: list[tuple[str, bytes]] = [
    ("min a string", b'{"op":"hello","tenant":"m","min":"x"}'),
    ("min NaN", b'{"op":"hello","tenant":"m","min":NaN}'),
    ("max Infinity", b'{"op":"hello","tenant":"m","max":Infinity}'),
    ("min a list", b'{"op":"hello","tenant":"m","min":[1]}'),
    ("min true", b'{"op":"hello","tenant":"m","min":true}'),
    ("min a float", b'{"op":"hello","tenant":"m","min":4096.0}'),
    ("min huge", b'{"op":"hello","tenant":"m","min":' + b"9" * 5000 + b"}"),
    ("role unknown", b'{"op":"hello","role":"root","tenant":"m"}'),
    ("name not printable", b'{"op":"hello","tenant":"a\\u001b[2J"}'),
    ("an unknown field", b'{"op":"hello","tenant":"m","evil":1}'),
    ("not an object", b"[1,2,3]"),
    ("no op", b'{"tenant":"m"}'),
    ("not UTF-8", b'{"op":"hello","tenant":"\xff\xfe"}'),
    ("not JSON", b"\x00\x01garbage"),
    ("50,000 nested lists", b"[" * 50_000),
    ("30,000 nested objects", b'{"a":' * 30_000),
]
AFTER_HELLO: list[tuple[str, dict]] = [
    ("give ids 5", {"op": "give", "ids": 5}),
    ("give ids [null]", {"op": "give", "ids": [None]}),
    ("give ids not held", {"op": "give", "ids": [3]}),
    ("want without n", {"op": "want", "req": 1, "need": 1}),
    ("want need > n", {"op": "want", "req": 1, "n": 1, "need": 2}),
    ("want n 0", {"op": "want", "req": 1, "n": 0, "need": 0}),
    ("report negative", {"op": "report", "cached": -1, "mapped": 0}),
    ("a second hello", {"op": "hello", "tenant": "again"}),
    ("an operator op", {"op": "list", "req": 1}),
    ("a tenant asking the owner to stop", {"op": "stop", "req": 1}),  # only operators may
]


def test_malformed_messages_drop_only_their_peer(pool):
    keeper = Tenant(pool, "keeper", batch_chunks=2)
    keeper.acquire(2)
    for what, data in MALFORMED:
        c = Raw(pool)
        c.send(data)
        reply = c.recv()
        assert reply is None or reply["op"] == "refused", (what, reply)
        assert c.recv() is None, what  # the owner closed this connection
        c.close()
    for i, (what, msg) in enumerate(AFTER_HELLO):
        c = Raw(pool)
        assert c.hello(f"t{i}")["op"] == "welcome"
        c.send(msg)
        assert c.recv() is None, what
        c.close()
    op = Raw(pool)
    op.send({"op": "hello", "role": "operator"})
    assert op.recv()["op"] == "welcome"
    op.send({"op": "set_limits", "req": 1, "max": 0})  # no tenant
    assert op.recv() is None
    keeper.acquire(2)  # the pool and the other tenant never noticed
    assert keeper.held_chunks == 4
    state = pool_state(pool)
    assert [t["name"] for t in state["tenants"]] == ["keeper"]
    assert state["counters"]["peers.dropped"] >= len(MALFORMED) + len(AFTER_HELLO) + 1
    keeper.close()


def _fuzz_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(10 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, 1, -1, 4096, 2**62, 2**63, -(2**40), 7])
    if kind == 1:
        return rng.random() * rng.choice([1, 1e300, -5])
    if kind == 2:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(0, 200)))
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return rng.randrange(0, 64)
    if kind == 5:
        return rng.choice(["tenant", "operator", "fuzz"])
    if kind < 8:
        return [_fuzz_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {rng.choice(FIELDS): _fuzz_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


OPS = ["hello", "want", "give", "report", "list", "set_limits", "grant", "nope"]
FIELDS = ["op", "role", "tenant", "min", "max", "pid", "req", "n", "need", "ids", "reclaim",
          "cached", "mapped", "x"]  # fmt: skip


def fuzz_message(rng: random.Random) -> bytes:
    """A seeded random message: raw bytes, or a JSON object of known ops / fields with
    random values (valid ones often enough to get past hello and be granted chunks)."""
    roll = rng.random()
    if roll < 0.15:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
    msg: dict = {"op": rng.choice(OPS)}
    for _ in range(rng.randrange(0, 5)):
        msg[rng.choice(FIELDS)] = _fuzz_value(rng)
    if roll < 0.35:  # a valid want, so that some get chunks before breaking a rule
        msg = {"op": "want", "req": rng.randrange(9), "n": rng.randrange(1, 9), "need": 1}
    elif roll < 0.4:
        msg = {"op": "give", "ids": [rng.randrange(64)], "reclaim": None}
    return json.dumps(msg).encode()


def _drain_one(sock: socket.socket) -> bool:
    """Read one waiting message and close its fds; False if none waits."""
    try:
        data, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4), socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    for level, kind, payload in anc:
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
            for i in range(0, len(payload) - len(payload) % 4, 4):
                os.close(int.from_bytes(payload[i : i + 4], sys.byteorder))
    if not data:
        raise ConnectionResetError("the owner closed the connection")
    return True


def _fuzz_client(pool: str, seed: int, count: int, out: int) -> None:
    rng = random.Random(seed)
    sent = conns = 0
    sock: socket.socket | None = None
    while sent < count:
        if sock is None:
            sock = connect(pool, 5.0)
            sock.settimeout(None)  # MSG_DONTWAIT below must not wait for the timeout
            conns += 1
            if rng.random() < 0.8:
                hello = {"op": "hello", "tenant": f"fz{conns}", "max": rng.choice([8, 64]) * G}
                sock.sendall(json.dumps(hello).encode())
        try:
            sock.sendall(fuzz_message(rng))
            sent += 1
            while _drain_one(sock):  # replies, and the fds grants carry
                pass
        except OSError:
            sock.close()
            sock = None
    os.write(out, json.dumps({"sent": sent, "connections": conns}).encode())


def test_1200_fuzzed_messages_leave_the_owner_serving(pool):
    keeper = Tenant(pool, "keeper", batch_chunks=1)
    pid, r = in_child(lambda w: _fuzz_client(pool, 20261126, 1200, w))
    assert reap(pid) == 0
    report = json.loads(os.read(r, 4096))
    os.close(r)
    assert report["sent"] == 1200 and report["connections"] > 50, report
    keeper.acquire(1)  # still served
    state = pool_state(pool)
    assert state["counters"]["errors.unexpected"] == 0
    assert state["counters"]["grants"] > 1  # the fuzz got past hello and was lent chunks
    assert [t["name"] for t in state["tenants"]] == ["keeper"]
    keeper.close()


def _victim(pool: str, w: int, go: int) -> None:
    c = Raw(pool)
    assert c.hello("victim")["op"] == "welcome"
    c.send({"op": "want", "req": 1, "n": 64, "need": 64})
    assert c.recv()["op"] == "grant"
    c.sock.shutdown(socket.SHUT_RD)  # the owner's next send to it fails
    os.write(w, b"1")
    os.read(go, 1)  # stays alive (and may map its chunks) until told


def test_a_victim_vanishing_mid_reclaim_is_dropped_and_its_chunks_quarantined(pool):
    go_r, go_w = os.pipe()
    pid, r = in_child(lambda w: _victim(pool, w, go_r))
    assert os.read(r, 1) == b"1"
    waiter = Raw(pool)
    assert waiter.hello("waiter")["op"] == "welcome"
    waiter.send({"op": "want", "req": 7, "n": 4, "need": 4})
    reply = waiter.recv()  # reclaim sent to the victim fails: it is dropped, not re-lent
    assert reply["op"] == "deny" and reply["req"] == 7, reply
    assert "4 chunks, 0 of 64 unlent (64 quarantined)" in reply["error"]
    state = pool_state(pool)
    assert [t["name"] for t in state["tenants"]] == ["waiter"]
    assert state["quarantined"] == BUDGET and state["lent"] == 0
    os.write(go_w, b"1")  # the victim's process exits: its chunks come back
    assert reap(pid) == 0
    wait_until(lambda: pool_state(pool)["quarantined"] == 0, 5.0, "quarantine released")
    waiter.send({"op": "want", "req": 8, "n": 4, "need": 4})
    reply = waiter.recv()
    assert reply["op"] == "grant" and reply["req"] == 8 and len(reply["ids"]) == 4
    waiter.send({"op": "give", "ids": reply["ids"]})  # else they wait for this process's exit
    waiter.close()
    for fd in (r, go_r, go_w):
        os.close(fd)


def test_a_12000_chunk_grant_arrives_in_parts():
    name = pool_name()
    with owner_process(name, 12_288 * G, G):
        a = Worker(name, "a")
        try:
            assert a(map=8)["held"] == 8
            got = a(acquire=12_000)
            assert "error" not in got and got["held"] == 12_008, got
            assert a(check=True)["bad"] == []
            assert pool_state(name)["tenants"][0]["held"] == 12_008 * G
        finally:
            a.close()
        settled(name)


def test_a_dropped_tenant_keeps_its_chunks_until_its_process_exits(pool):
    a = Worker(pool, "a", max_bytes=8 * G)
    b = Worker(pool, "b")
    try:
        assert a(map=8)["held"] == 8
        a_ids = a(ids=True)["ids"]
        a(raw={"op": "give", "ids": [10_000]})  # breaks the protocol: the owner drops it
        wait_until(lambda: pool_state(pool)["quarantined"] == 8 * G, 5.0, "a quarantined")
        assert b(map=56)["mapped"] == 56  # everything not quarantined, and not one chunk more
        assert "OutOfMemory" in b(map=1).get("error", "")
        assert set(b(ids=True)["ids"]).isdisjoint(a_ids)
        assert b(check=True)["bad"] == []
        assert a(check=True)["bad"] == []  # b wrote all its chunks: a's bytes are intact
        assert "PoolRefused" in a(acquire=1)["error"]
    finally:
        a.close()
    wait_until(lambda: pool_state(pool)["quarantined"] == 0, 5.0, "a's chunks released")
    try:
        assert b(map=8)["mapped"] == 64 and b(check=True)["bad"] == []
    finally:
        b.close()


def test_two_tenants_cannot_join_under_one_name(pool):
    first = Tenant(pool, "llama")
    with pytest.raises(PoolRefused, match="already has a tenant named 'llama'"):
        Tenant(pool, "llama")
    cli = [sys.executable, "-m", "vmm.shared.cli", "limits", pool, "llama", "--max", "16K"]
    assert subprocess.run(cli, cwd=ROOT, timeout=30).returncode == 0
    (row,) = pool_state(pool)["tenants"]
    assert (row["name"], row["max"]) == ("llama", 16 * 1024)
    first.close()
    wait_until(lambda: not pool_state(pool)["tenants"], 5.0, "llama gone")
    again = Tenant(pool, "llama")  # the name is free again
    again.close()


def test_a_late_reply_is_never_taken_for_the_next_one():
    name = pool_name()
    with owner_process(name, BUDGET, G) as owner:
        t = Tenant(name, "late", batch_chunks=1, keep_chunks=64, timeout=0.5)
        os.kill(owner.pid, signal.SIGSTOP)
        try:
            with pytest.raises(vmm.OutOfMemory, match=r"did not answer want 1 within 0\.5 s"):
                t.acquire(2)
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        t.acquire(3)  # its own reply: 3 chunks; the late grant of 2 joins the lease
        assert t.counters["replies.late"] == 1
        assert t.held_chunks == t.lease_chunks == 5
        assert pool_state(name)["tenants"][0]["held"] == 5 * G
        t.close()
        settled(name)


def _blocking_connect(name: str) -> socket.socket:
    """Connect, waiting while the owner's backlog is full (5 s at most)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))
    s.connect("\0jenga-vmm-pool/" + name)
    return s


def test_a_connection_flood_under_a_low_fd_limit():
    name = pool_name()
    with owner_process(name, BUDGET, G, args=("--max-conns-per-uid", "1000"), max_fds=256):
        keeper = Tenant(name, "keeper", batch_chunks=1)
        keeper.acquire(1)
        flood = [_blocking_connect(name) for _ in range(400)]  # idle: never a hello
        state = wait_until(lambda: pool_state(name), 10.0, "ls during the flood")
        assert state["counters"]["accept.fds_exhausted"] > 0, state["counters"]
        keeper.acquire(1)  # tenants are never evicted
        for s in flood:
            s.close()
        assert [t["name"] for t in pool_state(name)["tenants"]] == ["keeper"]
        keeper.close()
        settled(name)


def test_idle_connections_are_capped_per_uid_and_time_out():
    name = pool_name()
    args = ("--max-conns-per-uid", "8", "--idle-timeout", "0.5")
    with owner_process(name, BUDGET, G, args=args):
        idle = [connect(name) for _ in range(20)]
        assert pool_state(name)["counters"]["peers.dropped"] >= 12  # oldest idle evicted
        for s in idle:
            s.settimeout(5.0)
            assert s.recv(100) == b""  # evicted, or closed once idle for 0.5 s
            s.close()
        settled(name)


def test_another_uid_may_neither_join_nor_operate():
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    name = pool_name()
    nobody = 65534

    def refused_at_accept(w: int) -> None:
        """The owner refuses another uid before reading anything: the reply is there
        before the client says a word (a hello sent after it would race the close)."""
        os.setgid(nobody)
        os.setuid(nobody)
        out = [Raw(name).recv(), Raw(name).recv()]
        os.write(w, json.dumps(out).encode())

    def as_nobody(w: int) -> None:
        os.setgid(nobody)
        os.setuid(nobody)
        out = []
        c = Raw(name)
        out.append(c.hello("intruder"))
        c = Raw(name)
        c.send({"op": "hello", "role": "operator"})
        out.append(c.recv())
        os.write(w, json.dumps(out).encode())

    with owner_process(name, BUDGET, G):
        pid, r = in_child(refused_at_accept)
        assert reap(pid) == 0
        replies = json.loads(os.read(r, 65536))
        os.close(r)
        assert [m["op"] for m in replies] == ["refused", "refused"], replies
        assert "uid 65534 / gid 65534 may not connect" in replies[0]["error"]
        assert pool_state(name)["counters"]["connections.refused"] == 2
        settled(name)
    name = pool_name()
    with owner_process(name, BUDGET, G, args=("--allow-uid", str(nobody))):
        pid, r = in_child(as_nobody)
        assert reap(pid) == 0
        replies = json.loads(os.read(r, 65536))
        os.close(r)
        assert [m["op"] for m in replies] == ["welcome", "refused"], replies
        assert "uid 65534 may not operate" in replies[1]["error"]
        settled(name)


def test_long_names_are_refused_and_ls_lists_many_tenants_in_parts():
    name = pool_name()
    with owner_process(name, BUDGET, G, args=("--max-conns-per-uid", "1000")):
        c = Raw(name)
        reply = c.hello("n" * 100_000)
        assert reply["op"] == "refused" and "string of 100000 bytes" in reply["error"], reply
        c.close()
        clients = []
        for i in range(300):
            c = Raw(name)
            assert c.hello(f"{i:03d}" + "x" * 125)["op"] == "welcome"
            clients.append(c)
        run = [sys.executable, "-m", "vmm.shared.cli", "ls", name]
        out = subprocess.run([*run, "--json"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True)  # fmt: skip
        names = [t["name"] for t in json.loads(out.stdout)["tenants"]]
        assert names == [f"{i:03d}" + "x" * 125 for i in range(300)]
        text = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert text.returncode == 0 and text.stdout.count("x" * 125) == 300
        for c in clients:
            c.close()
        settled(name)


@pytest.mark.parametrize("value", ["nan", "-5", "0", "inf"])
def test_reclaim_timeout_must_be_finite_and_positive(value):
    cmd = [sys.executable, "-m", "vmm.shared.cli", "start", pool_name(), "--budget", "64K",
           "--chunk", "4K", "--reclaim-timeout", value]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"vmm-pool: --reclaim-timeout must be a finite number of seconds > 0, got {float(value)}"
    ]
    with pytest.raises(ValueError, match="reclaim_timeout must be a finite number"):
        PoolOwner(pool_name(), 16 * G, G, reclaim_timeout=float(value))


def test_a_tenant_sees_pool_refused_once_the_owner_is_gone():
    name = pool_name()
    cmd = [sys.executable, "-m", "vmm.shared.cli", "start", name, "--budget", "64K",
           "--chunk", "4K", "--check"]  # fmt: skip
    owner = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: pool_state(name), 20.0, "owner")
        backend = join_pool(name, "orphan", batch_chunks=1, keep_chunks=0)
        chunks = vmm.ChunkPool(backend, backend.tenant.max_bytes)
        rng = chunks.reserve(8 * G)
        rng.map([0])
    finally:
        owner.kill()
        owner.wait(5.0)
    with pytest.raises(PoolRefused, match=f"pool '{name}' is gone"):
        rng.map([1])
    rng.unmap([0])  # giving back to a gone owner only forgets the chunk here
    chunks.close()


def test_a_pool_named_by_a_path_is_a_socket_file_only_its_mode_lets_in(tmp_path):
    """A path pool: the socket file has the owner's mode bits (600 by default), tenants and
    `ls` reach it by the path, another uid cannot open it, and it goes with the owner."""
    os.chmod(tmp_path, 0o755)  # the directory is not what keeps others out
    name = str(tmp_path / "pool.sock")
    with owner_process(name, BUDGET, G):
        assert os.stat(name).st_mode & 0o777 == 0o600
        backend = join_pool(name, "t", max_bytes=8 * G)
        pool = vmm.ChunkPool(backend, 8 * G)
        rng = pool.reserve(4 * G)
        vmm.MappingPlan().map(rng, [0, 1]).apply()
        assert pool_state(name)["lent"] >= 2 * G
        rng.close()
        pool.close()
        if os.geteuid() == 0:

            def as_nobody(w: int) -> None:
                os.setgid(65534)
                os.setuid(65534)
                try:
                    connect(name)
                    os.write(w, b"connected")
                except PermissionError:
                    os.write(w, b"refused")

            pid, r = in_child(as_nobody)
            assert reap(pid) == 0
            assert os.read(r, 100) == b"refused"  # the file mode, before the owner's checks
            os.close(r)
        settled(name)
    wait_until(lambda: not os.path.exists(name), 10.0, "the socket file to go")


def test_a_path_pool_can_let_its_group_in():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        name = os.path.join(tmp, "pool.sock")
        with owner_process(name, BUDGET, G, args=("--socket-mode", "660")):
            assert os.stat(name).st_mode & 0o777 == 0o660
            settled(name)
