"""vLLM 0.32 conformance: our manager against vLLM's own `KVCacheManager`.

Each test drives vLLM's real manager and ours (`jenga_kv_cache_manager`, the constructor
the conformance suite swaps in) with the same config and requests and compares what a
caller sees: the hit's blocks, Mamba hits per cache mode, retention-interval checks, KV
events, placeholder token ids, ``reserved_blocks``, vLLM's own slot sizes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import torch
from integrations.vllm.drop_in import jenga_kv_cache_manager
from integrations.vllm.errors import JengaVllmError
from integrations.vllm.options import JengaVllmOptions
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from integrations.vllm import compat

BLOCK = 16


def _full(block_size: int = BLOCK, dtype: torch.dtype = torch.float32) -> Any:
    return compat.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=dtype)


def _window(window: int, block_size: int = BLOCK) -> Any:
    return compat.SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=window,
    )


def _mamba(mode: str, shapes: Any = ((1, 1),)) -> Any:
    return compat.MambaSpec(
        block_size=BLOCK, shapes=shapes, dtypes=(torch.float32,), mamba_cache_mode=mode
    )


def _config(*specs: Any, num_blocks: int = 100, tensors: Any = (), **kw: Any) -> Any:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=list(tensors), kv_cache_groups=groups, **kw
    )


def _managers(config: Any, **kw: Any) -> tuple[Any, Any]:
    """(vLLM's manager, ours) on the same config."""
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    kw.setdefault("enable_caching", True)
    kw.setdefault("hash_block_size", min(sizes))
    kw.setdefault("max_model_len", 8192)
    ours = jenga_kv_cache_manager(config, **kw)
    theirs = KVCacheManager(config, scheduler_block_size=math.lcm(*sizes), **kw)
    return theirs, ours


def _request(rid: str, prompt: list[int], **kw: Any) -> Any:
    return compat.Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=compat.sampling_params(max_tokens=17),
        pooling_params=None,
        block_hasher=compat.request_block_hasher(BLOCK, "sha256"),
        **kw,
    )


def _shape(blocks: Any) -> list[list[bool]]:
    """Per group, which hit entries are null (vLLM's view of a hit's layout)."""
    return [[b.is_null for b in group] for group in blocks.blocks]


# -- the hit's blocks ------------------------------------------------------------------
def test_the_hit_comes_with_its_blocks_as_vllm_returns_them() -> None:
    # full attention on 32-token blocks, a 2-block window on 16-token blocks
    config = _config(_full(2 * BLOCK, torch.float16), _window(2 * BLOCK))
    prompt = [i for i in range(10) for _ in range(BLOCK)]
    seen = []
    for manager in _managers(config):
        first = _request("0", prompt)
        assert manager.allocate_slots(first, 7 * BLOCK) is not None
        second = _request("1", prompt[: 7 * BLOCK + 1])
        blocks, hit, _ = manager.get_computed_blocks(second)
        held = manager.get_block_ids("0")
        for group, row in zip(blocks.blocks, held, strict=True):
            live = [(i, b.block_id) for i, b in enumerate(group) if not b.is_null]
            assert live and all(row[i] == block for i, block in live)  # the first's blocks
        new = manager.allocate_slots(second, second.num_tokens - hit, hit, blocks)
        assert new is not None
        ids = manager.get_block_ids("1")
        assert [row[: len(g)] for row, g in zip(ids, blocks.blocks, strict=True)] == [
            [b.block_id for b in g] for g in blocks.blocks
        ]
        seen.append((hit, _shape(blocks)))
    assert seen[0] == seen[1]
    assert seen[1][0] == 6 * BLOCK and [len(g) for g in seen[1][1]] == [3, 6]


@pytest.mark.parametrize("mode", ["none", "align"])
def test_mamba_hits_follow_the_cache_mode_as_vllm(mode: str) -> None:
    """ "none" (vLLM's tests build it with caching on): every block is a cached state;
    "align": a state exists only where a step ended."""
    if mode == "none" and compat.AT_LEAST_0_33:
        pytest.skip("vLLM 0.33's manager refuses Mamba prefix caching outside 'align' mode")
    config = _config(_full(), _mamba(mode))
    common = [i for i in range(3) for _ in range(BLOCK)]
    seen = []
    for manager in _managers(config):
        first = _request("0", common + [3] * 7)
        assert manager.allocate_slots(first, 55) is not None
        blocks, hit, _ = manager.get_computed_blocks(_request("1", common + [4] * 5))
        seen.append((hit, _shape(blocks)))
    assert seen[0] == seen[1]
    assert seen[1][0] == (3 * BLOCK if mode == "none" else 0)


def test_a_mamba_spec_without_state_shapes_takes_vllms_slot() -> None:
    """vLLM's tests build ``MambaSpec(shapes=(1, 1))``; vLLM's manager never sizes it."""
    config = _config(_full(), _mamba("align", shapes=(1, 1)))
    prompt = [i for i in range(4) for _ in range(BLOCK)]
    hits = []
    for manager in _managers(config):
        first = _request("0", [*prompt, 9])
        assert manager.allocate_slots(first, first.num_tokens) is not None
        hits.append(manager.get_computed_blocks(_request("1", [*prompt, 8]))[1])
    assert hits[0] == hits[1]
    with pytest.raises(JengaVllmError, match=r"shapes \(1, 1\) are not a tuple of state"):
        jenga_kv_cache_manager(config, 8192, jenga_options=JengaVllmOptions(pages="vmm"))


def test_a_slot_smaller_than_a_spec_page_is_vllms_business() -> None:
    """10-byte slots for 4 KiB pages (vLLM's lookahead test): both managers count slots."""
    tensor = compat.KVCacheTensor(size=100, layers=["layer0"], layer_stride=100, block_stride=10)
    spec = compat.FullAttentionSpec(
        block_size=4, num_kv_heads=32, head_size=128, dtype=torch.float32
    )
    ids = []
    for manager in _managers(_config(spec, num_blocks=10, tensors=[tensor]), max_model_len=100):
        request = _request("0", [1, 2, 3])
        blocks = manager.allocate_slots(request, 3, num_lookahead_tokens=2)
        ids.append(blocks.get_block_ids())
    assert ids[0] == ids[1] == ([1, 2],)


# -- retention interval ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("specs", "interval", "match"),
    [
        ((_full(),), 16, "no sliding-window or Mamba"),
        ((_full(4 * 8), _window(8, 8)), 33, "multiple of scheduler_block_size"),
        ((_full(4 * 8), _window(8, 8)), -32, "non-negative"),
    ],
)
def test_a_bad_retention_interval_is_a_value_error_as_in_vllm(
    specs: tuple[Any, ...], interval: int, match: str
) -> None:
    config = _config(*specs, prefix_cache_retention_interval=interval)
    sizes = [s.block_size for s in specs]
    with pytest.raises(ValueError, match=match):
        KVCacheManager(
            config, 8192, scheduler_block_size=math.lcm(*sizes), hash_block_size=min(sizes)
        )
    with pytest.raises(ValueError, match=match):
        jenga_kv_cache_manager(config, 8192, hash_block_size=min(sizes))


@pytest.mark.parametrize("interval", [None, 0, 64])
def test_every_retention_interval_is_served_with_every_hit_vllm_keeps(
    interval: int | None,
) -> None:
    """vLLM keeps sliding-window entries sparsely (every ``interval`` tokens, plus the
    latest replay tail); jenga caches them densely and evicts by prefix-subset LRU, so
    each hit vLLM's manager serves, ours serves too (here: every shorter replay)."""
    config = _config(_full(), _window(2 * BLOCK), prefix_cache_retention_interval=interval)
    prompt = [i for i in range(12) for _ in range(BLOCK)]
    theirs, ours = _managers(config)
    assert ours.num_kv_cache_groups == 2
    hits: dict[int, list[int]] = {}
    for manager in (theirs, ours):
        first = _request("0", prompt)
        assert manager.allocate_slots(first, len(prompt)) is not None
        first.num_computed_tokens = len(prompt)
        manager.cache_blocks(first, len(prompt))
        manager.free(first)
        for n in range(BLOCK + 1, len(prompt) + 1, BLOCK):
            hits.setdefault(n, []).append(manager.get_computed_blocks(_request("r", prompt[:n]))[1])
    assert all(mine >= vllm for vllm, mine in hits.values())
    assert [mine for _, mine in hits.values()] == [n - 1 for n in hits]  # dense: all of it


# -- KV events -------------------------------------------------------------------------
def _stored(manager: Any) -> list[tuple[Any, ...]]:
    return [
        (
            e.block_hashes,
            e.parent_block_hash,
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.lora_name,
            e.extra_keys,
            e.group_idx,
            e.session_id,
        )
        for e in manager.take_events()
        if isinstance(e, compat.BlockStored)
    ]


def test_block_stored_events_are_vllms_with_lora_salt_and_session() -> None:
    config = _config(_full(), num_blocks=12)
    events = []
    for manager in _managers(config, enable_kv_cache_events=True):
        request = _request(
            "a",
            list(range(5 * BLOCK + 3)),
            lora_request=compat.lora_request("adapter", 42),
            cache_salt="salt",
            session_id="session-1",
        )
        assert manager.allocate_slots(request, 2 * BLOCK + 5) is not None
        request.num_computed_tokens = 2 * BLOCK + 5
        assert manager.allocate_slots(request, 3 * BLOCK - 2) is not None
        events.append(_stored(manager))
    assert events[0] == events[1]
    assert [len(e[0]) for e in events[1]] == [2, 3]  # one event per commit
    assert events[1][0][4:6] == (42, "adapter") and events[1][0][8] == "session-1"


# -- placeholder token ids ---------------------------------------------------------------
def test_placeholder_ids_of_a_multimodal_request_are_served_as_vllm() -> None:
    prompt = list(range(10)) + [-1] * 22 + list(range(10, 30))
    image = compat.multimodal_feature("img-a", 10, 22, "image")
    hits = []
    for manager in _managers(_config(_full())):
        first = _request("0", prompt, mm_features=[image])
        assert manager.allocate_slots(first, first.num_tokens) is not None
        second = _request("1", prompt[:48] + [7] * 9, mm_features=[image])
        hits.append(manager.get_computed_blocks(second)[1])
    assert hits[0] == hits[1] == 3 * BLOCK
    # block identity is vLLM's digest: token ids are never read, any id is served as vLLM
    for manager in _managers(_config(_full())):
        assert manager.allocate_slots(_request("text", [1, 2, 3, -1, 5]), 5) is not None


# -- reserved blocks -------------------------------------------------------------------
@pytest.mark.parametrize(("reserved", "fits"), [(4, True), (10, False)])
def test_reserved_blocks_stay_free_as_in_vllm(reserved: int, fits: bool) -> None:
    for manager in _managers(_config(_full(), num_blocks=11), max_model_len=128):
        request = _request("chunk", list(range(128)))
        blocks = manager.allocate_slots(
            request, BLOCK, full_sequence_must_fit=True, reserved_blocks=reserved
        )
        assert (blocks is not None) is fits
