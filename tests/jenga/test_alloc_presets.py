"""Every preset's page table drives the allocator: a short shared-prefix trace per model.

Builds `AllocatorConfig.from_page_table` for each preset in VMM mode and in static LCM
mode, runs two requests that share a prompt (with an image for vision models), and
checks invariants, the prefix hit, and that freeing everything leaves only cached blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from jenga.allocator import AllocatorConfig, ImageSpan, JengaAllocator
from jenga.pages import static_page_table, vmm_page_table
from jenga.specs import Kind

from jenga import presets


@pytest.mark.parametrize("mode", ["vmm", "static"])
@pytest.mark.parametrize("name", presets.names())
def test_preset_trace(name: str, mode: str):
    model = presets.get(name)
    table = vmm_page_table(model) if mode == "vmm" else static_page_table(model)
    units = max(g.units_per_large_page for g in table.groups) * 64
    alloc = JengaAllocator(AllocatorConfig.from_page_table(model, table, units))
    kinds = {g.spec.kind for g in model.groups}
    step = alloc._prefix_step
    prompt = np.arange(2 * step + 7, dtype=np.int64) % 50_000
    image_kinds = {Kind.CROSS_ATTENTION, Kind.VISION_EMBEDDING}
    images = [ImageSpan(1, 5, 77)] if kinds & image_kinds else []
    assert alloc.add_request("a", prompt, images=images) == 0
    got = alloc.allocate("a", len(prompt))
    assert got is not None
    assert alloc.cache("a", len(prompt)) > 0
    alloc.free("a")
    alloc.check_invariants(expensive=True)
    fractional = any(g.spec.token_fraction != (1, 1) for g in model.groups)
    expected = 0 if fractional else 2 * step
    assert alloc.add_request("b", prompt, images=images) == expected
    assert alloc.allocate("b", len(prompt) - expected) is not None
    alloc.free("b")
    use = alloc.usage()
    assert sum(use.used_blocks) == 0 and sum(use.cached_blocks) > 0
    alloc.check_invariants(expensive=True)
