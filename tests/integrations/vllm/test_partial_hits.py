"""Sub-block ("partial hash") Mamba hits through vLLM's real Scheduler, contents checked.

A simulated worker keeps what each vLLM block holds: a full-attention slot the token id
written at its position (attention blocks of the hash block, larger ones whose partial
block a hit copies, and decode context parallel ones whose block spans the ranks), a
Mamba block the tokens its state has consumed. Each step it
runs the scheduler's block copies first, then per request checks that every position
below the computed tokens reads the request's own token and that the Mamba state it
starts from is the state of exactly its computed tokens (vLLM's "align" mode reads the
state at block ``(computed - 1) // block`` and writes it at ``(end - 1) // block``), then
writes the step. A hit served from a wrong or stale block, or a missing copy, fails the
check; the same run on vLLM's own manager gives the same hits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import replay
from integrations.vllm.manager import JengaKVCacheManager
from integrations.vllm.scheduler import JengaScheduler

from integrations.vllm import compat
from tests.integrations.vllm.mamba_hybrid import mamba_hybrid_config

HASH = 16  # attention block = vLLM's hash block
MAMBA_BLOCK = 64
PROMPT = 100  # its tail checkpoint: 96, inside the second Mamba block
# (attention block of one rank, decode context parallel ranks): the attention block
# holds block * ranks tokens; 96 lies inside the second one of 64 tokens
GEOMETRIES = [(HASH, 1), (64, 1), (32, 2)]


def _scheduler(model_dir: Path, jenga: bool, geometry: tuple[int, int], eagle: bool) -> Any:
    attn_block, dcp = geometry
    kv_config = mamba_hybrid_config(attn_block, MAMBA_BLOCK, num_blocks=200)
    # EAGLE (the tiny model as its own draft): 0.32 drops a hit's last hash block,
    # 0.33 hashes each block with the token after it instead
    draft = {"method": "eagle", "model": str(model_dir), "num_speculative_tokens": 2}
    setup = replay.SchedulerSetup(
        max_model_len=1024,
        max_num_batched_tokens=512,
        block_size=MAMBA_BLOCK,
        speculative=draft if eagle else None,
    )
    config = replay.make_vllm_config(model_dir, setup)
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    config.parallel_config.decode_context_parallel_size = dcp
    cls = JengaScheduler if jenga else compat.Scheduler
    return cls(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=compat.structured_output_manager(config),
        block_size=MAMBA_BLOCK,
        hash_block_size=HASH,
        log_stats=True,
    )


class _Worker:
    """Block contents as a worker would hold them (slot ids are shared by the groups)."""

    def __init__(self, attn_tokens: int) -> None:
        self.attn_tokens = attn_tokens  # tokens per attention block (all ranks)
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id
        self.state: dict[int, tuple[int, ...]] = {}  # block id -> tokens consumed
        self.tables: dict[str, list[list[int]]] = {}
        self.copies = 0
        self.resumed_at: dict[str, int] = {}  # request -> computed tokens of its first step

    def step(self, out: Any, requests: dict[str, Any]) -> None:
        for src, dst in out.kv_cache_block_copies or ():
            self.copies += 1
            self.state[dst] = self.state.get(src, ())
            for slot in range(self.attn_tokens):
                if (src, slot) in self.kv:
                    self.kv[dst, slot] = self.kv[src, slot]
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.resumed_at[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            for table, row in zip(self.tables[rid], ids or (), strict=False):
                table.extend(row)
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, n in out.num_scheduled_tokens.items():
            self._run(rid, requests[rid].all_token_ids, computed[rid], n)

    def _run(self, rid: str, tokens: list[int], computed: int, n: int) -> None:
        attn, mamba = self.tables[rid]
        a = self.attn_tokens
        for p in range(computed):
            got = self.kv.get((attn[p // a], p % a))
            assert got == tokens[p], f"{rid}: position {p} reads {got}, expected {tokens[p]}"
        if computed:
            state = self.state.get(mamba[(computed - 1) // MAMBA_BLOCK])
            assert state == tuple(tokens[:computed]), (
                f"{rid}: the Mamba state at {computed} tokens is of "
                f"{None if state is None else len(state)} tokens (or other ones)"
            )
        for p in range(computed, computed + n):
            self.kv[attn[p // a], p % a] = tokens[p]
        self.state[mamba[(computed + n - 1) // MAMBA_BLOCK]] = tuple(tokens[: computed + n])


def _serve(
    scheduler: Any, worker: _Worker, by_id: dict[str, Any], add: list[Any], steps: int
) -> None:
    """Add ``add``, then step until no request is left or ``steps`` steps ran."""
    for req in add:
        scheduler.add_request(req)
    for step in range(1, steps + 1):
        if not scheduler.get_num_unfinished_requests():
            return
        out = scheduler.schedule()
        worker.step(out, by_id)
        scheduler.update_from_output(out, replay.fake_model_output(out, by_id, step))
    assert not scheduler.get_num_unfinished_requests() or steps < 200, "requests left"


def _run(
    model_dir: Path,
    jenga: bool,
    overlap: bool,
    geometry: tuple[int, int] = (HASH, 1),
    eagle: bool = False,
) -> tuple[_Worker, Any]:
    """A producer, then (``overlap``: while it still decodes) two requests sharing its
    first 96 tokens, then one sharing 48 of them."""
    scheduler = _scheduler(model_dir, jenga, geometry, eagle)
    worker = _Worker(geometry[0] * geometry[1])
    base = list(range(1, PROMPT + 1))
    producer = replay.make_requests([base], [12 if overlap else 2], HASH, prefix="p")
    siblings = replay.make_requests(
        [base[:96] + [500 + i] * 30 for i in range(2)] + [base[:48] + [900] * 40],
        [4, 4, 4],
        HASH,
        prefix="s",
    )
    by_id = {r.request_id: r for r in producer + siblings}
    # overlap: the siblings arrive once the producer's prompt is done (3 chunks)
    _serve(scheduler, worker, by_id, producer, 4 if overlap else 200)
    _serve(scheduler, worker, by_id, siblings, 200)
    return worker, scheduler


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("overlap", [False, True])
def test_partial_hits_serve_the_states_recompute_gives(
    model_dir: Path, overlap: bool, geometry: tuple[int, int]
) -> None:
    worker, scheduler = _run(model_dir, jenga=True, overlap=overlap, geometry=geometry)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, JengaKVCacheManager)
    assert manager.coordinator.enable_partial_hash_hits and scheduler.mamba_partial_cache_hit
    # the siblings resume at the producer's tail checkpoint (96, inside a Mamba block and
    # a larger attention block), the last one at the 48-token state nobody named: the
    # checkpoint below it (0)
    assert [worker.resumed_at[f"s{i}"] for i in range(3)] == [96, 96, 0]
    # the producer's move and each hitter's own copy, per group inside a block
    partial = 1 + (geometry[0] * geometry[1] > HASH)
    assert worker.copies >= 2 * partial
    manager.check_invariants(expensive=True)
    # every block kept for a copy came back through vLLM's scheduler once it ran
    assert manager.allocator.usage().used_blocks == (0, 0)
    ours = dict(worker.resumed_at)
    theirs = _run(model_dir, jenga=False, overlap=overlap, geometry=geometry)[0].resumed_at
    assert ours == theirs


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_partial_hits_with_eagle_serve_what_recompute_gives(
    model_dir: Path, geometry: tuple[int, int]
) -> None:
    """EAGLE with a Mamba hybrid: on 0.32 the block drop (the state kept one hash block
    below the prompt's last boundary, the attention block named at that boundary proves
    it), on 0.33 lookahead hashes (no drop); the hits equal vLLM's own manager's."""
    worker, scheduler = _run(model_dir, jenga=True, overlap=True, geometry=geometry, eagle=True)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, JengaKVCacheManager)
    assert manager.coordinator.enable_partial_hash_hits and scheduler.mamba_partial_cache_hit
    assert manager.speculative.use_eagle is not compat.AT_LEAST_0_33
    resumed = [worker.resumed_at[f"s{i}"] for i in range(3)]
    # 0.32: the state at 80 (one hash block below 96), proven by the attention at 96
    assert resumed == ([96, 96, 0] if compat.AT_LEAST_0_33 else [80, 80, 0])
    manager.check_invariants(expensive=True)
    assert manager.allocator.usage().used_blocks == (0, 0)
    theirs = _run(model_dir, jenga=False, overlap=True, geometry=geometry, eagle=True)[0]
    assert worker.resumed_at == theirs.resumed_at


def _manager(attn_block: int, mamba_block: int, **kwargs: Any) -> Any:
    from integrations.vllm.drop_in import jenga_kv_cache_manager

    config = mamba_hybrid_config(attn_block, mamba_block)
    kwargs.setdefault("hash_block_size", HASH)
    return jenga_kv_cache_manager(config, 1024, enable_caching=True, **kwargs)


@pytest.mark.parametrize(
    ("attn_block", "mamba_block", "kwargs", "served"),
    [
        (HASH, MAMBA_BLOCK, {}, True),
        (MAMBA_BLOCK, MAMBA_BLOCK, {}, True),  # a partial attention block, copied
        (HASH * 2, MAMBA_BLOCK, {"dcp_world_size": 2}, True),  # 64-token DCP blocks
        (HASH, HASH, {}, False),  # Mamba blocks on the hash grid: nothing finer to hit
    ],
)
def test_partial_hits_are_announced_only_where_served(
    attn_block: int, mamba_block: int, kwargs: dict[str, Any], served: bool
) -> None:
    manager = _manager(attn_block, mamba_block, **kwargs)
    assert manager.coordinator.enable_partial_hash_hits is served
    # the prompt's last hash boundary (96) lies inside a 64-token Mamba block
    prompt = list(range(1, PROMPT + 1))
    first = replay.make_requests([prompt], [1], HASH, prefix="a")[0]
    blocks, hit, _ = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, 96, hit, blocks) is not None
    first.num_computed_tokens = 96
    manager.free(first)
    manager.new_step_starts()
    second = replay.make_requests([[*prompt[:96], 7, 7, 7]], [1], HASH, prefix="b")[0]
    # one 96-token step writes the Mamba state at 96 only: a whole-block manager hits it
    # only where 96 is a Mamba block boundary
    hit = manager.get_computed_blocks(second)[1]
    assert hit == (96 if served or 96 % mamba_block == 0 else 0)


@pytest.mark.parametrize("preempted", [False, True])
def test_a_state_named_in_a_step_that_never_ran_is_not_hit(preempted: bool) -> None:
    """A running request freed in the step that named its state (vLLM preempts it and
    drops that step) leaves no name: its block never received the state."""
    manager = _manager(HASH, MAMBA_BLOCK)
    prompt = list(range(1, PROMPT + 1))
    first = replay.make_requests([prompt], [1], HASH, prefix="a")[0]
    assert manager.allocate_slots(first, 64) is not None
    first.num_computed_tokens = 64
    manager.new_step_starts()
    assert manager.allocate_slots(first, 32) is not None  # names the state at 96
    if preempted:
        first.status = compat.RequestStatus.RUNNING
    else:  # the step ran: the request is done with it
        first.num_computed_tokens = 96
        manager.new_step_starts()
    manager.free(first)
    manager.new_step_starts()
    second = replay.make_requests([[*prompt[:96], 7, 7, 7]], [1], HASH, prefix="b")[0]
    assert manager.get_computed_blocks(second)[1] == (64 if preempted else 96)
    manager.check_invariants(expensive=True)
