"""A shared pool with real processes: an owner (`vmm-pool start`) and tenant workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from vmm.shared.cli import pool_state, set_limits

import vmm
from tests.vmm.shared.pool_helpers import ROOT, Worker, owner_process, pool_name, wait_until
from vmm.shared import PoolRefused, Tenant, join_pool

G = 4096
BUDGET = 32 * G


@pytest.fixture
def pool():
    name = pool_name()
    with owner_process(name, BUDGET, G):
        yield name


def held(name: str) -> dict[str, int]:
    return {t["name"]: t["held"] for t in pool_state(name)["tenants"]}


def test_owner_refuses_a_tenant_over_the_budget_with_the_numbers(pool):
    a = Tenant(pool, "a", min_bytes=20 * G)
    numbers = (
        rf"min {16 * G} bytes does not fit: budget {BUDGET} bytes, {20 * G} bytes already "
        rf"guaranteed to other tenants, {12 * G} left"
    )
    with pytest.raises(PoolRefused, match=numbers):
        Tenant(pool, "b", min_bytes=16 * G)
    with pytest.raises(PoolRefused, match=rf"max {40 * G} bytes exceeds the pool budget"):
        Tenant(pool, "c", max_bytes=40 * G)
    with pytest.raises(PoolRefused, match="multiples of the 4096-byte chunk"):
        Tenant(pool, "d", min_bytes=100)
    assert [t["name"] for t in pool_state(pool)["tenants"]] == ["a"]
    a.close()


def test_limits_are_honoured_exactly_and_change_at_run_time(pool):
    backend = join_pool(pool, "a", max_bytes=5 * G, batch_chunks=4, keep_chunks=64)
    chunks = vmm.ChunkPool(backend, backend.tenant.max_bytes)
    rng = chunks.reserve(8 * G)
    rng.map([0, 1, 2, 3, 4])  # batch 4 then 1: never more than max
    assert held(pool) == {"a": 5 * G}
    with pytest.raises(vmm.OutOfMemory):
        rng.map([5])
    with pytest.raises(
        vmm.OutOfMemory, match="holds 5 chunks and needs 1 more: above its max of 5"
    ):
        backend.tenant.acquire(1)
    rng.unmap([3, 4])
    chunks.set_budget(3 * G)  # the free chunks go to the lease
    chunks.set_budget(5 * G)
    assert backend.tenant.lease_chunks == 2
    assert set_limits(pool, "a", None, 3 * G) == ""  # the owner reclaims the lease
    wait_until(lambda: held(pool) == {"a": 3 * G}, 5.0, "reclaim to the new max")
    assert "exceeds the pool budget" in set_limits(pool, "a", None, 64 * G)
    assert "no tenant 'zz'" in set_limits(pool, "zz", 0, G)
    chunks.check_invariants(expensive=True)
    chunks.close()
    wait_until(lambda: pool_state(pool)["tenants"] == [], 5.0, "tenant gone")
    assert pool_state(pool)["lent"] == 0


def test_reclaim_moves_idle_memory_and_every_byte_reads_back(pool):
    a = Worker(pool, "a", min_bytes=4 * G)
    b = Worker(pool, "b", min_bytes=4 * G)
    try:
        assert a(map=24)["held"] >= 24
        a(unmap=12)
        assert a(trim=True)["lease"] >= 12  # a idles: 12 chunks mapped, the rest in its lease
        got = b(map=16)  # the budget is lent out: the owner reclaims a's lease
        assert "error" not in got, got
        assert got["held"] >= 16
        state = held(pool)
        assert state["a"] + state["b"] <= BUDGET and state["a"] >= 12 * G
        assert a(check=True)["bad"] == [] and b(check=True)["bad"] == []
        got = b(map=12)  # a has 12 mapped, 4 of them above its min: still not enough
        assert "error" in got and "OutOfMemory" in got["error"], got
        assert "full" in got["error"] and "needs" in got["error"], got
        a(unmap=8)
        a(trim=True)
        assert "error" not in b(map=12)
        assert a(check=True)["bad"] == [] and b(check=True)["bad"] == []
    finally:
        a.close()
        b.close()


def test_kill_9_returns_a_tenants_chunks(pool):
    a = Worker(pool, "a")
    b = Worker(pool, "b")
    try:
        a(map=20)
        b(map=6)
        assert held(pool)["a"] >= 20 * G
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(5.0)
        wait_until(lambda: list(held(pool)) == ["b"], 5.0, "a's chunks back")
        state = pool_state(pool)
        assert state["lent"] == held(pool)["b"] and state["counters"]["tenants.died"] == 1
        assert "error" not in b(map=24)  # the memory a held is lendable again
        assert b(check=True)["bad"] == []
    finally:
        a.close()
        b.close()


def test_cli_lists_tenants_as_json_and_text(pool):
    t = Tenant(pool, "lister", min_bytes=2 * G, max_bytes=8 * G)
    t.acquire(3)
    t.report(cached=G, mapped=0)
    run = [sys.executable, "-m", "vmm.shared.cli"]
    out = subprocess.run([*run, "ls", pool, "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, check=True)  # fmt: skip
    state = json.loads(out.stdout)
    (row,) = state["tenants"]
    assert (row["name"], row["min"], row["max"], row["cached"]) == ("lister", 2 * G, 8 * G, G)
    assert row["held"] == 8 * G  # a batch of 8 (the default) asked for 3
    text = subprocess.run([*run, "ls", pool], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, check=True).stdout  # fmt: skip
    assert "lister" in text and "budget 128.0K" in text
    live = subprocess.run([*run, "ls", pool, "--watch", "0.05", "--count", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    assert "lister" in live.stdout  # the rich live table
    done = subprocess.run([*run, "limits", pool, "lister", "--max", "4K", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert json.loads(done.stdout)["ok"] is False  # min 8K > max 4K refused
    missing = subprocess.run([*run, "ls", "no-such-pool-xyz"], cwd=ROOT, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
    assert missing.returncode == 2 and "no owner" in missing.stderr
    t.close()


def test_pinned_lease_chunks_are_not_reclaimed(pool):
    t = Tenant(pool, "pinned", batch_chunks=8, keep_chunks=64)
    assert t.ensure_free(6)  # a batch of 8 arrives; 6 are pinned for an allocation
    assert t.lease_chunks == 8
    assert set_limits(pool, "pinned", None, 2 * G) == ""  # asks for 6 back: 2 are free
    wait_until(lambda: held(pool) == {"pinned": 6 * G}, 5.0, "the unpinned chunks back")
    assert t.lease_chunks == 6
    t.unpin()
    assert set_limits(pool, "pinned", None, 2 * G) == ""
    wait_until(lambda: held(pool) == {"pinned": 2 * G}, 5.0, "the rest back")
    t.close()
