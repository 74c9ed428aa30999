"""Two mini engines (different tiny models) in two processes share one pool: memory follows
the load, every output equals `generate` (so every KV byte written read back), a killed
engine's chunks return."""

from __future__ import annotations

import os
import signal
import sys

import pytest

pytest.importorskip("transformers")

from vmm.shared.cli import pool_state

from tests.vmm.shared.pool_helpers import (
    ROOT,
    JsonLineProcess,
    owner_process,
    pool_name,
    wait_until,
)

CHUNK = 4096
BUDGET = 64 * CHUNK
HALF = BUDGET // 2
WORKER = ROOT / "tests" / "integrations" / "engine" / "shared_engine_worker.py"


class Engine(JsonLineProcess):
    """A mini engine in its own process (shared_engine_worker.py), one JSON command a line."""

    close_timeout = 20.0

    def __init__(
        self, pool: str, name: str, layers: int, min_bytes: int, cache: bool = False
    ) -> None:
        args = [sys.executable, str(WORKER), pool, name, str(layers), str(min_bytes)]
        super().__init__(args + (["1"] if cache else []))
        self.ready = self._read()

    def burst(self, k: int, seed: int) -> dict:
        return self.send({"burst": k, "seed": seed})

    def stats(self) -> dict:
        return self.send({"stats": 1})


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
