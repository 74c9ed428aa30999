"""Real processes for the shared-pool tests: an owner (`vmm-pool start`) and tenant workers.

A tenant worker (this file run as a script) joins a pool, then obeys one JSON command per
stdin line and answers one JSON line on stdout::

    {"map": n}        map n more slots of its range and fill each with its pattern
    {"unmap": n}      unmap its last n mapped slots (chunks go to the lease)
    {"trim": true}    move the pool's free chunks to the lease
    {"check": true}   every mapped slot still holds its pattern -> {"bad": [...]}
    {"state": true}   held / lease / mapped chunks
    {"acquire": n}    ask the owner for n chunks into the lease
    {"ids": true}     the owner's ids of every chunk this tenant holds -> {"ids": [...]}
    {"raw": msg}      send `msg` to the owner as it is (a broken tenant)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def pool_name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def wait_until(pred: Callable[[], object], timeout: float = 10.0, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
        except OSError:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or pred}")
        time.sleep(0.02)


@contextlib.contextmanager
def owner_process(
    name: str,
    budget: int,
    chunk: int,
    timeout: float = 1.0,
    args: tuple[str, ...] = (),
    max_fds: int | None = None,
) -> Iterator[subprocess.Popen]:
    """`vmm-pool start` in a child process (more `args`; `max_fds`: its RLIMIT_NOFILE),
    stopped (and reaped) on exit."""
    from vmm.shared.cli import pool_state

    cmd = [sys.executable, "-m", "vmm.shared.cli", "start", name, "--budget", str(budget),
           "--chunk", str(chunk), "--reclaim-timeout", str(timeout), "--check", *args]  # fmt: skip

    def limit_fds() -> None:
        if max_fds is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_fds, max_fds))

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=limit_fds)  # fmt: skip
    try:
        wait_until(lambda: pool_state(name), 20.0, f"owner of {name}")
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the owner; it must exit cleanly (its invariant checks raised nothing)."""
    proc.terminate()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5.0)
    output = proc.stdout.read().decode() if proc.stdout else ""
    if proc.stdout:
        proc.stdout.close()
    assert proc.returncode == 0, f"owner exited with {proc.returncode}:\n{output}"


class JsonLineProcess:
    """A child process (run from the repository root) spoken to in JSON lines: one command
    per stdin line, one answer per stdout line. The tenant workers here and the mini-engine
    workers of tests/integrations/engine/test_shared_pool.py."""

    close_timeout = 5.0  # seconds `close` waits for the child to exit before killing it

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip

    def _read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"{type(self).__name__} exited with {self.proc.wait(10.0)}")
        return json.loads(line)

    def send(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(self.close_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        self.proc.stdout.close()  # type: ignore[union-attr]


class Worker(JsonLineProcess):
    """A tenant worker process (see module note)."""

    def __init__(self, pool: str, name: str, min_bytes: int = 0, max_bytes: int | None = None):
        limits = [str(min_bytes), str(max_bytes or 0)]
        super().__init__([sys.executable, __file__, pool, name, *limits])
        self.hello = self._read()

    def __call__(self, **cmd: object) -> dict:
        return self.send(cmd)


def _pattern(slot: int, size: int) -> bytes:
    seed = (os.getpid() * 131 + slot * 7919) & 0xFFFFFFFF
    return seed.to_bytes(4, "little") * (size // 4)


def _worker_main(pool: str, name: str, lo: int, hi: int) -> None:
    import vmm
    from vmm.shared import PoolRefused, join_pool

    try:
        backend = join_pool(pool, name, min_bytes=lo, max_bytes=hi or None, keep_chunks=1 << 20)
    except PoolRefused as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        return
    tenant = backend.tenant
    chunks = vmm.ChunkPool(backend, tenant.max_bytes)
    gran = chunks.granularity
    rng = chunks.reserve(tenant.max_bytes)
    mapped: list[int] = []
    print(json.dumps({"granularity": gran, "max": tenant.max_bytes}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict = {}
        try:
            if "map" in cmd:
                slots = list(range(len(mapped), len(mapped) + cmd["map"]))
                rng.map(slots)
                for s in slots:
                    ctypes.memmove(rng.address(s), _pattern(s, gran), gran)
                mapped += slots
            elif "unmap" in cmd:
                gone = mapped[len(mapped) - cmd["unmap"] :]
                rng.unmap(gone)
                del mapped[len(mapped) - cmd["unmap"] :]
            elif "trim" in cmd:
                budget = chunks.budget_bytes
                chunks.set_budget(chunks.num_mapped * gran)
                chunks.set_budget(budget)
            elif "acquire" in cmd:
                tenant.acquire(cmd["acquire"])
            elif "ids" in cmd:
                out["ids"] = sorted(tenant._owner_id.values())
            elif "raw" in cmd:
                tenant._send(cmd["raw"])
            elif "check" in cmd:
                out["bad"] = [s for s in mapped if ctypes.string_at(rng.address(s), gran)
                              != _pattern(s, gran)]  # fmt: skip
        except vmm.VmmError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out.update(held=tenant.held_chunks, lease=tenant.lease_chunks, mapped=len(mapped))
        print(json.dumps(out), flush=True)
    chunks.close()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
