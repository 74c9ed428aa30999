"""`integrations.vllm.harness.pinning` on a hand-built allocator state (no scheduler)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness.pinning import PinningTally, chunk_pinning
from jenga.allocator import NULL_BLOCK


class _Alloc:
    def __init__(self, tables: dict[str, list[list[int]]], used: int) -> None:
        self.tables, self.used = tables, used

    def block_table(self, rid: str, g: int) -> list[int]:
        return self.tables[rid][g]

    def usage(self) -> SimpleNamespace:
        return SimpleNamespace(used_units=self.used)


def test_single_pinned_and_packable_chunks_count_distinct_live_blocks_per_page() -> None:
    # group 0: pages of 4 blocks, 2 chunks each; group 1: pages of 2 blocks, 1 chunk
    groups = [
        SimpleNamespace(pages=SimpleNamespace(blocks_per_large_page=4, units_per_large_page=2)),
        SimpleNamespace(pages=SimpleNamespace(blocks_per_large_page=2, units_per_large_page=1)),
    ]
    tables = {
        # a and b share block 0 (a prefix); a holds 1 on page 0, 5 alone on page 1;
        # b holds 9 alone on page 2
        "a": [[0, 1, 5], [NULL_BLOCK, 3]],
        "b": [[0, 9], [0, 1]],
    }
    manager = SimpleNamespace(
        allocator=_Alloc(tables, used=12), layout=SimpleNamespace(groups=groups)
    )
    mapped, single, packable = chunk_pinning(manager, ["a", "b"])
    # group 0: live {0, 1, 5, 9} on pages {0: 2, 1: 1, 2: 1} -> 2 single pages x 2 chunks;
    # packed: ceil(4/4) = 1 page instead of 3 -> 4 chunks. group 1: live {0, 1, 3} on
    # pages {0: 2, 1: 1} -> 1 single page x 1 chunk; packed 2 pages = 2 -> 0.
    assert (mapped, single, packable) == (12, 5, 4)
    tally = PinningTally()
    tally.add(mapped, single, packable)
    tally.add(8, 0, 0)
    assert (tally.single_pinned_fraction, tally.packable_fraction) == (0.25, 0.2)
    assert PinningTally().packable_fraction == 0.0
