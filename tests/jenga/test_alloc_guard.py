"""`JengaAllocator` refuses what would corrupt it at the call: a second thread inside it
(`ConcurrentUse`, nothing changed) and token ids past int64 (they would be stored
negative)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.errors import ConcurrentUse, InvalidInput
from jenga.specs import Kind


def _alloc() -> JengaAllocator:
    return JengaAllocator(AllocatorConfig((GroupConfig("full", Kind.FULL, 4, 2, 1),), 16))


def test_a_second_thread_inside_a_call_raises_concurrent_use_and_changes_nothing() -> None:
    alloc = _alloc()
    alloc.add_request("a", list(range(8)))
    inside, leave = threading.Event(), threading.Event()
    needs = alloc._group_needs

    def held_inside(*args: Any) -> Any:
        inside.set()
        assert leave.wait(10)
        return needs(*args)

    alloc._group_needs = held_inside  # type: ignore[method-assign]
    worker = threading.Thread(target=alloc.allocate, args=("a", 8))
    worker.start()
    assert inside.wait(10)
    before = alloc.usage()
    with pytest.raises(ConcurrentUse, match=r"JengaAllocator\.add_request called from thread"):
        alloc.add_request("b", [1, 2, 3])
    with pytest.raises(ConcurrentUse, match=r"JengaAllocator\.free called from thread"):
        alloc.free("a")
    assert alloc.usage() == before
    leave.set()
    worker.join(10)
    assert alloc.num_tokens("a") == 8 and alloc.stats()["requests.live"] == 1
    alloc.check_invariants(expensive=True)


def test_the_same_thread_reenters_and_calls_in_turn_from_two_threads_pass() -> None:
    alloc = _alloc()
    alloc.add_request("a", [1] * 16)
    assert alloc.allocate("a", 16) is not None
    alloc.cache("a", 16)
    alloc.free("a")
    assert alloc.set_total_units(1).num_unmaps == 1  # re-enters evict_cached, same thread
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(alloc.add_request("b", [1] * 9)))
    worker.start()
    worker.join(10)
    assert done == [8]  # the page with the first 8 tokens is still cached


@pytest.mark.parametrize(
    "prompt",
    [np.array([1, 2**63], dtype=np.uint64), [1, 2**63], [1, 2**64 + 5]],
    ids=["uint64-array", "int-list", "int-list-past-uint64"],
)
def test_token_ids_past_int64_are_refused_at_the_call(prompt: Any) -> None:
    alloc = _alloc()
    with pytest.raises(InvalidInput, match=r"prompt\[1\] is \d+, token ids must be <= "):
        alloc.add_request("a", prompt)
    assert alloc.stats()["requests.live"] == 0
