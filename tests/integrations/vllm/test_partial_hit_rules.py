"""vLLM's rules around sub-block ("partial hash") Mamba hits, on the jenga manager.

Junctions: with EAGLE's block drop a follower's full-attention hit ends one hash block
below the prefix it shares; no Mamba state lies there, so it hits the Mamba block below.
vLLM's ``enable_mamba_shared_prefix_checkpoint`` has the scheduler end the follower's
chunk at that junction and the manager keep the state there, so the next sibling resumes
at it. The chunk ends below are the ones vLLM's scheduler makes for these prompts.

EAGLE draft groups: where the config marks the draft's groups (``is_eagle_group``) only
they drop a block of a hit, each one of its own blocks, as vLLM's coordinator does.

Internal prefill checkpoints: with Mamba checkpoint blocks vLLM's scheduler does not stop
at the prompt's tail checkpoint; its worker writes the state there, inside the last
chunk, into the block just below the running one, which the manager keeps and names.

Partial-tail offloads: a KV producer's state named at the prompt's tail checkpoint
inside a Mamba block is handed to its connector once: as the moved block's boundary
offer when the request runs on, or as the running block when it finishes there.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import torch
from integrations.vllm.drop_in import jenga_kv_cache_manager
from integrations.vllm.harness import replay
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from integrations.vllm import compat
from tests.integrations.vllm.mamba_hybrid import mamba_hybrid_config

HASH, MAMBA_BLOCK = 16, 64
BASE = list(range(1, 101))  # the shared prefix: 100 tokens


def _manager(attn_block: int = HASH, **kwargs: Any) -> Any:
    config = mamba_hybrid_config(attn_block, MAMBA_BLOCK)
    kwargs.setdefault("hash_block_size", HASH)
    kwargs.setdefault("use_eagle", True)
    return jenga_kv_cache_manager(config, 1024, enable_caching=True, **kwargs)


def _prefill(manager: Any, request: Any, ends: list[int]) -> int:
    """Run the request's prompt in chunks ending at ``ends``; returns the junction the
    lookup reported (set on the request, as vLLM's scheduler does)."""
    blocks, hit, junction = manager.get_computed_blocks(request)
    request.shared_prefix_boundary = junction
    first = True
    for end in ends:
        start = request.num_computed_tokens + (hit if first else 0)
        got = manager.allocate_slots(
            request, end - start, hit if first else 0, blocks if first else None
        )
        assert got is not None
        request.num_computed_tokens = end
        manager.take_kv_cache_block_copies()  # the worker runs them
        manager.new_step_starts()
        first = False
    manager.free(request)
    return junction


@pytest.mark.parametrize("armed", [True, False])
def test_a_sibling_resumes_at_the_junction_the_follower_stopped_at(armed: bool) -> None:
    manager = _manager(enable_mamba_shared_prefix_checkpoint=armed)
    assert manager.mamba_shared_prefix_checkpoint is armed
    owner, follower, sibling = replay.make_requests(
        [BASE + [-1] * 40, BASE + [-2] * 40, BASE + [-3] * 40], [1, 1, 1], HASH, prefix="r"
    )
    # the owner's states: 64 (a block), 112 (its EAGLE tail checkpoint), 128 (a block)
    assert _prefill(manager, owner, [64, 112, 128, 140]) == 0
    # the follower's attention hit (96 shared) drops to 80; Mamba has 64: it hits 64 and
    # the scheduler ends its first chunk at the junction, 80
    assert manager.get_computed_blocks(follower)[1:] == (64, 80)
    assert _prefill(manager, follower, [80, 112, 128, 140]) == 80
    # armed, the state kept at 80 serves the sibling; else it hits the block below
    assert manager.get_computed_blocks(sibling)[1] == (80 if armed else 64)
    manager.check_invariants(expensive=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"use_eagle": False},  # no EAGLE group: hits need no proof, nothing drops
        {"num_prefill_lookahead": 2},  # multi-module MTP: cached tokens lag the chunk
        {"hash_block_size": MAMBA_BLOCK},  # no sub-block hits
        {},  # not asked for
    ],
)
def test_junction_states_are_kept_only_where_vllm_keeps_them(kwargs: dict[str, Any]) -> None:
    asked = {"enable_mamba_shared_prefix_checkpoint": bool(kwargs)}
    manager = _manager(**asked, **kwargs)
    assert manager.mamba_shared_prefix_checkpoint is False
    assert _manager(enable_mamba_shared_prefix_checkpoint=True).mamba_shared_prefix_checkpoint


def _tail_named(manager: Any) -> Any:
    """A 100-token request whose second step ends at its tail checkpoint, 96 (inside the
    second Mamba block): the state there is named in the block the request writes."""
    request = replay.make_requests([BASE], [1], HASH, prefix="t")[0]
    assert manager.allocate_slots(request, 64) is not None
    request.num_computed_tokens = 64
    manager.new_step_starts()
    first = manager.take_boundary_state_offloads()  # the state at 64, a whole block
    assert [n for _, _, n in first[request.request_id]] == [64]
    assert manager.allocate_slots(request, 32) is not None
    request.num_computed_tokens = 96
    manager.new_step_starts()
    return request


@pytest.mark.parametrize("attn_block", [HASH, MAMBA_BLOCK])  # 64: its block is moved too
def test_a_finished_producers_tail_is_its_running_block_once(attn_block: int) -> None:
    manager = _manager(attn_block, use_eagle=False)
    request = _tail_named(manager)
    running = manager.get_block_ids(request.request_id)[1][1]
    assert manager.take_boundary_state_offloads() == {}
    assert manager.finalize_partial_tail_offloads(request) == [(1, running, 96)]
    assert manager.finalize_partial_tail_offloads(request) == []


@pytest.mark.parametrize("attn_block", [HASH, MAMBA_BLOCK])
def test_a_producer_that_ran_on_offers_the_moved_tail_instead(attn_block: int) -> None:
    manager = _manager(attn_block, use_eagle=False)
    request = _tail_named(manager)
    assert manager.allocate_slots(request, 4) is not None  # the name moves off the block
    copies, kept = manager.take_kv_cache_block_copies()
    assert len(copies) == 1 + (attn_block > HASH)  # the attention block at 96 moves too
    offers = manager.take_boundary_state_offloads()
    [(group, block, tokens)] = offers[request.request_id]
    assert (group, tokens) == (1, 96) and block in {c.dst_block_id for c in copies}
    request.num_computed_tokens = 100
    assert manager.finalize_partial_tail_offloads(request) == []
    manager.block_pool.free_blocks(kept)


def test_a_tail_past_the_computed_tokens_is_not_handed_over() -> None:
    """Tokens computed past the tail (or still in flight) overwrote the running state."""
    manager = _manager(use_eagle=False)
    request = _tail_named(manager)
    request.num_computed_tokens = 97
    assert manager.finalize_partial_tail_offloads(request) == []


def test_only_a_marked_draft_group_drops_and_by_its_own_block() -> None:
    """Full attention (2-token blocks), Mamba (8) and an EAGLE draft sliding window (4,
    marked): partial hits are off (the window is off the hash grid); a 12-token prompt
    leaves states at 8 and the draft's blocks to 12, so a longer prompt hits 8, proven
    by the draft's block 8..12 (a proof of one prefix step, 8, would need 16)."""
    full = compat.FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = compat.MambaSpec(
        block_size=8, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    draft = compat.SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=4
    )
    groups = [
        KVCacheGroupSpec(["full"], full),
        KVCacheGroupSpec(["mamba"], mamba),
        KVCacheGroupSpec(["draft"], draft, is_eagle_group=True),
    ]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = jenga_kv_cache_manager(
        config, 1024, enable_caching=True, hash_block_size=2, use_eagle=True
    )
    assert not manager.coordinator.enable_partial_hash_hits
    tokens = list(range(12))
    first, second = replay.make_requests([tokens, [*tokens, 12, 13]], [1, 1], 2, prefix="w")
    assert manager.allocate_slots(first, 8) is not None
    first.num_computed_tokens = 8
    manager.new_step_starts()
    assert manager.allocate_slots(first, 4) is not None
    first.num_computed_tokens = 12
    manager.free(first)
    manager.new_step_starts()
    blocks, hit, _ = manager.get_computed_blocks(second)
    assert hit == 8 and len(blocks.get_block_ids()[0]) == 4
    manager.check_invariants(expensive=True)


@pytest.mark.parametrize(("alignment", "hit"), [(16, 112), (48, 0)])
def test_an_internal_checkpoint_is_kept_below_the_running_state(alignment: int, hit: int) -> None:
    """Full attention of 16-token blocks, Mamba of 32, hash 16: one 120-token step with
    checkpoint blocks aligned at 16 writes the state at 112 (the prompt's tail
    checkpoint) into table entry 2 (tokens 64..96), below the running state (entry 3);
    at an alignment 112 is not a multiple of there is none."""
    config = mamba_hybrid_config(
        HASH, 32, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=alignment
    )
    manager = jenga_kv_cache_manager(config, 1024, enable_caching=True, hash_block_size=HASH)
    tokens = list(range(120))
    producer, replay_ = replay.make_requests([tokens, tokens], [1, 1], HASH, prefix="c")
    assert manager.allocate_slots(producer, 120) is not None
    states = manager.get_blocks(producer.request_id).blocks[1]
    assert states[2].is_null is (hit == 0) and not states[3].is_null
    # a connector is offered the kept block with the state it holds (112, not 96)
    offers = manager.take_boundary_state_offloads()
    assert offers == ({producer.request_id: [(1, states[2].block_id, 112)]} if hit else {})
    producer.num_computed_tokens = 120
    manager.free(producer)
    manager.new_step_starts()
    blocks, got, _ = manager.get_computed_blocks(replay_)
    assert got == hit
    if hit:  # the hit's state entry is the kept block, copied into the hitter's own
        assert blocks.blocks[1][-1].block_id == states[2].block_id
        assert manager.allocate_slots(replay_, 120 - hit, hit, blocks) is not None
        copies, kept = manager.take_kv_cache_block_copies()
        assert [c.src_block_id for c in copies] == [states[2].block_id]
        manager.block_pool.free_blocks(kept)
    manager.check_invariants(expensive=True)
