"""The allocator's bad-input table: a fractional token count (`allocate("r", 1.5)`), float
or digit-string prompts, `append_tokens([1.9])` and 10**12 tokens each raise a jenga error
with the value, and change nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from jenga.allocator import AllocatorConfig
from jenga.pages import vmm_page_table

from jenga import InvalidInput, InvalidSize, JengaAllocator, presets

CASES: list[tuple[str, Callable[[JengaAllocator], Any], type[Exception], str]] = [
    ("allocate float", lambda a: a.allocate("r", 1.5), InvalidInput, "1.5"),
    ("allocate str", lambda a: a.allocate("r", "4"), InvalidInput, "'4'"),
    ("allocate bool", lambda a: a.allocate("r", True), InvalidInput, "True"),
    ("allocate 10**12", lambda a: a.allocate("r", 10**12), InvalidSize, "1000000000010"),
    ("allocate 2**64", lambda a: a.allocate("r", 2**64), InvalidSize, str(2**64 + 10)),
    ("prompt floats", lambda a: a.add_request("s", [1.0, 2.0]), InvalidInput, "1.0"),
    ("prompt digit string", lambda a: a.add_request("s", "123"), InvalidInput, "'123'"),
    ("prompt negative id", lambda a: a.add_request("s", [5, -3]), InvalidInput, "-3"),
    ("prompt float array", lambda a: a.add_request("s", np.ones(4)), InvalidInput, "float64"),
    (
        "prompt 10**12 tokens",
        lambda a: a.add_request("s", range(10**12)),
        InvalidSize,
        "1000000000000 tokens exceed",
    ),
    ("append float", lambda a: a.append_tokens("r", [1.9]), InvalidInput, "1.9"),
    ("append str", lambda a: a.append_tokens("r", ["7"]), InvalidInput, "'7'"),
    ("cache float", lambda a: a.cache("r", 4.0), InvalidInput, "4.0"),
    ("salt float", lambda a: a.add_request("s", [1, 2], salt=0.5), InvalidInput, "0.5"),
]


def _allocator() -> JengaAllocator:
    model = presets.get("gemma-2-9b")
    table = vmm_page_table(model)
    return JengaAllocator(AllocatorConfig.from_page_table(model, table, total_units=512))


@pytest.mark.parametrize(
    ("call", "error", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_raises_with_the_value_and_changes_nothing(
    call: Callable[[JengaAllocator], Any], error: type[Exception], text: str
) -> None:
    alloc = _allocator()
    alloc.add_request("r", list(range(10)))
    alloc.allocate("r", 10)
    before = (alloc.num_tokens("r"), alloc.stats())
    with pytest.raises(error) as info:
        call(alloc)
    assert text in str(info.value)
    assert (alloc.num_tokens("r"), alloc.stats()) == before
    alloc.allocate("r", 1)  # still usable: the next growing allocate works
    alloc.check_invariants(True)


def test_numpy_ints_and_int_arrays_are_accepted() -> None:
    alloc = _allocator()
    alloc.add_request("r", np.arange(10, dtype=np.int64))
    assert alloc.allocate("r", np.int32(10)) is not None
    alloc.append_tokens("r", [np.int64(3)])
