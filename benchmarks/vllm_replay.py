"""Replay jenga_bench's traces through vLLM's own v1 `BlockPool` (run by jenga_bench).

Reads a JSON list of jobs ``{"trace", "pool", "per_op", "ops"}`` on stdin and prints a
JSON list with, per job, the nanoseconds of each op (jenga_bench summarizes them). Runs
in an interpreter that has vLLM (``--vllm-python``) and needs no jenga-vmm install: the
timing loop is `vmm/bench/stats.py`, loaded from its file (it imports only the standard
library). The ops mirror jenga_bench's:
``get_new_blocks`` / ``free_blocks`` (tail first, as vLLM's KV cache manager frees) /
``cache_full_blocks`` / ``get_cached_block`` with vLLM's default sha256 block hashes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

BLOCK_TOKENS = 16
HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)


def _load_stats() -> ModuleType:
    """`vmm.bench.stats` from its source file (this interpreter may lack jenga-vmm)."""
    path = Path(__file__).resolve().parents[1] / "vmm" / "bench" / "stats.py"
    spec = importlib.util.spec_from_file_location("jenga_vmm_bench_stats", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


timed = _load_stats().time_calls


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
    samples = [
        TRACES[job["trace"]](job["pool"], job["per_op"], job["ops"]) for job in json.load(sys.stdin)
    ]
    json.dump(samples, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
