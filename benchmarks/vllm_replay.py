"""Replay jenga_bench's traces through vLLM's own v1 `BlockPool` (run by jenga_bench).

Reads a JSON list of jobs ``{"trace", "pool", "per_op", "ops"}`` on stdin and prints a
JSON list of rows in jenga_bench's `Row` schema. Runs in an interpreter that has vLLM
(``--vllm-python``) and needs nothing from jenga. The ops mirror jenga_bench's:
``get_new_blocks`` / ``free_blocks`` (tail first, as vLLM's KV cache manager frees) /
``cache_full_blocks`` / ``get_cached_block`` with vLLM's default sha256 block hashes.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from types import SimpleNamespace

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

BLOCK_TOKENS = 16
HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)


def timed(op, ops: int) -> list[int]:
    gc.collect()
    gc.disable()
    try:
        out = []
        for i in range(ops):
            t0 = time.perf_counter_ns()
            op(i)
            out.append(time.perf_counter_ns() - t0)
        return out
    finally:
        gc.enable()


def hashes_of(tokens: list[int], n: int, salt: int = 0) -> list:
    out, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(
            HASH, parent, tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS], (salt,)
        )
        out.append(parent)
    return out


def pool_of(blocks: int) -> BlockPool:
    return BlockPool(blocks + 1, True, BLOCK_TOKENS)  # +1: vLLM reserves a null block


def cache(pool: BlockPool, blocks: list, hashes: list) -> None:
    req = SimpleNamespace(block_hashes=hashes, request_id="r")
    pool.cache_full_blocks(req, blocks, 0, len(blocks), BLOCK_TOKENS, 0)


def alloc_free(pool_blocks: int, per_op: int, ops: int) -> list[int]:
    pool = pool_of(pool_blocks)
    live = [pool.get_new_blocks(per_op) for _ in range(max(1, pool_blocks // (2 * per_op)))]

    def op(i: int) -> None:
        live.append(pool.get_new_blocks(per_op))
        pool.free_blocks(reversed(live.pop(0)))

    return timed(op, ops)


def match(pool_blocks: int, per_op: int, ops: int) -> list[int]:
    pool = pool_of(pool_blocks)
    tokens = list(range(per_op * BLOCK_TOKENS))
    blocks = pool.get_new_blocks(per_op)
    cache(pool, blocks, hashes_of(tokens, per_op))
    pool.free_blocks(reversed(blocks))

    def op(i: int) -> None:
        found = [pool.get_cached_block(h, [0]) for h in hashes_of(tokens, per_op)]
        assert found[-1] is not None

    return timed(op, ops)


def evict(pool_blocks: int, per_op: int, ops: int) -> list[int]:
    pool = pool_of(pool_blocks)
    blocks = pool.get_new_blocks(pool_blocks)
    cache(pool, blocks, [HASH(("evict", i)) for i in range(pool_blocks)])
    pool.free_blocks(reversed(blocks))
    fresh = [[HASH(("new", i, j)) for j in range(per_op)] for i in range(ops)]

    def op(i: int) -> None:
        new = pool.get_new_blocks(per_op)
        cache(pool, new, fresh[i])
        pool.free_blocks(reversed(new))

    return timed(op, ops)


def prefill(pool_blocks: int, per_op: int, ops: int) -> list[int]:
    pool = pool_of(pool_blocks)
    tokens = list(range(per_op * BLOCK_TOKENS))

    def op(i: int) -> None:
        blocks = pool.get_new_blocks(per_op)
        cache(pool, blocks, hashes_of(tokens, per_op, salt=i))
        pool.free_blocks(reversed(blocks))

    return timed(op, ops)


TRACES = {"alloc_free": alloc_free, "match": match, "evict": evict, "prefill": prefill}


def main() -> int:
    rows = []
    for job in json.load(sys.stdin):
        samples = TRACES[job["trace"]](job["pool"], job["per_op"], job["ops"])
        per_block = sorted(s / job["per_op"] for s in samples)
        rows.append(
            {
                "trace": job["trace"],
                "impl": "vllm",
                "pool_blocks": job["pool"],
                "blocks_per_op": job["per_op"],
                "ops": len(samples),
                "avg_ns": statistics.fmean(per_block),
                "p50_ns": statistics.median(per_block),
                "p99_ns": per_block[min(len(per_block) - 1, int(0.99 * len(per_block)))],
                "max_ns": per_block[-1],
            }
        )
    json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
