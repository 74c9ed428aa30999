"""Token-level reads and writes of attention layers through the block tables.

Rationale
    Engines without a paged kernel (torch SDPA here, the transformers Cache) need a
    request's K/V as a dense ``[n, H, D]`` tensor and must write new tokens into their
    slots. Both are one advanced-indexing op over the layer's paged view, so no Python
    loop runs per token.

Approach
    Token t of a request lives in block ``table[t // T]`` at row ``t % T``; the block is
    (page, j) = divmod(block, B) in the paged view ``[pages, B, (2,) T, H, D]``.
    `TokenSlots` holds the three index vectors for a span of positions, computed once per
    group and step and reused for every layer of the group.

    One-vector kinds (MLA's latent) hold one ``[H, D]`` vector per token:
    `write_latent` / `read_latent` move it through the same slots.

Limitations
    K/V kinds (full, sliding, chunked, cross attention) through `write_kv` / `read_kv`,
    one-vector kinds through `write_latent` / `read_latent`. Reading a position
    whose block the request released (``NULL_BLOCK``) raises `ReleasedBlockError`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jenga.allocator import NULL_BLOCK

from integrations.kvcache.cache import KVCache

if TYPE_CHECKING:
    import torch


class ReleasedBlockError(IndexError):
    """A position's block was released (left the window) or never allocated."""


@dataclass(frozen=True)
class TokenSlots:
    """Index vectors (page, block-in-page, row-in-block) for positions [start, stop)."""

    start: int
    stop: int
    pages: torch.Tensor
    blocks: torch.Tensor
    rows: torch.Tensor


def token_slots(
    cache: KVCache,
    request_id: Hashable,
    group: int,
    start: int,
    stop: int,
    table: Sequence[int] | None = None,
) -> TokenSlots:
    """Where positions [start, stop) of `request_id` live in group `group` (`table`: a
    block table taken earlier, e.g. before an allocation that releases blocks)."""
    import torch

    geo = cache.geometries[group]
    spec = cache.model.groups[group].spec
    if table is None:
        table = cache.block_table(request_id, group)
    t = spec.block_size
    first, last = start // t, (stop - 1) // t
    if stop <= start:
        empty = torch.empty(0, dtype=torch.long)
        return TokenSlots(start, stop, empty, empty, empty)
    if last >= len(table) or NULL_BLOCK in table[first : last + 1]:
        raise ReleasedBlockError(
            f"request {request_id!r} group {geo.name!r}: positions [{start}, {stop}) need "
            f"blocks {first}..{last}, table has {len(table)} entries: "
            f"{list(table[first : last + 1])}"
        )
    positions = torch.arange(start, stop)
    block_ids = torch.tensor(list(table), dtype=torch.long)[positions // t]
    return TokenSlots(
        start,
        stop,
        block_ids // geo.blocks_per_page,
        block_ids % geo.blocks_per_page,
        positions % t,
    )


def write_kv(
    cache: KVCache, layer: int, slots: TokenSlots, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Store ``keys``/``values`` ``[n, H, D]`` at `slots` of `layer`."""
    p, b, r = slots.pages, slots.blocks, slots.rows
    if cache.group_of(layer).tensors_per_layer == 2:
        cache.layer_view(layer, 0)[p, b, r] = keys
        cache.layer_view(layer, 1)[p, b, r] = values
        return
    view = cache.layer_view(layer)
    view[p, b, 0, r] = keys
    view[p, b, 1, r] = values


def read_kv(cache: KVCache, layer: int, slots: TokenSlots) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` ``[n, H, D]`` at `slots` of `layer` (a gather: new tensors)."""
    p, b, r = slots.pages, slots.blocks, slots.rows
    if cache.group_of(layer).tensors_per_layer == 2:
        return cache.layer_view(layer, 0)[p, b, r], cache.layer_view(layer, 1)[p, b, r]
    view = cache.layer_view(layer)
    return view[p, b, 0, r], view[p, b, 1, r]


def write_latent(cache: KVCache, layer: int, slots: TokenSlots, latents: torch.Tensor) -> None:
    """Store one-vector-kind ``latents`` ``[n, H, D]`` (MLA) at `slots` of `layer`."""
    cache.layer_view(layer)[slots.pages, slots.blocks, slots.rows] = latents


def read_latent(cache: KVCache, layer: int, slots: TokenSlots) -> torch.Tensor:
    """The ``[n, H, D]`` latents at `slots` of a one-vector-kind `layer` (a gather)."""
    return cache.layer_view(layer)[slots.pages, slots.blocks, slots.rows]
