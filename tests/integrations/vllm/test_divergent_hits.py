"""Divergent hybrid hits under vLLM's real scheduler with a KV connector, on vLLM's manager
and ours: a full attention + Mamba ("align") model whose full-attention prefix is cached
deeper than its Mamba states, with a connector that restores the missing Mamba state
(``supports_divergent_local_hybrid_hits``), one that cannot, and a store that ends inside
the local hit (vLLM's scheduler then takes the hit every group agrees on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import replay

from integrations.vllm import compat
from tests.integrations.vllm.test_conformance_fixes import BLOCK, _config, _full, _mamba, _request

CONNECTOR = "tests.integrations.vllm.prefix_store_connector"
PROMPT = list(range(6 * BLOCK))  # the replayed request; its first 4 blocks are seeded


def _scheduler(model_dir: Path, *, jenga: bool, stored: int, divergent: bool) -> Any:
    setup = replay.SchedulerSetup(max_model_len=1024, jenga_options={} if jenga else None)
    config = replay.make_vllm_config(model_dir, setup)
    config.kv_transfer_config = compat.config_classes()["KVTransferConfig"](
        kv_connector="PrefixStoreConnector",
        kv_connector_module_path=CONNECTOR,
        kv_role="kv_both",
        kv_connector_extra_config={
            "stored_tokens": stored,
            "supports_divergent_local_hybrid_hits": divergent,
        },
    )
    return replay.make_scheduler(config, _config(_full(), _mamba("align")), jenga=jenga)


def _seed(manager: Any) -> tuple[list[int], list[int]]:
    """The prompt's first 4 blocks computed one block per step, so "align" Mamba caches
    the state at every block boundary; (full-attention ids, Mamba state ids)."""
    fill = _request("fill", PROMPT[: 4 * BLOCK])
    blocks, hit, _ = manager.get_computed_blocks(fill)
    assert hit == 0
    mamba = []
    for i in range(4):
        assert manager.allocate_slots(fill, BLOCK, new_computed_blocks=blocks if i == 0 else None)
        fill.num_computed_tokens += BLOCK
        full, states = manager.get_block_ids("fill")
        mamba.append(states[i])
    manager.free(fill)
    return list(full), mamba


def _replay(
    model_dir: Path, *, jenga: bool, stored: int, divergent: bool, evict: tuple[Any, Any]
) -> tuple[tuple[int, int, int], tuple[list[int], ...], list[int], list[int]]:
    """Seed, evict the blocks ``evict`` names ((full-attention indices, Mamba indices)),
    schedule the replay: ((computed tokens, the local hit the connector was told, its
    tokens), the replay's block ids, the seeded full-attention ids, the seeded Mamba ids)."""
    scheduler = _scheduler(model_dir, jenga=jenga, stored=stored, divergent=divergent)
    manager = scheduler.kv_cache_manager
    full, mamba = _seed(manager)
    gone = {full[i] for i in evict[0]} | {mamba[i] for i in evict[1]}
    manager.block_pool.evict_blocks(gone)
    scheduler.add_request(_request("replay", PROMPT))
    (new,) = scheduler.schedule().scheduled_new_reqs
    told, external, ids = scheduler.connector.seen["replay"]
    if jenga:
        manager.check_invariants(expensive=True)
    return (new.num_computed_tokens, told, external), ids, full, mamba


MAMBA_EVICTED = ((), (1, 2, 3))  # full attention caches 4 blocks, Mamba the state at 16


@pytest.mark.parametrize(
    ("stored", "divergent", "evict", "expected"),
    [
        # the deeper full-attention hit, the connector's block after it
        (5 * BLOCK, True, MAMBA_EVICTED, (5 * BLOCK, 4 * BLOCK, BLOCK)),
        # a connector that cannot restore Mamba state: the hit every group agrees on
        (5 * BLOCK, False, MAMBA_EVICTED, (5 * BLOCK, BLOCK, 4 * BLOCK)),
        # the store ends inside the deeper hit: no connector tokens, the common hit
        (4 * BLOCK, True, MAMBA_EVICTED, (BLOCK, 4 * BLOCK, 0)),
        # Mamba alone runs deeper (full-attention tail evicted): the common hit
        (5 * BLOCK, True, ((2, 3), (1, 2)), (5 * BLOCK, BLOCK, 4 * BLOCK)),
    ],
    ids=["restored", "not-restorable", "store-inside-hit", "mamba-deeper"],
)
def test_divergent_hits_split_local_and_connector_tokens_as_vllms_manager(
    model_dir: Path, stored: int, divergent: bool, evict: Any, expected: tuple[int, int, int]
) -> None:
    kw = {"stored": stored, "divergent": divergent, "evict": evict}
    ours = _replay(model_dir, jenga=True, **kw)[0]
    assert ours == _replay(model_dir, jenga=False, **kw)[0]
    assert ours == expected


def test_a_divergent_hit_hands_over_the_prefix_blocks_and_a_fresh_mamba_block(
    model_dir: Path,
) -> None:
    """The deeper hit's full-attention blocks are the ones that hold the prefix's KV; the
    Mamba group reads no cached state (none is cached at 64 tokens) and gets a block of
    its own at the end of the connector's tokens, which the connector fills."""
    kw = {"stored": 5 * BLOCK, "divergent": True, "evict": MAMBA_EVICTED}
    split, ids, full, mamba = _replay(model_dir, jenga=True, **kw)
    theirs = _replay(model_dir, jenga=False, **kw)[1]
    assert split == (5 * BLOCK, 4 * BLOCK, BLOCK)
    assert [[b == 0 for b in row] for row in ids] == [[b == 0 for b in row] for row in theirs]
    fa_row, mamba_row = ids
    assert fa_row[:4] == full
    assert len(fa_row) == 6  # the prompt's 96 tokens
    assert mamba[0] not in mamba_row  # the state at 16 tokens is no state at 64 or 80
    null = 0  # the null block id on vLLM's tensors
    assert mamba_row[:4] == [null] * 4
    assert mamba_row[4] != null and mamba_row[4] not in fa_row
