"""Scheduler-side cost of the jenga KV-cache manager vs vLLM's own, in one process.

Rationale
    An engine pays for the whole KV-cache manager on every scheduler step, not just for
    the allocator core. This benchmark replays one request trace through vLLM's full
    `KVCacheManager` and through `JengaKVCacheManager` (both built by vLLM's real
    `Scheduler` constructor on the same `KVCacheConfig`), alternating managers round by
    round in one process, so a shared, noisy machine slows both alike and only the
    ratios matter.

Approach
    Trace: ``running`` slots; each slot serves ``requests_per_slot`` requests one after
    another (prompt ``prompt`` tokens, the first ``shared`` of them common to every
    request when prefix sharing is on, else every prompt is unique; ``output`` tokens
    generated, the first request of slot s only ``1 + s * output // running`` so
    requests finish and arrive on every step). Each step makes the calls vLLM's
    `Scheduler` makes: ``new_step_starts``; ``allocate_slots`` for every running request
    (one token, or the next prefill chunk); for each admission ``get_computed_blocks`` +
    ``allocate_slots`` with the hit + ``get_blocks``; then (untimed, the "model") every
    scheduled request's ``num_computed_tokens`` advances and one whose prompt is done
    gets one sampled token; then ``free`` for the finished ones (timed). Prefills take
    one step, except on Mamba hybrids, where they end where vLLM's scheduler ends them
    (`Driver`). Only the manager calls are timed, with
    ``time.thread_time_ns`` (thread CPU: another process's load does not count).

    Per round and manager: CPU per step (total / steps) and per request (total /
    requests). Rounds alternate the manager order; the table reports the median and p90
    over rounds and the median over rounds of each round's ratio to vLLM.

    Memory (tracemalloc, outside the timed rounds): ``req B`` = Python bytes the manager
    holds with ``running`` requests live (admitted, half their output decoded) divided
    by ``running``; ``block B`` = Python bytes it still holds once every request is freed
    and gone, divided by the cached blocks (vLLM: blocks with a hash; jenga: the
    allocator's cached blocks). Allocations made by vLLM's `Request` itself (its token
    list, its block hashes) and by this driver are excluded, as are the objects created
    before the measurement (the `Request` s, the `KVCacheBlock` s both managers make up
    front: vLLM's `BlockPool` one per block, ours one per slot or per VMM block id).
    ``objects B``: the part of ``req B`` that is block objects ours makes on first use on
    VMM ranges (one per block id, kept for the pool's life; vLLM makes all of its objects
    up front, before the measurement). ``fixed MiB``: Python bytes held once the
    scheduler is built, before any request
    (those block objects, the configs, the `Request` s). ``core B``: ours, the C++ core's bytes
    (`JengaAllocator.core_memory_bytes`) per cached block at the same moment as
    ``block B``; a block costs ours ``block B + core B``.

    Block pool: per block allocate + free, ``n`` blocks per call, vs vLLM's `BlockPool`
    (``get_new_blocks`` + ``free_blocks``). "The public API" is `jenga._core.Core`'s block
    calls, one crossing each: ``allocate_blocks(group, n, owner, now)`` (a list of ids;
    ``core``) or with ``out=`` a caller-owned int32 block table (``core_out``), then
    ``release(group, ids, now)``; the core built with ``record_plan=False`` (vLLM owns
    its KV tensors: no page is mapped, so no plan is kept or drained). Beside them, the
    array API the allocator used before (``allocate_arrays`` + ``release`` +
    ``drain_plan``, plans recorded; ``arrays``) and `jenga.allocator.JengaAllocator`
    (``add_request`` + ``allocate`` + ``free``: a request per call). One full-attention
    group of 32-block pages, each pool kept half full, every call a new owner (a new
    page per call: the costliest case for a page-per-request allocator), interleaved
    rounds, thread CPU. Core memory: ``Core.memory_bytes()`` (container capacities,
    set nodes estimated) with the whole pool cached (committed, released), per cached
    block.

Limitations
    The "model" is a counter: no preemption (memory is sized so every request fits),
    synchronous scheduling, one prefill chunk per prompt. The scheduler's own Python
    (the same for both managers) is not timed here; `integrations.vllm.harness.
    side_by_side` measures ``schedule()`` + ``update_from_output()`` as a whole.

Usage::

    .venv-vllm-0.32.0/bin/python benchmarks/vllm_manager_cost.py --reps 3
    .venv-vllm-0.32.0/bin/python benchmarks/vllm_manager_cost.py --pool-only --reps 5
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from integrations.vllm.block_ids import RangeBlockIds
from integrations.vllm.harness import cases, replay
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.specs import Kind
from vllm.v1.core.block_pool import BlockPool
from vmm.bench.stats import percentile

from jenga import _core

MANAGERS = ("vllm", "jenga", "jenga-vmm")
"""vLLM's own; ours on vLLM's KV tensors (``pages="vllm"``); ours on VMM pages."""
BLOCK_TOKENS = 16
CASE_KINDS = {"llama": "full", "gemma2": "swa", "ministral": "swa", "jamba": "mamba"}


@dataclass(frozen=True)
class Trace:
    case: str
    running: int
    prompt: int = 256
    shared: int = 0  # tokens every prompt starts with (0: no prefix sharing)
    output: int = 64
    requests_per_slot: int = 2

    @property
    def num_requests(self) -> int:
        return self.running * self.requests_per_slot

    def prompts(self) -> list[list[int]]:
        """Request k's prompt: the shared part, then tokens unique to k."""
        out = []
        for k in range(self.num_requests):
            private = self.prompt - self.shared
            head = [1 + (j % 97) for j in range(self.shared)]
            out.append(
                head + [30000 - (k % 29000)] + [(k * 7 + j) % 29000 + 2 for j in range(private - 1)]
            )
        return out

    def outputs(self) -> list[int]:
        first = [1 + s * self.output // self.running for s in range(self.running)]
        return first + [self.output] * (self.num_requests - self.running)


@dataclass
class Totals:
    cpu_ns: int = 0
    steps: int = 0
    requests: int = 0
    hit_tokens: int = 0


# -- building -----------------------------------------------------------------------------
def _setup(trace: Trace, manager: str) -> replay.SchedulerSetup:
    options: dict[str, Any] = {}
    if manager != "vllm":
        options["pages"] = "vmm" if manager == "jenga-vmm" else "vllm"
    return replay.SchedulerSetup(
        max_model_len=2048,
        max_num_seqs=max(trace.running, 1),
        max_num_batched_tokens=max(2048, trace.prompt * 2),
        block_size=BLOCK_TOKENS,
        jenga_options=options,
    )


def memory_bytes(model_dir: Path, trace: Trace) -> int:
    """KV-cache bytes that hold every running request with room to spare (no preemption)."""
    config = replay.make_vllm_config(model_dir, _setup(trace, "vllm"))
    specs = cases.layer_specs(trace.case)
    probe = replay.kv_cache_config_for(config, specs, 1 << 30)
    length = trace.prompt + trace.output
    slots = 0
    for group in probe.kv_cache_groups:
        slots += -(-length // int(group.kv_cache_spec.block_size)) + 2
    need = 2 * trace.running * slots + 64
    return max(64 << 20, int(need * (1 << 30) / probe.num_blocks))


def build(model_dir: Path, trace: Trace, manager: str, memory: int) -> tuple[Any, list[Any]]:
    """(the manager vLLM's `Scheduler` constructor builds (ours installed for jenga), the
    trace's requests, fresh)."""
    setup = _setup(trace, manager)
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs(trace.case), memory)
    scheduler = replay.make_scheduler(config, kv_config, jenga=manager != "vllm")
    requests = replay.make_requests(
        trace.prompts(), trace.outputs(), BLOCK_TOKENS, prefix=f"{manager}-"
    )
    return scheduler.kv_cache_manager, requests


# -- the replay ---------------------------------------------------------------------------
class Driver:
    """Steps one manager through the trace the way vLLM's scheduler calls it.

    ``mamba``: prefills end where vLLM's scheduler ends them for Mamba models in "align"
    mode (`Scheduler._mamba_block_aligned_split`): at the shared-prefix junction the
    manager reports, then at the prompt's last block boundary (``(P - 1) // 16 * 16``),
    then the rest; other models prefill in one step.
    """

    def __init__(
        self, manager: Any, requests: Sequence[Any], running: int, mamba: bool = False
    ) -> None:
        self.manager = manager
        self.mamba = mamba
        self.queues: list[deque[Any]] = [deque() for _ in range(running)]
        for k, req in enumerate(requests):
            self.queues[k % running].append(req)
        self.running: dict[int, Any] = {}
        self.junction: dict[str, int] = {}
        self.totals = Totals()

    @property
    def done(self) -> bool:
        return not self.running and not any(self.queues)

    def chunk(self, req: Any, start: int) -> int:
        """Tokens the scheduler schedules for ``req`` from ``start`` computed tokens."""
        end = req.num_tokens
        if self.mamba and start < req.num_prompt_tokens:
            last = (req.num_prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
            junction = self.junction.get(req.request_id, 0)
            end = min((s for s in (junction, last) if start < s < end), default=end)
        return end - start

    def schedule(self, admit: bool = True) -> list[tuple[int, Any, int]]:
        """The timed scheduler half: grow the running, admit into free slots."""
        mgr = self.manager
        scheduled: list[tuple[int, Any, int]] = []
        start = time.thread_time_ns()
        mgr.new_step_starts()
        for slot, req in self.running.items():
            new = self.chunk(req, req.num_computed_tokens)
            if mgr.allocate_slots(req, new) is None:
                raise RuntimeError(f"{req.request_id}: no room to grow (size the memory up)")
            scheduled.append((slot, req, new))
        for slot, queue in enumerate(self.queues) if admit else ():
            if slot in self.running or not queue:
                continue
            req = queue.popleft()
            blocks, hit, junction, *_ = mgr.get_computed_blocks(req)
            self.junction[req.request_id] = junction
            new = self.chunk(req, hit)
            if mgr.allocate_slots(req, new, hit, blocks) is None:
                raise RuntimeError(f"{req.request_id}: no room to admit (size the memory up)")
            mgr.get_blocks(req.request_id)
            req.num_computed_tokens = hit
            self.totals.hit_tokens += hit
            scheduled.append((slot, req, new))
        self.totals.cpu_ns += time.thread_time_ns() - start
        return scheduled

    def model(self, scheduled: list[tuple[int, Any, int]]) -> list[int]:
        """Untimed: the scheduled tokens are computed; a request whose prompt is done
        samples one token per step."""
        finished = []
        for slot, req, n in scheduled:
            req.num_computed_tokens += n
            self.running[slot] = req
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk
            req.append_output_token_ids(1000 + (req.num_tokens * 131 + slot) % 20000)
            if req.num_output_tokens >= req.max_tokens:
                finished.append(slot)
        return finished

    def finish(self, slots: list[int]) -> None:
        start = time.thread_time_ns()
        for slot in slots:
            self.manager.free(self.running.pop(slot))
        self.totals.cpu_ns += time.thread_time_ns() - start
        self.totals.requests += len(slots)

    def step(self, admit: bool = True) -> None:
        self.finish(self.model(self.schedule(admit)))
        self.totals.steps += 1

    def run(self) -> Totals:
        while not self.done:
            self.step()
        return self.totals


def timed_run(model_dir: Path, trace: Trace, manager: str, memory: int) -> Totals:
    mgr, requests = build(model_dir, trace, manager, memory)
    gc.collect()
    totals = Driver(mgr, requests, trace.running, CASE_KINDS[trace.case] == "mamba").run()
    if totals.requests != trace.num_requests:
        raise RuntimeError(f"{manager}: {totals.requests} of {trace.num_requests} finished")
    return totals


# -- memory -------------------------------------------------------------------------------
_NOT_MANAGER = (
    tracemalloc.Filter(False, "*/vllm/v1/request.py", all_frames=True),  # the request's own
    tracemalloc.Filter(False, __file__),  # this driver's counters
    tracemalloc.Filter(False, tracemalloc.__file__),
)


def _traced_bytes(snapshot: tracemalloc.Snapshot) -> int:
    return sum(s.size for s in snapshot.filter_traces(_NOT_MANAGER).statistics("filename"))


def _first_use_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes of the block objects our manager made on first use (VMM ranges): per block,
    not per request, though the requests of the measurement are the first to use them
    (vLLM's `BlockPool` makes all of its objects before the measurement)."""
    code = RangeBlockIds._new_block_object.__code__
    lines = {line for _, _, line in code.co_lines() if line is not None}
    file = code.co_filename
    return sum(
        t.size
        for t in snapshot.traces
        if any(f.filename == file and f.lineno in lines for f in t.traceback)
    )


def cached_blocks(manager: Any) -> int:
    if hasattr(manager, "allocator"):
        return int(sum(manager.allocator.usage().cached_blocks))
    return sum(1 for b in manager.block_pool.blocks if b.block_hash is not None)


@dataclass(frozen=True)
class Memory:
    case: str
    shared: int
    running: int
    manager: str
    request_bytes: float  # Python bytes held per live request
    objects_bytes: float  # of which: block objects made on first use (ours on VMM ranges)
    cached_block_bytes: float  # Python bytes held per cached block, no request live
    core_block_bytes: float  # ours: the C++ core's bytes per cached block, same moment
    cached_blocks: int
    fixed_mib: float  # Python bytes the manager holds before any request (block objects)


def measure_memory(model_dir: Path, trace: Trace, manager: str, memory: int) -> Memory:
    """tracemalloc deltas: ``running`` live requests, then every request freed."""
    one = replace(trace, requests_per_slot=1)
    gc.collect()
    tracemalloc.start(1)  # one frame: building makes millions of objects at scale
    try:
        empty = tracemalloc.get_traced_memory()[0]
        mgr, requests = build(model_dir, one, manager, memory)
        gc.collect()
        fixed = tracemalloc.get_traced_memory()[0] - empty
    finally:
        tracemalloc.stop()
    drive = Driver(mgr, requests, one.running, CASE_KINDS[trace.case] == "mamba")
    gc.collect()
    tracemalloc.start(32)
    try:
        base = _traced_bytes(tracemalloc.take_snapshot())
        drive.step()  # admits every slot's request
        for _ in range(one.output // 2 + 2):  # prefills end, half the output is decoded
            drive.step(admit=False)
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
        live = _traced_bytes(snapshot) - base
        objects = _first_use_bytes(snapshot)
        drive.finish(list(drive.running))
        del drive
        gc.collect()
        kept = _traced_bytes(tracemalloc.take_snapshot()) - base
    finally:
        tracemalloc.stop()
    cached = cached_blocks(mgr)
    core = mgr.allocator.core_memory_bytes() if hasattr(mgr, "allocator") else 0
    return Memory(
        trace.case,
        trace.shared,
        trace.running,
        manager,
        round(live / one.running, 1),
        round(objects / one.running, 1),
        round(kept / max(cached, 1), 1),
        round(core / max(cached, 1), 1),
        cached,
        round(fixed / (1 << 20), 2),
    )


# -- block pool ---------------------------------------------------------------------------
def _jenga_alloc_free(pool: int, per_op: int) -> Callable[[int], None]:
    group = GroupConfig("full", Kind.FULL, BLOCK_TOKENS, 32, 1)
    alloc = JengaAllocator(AllocatorConfig((group,), pool // 32))
    tokens = per_op * BLOCK_TOKENS
    prompt = np.arange(tokens, dtype=np.int64)
    live: deque[int] = deque()
    for rid in range(max(1, pool // (2 * per_op))):
        alloc.add_request(rid, prompt, use_cache=False)
        assert alloc.allocate(rid, tokens) is not None
        live.append(rid)
    next_id = [len(live)]

    def op(count: int) -> None:
        for _ in range(count):
            rid = next_id[0]
            next_id[0] += 1
            alloc.add_request(rid, prompt, use_cache=False)
            if alloc.allocate(rid, tokens) is None:
                raise RuntimeError("jenga pool ran out")
            live.append(rid)
            alloc.free(live.popleft())

    return op


def _core_alloc_free(pool: int, per_op: int, out: bool) -> Callable[[int], None]:
    """The public block API: `Core.allocate_blocks` + `Core.release`, one call each.

    No plan is recorded (``record_plan=False``: vLLM owns its KV tensors, nothing maps
    pages). ``out``: the ids go to a caller-owned int32 block table (``out=``), else the
    call returns a list.
    """
    core = _core.Core([32], [1], pool // 32, record_plan=False)
    live = max(1, pool // (2 * per_op))
    tables = [np.empty(per_op, np.int32) for _ in range(live + 1)] if out else []
    held: deque[Any] = deque()
    for owner in range(live):
        got = core.allocate_blocks(0, per_op, owner, owner, tables[owner] if out else None)
        held.append(tables[owner] if out else got)
    state = [live]

    def op(count: int) -> None:
        for _ in range(count):
            owner = state[0]
            state[0] += 1
            table = tables[owner % (live + 1)] if out else None
            got = core.allocate_blocks(0, per_op, owner, owner, table)
            if got is None:
                raise RuntimeError("jenga core pool ran out")
            held.append(table if out else got)
            core.release(0, held.popleft(), owner)

    return op


def _core_arrays_alloc_free(pool: int, per_op: int) -> Callable[[int], None]:
    """The array API the allocator used before: allocate_arrays + release + drain_plan."""
    core = _core.Core([32], [1], pool // 32)
    live: deque[Any] = deque()
    for owner in range(max(1, pool // (2 * per_op))):
        live.append(core.allocate_arrays(owner, [per_op], owner)[0])
    next_id = [len(live)]

    def op(count: int) -> None:
        for _ in range(count):
            owner = next_id[0]
            next_id[0] += 1
            got = core.allocate_arrays(owner, [per_op], owner)
            if got is None:
                raise RuntimeError("jenga core pool ran out")
            live.append(got[0])
            core.release(0, live.popleft(), owner)
            core.drain_plan()

    return op


def _vllm_alloc_free(pool: int, per_op: int) -> Callable[[int], None]:
    bp = BlockPool(pool + 1, True, BLOCK_TOKENS)  # +1: vLLM's null block
    live = deque(bp.get_new_blocks(per_op) for _ in range(max(1, pool // (2 * per_op))))

    def op(count: int) -> None:
        for _ in range(count):
            live.append(bp.get_new_blocks(per_op))
            bp.free_blocks(reversed(live.popleft()))

    return op


@dataclass(frozen=True)
class PoolRow:
    blocks_per_call: int
    vllm_ns: float  # per block, median over rounds
    core_ns: float  # Core.allocate_blocks (a list) + release
    core_out_ns: float  # Core.allocate_blocks(out=int32 table) + release
    arrays_ns: float  # Core.allocate_arrays + release + drain_plan (the former API)
    allocator_ns: float  # JengaAllocator: add_request + allocate + free
    core_ratio: float  # core / vLLM, median of per-round ratios
    core_out_ratio: float
    arrays_ratio: float
    allocator_ratio: float


def pool_bench(per_op: int, reps: int, ops: int, pool: int = 1 << 16) -> PoolRow:
    impls = {
        "vllm": _vllm_alloc_free(pool, per_op),
        "core": _core_alloc_free(pool, per_op, out=False),
        "core_out": _core_alloc_free(pool, per_op, out=True),
        "arrays": _core_arrays_alloc_free(pool, per_op),
        "allocator": _jenga_alloc_free(pool, per_op),
    }
    for op in impls.values():
        op(max(1, ops // 10))  # warm up
    got: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    for r in range(reps):
        for name in (*names[r % len(names) :], *names[: r % len(names)]):
            gc.collect()
            start = time.thread_time_ns()
            impls[name](ops)
            got[name].append((time.thread_time_ns() - start) / (ops * per_op))

    def ratio(name: str) -> float:
        pairs = zip(got[name], got["vllm"], strict=True)
        return round(statistics.median(j / v for j, v in pairs), 3)

    def median(name: str) -> float:
        return round(statistics.median(got[name]), 1)

    return PoolRow(
        per_op,
        *(median(name) for name in names),
        *(ratio(name) for name in names[1:]),
    )


@dataclass(frozen=True)
class CoreMemory:
    cached_blocks: int
    core_bytes: int  # Core.memory_bytes() with every block cached, no request live
    bytes_per_cached_block: float


def core_memory(pool: int = 1 << 16, per_request: int = 32) -> CoreMemory:
    """The C++ core's bytes per cached block: the whole pool committed, then released."""
    core = _core.Core([32], [1], pool // 32, record_plan=False)
    rng = np.random.default_rng(0)
    for owner in range(pool // per_request):
        blocks = core.allocate_blocks(0, per_request, owner, owner)
        assert blocks is not None
        ids = rng.integers(0, 2**63, size=(per_request, 2), dtype=np.uint64)
        core.commit_run(0, np.asarray(blocks, np.int32), ids, per_request, BLOCK_TOKENS)
        core.release(0, blocks, owner)
    cached = int(core.group_counts(0)[1])
    total = int(core.memory_bytes())
    return CoreMemory(cached, total, round(total / max(cached, 1), 1))


# -- rounds and the table -----------------------------------------------------------------
def p90(values: Sequence[float]) -> float:
    """The 90th percentile (`vmm.bench.stats.percentile`: linear between order statistics)."""
    return percentile(sorted(values), 90.0)


@dataclass(frozen=True)
class Row:
    case: str
    shared: int
    running: int
    manager: str
    steps: int
    hit_tokens: int
    step_us: float  # CPU per step, median over rounds
    step_us_p90: float
    request_us: float  # CPU per request, median over rounds
    request_us_p90: float
    ratio: float  # median over rounds of (this manager / vLLM) per step


def compare(model_dir: Path, trace: Trace, managers: Sequence[str], reps: int) -> list[Row]:
    """Interleaved rounds: each round runs every manager once, the order rotating."""
    memory = memory_bytes(model_dir, trace)
    runs: dict[str, list[Totals]] = {m: [] for m in managers}
    for r in range(reps):
        k = r % len(managers)
        for manager in [*managers[k:], *managers[:k]]:
            runs[manager].append(timed_run(model_dir, trace, manager, memory))
    rows = []
    for manager, totals in runs.items():
        step = [t.cpu_ns / t.steps / 1e3 for t in totals]
        req = [t.cpu_ns / t.requests / 1e3 for t in totals]
        base = runs.get("vllm", totals)
        ratios = [t.cpu_ns / b.cpu_ns for t, b in zip(totals, base, strict=True)]
        rows.append(
            Row(
                trace.case,
                trace.shared,
                trace.running,
                manager,
                totals[0].steps,
                totals[0].hit_tokens,
                round(statistics.median(step), 1),
                round(p90(step), 1),
                round(statistics.median(req), 1),
                round(p90(req), 1),
                round(statistics.median(ratios), 3),
            )
        )
    return rows


def format_rows(rows: Sequence[Any]) -> str:
    if not rows:
        return ""
    names = list(asdict(rows[0]))
    cells = [[str(v) for v in asdict(r).values()] for r in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    lines = ["  ".join(n.rjust(w) for n, w in zip(names, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def report(
    args: argparse.Namespace,
    rows: list[Row],
    mems: list[Memory],
    pools: list[PoolRow],
    core_mem: CoreMemory | None = None,
) -> None:
    """The three tables on stdout; all of it as JSON with ``--json``."""
    print("\nscheduler-side CPU (thread time; ratio = median over rounds of manager / vllm)")
    print(format_rows(rows))
    if mems:
        print("\nPython memory (tracemalloc): per live request, per cached block")
        print(format_rows(mems))
    if pools:
        print("\nallocate + free, ns per block (public API vs vLLM BlockPool)")
        print(format_rows(pools))
    if core_mem is not None:
        print("\nC++ core bytes per cached block (Core.memory_bytes(), whole pool cached)")
        print(format_rows([core_mem]))
    if args.json is not None:
        payload = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": [asdict(r) for r in rows],
            "memory": [asdict(m) for m in mems],
            "pool": [asdict(p) for p in pools],
            "core_memory": asdict(core_mem) if core_mem is not None else None,
        }
        args.json.write_text(json.dumps(payload, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", nargs="+", default=["llama", "ministral", "jamba"], choices=cases.CASES
    )
    parser.add_argument("--running", nargs="+", type=int, default=[10, 100, 1000])
    parser.add_argument("--sharing", choices=("both", "on", "off"), default="both")
    parser.add_argument("--managers", nargs="+", default=list(MANAGERS), choices=MANAGERS)
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds per trace")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--shared", type=int, default=192, help="shared tokens when sharing")
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument(
        "--pool-ops",
        type=int,
        default=200000,
        help="blocks per pool round (0: skip the pool bench); 20,000 made a 128-block round "
        "156 calls, under a millisecond for the core, timing the pool's first touches",
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--pool-only", action="store_true", help="only the block-pool and core-memory tables"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if "vllm" not in args.managers:
        parser.error("--managers must include vllm (ratios are to it)")
    sharing = {"both": (True, False), "on": (True,), "off": (False,)}[args.sharing]
    traces = [
        Trace(case, n, args.prompt, args.shared if share else 0, args.output)
        for case in args.cases
        for share in sharing
        for n in args.running
        if not args.pool_only
    ]
    rows: list[Row] = []
    mems: list[Memory] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = replay.write_tiny_model(Path(tmp) / "model")
        for trace in traces:
            got = compare(model_dir, trace, args.managers, args.reps)
            print(format_rows(got), flush=True)
            rows += got
        if not args.no_memory:
            for trace in traces:
                if trace.running != max(args.running):
                    continue
                memory = memory_bytes(model_dir, trace)
                mems += [measure_memory(model_dir, trace, m, memory) for m in args.managers]
    pools = (
        [pool_bench(n, args.reps, max(1, args.pool_ops // n)) for n in (1, 128)]
        if args.pool_ops
        else []
    )
    report(args, rows, mems, pools, core_memory() if args.pool_ops else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
