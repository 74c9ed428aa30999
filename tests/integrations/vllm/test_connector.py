"""The KV-connector calls of vLLM's scheduler on the jenga manager: external tokens, delayed
caching, deferred frees, zeroing after a failed load, eviction by block id, Mamba
boundary-state offers, and the connectors refused at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.errors import UnsupportedFeature
from integrations.vllm.harness import cases, replay

from integrations.vllm import compat
from tests.integrations.vllm.test_conformance_fixes import (
    BLOCK,
    _config,
    _full,
    _mamba,
    _managers,
    _request,
)


def _ids(manager: Any, rid: str) -> list[list[int]]:
    return [list(row) for row in manager.get_block_ids(rid)]


def _nulls(manager: Any, rid: str) -> list[list[bool]]:
    return [[b.is_null for b in row] for row in manager.get_blocks(rid).blocks]


def _hit(manager: Any, prompt: list[int], rid: str = "probe") -> int:
    return int(manager.get_computed_blocks(_request(rid, prompt))[1])


def _cached(manager: Any, rid: str) -> list[bool]:
    return [manager.is_cached_block(0, b) for b in _ids(manager, rid)[0]]


# -- external tokens --------------------------------------------------------------------
# vLLM 0.33's manager refuses Mamba "none" mode with prefix caching
@pytest.mark.parametrize("mode", ["align"] if compat.AT_LEAST_0_33 else ["align", "none"])
def test_external_tokens_get_the_blocks_vllms_manager_gives_them(mode: str) -> None:
    """A connector hit of 3 blocks plus a 20-token chunk: every group's table has the
    shape vLLM's manager gives (the Mamba state at the external boundary included)."""
    prompt = list(range(5 * BLOCK + 4))
    shapes = []
    for manager in _managers(_config(_full(), _mamba(mode))):
        request = _request("r", prompt)
        got = manager.allocate_slots(request, 20, num_external_computed_tokens=3 * BLOCK)
        assert got is not None
        shapes.append(_nulls(manager, "r"))
    assert shapes[1] == shapes[0]
    assert len(shapes[1][0]) == -(-(3 * BLOCK + 20) // BLOCK)


def test_a_delayed_load_is_cached_only_once_the_scheduler_says_it_landed() -> None:
    _, ours = _managers(_config(_full()))
    prompt = list(range(4 * BLOCK + 3))
    request = _request("r", prompt)
    got = ours.allocate_slots(
        request, 0, num_external_computed_tokens=4 * BLOCK, delay_cache_blocks=True
    )
    assert got is not None and len(_ids(ours, "r")[0]) == 4
    assert _cached(ours, "r") == [False] * 4  # the load has not landed
    assert _hit(ours, prompt) == 0
    request.num_computed_tokens = 4 * BLOCK  # the scheduler: the load finished
    ours.cache_blocks(request, 4 * BLOCK)
    assert _cached(ours, "r") == [True] * 4
    assert _hit(ours, prompt) == 4 * BLOCK
    ours.check_invariants(expensive=True)


def test_a_failed_second_allocation_releases_the_external_slots() -> None:
    _, ours = _managers(_config(_full(), num_blocks=6))  # 5 usable blocks
    request = _request("r", list(range(8 * BLOCK)))
    assert ours.allocate_slots(request, 3 * BLOCK, num_external_computed_tokens=3 * BLOCK) is None
    assert "r" not in ours._requests
    assert ours.allocator.usage().used_blocks == (0,)
    ours.check_invariants(expensive=True)


# -- deferred frees ---------------------------------------------------------------------
def test_popped_blocks_stay_held_until_the_block_pool_takes_them_back() -> None:
    _, ours = _managers(_config(_full()))
    pool = ours.bind_connector()
    prompt = list(range(3 * BLOCK + 5))
    request = _request("r", prompt)
    assert ours.allocate_slots(request, len(prompt)) is not None
    request.num_computed_tokens = len(prompt)
    ids = _ids(ours, "r")[0]
    blocks = ours.pop_blocks_for_free(request)
    assert [b.block_id for b in blocks] == ids
    assert "r" not in ours._requests
    assert ours.allocator.usage().used_blocks == (4,)  # an in-flight step may still write
    assert _hit(ours, prompt) == 3 * BLOCK  # the complete blocks are cached meanwhile
    pool.free_blocks(reversed(blocks))
    assert ours.allocator.usage().used_blocks == (0,)
    assert _hit(ours, prompt) == 3 * BLOCK
    with pytest.raises(ValueError, match=r"block \d+ was not handed out by pop_blocks_for_free"):
        pool.free_blocks(blocks[:1])
    ours.check_invariants(expensive=True)


def test_a_prefix_cache_reset_waits_for_parked_blocks() -> None:
    _, ours = _managers(_config(_full()))
    pool = ours.bind_connector()
    request = _request("r", list(range(2 * BLOCK)))
    assert ours.allocate_slots(request, 2 * BLOCK) is not None
    blocks = ours.pop_blocks_for_free(request)
    assert not ours.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert ours.reset_prefix_cache()


# -- failed loads -----------------------------------------------------------------------
def test_new_blocks_are_zeroed_unless_an_async_load_writes_them() -> None:
    """A KV cache that needs zeroing (Mamba, mixed precision) zeroes every new attention
    block, except those an asynchronous load of that group writes, as vLLM's manager."""
    config = _config(_full(), _mamba("align"))
    theirs, ours = _managers(config)
    for loaded, want_zeroed in (((0,), 1), ((), 5)):
        for manager in (theirs, ours):
            request = _request(f"r{loaded}", list(range(6 * BLOCK)))
            assert (
                manager.allocate_slots(
                    request,
                    BLOCK,
                    num_external_computed_tokens=4 * BLOCK,
                    skip_zeroing_group_ids=loaded,
                )
                is not None
            )
            attention = manager.get_block_ids(request.request_id)[0]
            assert manager.take_new_block_ids() == attention[5 - want_zeroed :]


def test_blocks_a_failed_load_left_unwritten_are_queued_for_zeroing() -> None:
    config = _config(_full(), _mamba("align"))
    assert config.needs_kv_cache_zeroing
    _, ours = _managers(config)
    request = _request("r", list(range(5 * BLOCK)))
    assert ours.allocate_slots(request, 0, num_external_computed_tokens=4 * BLOCK) is not None
    attention = _ids(ours, "r")[0]
    # the load was not asynchronous for any group: its new blocks are zeroed (vLLM's rule)
    assert ours.take_new_block_ids() == attention
    ours.record_blocks_for_zeroing("r", BLOCK)
    assert ours.take_new_block_ids() == attention[1:]
    assert ours.take_new_block_ids() == []
    with pytest.raises(ValueError, match=r"token 5, not a multiple of group 0's block size 16"):
        ours.record_blocks_for_zeroing("r", 5)


def test_evicted_block_ids_leave_the_prefix_cache() -> None:
    _, ours = _managers(_config(_full()))
    prompt = list(range(4 * BLOCK + 1))
    holder = _request("holder", prompt)
    assert ours.allocate_slots(holder, len(prompt)) is not None
    ids = _ids(ours, "holder")[0]
    assert _hit(ours, prompt) == 4 * BLOCK
    ours.evict_blocks({ids[2]})  # held: it loses its identity now, is freed at release
    assert _hit(ours, prompt) == 2 * BLOCK
    ours.free(holder)
    assert ours.allocator.usage().used_blocks == (0,)
    assert _hit(ours, prompt) == 2 * BLOCK
    ours.evict_blocks({ids[1], 10_000})  # cached: freed now; an unknown id is no block
    assert _hit(ours, prompt) == BLOCK
    ours.check_invariants(expensive=True)


# -- Mamba boundary-state offers ----------------------------------------------------------
def test_boundary_states_are_offered_as_vllms_manager_offers_them() -> None:
    config = _config(_full(), _mamba("align"), _mamba("align"))
    offers = []
    for manager in _managers(config):
        request = _request("r", list(range(3 * BLOCK + 4)))
        seen = []
        for step, chunk in enumerate([BLOCK, BLOCK + 4, BLOCK - 4, 8]):
            manager.new_step_starts()
            assert manager.allocate_slots(request, chunk) is not None
            request.num_computed_tokens += chunk
            got = manager.take_boundary_state_offloads().get("r", [])
            seen.append(sorted((g, tokens) for g, _, tokens in got))
            for g, block_id, _ in got:
                assert block_id in manager.get_block_ids("r")[g], step
        offers.append(seen)
    assert offers[1] == offers[0]
    assert offers[1][0] == [(1, BLOCK), (2, BLOCK)]


def test_a_freed_request_takes_its_untaken_offers_with_it() -> None:
    _, ours = _managers(_config(_full(), _mamba("align")))
    request = _request("r", list(range(2 * BLOCK + 1)))
    assert ours.allocate_slots(request, BLOCK) is not None
    ours.free(request)
    assert ours.take_boundary_state_offloads() == {}


# -- start-up refusals --------------------------------------------------------------------
def test_a_connector_that_drives_vllms_block_pool_is_refused_at_start_up(
    model_dir: Path,
) -> None:
    """vLLM's scheduler builds the connector; binding it to our manager refuses it, naming
    it and what it reads (here: vLLM's own GPU block pool)."""
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(max_model_len=512))
    config.kv_transfer_config = compat.config_classes()["KVTransferConfig"](
        kv_connector="SimpleCPUOffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 26},
    )
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("llama"), 16 << 20)
    with pytest.raises(
        UnsupportedFeature,
        match=r"does not support the KV connector\(s\) SimpleCPUOffloadConnector \(it drives "
        r"vLLM's own GPU block pool: bind_gpu_block_pool\)",
    ):
        replay.make_scheduler(config, kv_config, jenga=True)
    assert replay.make_scheduler(config, kv_config, jenga=False).connector is not None
