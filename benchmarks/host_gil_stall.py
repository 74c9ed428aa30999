"""GIL stalls from host-backend queries while another thread maps (overlap worker pattern).

Rationale
    The overlap worker maps chunks with the GIL released while the scheduler thread keeps
    running Python. A binding that waits for the backend's mutex with the GIL held (as
    `slot_table`, `view_factory`, `physical_bytes` once did) freezes every Python thread
    until the mapping batch ends. This measures that freeze.

Approach
    A mapper thread maps and unmaps `--slots` non-mergeable slots in a loop (one backend
    call each, mutex held throughout). A ticker thread sleeps 0.5 ms per iteration and
    records the gap between wake-ups. Two phases of `--seconds` each, in the same run:
    baseline (the main thread only sleeps) and query (the main thread calls `slot_table`
    and the `syscalls`/`num_chunks`/`physical_bytes` getters in a loop). With the GIL
    released while waiting, the query phase's gaps match the baseline's. Reports
    avg/p50/p99/max gap in ms, a table and `--json`.

Limitations
    Host backend only; a shared machine adds scheduler noise to both phases alike.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from vmm.bench.stats import Summary
from vmm.host import HostBackend


def run_phase(backend: HostBackend, va: int, size: int, seconds: float, query: bool) -> dict:
    gran = backend.granularity
    num = size // gran
    vas = [va + i * gran for i in range(num)]
    handles = backend.create(num)
    order = handles[::2] + handles[1::2]  # neighbours never merge: one mmap per slot
    stop = threading.Event()
    gaps: list[float] = []

    def mapper() -> None:
        while not stop.is_set():
            backend.map(vas, order)
            backend.unmap(vas)

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append((now - last) * 1e3)
            last = now

    threads = [threading.Thread(target=mapper), threading.Thread(target=ticker)]
    for t in threads:
        t.start()
    calls, end = 0, time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            if query:
                backend.slot_table(va, size)
                _ = backend.syscalls, backend.num_chunks, backend.physical_bytes()
                calls += 1
            else:
                time.sleep(0.001)
    finally:
        stop.set()
        for t in threads:
            t.join()
    backend.release(handles)
    s = Summary.of(gaps)
    return {
        "phase": "query" if query else "baseline",
        "ticks": s.n,
        "queries": calls,
        "avg_ms": s.avg,
        "p50_ms": s.p50,
        "p99_ms": s.p99,
        "max_ms": s.max,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4096, help="slots mapped per batch")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each phase")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    gran = 4096
    backend = HostBackend(granularity=gran, capacity=2 * args.slots * gran, vma_budget=60000)
    size = args.slots * gran
    va = backend.reserve(size)
    rows = [run_phase(backend, va, size, args.seconds, query) for query in (False, True)]
    backend.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'phase':<9} {'ticks':>6} {'queries':>8} {'avg':>7} {'p50':>7} {'p99':>7} {'max':>7}")
    for r in rows:
        print(
            f"{r['phase']:<9} {r['ticks']:>6} {r['queries']:>8} {r['avg_ms']:>7.2f} "
            f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['max_ms']:>7.2f}  (ticker gap, ms)"
        )


if __name__ == "__main__":
    main()
