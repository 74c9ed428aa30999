"""jenga allocator benchmark: per-block cost of allocate+free, prefix match, eviction, prefill.

Rationale
    The allocator runs once per block per scheduler step; its cost must stay far below a
    model step (goal: <= 100 ns per block amortized). Every figure is measured against a
    baseline in the same run on the same op trace: a pure-Python free-list pool (always)
    and vLLM's own `BlockPool` (when an interpreter with vLLM is given or importable).

Approach
    Traces (one block = 16 tokens, one full-attention group, 32 blocks per 2 MiB page):
      alloc_free  a pool of N blocks kept half full by live requests of R blocks; each op
                  allocates R blocks for a new request and frees the oldest request.
      match       a cached prompt of P blocks; each op hashes the prompt and looks it up.
      evict       a pool full of cached (evictable) blocks; each op allocates R blocks,
                  all by eviction, caches them under new hashes and frees them, so the
                  pool stays full and every op evicts.
      prefill     one 1M-token request: allocate, hash+cache, free (62,500 blocks).
    Block identities are jenga's (`jenga.prefix.BlockIdentity`: keyed BLAKE2b-128 by
    default, ``--identity sha256`` for SHA-256); the Python baselines hash with Python's
    built-in 64-bit ``hash``.
    Per op, the time divided by its block count gives ns/block; the table reports avg,
    p50, p99 and max over ops (`vmm.bench.stats`: interpolated percentiles), and each
    row's p50 over the best jenga p50 (the median resists the scheduler stalls of a
    shared machine; the averages are printed too).

Limitations
    Single-threaded, CPU only; wall-clock timings on a shared machine are noisy (run it
    twice to see the spread). vLLM's replay runs in its own interpreter
    (``--vllm-python``), so it needs no jenga install.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.prefix import HASH_ALGORITHMS, BlockIdentity
from jenga.specs import Kind
from vmm.bench.stats import Summary, time_calls

from jenga import _core as J

BLOCK_TOKENS = 16
BLOCKS_PER_PAGE = 32
HERE = Path(__file__).resolve().parent
# the block identity jenga's rows use (set by --identity)
IDENTITY = BlockIdentity()


@dataclass(frozen=True)
class Row:
    trace: str
    impl: str
    pool_blocks: int
    blocks_per_op: int
    ops: int
    avg_ns: float
    p50_ns: float
    p99_ns: float
    max_ns: float


def summarize(trace: str, impl: str, pool: int, per_op: int, samples: list[int]) -> Row:
    """One table row from the ns of each op (`samples`), per block."""
    s = Summary.of([t / per_op for t in samples])
    return Row(trace, impl, pool, per_op, s.n, s.avg, s.p50, s.p99, s.max)


# -- jenga ---------------------------------------------------------------------------------
def core_alloc_free(pool: int, per_op: int, ops: int) -> list[int]:
    core = J.Core([BLOCKS_PER_PAGE], [1], pool // BLOCKS_PER_PAGE)
    live: list[list[int]] = []
    for owner in range(max(1, pool // (2 * per_op))):
        got = core.allocate(owner, [per_op], owner)
        assert got is not None
        live.append(got[0])
    base = len(live)

    def op(i: int) -> None:
        got = core.allocate_arrays(base + i, [per_op], base + i)
        assert got is not None
        live.append(got[0])
        core.release(0, live.pop(0), base + i)
        core.drain_plan()

    return time_calls(op, ops)


def api_config(pool: int) -> AllocatorConfig:
    group = GroupConfig("full", Kind.FULL, BLOCK_TOKENS, BLOCKS_PER_PAGE, 1)
    return AllocatorConfig((group,), pool // BLOCKS_PER_PAGE, identity=IDENTITY)


def serial_ids(first: int, n: int) -> np.ndarray:
    """n distinct identities (first.., 0): for traces that need keys, not hashing."""
    ids = np.zeros((n, 2), dtype=np.uint64)
    ids[:, 0] = np.arange(first, first + n, dtype=np.uint64)
    return ids


def api_alloc_free(pool: int, per_op: int, ops: int) -> list[int]:
    alloc = JengaAllocator(api_config(pool))
    tokens = per_op * BLOCK_TOKENS
    prompt = np.arange(tokens, dtype=np.int64)
    live: list[int] = []
    for rid in range(max(1, pool // (2 * per_op))):
        alloc.add_request(rid, prompt, use_cache=False)
        assert alloc.allocate(rid, tokens) is not None
        live.append(rid)
    base = len(live)

    def op(i: int) -> None:
        rid = base + i
        alloc.add_request(rid, prompt, use_cache=False)
        assert alloc.allocate(rid, tokens) is not None
        live.append(rid)
        alloc.free(live.pop(0))

    return time_calls(op, ops)


def core_match(pool: int, per_op: int, ops: int) -> list[int]:
    core = J.Core([BLOCKS_PER_PAGE], [1], pool // BLOCKS_PER_PAGE)
    tokens = np.arange(per_op * BLOCK_TOKENS, dtype=np.int64)
    hasher = IDENTITY.hasher()
    root = np.zeros(2, dtype=np.uint64)
    hashes = hasher.chain(tokens, BLOCK_TOKENS, root)
    got = core.allocate(0, [per_op], 0)
    assert got is not None
    core.commit(0, got[0], hashes, list(range(per_op)))
    core.release(0, got[0], 1)

    def op(i: int) -> None:
        found = core.lookup(0, hasher.chain(tokens, BLOCK_TOKENS, root))
        assert found[-1] >= 0

    return time_calls(op, ops)


def api_match(pool: int, per_op: int, ops: int) -> list[int]:
    alloc = JengaAllocator(api_config(pool))
    prompt = np.arange(per_op * BLOCK_TOKENS + 1, dtype=np.int64)
    alloc.add_request("warm", prompt)
    assert alloc.allocate("warm", len(prompt)) is not None
    alloc.cache("warm", len(prompt))
    alloc.free("warm")

    def op(i: int) -> None:
        assert alloc.prefix_match(prompt).hit == per_op * BLOCK_TOKENS

    return time_calls(op, ops)


def core_evict(pool: int, per_op: int, ops: int) -> list[int]:
    core = J.Core([BLOCKS_PER_PAGE], [1], pool // BLOCKS_PER_PAGE)
    got = core.allocate(0, [pool], 0)
    assert got is not None
    core.commit(0, got[0], serial_ids(0, pool), list(range(pool)))
    core.release(0, got[0], 1)
    core.drain_plan()

    def op(i: int) -> None:
        # every op evicts: the pool stays full of cached blocks (the new ones get cached)
        new = core.allocate_arrays(i + 1, [per_op], i + 2)
        assert new is not None
        core.commit_run(0, new[0], serial_ids(pool + i * per_op, per_op), 1, 1)
        core.release(0, new[0], i + 2)
        core.drain_plan()

    return time_calls(op, ops)


def api_prefill(pool: int, per_op: int, ops: int) -> list[int]:
    alloc = JengaAllocator(api_config(pool))
    tokens = per_op * BLOCK_TOKENS
    prompt = np.arange(tokens, dtype=np.int64)

    def op(i: int) -> None:
        rid = f"r{i}"
        alloc.add_request(rid, prompt, use_cache=False, salt=i)
        assert alloc.allocate(rid, tokens) is not None
        alloc.cache(rid, tokens)
        alloc.free(rid)

    return time_calls(op, ops)


# -- baseline: a pure-Python free-list pool (vLLM-like, no C++) ----------------------------
class PyPool:
    """Free list + hash dict + LRU OrderedDict of cached blocks; the simplest fair design."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, int] = {}
        self.index: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.index[self.hash_of.pop(b)]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.lru[b] = None
                else:
                    self.free.append(b)

    def commit(self, blocks: list[int], hashes: list[int]) -> None:
        for b, h in zip(blocks, hashes, strict=True):
            if h not in self.index:
                self.index[h] = b
                self.hash_of[b] = h


def py_alloc_free(pool: int, per_op: int, ops: int) -> list[int]:
    p = PyPool(pool)
    live = [p.allocate(per_op) for _ in range(max(1, pool // (2 * per_op)))]

    def op(i: int) -> None:
        live.append(p.allocate(per_op))
        p.release(live.pop(0))

    return time_calls(op, ops)


def py_match(pool: int, per_op: int, ops: int) -> list[int]:
    p = PyPool(pool)
    tokens = list(range(per_op * BLOCK_TOKENS))

    def hashes() -> list[int]:
        out, parent = [], 0
        for i in range(per_op):
            parent = hash((parent, *tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]))
            out.append(parent)
        return out

    blocks = p.allocate(per_op)
    p.commit(blocks, hashes())
    p.release(blocks)

    def op(i: int) -> None:
        assert all(h in p.index for h in hashes())

    return time_calls(op, ops)


def py_evict(pool: int, per_op: int, ops: int) -> list[int]:
    p = PyPool(pool)
    blocks = p.allocate(pool)
    p.commit(blocks, list(range(pool)))
    p.release(blocks)

    def op(i: int) -> None:
        new = p.allocate(per_op)
        p.commit(new, range(pool + i * per_op, pool + (i + 1) * per_op))  # type: ignore[arg-type]
        p.release(new)

    return time_calls(op, ops)


def py_prefill(pool: int, per_op: int, ops: int) -> list[int]:
    p = PyPool(pool)

    def op(i: int) -> None:
        blocks = p.allocate(per_op)
        p.commit(blocks, [hash((i, b)) for b in range(per_op)])
        p.release(blocks)
        for b in blocks:  # drop the cached copies so the next op starts empty
            p.lru.pop(b, None)
            p.index.pop(p.hash_of.pop(b), None)
            p.free.append(b)

    return time_calls(op, ops)


TRACES: dict[str, dict[str, Callable[[int, int, int], list[int]]]] = {
    "alloc_free": {
        "jenga.core": core_alloc_free, "jenga.api": api_alloc_free, "python": py_alloc_free,
    },
    "match": {"jenga.core": core_match, "jenga.api": api_match, "python": py_match},
    "evict": {"jenga.core": core_evict, "python": py_evict},
    "prefill": {"jenga.api": api_prefill, "python": py_prefill},
}  # fmt: skip


def run_vllm(python: str, jobs: list[dict[str, int | str]]) -> list[Row]:
    """Replay the traces through vLLM's BlockPool in ``python`` (see vllm_replay.py); its
    per-op samples are summarized here, like every other row."""
    script = HERE / "vllm_replay.py"
    out = subprocess.run(
        [python, str(script)], input=json.dumps(jobs), capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        print(f"vLLM replay failed ({python}):\n{out.stderr[-2000:]}", file=sys.stderr)
        return []
    return [
        summarize(job["trace"], "vllm", job["pool"], job["per_op"], samples)
        for job, samples in zip(jobs, json.loads(out.stdout), strict=True)
    ]


def find_vllm_python(explicit: str | None) -> str | None:
    candidates = [explicit] if explicit else [sys.executable, "/work/vllm-venv/bin/python"]
    for py in candidates:
        if py and os.path.exists(py):
            probe = subprocess.run(
                [py, "-c", "import vllm.v1.core.block_pool"], capture_output=True, check=False
            )
            if probe.returncode == 0:
                return py
    return None


def print_table(rows: list[Row]) -> None:
    head = f"{'trace':<11}{'impl':<12}{'pool':>9}{'blk/op':>8}{'ops':>6}"
    head += f"{'avg ns/blk':>12}{'p50':>9}{'p99':>9}{'max':>10}{'p50/jenga':>11}"
    print(head)
    print("-" * len(head))
    best: dict[tuple[str, int, int], float] = {}
    for r in rows:
        if r.impl.startswith("jenga"):
            key = (r.trace, r.pool_blocks, r.blocks_per_op)
            best[key] = min(best.get(key, float("inf")), r.p50_ns)
    for r in rows:
        ref = best.get((r.trace, r.pool_blocks, r.blocks_per_op))
        ratio = f"{r.p50_ns / ref:10.1f}x" if ref else ""
        print(
            f"{r.trace:<11}{r.impl:<12}{r.pool_blocks:>9}{r.blocks_per_op:>8}{r.ops:>6}"
            f"{r.avg_ns:>12.1f}{r.p50_ns:>9.1f}{r.p99_ns:>9.1f}{r.max_ns:>10.1f}{ratio:>11}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pools", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--blocks-per-op", type=int, default=128, help="R: blocks per request")
    ap.add_argument("--ops", type=int, default=200, help="timed ops per configuration")
    ap.add_argument("--prefill-tokens", type=int, default=1_000_000)
    ap.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    ap.add_argument("--impls", nargs="+", default=None, help="subset of implementations")
    ap.add_argument("--vllm-python", default=None, help="interpreter with vLLM installed")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="small pools and few ops (smoke run)")
    ap.add_argument("--from-json", type=Path, default=None, help="print a saved run's table")
    ap.add_argument(
        "--identity", choices=HASH_ALGORITHMS, default="blake2b", help="jenga's block identity"
    )
    args = ap.parse_args(argv)
    global IDENTITY
    IDENTITY = BlockIdentity(algorithm=args.identity)
    if args.from_json:
        print_table([Row(**r) for r in json.loads(args.from_json.read_text())])
        return 0
    if args.quick:
        args.pools, args.ops, args.prefill_tokens = [10_000], 20, 65_536
    rows: list[Row] = []
    jobs: list[dict[str, int | str]] = []
    for trace in args.traces:
        for pool, per_op, ops in _configs(trace, args):
            jobs.append({"trace": trace, "pool": pool, "per_op": per_op, "ops": ops})
            for impl, fn in TRACES[trace].items():
                if args.impls and impl not in args.impls:
                    continue
                rows.append(summarize(trace, impl, pool, per_op, fn(pool, per_op, ops)))
    vllm_py = None if args.no_vllm else find_vllm_python(args.vllm_python)
    if vllm_py:
        rows.extend(run_vllm(vllm_py, jobs))
    else:
        print("vLLM not found: baseline is the pure-Python pool only", file=sys.stderr)
    rows.sort(key=lambda r: (list(TRACES).index(r.trace), r.pool_blocks, r.impl))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


def _configs(trace: str, args: argparse.Namespace) -> list[tuple[int, int, int]]:
    if trace == "prefill":
        blocks = args.prefill_tokens // BLOCK_TOKENS
        pool = -(-blocks // BLOCKS_PER_PAGE) * BLOCKS_PER_PAGE
        return [(pool, blocks, max(3, args.ops // 40))]
    pools = [pool // BLOCKS_PER_PAGE * BLOCKS_PER_PAGE for pool in args.pools]
    if trace == "match":
        return [(pool, min(args.blocks_per_op * 8, pool // 2), args.ops) for pool in pools]
    return [(pool, args.blocks_per_op, args.ops) for pool in pools]


if __name__ == "__main__":
    raise SystemExit(main())
