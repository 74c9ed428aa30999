"""vmm-bench, host backend: each op through vmm and as a raw C loop of the same syscalls.

Rationale
---------
The host backend's worth is how little it adds to the syscalls it must make, so every
figure is paired with a floor measured in the same run, on the same sizes and the same
memfd offsets: `vmm._core.bench.raw_host_cycle` does the syscalls of the backend one by
one in C++, timing each call there (see csrc/bench/raw_host.hpp).

Approach
--------
One round of a case (chunk size G, N chunks, mode, layout) runs, on a fresh backend:

    create / release    N chunks: N calls of 1 (one_by_one) or one call of N (batched)
    reserve / free      one reservation of N*G bytes (one sample per round, per call),
                        freed after every slot was mapped and unmapped, as in the raw cycle
    map / unmap         N slots, slot i <- chunk order[i]: N calls or one batched call
    apply_plan          a MappingPlan of N map ops through ChunkPool.apply (batched only)

and one raw cycle over the same `order`. Layouts: `contiguous` maps chunk i at slot i
(neighbouring mappings can merge into one mmap / VMA); `scattered` maps chunk 2i at slot i,
so nothing merges and ours must make exactly the raw loop's N mmaps. Python timings use
`time.perf_counter_ns` around each call (its ~50 ns cost is counted against ours); the
garbage collector is off while timing and collected between cases.

Limitations
-----------
Linux only. Kernel work varies with what else runs (the figures are medians of a shared
machine); the JSON records the machine facts with the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vmm.bench.report import OpResult
from vmm.bench.stats import Summary, gc_paused, timed_calls, timed_once

Samples = dict[str, list[float]]
#: ops measured per case, in table order; tensor_view is per chunk size (see tensor_view_case)
HOST_OPS = ("create", "reserve", "map", "unmap", "release", "free_reservation", "apply_plan")


@dataclass(frozen=True)
class Case:
    """One configuration: `rounds` repetitions of N chunks of `chunk_size` bytes."""

    chunk_size: int
    num_chunks: int
    mode: str  # "one_by_one" | "batched"
    layout: str  # "contiguous" | "scattered" | "-" (lifecycle ops)
    rounds: int


def chunk_order(layout: str, num_chunks: int) -> list[int]:
    """Chunk index mapped at slot i: i (contiguous) or 2i (scattered: nothing merges)."""
    if layout == "contiguous":
        return list(range(num_chunks))
    if layout == "scattered":
        return [2 * i for i in range(num_chunks)]
    raise ValueError(f"unknown layout {layout!r} (contiguous or scattered)")


def add_per_chunk(samples: Samples, op: str, values: list[int], mode: str) -> None:
    """One_by_one keeps every call; batched keeps the round's mean per chunk."""
    if mode == "one_by_one":
        samples.setdefault(op, []).extend(float(v) for v in values)
    else:
        samples.setdefault(op, []).append(sum(values) / len(values))


# ---- raw -------------------------------------------------------------------------------
def raw_lifecycle_round(case: Case, samples: Samples) -> None:
    """create / reserve / release / free of one raw C cycle, added to `samples`."""
    from vmm._core import bench

    times: dict[str, list[int]] = bench.raw_host_cycle(
        case.chunk_size, chunk_order("contiguous", case.num_chunks)
    )
    for op in ("create", "release"):
        add_per_chunk(samples, op, times[op], case.mode)
    for op in ("reserve", "free_reservation"):
        samples.setdefault(op, []).extend(float(v) for v in times[op])


def raw_map_rounds(case: Case, samples: Samples) -> None:
    """`rounds` raw map + unmap passes over the case's order; apply_plan's floor too."""
    from vmm._core import bench

    n = case.num_chunks
    times = bench.raw_host_map_rounds(case.chunk_size, chunk_order(case.layout, n), case.rounds)
    for r in range(case.rounds):
        for op in ("map", "unmap"):
            add_per_chunk(samples, op, times[op][r * n : (r + 1) * n], case.mode)
        add_per_chunk(samples, "apply_plan", times["map"][r * n : (r + 1) * n], "batched")


# ---- ours ------------------------------------------------------------------------------
def ours_lifecycle(backend: Any, case: Case, samples: Samples) -> None:
    """The raw cycle's steps through `backend`: create and reserve (timed), map and unmap
    every slot (untimed: measured by the map rounds), release and free (timed), so each
    timed step does the same work as its raw counterpart."""
    n, g = case.num_chunks, case.chunk_size
    if case.mode == "one_by_one":
        t_create, outs = timed_calls(backend.create, [1] * n)
        handles = [out[0] for out in outs]
    else:
        t, handles = timed_once(lambda: backend.create(n))
        t_create = [t // n] * n
    t, va = timed_once(lambda: backend.reserve(n * g))
    samples.setdefault("reserve", []).append(float(t))
    vas = [va + i * g for i in range(n)]
    backend.map(vas, handles)
    backend.unmap(vas)
    if case.mode == "one_by_one":
        t_release, _ = timed_calls(lambda h: backend.release([h]), handles)
    else:
        t, _ = timed_once(lambda: backend.release(handles))
        t_release = [t // n] * n
    t, _ = timed_once(lambda: backend.free_reservation(va, n * g))
    samples.setdefault("free_reservation", []).append(float(t))
    add_per_chunk(samples, "create", t_create, case.mode)
    add_per_chunk(samples, "release", t_release, case.mode)


def ours_map_rounds(backend: Any, case: Case, samples: Samples) -> None:
    """`rounds` passes of map slot i <- chunk order[i], then unmap, through `backend`
    (chunks and reservation set up once, untimed)."""
    g, n = case.chunk_size, case.num_chunks
    order = chunk_order(case.layout, n)
    created = backend.create(max(order) + 1)
    handles = [created[i] for i in order]
    va = backend.reserve(g * n)
    vas = [va + i * g for i in range(n)]
    pairs = list(zip(vas, handles, strict=True))
    try:
        for _ in range(case.rounds):
            if case.mode == "one_by_one":
                t_map, _ = timed_calls(lambda p: backend.map([p[0]], [p[1]]), pairs)
                t_unmap, _ = timed_calls(lambda v: backend.unmap([v]), vas)
                add_per_chunk(samples, "map", t_map, "one_by_one")
                add_per_chunk(samples, "unmap", t_unmap, "one_by_one")
            else:
                t, _ = timed_once(lambda: backend.map(vas, handles))
                samples.setdefault("map", []).append(t / n)
                t, _ = timed_once(lambda: backend.unmap(vas))
                samples.setdefault("unmap", []).append(t / n)
    finally:
        backend.free_reservation(va, g * n)
        backend.release(created)


def run_case(
    case: Case,
    make_backend: Callable[[int], Any],
    apply_plan: Callable[[Case, Samples], None] | None,
    lifecycle: Case | None,
) -> list[OpResult]:
    """The host ops of one case. `lifecycle` (None: skip) is the case whose create,
    reserve, release and free are measured, one fresh backend per round; map, unmap and
    apply_plan run `rounds` passes over chunks created once."""
    ours: Samples = {}
    raw: Samples = {}
    with gc_paused():
        for _ in range(lifecycle.rounds if lifecycle else 0):
            assert lifecycle is not None
            raw_lifecycle_round(lifecycle, raw)
            backend = make_backend(case.chunk_size)
            try:
                ours_lifecycle(backend, lifecycle, ours)
            finally:
                backend.close()
        raw_map_rounds(case, raw)
        backend = make_backend(case.chunk_size)
        try:
            ours_map_rounds(backend, case, ours)
        finally:
            backend.close()
        if apply_plan is not None and case.mode == "batched":
            apply_plan(case, ours)
    return [_result(case, lifecycle, op, ours[op], raw[op]) for op in HOST_OPS if op in ours]


def _result(
    case: Case, lifecycle: Case | None, op: str, ours: list[float], raw: list[float]
) -> OpResult:
    per_call = op in ("reserve", "free_reservation")
    source = case if op in ("map", "unmap", "apply_plan") or lifecycle is None else lifecycle
    return OpResult(
        op=op,
        backend="host",
        chunk_size=source.chunk_size,
        num_chunks=source.num_chunks,
        mode=source.mode,
        layout=case.layout if op in ("map", "unmap", "apply_plan") else "-",
        ours=Summary.of(ours),
        raw=Summary.of(raw),
        unit="ns_per_call" if per_call else "ns_per_chunk",
    )


def tensor_view_case(
    make_pool: Callable[[int, int], Any], chunk_size: int, num_views: int, cuda_device: int = -1
) -> OpResult:
    """`VirtualRange.tensor` over one mapped chunk against `torch.from_dlpack` of a bare
    capsule over the same bytes (`cuda_device` -1: host memory, else that CUDA device)."""
    import torch

    from vmm._core import bench

    capsule = bench.raw_view_capsule
    with gc_paused():
        pool = make_pool(chunk_size, chunk_size)
        try:
            rng = pool.reserve(chunk_size)
            rng.map([0])
            shape = (chunk_size,)
            ours, _ = timed_calls(lambda _: rng.tensor(shape, torch.uint8), [0] * num_views)
            raw, _ = timed_calls(
                lambda _: torch.from_dlpack(capsule(rng.va, chunk_size, cuda_device)),
                [0] * num_views,
            )
            rng.unmap([0])
            rng.close()
        finally:
            pool.close()
    return OpResult(
        op="tensor_view",
        backend="host" if cuda_device < 0 else "cuda",
        chunk_size=chunk_size,
        num_chunks=1,
        mode="one_by_one",
        layout="-",
        ours=Summary.of(ours),
        raw=Summary.of(raw),
        unit="ns_per_call",
    )


def ours_apply_plan(make_pool: Callable[[int, int], Any], case: Case, samples: Samples) -> None:
    """`rounds` x ns per chunk of `pool.apply(MappingPlan().map(target, all N slots))` over
    ready chunks (the target is unmapped again between rounds, untimed).

    Contiguous: the pool's ready chunks are adjacent memfd offsets. Scattered: 2N chunks
    are mapped at a scratch range and every other one unmapped, so the pool hands out
    chunks 1, 3, 5, ... and no two neighbouring slots can share one mmap.
    """
    from vmm.plan import MappingPlan

    g, n = case.chunk_size, case.num_chunks
    scattered = case.layout == "scattered"
    pool = make_pool(g, (2 * n if scattered else n) * g)
    try:
        if scattered:
            scratch = pool.reserve(2 * n * g, name="scratch")
            scratch.map(list(range(2 * n)))
            scratch.unmap(list(range(1, 2 * n, 2)))
        else:
            pool.reserve_ahead = n
            pool.top_up()
        target = pool.reserve(n * g, name="target")
        slots = list(range(n))
        for _ in range(case.rounds):
            plan = MappingPlan().map(target, slots)
            t, _ = timed_once(lambda: pool.apply(plan))  # noqa: B023 - called at once
            samples.setdefault("apply_plan", []).append(t / n)
            target.unmap(slots)
    finally:
        pool.close()
