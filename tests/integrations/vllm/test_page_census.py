"""`integrations.vllm.harness.page_census` on the real scheduler (Ministral stand-in)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import page_census
from integrations.vllm.harness.pinning import chunk_pinning
from integrations.vllm.harness.side_by_side import Workload


def test_census_pages_agree_with_chunk_pinning_and_admissions_are_counted_once() -> None:
    """128 MiB, 32 requests: ours preempts. Every step's census splits the mapped pages
    into pages with a live block and idle ones, and its stranded pages are the chunks
    `chunk_pinning` finds packable (live blocks of the running requests); every request
    is admitted once."""
    packable: list[int] = []
    stranded: list[int] = []

    class Both(page_census.PageCensus):
        def __call__(self, scheduler: Any, out: Any) -> None:
            super().__call__(scheduler, out)
            kv = scheduler.kv_cache_manager
            running = [r.request_id for r in scheduler.running]
            packable.append(chunk_pinning(kv, running)[2])
            core = kv.allocator._core
            groups = kv.layout.groups
            census = [
                page_census.group_census(core, g, grp.pages.blocks_per_large_page)
                for g, grp in enumerate(groups)
            ]
            for c in census:
                assert c.live_pages + c.idle_pages == c.mapped_pages
                assert c.pages_needed <= c.live_pages
            units = [grp.pages.units_per_large_page for grp in groups]
            stranded.append(sum(c.stranded_pages * u for c, u in zip(census, units, strict=True)))

    observer = Both()
    workload = Workload(requests=32)
    page_census.run_cell("ministral", 128, workload, "jenga-vmm-group", observer=observer)
    assert observer.preempting, "the cell preempts (its census is recorded)"
    assert observer.before_first, "the step before the first preemption is kept"
    assert stranded == packable
    assert max(stranded) > 0  # window pages do pin chunks beyond a packed placement
    assert sum(observer.hit_lengths.values()) == workload.requests
    assert "first-admission hit lengths" in page_census.format_census(observer)
