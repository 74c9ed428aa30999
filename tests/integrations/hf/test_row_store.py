"""`RowStore.ensure` after a failure: no double allocation, no duplicate request ids."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from integrations.hf.cache import RowStore

import vmm
from tests.integrations.kvcache.conftest import MakeCache, hybrid_model
from tests.integrations.kvcache.conftest import make_cache as make_cache


def row_tokens(store: RowStore) -> list[int]:
    return [store.kv.num_tokens(row) for row in range(store.num_rows)]


def test_failed_ensure_records_grown_rows_and_a_retry_allocates_only_what_is_missing(
    make_cache: MakeCache,
):
    kv = make_cache(hybrid_model(), budget_chunks=8)
    store = RowStore(kv)
    store.ensure(2, 1)
    with pytest.raises(vmm.OutOfMemory, match="row 1 needs 32 more tokens, 0 of 8 chunks free"):
        store.ensure(2, 33)
    # Row 0 grew inside its mapped page (the allocator cannot shrink it); row 1 did not.
    assert (store.length, store.row_lengths, row_tokens(store)) == (1, [33, 1], [33, 1])
    with pytest.raises(vmm.OutOfMemory, match="row 1 needs 32 more tokens"):
        store.ensure(2, 33)  # the retry does not grow row 0 a second time
    assert (store.length, store.row_lengths, row_tokens(store)) == (1, [33, 1], [33, 1])
    store.ensure(2, 17)  # row 0 already holds 17 tokens: only row 1 allocates
    assert (store.length, store.row_lengths, row_tokens(store)) == (17, [33, 17], [33, 17])
    assert kv.stats()["chunks.mapped.current"] == kv.allocator.usage().used_units
    kv.check_invariants(expensive=True)


def test_failed_registration_frees_the_rows_added_before_it(make_cache: MakeCache):
    kv = make_cache(hybrid_model(), budget_chunks=8)
    store = RowStore(kv)
    real_add, calls = kv.add_request, []

    def add_second_fails(request_id: Any, *args: Any, **kwargs: Any) -> int:
        calls.append(request_id)
        if len(calls) == 2:
            raise vmm.OutOfMemory("injected", needed=1)
        return real_add(request_id, *args, **kwargs)

    kv.add_request = add_second_fails  # type: ignore[method-assign]
    with pytest.raises(vmm.OutOfMemory, match="injected"):
        store.ensure(2, 1)
    assert (store.num_rows, calls, kv.allocator.stats()["requests.live"]) == (0, [0, 1], 0)
    store.ensure(2, 1)  # the retry registers both rows again, no duplicate id
    assert (store.num_rows, store.length, row_tokens(store)) == (2, 1, [1, 1])
    kv.check_invariants(expensive=True)
