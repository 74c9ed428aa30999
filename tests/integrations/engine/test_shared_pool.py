"""Two mini engines (different tiny models) in two processes share one pool: memory follows
the load, every output equals `generate` (so every KV byte written read back), a killed
engine's chunks return."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from vmm.shared.cli import pool_state

from tests.vmm.shared.pool_helpers import ROOT, owner_process, pool_name, wait_until

CHUNK = 4096
BUDGET = 64 * CHUNK
HALF = BUDGET // 2
WORKER = ROOT / "tests" / "integrations" / "engine" / "shared_engine_worker.py"


class Engine:
    def __init__(
        self, pool: str, name: str, layers: int, min_bytes: int, cache: bool = False
    ) -> None:
        args = [sys.executable, str(WORKER), pool, name, str(layers), str(min_bytes)]
        args += ["1"] if cache else []
        self.proc = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"engine exited with {self.proc.wait(10.0)}"
        return json.loads(line)

    def burst(self, k: int, seed: int) -> dict:
        self.proc.stdin.write(json.dumps({"burst": k, "seed": seed}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def stats(self) -> dict:
        self.proc.stdin.write(json.dumps({"stats": 1}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(20.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        self.proc.stdout.close()  # type: ignore[union-attr]


def held() -> dict[str, int]:
    return {t["name"]: t["held"] for t in pool_state(NAME)["tenants"]}


def cached() -> dict[str, int]:
    return {t["name"]: t["cached"] for t in pool_state(NAME)["tenants"]}


NAME = pool_name()


def test_two_engines_memory_follows_the_load_and_a_killed_one_returns_its_chunks():
    with owner_process(NAME, BUDGET, CHUNK):
        a = Engine(NAME, "two", 2, 8 * CHUNK)  # a 2-layer and a 3-layer tiny Llama
        b = Engine(NAME, "three", 3, 12 * CHUNK)
        try:
            first = a.burst(6, seed=1)  # a busy, b idle
            assert first["match"], first
            assert first["peak"] * CHUNK > HALF, first  # more than a static half
            second = b.burst(6, seed=2)  # b busy, a idle: a's memory moves to b
            assert second["match"], second
            assert second["peak"] * CHUNK > HALF, second
            assert held()["two"] < first["peak"] * CHUNK
            state = pool_state(NAME)
            assert state["lent"] <= BUDGET
            assert all(t["held"] <= t["max"] for t in state["tenants"])
            os.kill(a.proc.pid, signal.SIGKILL)
            a.proc.wait(10.0)
            wait_until(lambda: list(held()) == ["three"], 10.0, "the killed engine's chunks")
            assert pool_state(NAME)["lent"] == held()["three"]
        finally:
            a.close()
            b.close()


def test_an_idle_engine_gives_back_its_prefix_cache_pages_when_the_other_needs_them():
    """Prefix cache on: after its burst the first engine's memory is cached pages (and its
    lease); the owner's reclaim for the second engine makes it evict them (jenga first)."""
    with owner_process(NAME, BUDGET, CHUNK):
        a = Engine(NAME, "two", 2, 0, cache=True)
        b = Engine(NAME, "three", 3, 0, cache=True)
        try:
            first = a.burst(6, seed=1)
            assert first["match"], first
            wait_until(lambda: cached().get("two", 0) > HALF // 2, 10.0, "a's cached report")
            cached_before, held_before = cached()["two"], held()["two"]
            assert held_before > HALF, held_before  # cached pages + lease
            second = b.burst(6, seed=2)  # a idle: its cached pages move to b
            assert second["match"], second
            assert second["peak"] * CHUNK > BUDGET - HALF // 2, second
            stats = a.stats()
            assert stats["evicted"] > 0, stats
            assert stats["held"] * CHUNK < held_before
            assert held()["two"] == stats["held"] * CHUNK
            assert cached()["two"] < cached_before
            state = pool_state(NAME)
            assert state["lent"] <= BUDGET
        finally:
            a.close()
            b.close()
