"""Mamba hybrids under speculative decoding: vLLM's ``MambaSpec.num_speculative_blocks``.

vLLM's manager and ours are driven with the same calls (chunked prefill, decode steps
with draft tokens verified and rejected, lookahead slots) and compared on what the
worker sees: each step's Mamba table (which entries are NULL, which block moved from
where) and the rows ``allocate_slots`` returns, which vLLM's worker appends to its block
table. Then a prefix hit on what the first request cached. Last, vLLM's real
`EngineCore` (executor replaced) serves a Jamba-style hybrid with n-gram and EAGLE
drafts, beside vLLM's own manager in the same engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.drop_in import jenga_kv_cache_manager
from integrations.vllm.harness import engine, replay
from jenga.specs import Kind
from vllm.v1.core.kv_cache_manager import KVCacheManager

from integrations.vllm import compat
from tests.integrations.vllm.mamba_hybrid import mamba_hybrid_config

ATTN_BLOCK = 32
MAMBA = 1  # the Mamba group's index


def _config(mamba_block: int, num_speculative_blocks: int, mode: str = "align") -> Any:
    return mamba_hybrid_config(
        ATTN_BLOCK, mamba_block, 400, mode, num_speculative_blocks=num_speculative_blocks
    )


def _managers(config: Any, enable_caching: bool = True) -> tuple[Any, Any]:
    """(vLLM's manager, ours) on the same config; a hash block of the Mamba block size
    (whole-block hits only)."""
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    kw: dict[str, Any] = {
        "enable_caching": enable_caching,
        "hash_block_size": max(sizes),
        "max_model_len": 4096,
    }
    ours = jenga_kv_cache_manager(config, **kw)
    theirs = KVCacheManager(config, scheduler_block_size=math.lcm(*sizes), **kw)
    return theirs, ours


def _request(rid: str, prompt: Sequence[int], block: int) -> Any:
    return compat.Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=compat.sampling_params(max_tokens=200),
        pooling_params=None,
        block_hasher=compat.request_block_hasher(block, "sha256"),
    )


def _moves(before: list[int], after: list[int], null: int) -> list[object]:
    """The Mamba table after a step, by entry: None (null), the index the block held
    before the step, or "new"; comparable across managers whose block ids differ."""
    where = {b: i for i, b in enumerate(before) if b != null}
    return [None if b == null else where.get(b, "new") for b in after]


def _shape(rows: list[int], table: list[int], null: int) -> list[object]:
    """A returned row in table terms: None (null) or the table index of the block."""
    where = {b: i for i, b in enumerate(table) if b != null}
    return [None if b == null else where.get(b, "gone") for b in rows]


def _step(manager: Any, request: Any, num_new: int, lookahead: int) -> list[object]:
    """One scheduled step; returns (table moves, returned row shape) of the Mamba group."""
    before = list(manager.get_block_ids(request.request_id)[MAMBA])
    blocks = manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
    assert blocks is not None
    after = manager.get_blocks(request.request_id).blocks[MAMBA]
    ids = [b.block_id for b in after]
    null = next((b.block_id for b in after if b.is_null), -999)
    rows = [b.block_id for b in blocks.blocks[MAMBA]] if blocks.blocks else []
    return [_moves(before, ids, null), _shape(rows, ids, null)]


def _serve(manager: Any, request: Any, chunks: Sequence[int], drafts: Sequence[int]) -> list:
    """Prefill in ``chunks``, then decode steps that verify 3 drafts each and accept
    ``drafts[i]`` of them (vLLM's scheduler rolls the rejected ones back)."""
    seen = []
    for chunk in chunks:
        seen.append(_step(manager, request, chunk, 3))
        request.num_computed_tokens += chunk
        manager.new_step_starts()
    request.append_output_token_ids([5000])
    for i, accepted in enumerate(drafts):
        request.spec_token_ids = [6000 + i, 6001 + i, 6002 + i]
        seen.append(_step(manager, request, 4, 3))
        request.num_computed_tokens += 4 - (3 - accepted)
        request.append_output_token_ids([7000 + i + j for j in range(accepted + 1)])
        manager.new_step_starts()
    return seen


@pytest.mark.parametrize("num_speculative_blocks", [1, 3])
@pytest.mark.parametrize(
    "chunks",
    [[300], [64, 64, 64, 108], [96, 204], [32, 268]],
    ids=["one-chunk", "aligned-chunks", "three-blocks-then-rest", "one-block-then-rest"],
)
def test_speculative_mamba_tables_are_vllms(num_speculative_blocks: int, chunks: list) -> None:
    """Every step's Mamba table and returned row equal vLLM's (block ids aside), and a
    second request hits the same prefix on both: the last chunk end on a Mamba block
    boundary (align mode writes a state only where a step ends). Chunks end on block
    boundaries but the last, as vLLM's scheduler splits them in align mode."""
    config = _config(32, num_speculative_blocks)
    theirs, ours = _managers(config)
    assert ours.layout.allocator_config.groups[MAMBA].speculative_states == num_speculative_blocks
    prompt = [i % 50 for i in range(300)]
    drafts = [3, 0, 1, 3, 3, 2, 0, 3, 3, 3, 1, 3, 3]
    seen = []
    for manager in (theirs, ours):
        request = _request("r", prompt, 32)
        seen.append(_serve(manager, request, chunks, drafts))
    assert seen[1] == seen[0]
    hits = []
    for manager in (theirs, ours):
        second = _request("s", [*prompt, 1, 2, 3], 32)
        _, hit = manager.get_computed_blocks(second)[:2]
        hits.append(hit)
    ends = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    assert hits[1] == hits[0] == max([e for e in ends if e % 32 == 0], default=0)
    ours.check_invariants(expensive=True)


def test_speculative_states_never_enter_the_prefix_cache() -> None:
    """The scratch blocks a long chunk skips past are moved, never hashed as the
    checkpoints they sit on: a request sharing the prompt hits the state at 64 (the
    first chunk's end), not 160, on both."""
    config = _config(32, 3)
    theirs, ours = _managers(config)
    assert ours.allocator.policies[MAMBA].kind is Kind.MAMBA
    prompt = [i % 7 for i in range(200)]
    for manager in (theirs, ours):
        request = _request("r", prompt, 32)
        _serve(manager, request, [64, 136], [])
        manager.free(request)
    hits = [m.get_computed_blocks(_request("s", prompt, 32))[1] for m in (theirs, ours)]
    assert hits[1] == hits[0] == 64


def test_no_caching_mode_keeps_speculative_blocks_in_place() -> None:
    """vLLM's "none" Mamba cache mode: the extra blocks are allocated as if for
    ``num_speculative_blocks`` more blocks of tokens, never moved."""
    config = _config(32, 2, mode="none")
    theirs, ours = _managers(config, enable_caching=False)
    seen = []
    for manager in (theirs, ours):
        seen.append(_serve(manager, _request("r", list(range(90)), 32), [50, 40], [3, 3, 1]))
    assert seen[1] == seen[0]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
NGRAM["prompt_lookup_min"] = 1


def _jamba_core(
    model_dir: Any, kv_tensors: str, jenga: bool, speculative: Any, asynchronous: bool
) -> Any:
    """vLLM's `EngineCore` on the Jamba-style case with 128 MiB of KV memory (the
    speculative states take more than one state per request)."""
    return engine.host_engine_core(
        model_dir,
        "jamba",
        jenga=jenga,
        kv_tensors=kv_tensors,
        kv_bytes=128 << 20,
        speculative=speculative,
        async_scheduling=asynchronous,
    )


def _worker_tables_match(core: Any) -> None:
    """The block tables the worker built from the scheduler's outputs (new requests'
    tables, running requests' appended rows) equal the manager's in every group, entry
    by entry where the manager holds a block (an entry the manager released or moved
    is null there and stays stale in the append-only worker table, as with vLLM's)."""
    worker = core.model_executor.worker
    manager = core.scheduler.kv_cache_manager
    for request in core.scheduler.running:
        rid = request.request_id
        for g, blocks in enumerate(manager.get_blocks(rid).blocks):
            table = worker.block_tables[rid][g]
            assert len(table) == len(blocks), (rid, g)
            held = [(i, b.block_id) for i, b in enumerate(blocks) if not b.is_null]
            assert [(i, table[i]) for i, _ in held] == held, (rid, g)


@pytest.mark.parametrize(
    ("method", "kv_tensors", "asynchronous"),
    [
        ("ngram", "torch", False),
        ("ngram", "vmm", False),
        ("eagle", "torch", False),
        ("eagle", "vmm", False),
        ("eagle", "torch", True),
    ],
)
def test_a_mamba_hybrid_serves_speculative_decoding_in_the_engine(
    model_dir: Any, tmp_path: Any, method: str, kv_tensors: str, asynchronous: bool
) -> None:
    """vLLM's real `EngineCore` on a Jamba-style hybrid with speculative decoding (and
    asynchronous scheduling once): the Mamba groups keep a state per draft token, the
    worker's block tables (built from what the scheduler sends) equal the manager's
    after every step, every request finishes, and the prefix hits equal those of vLLM's
    own manager in the same engine."""
    from tests.integrations.vllm.test_engine_kinds import _serve

    if method == "ngram":
        spec, k = NGRAM, 3
    else:
        draft = replay.write_tiny_model(tmp_path / "draft")
        spec, k = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}, 2
    hits = []
    for jenga in (True, False):
        core = _jamba_core(model_dir, kv_tensors, jenga, spec, asynchronous)
        manager = core.scheduler.kv_cache_manager
        assert (type(manager).__name__ == "JengaKVCacheManager") is jenga
        if jenga:
            states = [
                g.speculative_states
                for g in manager.layout.allocator_config.groups
                if g.kind is Kind.MAMBA
            ]
            assert states and set(states) == {k}
        assert _serve(core, 3, _worker_tables_match) == {"r0", "r1", "r2"}
        if method == "ngram":
            assert core.model_executor.worker.accepted_drafts >= 3 * k
        hits.append(core.hits)
        if jenga:
            manager.check_invariants(expensive=True)
        core.model_executor.shutdown()
    assert hits[0] == hits[1] > 0
