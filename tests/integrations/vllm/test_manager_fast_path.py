"""A running request's step within the blocks it holds never reaches the
allocator's `allocate` (the manager answers from the allocator's per-request record)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from tests.integrations.vllm.test_conformance_fixes import _config, _full, _managers, _request


def _refuse(*_args: Any, **_kw: Any) -> None:
    raise AssertionError("allocate() was called for a step within held blocks")


def _step(request: Any, computed: int, token: int) -> None:
    """What the scheduler does after a step: tokens computed, one token sampled."""
    request.num_computed_tokens = computed
    request.append_output_token_ids(token)


def test_a_decode_within_held_blocks_does_not_call_allocate() -> None:
    _, ours = _managers(_config(_full()))
    request = _request("r", list(range(20)))
    assert ours.allocate_slots(request, 20) is not None  # blocks for tokens 0..31
    _step(request, 20, 7)
    allocate = ours.allocator.allocate
    ours.allocator.allocate = _refuse  # type: ignore[method-assign]
    for n in range(21, 33):  # decodes up to the end of the second block
        assert ours.allocate_slots(request, 1) is ours.empty_kv_cache_blocks
        assert ours.allocator.num_tokens("r") == n
        _step(request, n, 7)
    with pytest.raises(AssertionError, match="within held blocks"):
        ours.allocate_slots(request, 1)  # token 33 needs a third block: the allocator
    ours.allocator.allocate = allocate  # type: ignore[method-assign]
    blocks = ours.allocate_slots(request, 1)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 1
    assert ours.allocator.num_tokens("r") == 33
