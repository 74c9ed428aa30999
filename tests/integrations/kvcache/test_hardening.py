"""KV cache hardening: views never fault on what a request owns, checked writes
raise before touching memory, a closed cache refuses before the allocator commits, and
token counts / ids are integers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from integrations.kvcache.cache import UnmappedBlockError
from jenga.allocator import InvalidSize

import vmm
from integrations.kvcache import KVCache
from tests.integrations.kvcache.conftest import MakeCache, hybrid_model


def test_unmapped_slots_read_zeros_by_default(make_cache: MakeCache) -> None:
    """Zero-backed by default: reading a reserved, unmapped block gives zeros (it faulted)."""
    kv = make_cache(hybrid_model())
    kv.add_request("r", list(range(8)))
    kv.allocate("r", 8)
    view = kv.block_view(0)
    assert float(view[-1].abs().sum()) == 0.0  # the last block's page is not mapped
    assert float(view.sum()) == 0.0  # a whole-range read never faults


def test_checked_block_view_raises_on_an_unmapped_block(make_cache: MakeCache) -> None:
    kv = make_cache(hybrid_model())
    kv.add_request("r", list(range(8)))
    kv.allocate("r", 8)
    table = kv.block_table("r", 0)
    kv.block(0, table[0]).fill_(1.0)  # a block the request owns: writable
    assert float(kv.block_view(0)[table[0]].sum()) == kv.block(0, table[0]).numel()
    geo = kv.group_of(0)
    unmapped = geo.max_blocks - 1
    with pytest.raises(UnmappedBlockError, match=f"block {unmapped} is on page"):
        kv.block(0, unmapped).zero_()
    with pytest.raises(vmm.InputError, match=r"1\.5"):
        kv.block(0, 1.5)


def test_raw_whole_range_write_faults_as_documented(make_cache: MakeCache) -> None:
    """What README/docs/kvcache.md state: a stray write through a raw whole-range view
    faults (SIGSEGV), even zero-backed; `block` is the checked alternative."""
    code = textwrap.dedent(
        """
        import torch, vmm
        from integrations.kvcache import KVCache, KVCacheConfig
        from tests.integrations.kvcache.conftest import hybrid_model
        pool = vmm.ChunkPool(vmm.get_backend("host", granularity=4096, capacity=1 << 24),
                             64 * 4096)
        kv = KVCache(hybrid_model(), pool, KVCacheConfig(dtype=torch.float32))
        kv.add_request("r", list(range(8)))
        kv.allocate("r", 8)
        kv.block_view(0).zero_()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    # SIGSEGV; under `make test-asan` (LD_PRELOAD inherited) ASan reports the SEGV and exits 1
    segv = proc.returncode == -11 or b"AddressSanitizer: SEGV" in proc.stderr
    assert segv, (proc.returncode, proc.stderr.decode()[-2000:])


def test_allocate_after_close_raises_before_the_allocator_commits(make_cache: MakeCache) -> None:
    kv = make_cache(hybrid_model())
    kv.add_request("r", list(range(8)))
    kv.allocate("r", 8)
    tokens = kv.num_tokens("r")
    kv.close()
    with pytest.raises(vmm.ClosedError, match="after close"):
        kv.allocate("r", 4)
    assert kv.num_tokens("r") == tokens  # nothing committed in the allocator
    with pytest.raises(vmm.ClosedError):
        kv.add_request("s", [1, 2])


@pytest.mark.parametrize(
    ("call", "text"),
    [
        (lambda kv: kv.allocate("r", 1.5), "1.5"),
        (lambda kv: kv.allocate("r", "4"), "'4'"),
        (lambda kv: kv.allocate("r", -1), "-1"),
        (lambda kv: kv.allocate("r", 10**12), "1000000000008 tokens exceed max_model_len"),
        (lambda kv: kv.add_request("s", [1.0, 2.0]), "1.0"),
        (lambda kv: kv.add_request("s", "12"), "'12'"),
        (lambda kv: kv.add_request("s", [-3]), "-3"),
        (lambda kv: kv.append_tokens("r", [1.9]), "1.9"),
    ],
    ids=[
        "alloc-float",
        "alloc-str",
        "alloc-neg",
        "alloc-1e12",
        "prompt-float",
        "prompt-str",
        "prompt-neg",
        "append-float",
    ],
)
def test_bad_inputs_raise_input_error(make_cache: MakeCache, call, text: str) -> None:
    kv: KVCache = make_cache(hybrid_model())
    kv.add_request("r", list(range(8)))
    kv.allocate("r", 8)
    before = (kv.num_tokens("r"), kv.stats())
    with pytest.raises((vmm.InputError, InvalidSize)) as info:  # 10**12: jenga's own check
        call(kv)
    assert text in str(info.value)
    assert (kv.num_tokens("r"), kv.stats()) == before
    kv.check_invariants(expensive=True)


def test_overlap_worker_maps_while_the_scheduler_reads_stats(make_cache: MakeCache) -> None:
    """The overlap worker applies plans on its thread while the main thread calls the pool."""
    kv = make_cache(hybrid_model(), budget_chunks=256)
    for step in range(30):
        rid = f"r{step}"
        kv.add_request(rid, list(range(step, step + 40)))
        kv.allocate_ahead(rid, 40)
        kv.launch_ahead()
        for _ in range(20):
            kv.pool.stats()
            kv.pool.check_invariants()
        kv.sync()
        if step % 3 == 2:
            kv.free(f"r{step - 1}")
    kv.check_invariants(expensive=True)
    assert torch.is_tensor(kv.layer_view(0))


def test_a_second_thread_inside_a_call_raises_concurrent_use(make_cache: MakeCache) -> None:
    """Threads: two threads inside one KVCache would interleave its plans and leave it
    unusable. A thread is held inside `allocate` (blocked on the pool's lock, which the
    test holds); a call from another thread then raises ConcurrentUse and changes nothing,
    and once the first call finishes the cache is whole and usable."""
    kv = make_cache(hybrid_model())
    kv.add_request("a", list(range(8)))
    kv.add_request("b", list(range(100, 108)))
    assert kv.allocate("b", 8) is not None
    results: list[object] = []
    with kv.pool.ledger.lock:  # the allocate below blocks in its plan's apply
        worker = threading.Thread(target=lambda: results.append(kv.allocate("a", 8)))
        worker.start()
        deadline = time.monotonic() + 30.0
        while kv.num_tokens("a") < 8:  # the allocator has committed: it is inside _apply
            assert time.monotonic() < deadline, "the allocating thread never started"
            time.sleep(0.005)
        for call in (lambda: kv.free("b"), lambda: kv.allocate("b", 1), kv.sync):
            with pytest.raises(vmm.ConcurrentUse, match=r"KVCache\.\w+ called from thread"):
                call()
        assert kv.num_tokens("b") == 8
    worker.join(30.0)
    assert not worker.is_alive() and results and results[0] is not None
    kv.check_invariants(expensive=True)
    kv.free("b")  # from this thread again, now that no call is in progress
    kv.free("a")
    kv.check_invariants(expensive=True)
