"""Per-group VMM placement for vLLM: one virtual range per KV-cache group, in integers.

Rationale
    With one range per *layer* (the "per_layer" geometry), a large page of group g is
    ``k`` chunks in each of g's layer ranges, so one live block pins ``k`` chunks times
    the group's layer count (21-27 x 2 MiB for 8-9B hybrids) and memory moves between
    groups in those units. With one range per *group* a large page is ``k`` chunks that
    hold ``B`` whole blocks of *every* layer of the group, so the exchange unit shrinks by
    the layer count, and a group's page is its own unpadded block size: no cross-group
    padding as in vLLM's shared slots.

Approach
    Large pages are outermost; inside one page each layer's ``B`` blocks are contiguous
    (layer-compact within the page), at a per-layer block stride ``S``::

        range of group g:  | page 0 (k chunks)                | page 1          | ...
                           | L0: b0 b1 .. bB-1 | L1: b0 .. | .. |tail| L0: b0 .. |
                           ^ 0                 ^ B*S             ^ k*C

    vLLM's kernels address layer ``l``'s block id ``v`` at ``base_l + v * S`` (its
    `create_kv_cache_views` with ``layer_stride = B*S``, ``block_stride = S``). That is
    linear in ``v`` only if a page spans a whole number of ids, ``M = k*C / S``; so the
    allocator's block ``b = q*B + j`` (page q, slot j) is handed to vLLM as id
    ``q*M + j``, and ids ``q*M + B .. q*M + M - 1`` are never used (they alias other
    layers' blocks; an id costs nothing). Choosing ``S`` to divide the page, not the
    group's whole block (``L*S``), is what lets a page carry an epsilon tail: vLLM's
    block-outermost placement (``block_stride = L*p``) would need ``L*p`` to divide the
    page, which an odd layer count (Gemma 2 9B: 21 per group) never allows short of the
    exact LCM (21 chunks).

    `place_group` picks, for the smallest ``k`` whose waste is within ``epsilon``, the
    largest ``M`` (so the largest ``B = M // L``) whose stride ``S = k*C/M`` is a multiple
    of ``align`` and ``>= p``: attention pages (powers of two in practice) get ``S = p``
    (dense, so vLLM may still split a block into kernel blocks); a Mamba state is padded
    to ``S`` (its kernels read the real block stride). Waste = padding + tail, counted
    against ``epsilon`` together.

Limitations
    Pure arithmetic. The null block of a group is the first id past its last page
    (``max_pages * M``), which lands in the range's spare zero-backed page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STRIDE_ALIGN = 512
"""Bytes every per-layer block stride is a multiple of (covers fp32 states and vector loads)."""

MAX_CHUNKS_PER_PAGE = 64

POOL_PAGES_PER_LARGEST = 256
"""A page may grow past the smallest within-epsilon one, to cut its waste, up to
``pool chunks // POOL_PAGES_PER_LARGEST`` chunks (1/256 of the pool: at most one page
per group pinned by a request's partly filled page costs that little of the pool). At
1/512, Gemma 2 9B at 20 GiB could not take its exact 21-chunk page (no tail) and held
1.6 % fewer blocks than vLLM in 4-chunk pages (0.976x vLLM's running requests)."""


def pool_least_waste_chunks(pool_bytes: int, chunk_bytes: int) -> int:
    """The largest page `place_group` may take to cut waste, for a pool of these bytes."""
    return pool_bytes // chunk_bytes // POOL_PAGES_PER_LARGEST


class PlacementError(ValueError):
    """No placement fits (a layer's block larger than the largest page allowed)."""


@dataclass(frozen=True)
class GroupPlacement:
    """Where one group's blocks sit in its one range (bytes; ids are vLLM block ids)."""

    layer_bytes: int  # p: one block of one layer, unpadded
    num_layers: int  # L
    chunk_bytes: int  # C
    chunks_per_page: int  # k
    stride: int  # S: one block of one layer as placed (S >= p, S divides k*C)
    blocks_per_page: int  # B: allocator blocks per large page (B <= M // L)
    within_epsilon: bool = True

    def __post_init__(self) -> None:
        if self.page_bytes % self.stride or self.stride < self.layer_bytes:
            raise PlacementError(f"stride {self.stride} B does not divide the page {self}")
        if self.blocks_per_page * self.num_layers > self.ids_per_page:
            raise PlacementError(
                f"{self.blocks_per_page} blocks x {self.num_layers} layers "
                f"exceed the {self.ids_per_page} strides of a page"
            )

    @property
    def page_bytes(self) -> int:
        return self.chunks_per_page * self.chunk_bytes

    @property
    def ids_per_page(self) -> int:
        """M: vLLM block ids one page spans (``B`` of them are used)."""
        return self.page_bytes // self.stride

    @property
    def layer_stride(self) -> int:
        """Bytes between layer l's and layer l+1's block j of one page."""
        return self.blocks_per_page * self.stride

    @property
    def block_bytes(self) -> int:
        """One block of all layers, unpadded (what the allocator counts)."""
        return self.layer_bytes * self.num_layers

    @property
    def tail_bytes(self) -> int:
        """Bytes of a page not holding block data (padding to ``S`` plus the tail)."""
        return self.page_bytes - self.blocks_per_page * self.block_bytes

    @property
    def spread(self) -> bool:
        """True when vLLM ids differ from the allocator's (``M != B``)."""
        return self.ids_per_page != self.blocks_per_page

    def vllm_id(self, block: int) -> int:
        """vLLM block id of allocator block ``block``."""
        page, j = divmod(block, self.blocks_per_page)
        return page * self.ids_per_page + j

    def allocator_block(self, vllm_id: int) -> int:
        """Inverse of `vllm_id`; raises `PlacementError` for an unused id."""
        page, j = divmod(vllm_id, self.ids_per_page)
        if j >= self.blocks_per_page:
            raise PlacementError(
                f"vLLM block id {vllm_id} is slot {j} of page {page}, which holds "
                f"{self.blocks_per_page} blocks"
            )
        return page * self.blocks_per_page + j

    def layer_offset(self, layer: int) -> int:
        """Byte offset of layer ``layer``'s (index in the group) block 0 in the range."""
        return layer * self.layer_stride


def _largest_stride_count(page: int, layer_bytes: int, align: int) -> int:
    """Largest M with ``page % M == 0``, ``page // M >= layer_bytes`` and aligned; 0 if none."""
    for m in range(page // layer_bytes, 0, -1):
        if page % m == 0 and (page // m) % align == 0:
            return m
    return 0


def place_group(
    layer_bytes: int,
    num_layers: int,
    chunk_bytes: int,
    *,
    epsilon: float,
    align: int = STRIDE_ALIGN,
    max_chunks: int = MAX_CHUNKS_PER_PAGE,
    least_waste_chunks: int = 0,
) -> GroupPlacement:
    """The smallest page (``k`` chunks) whose waste is ``<= epsilon``, else the least waste.

    ``least_waste_chunks``: pages up to this many chunks are also tried, and the one with
    the least waste wins (the smaller on a tie); the budget's share, see
    `pool_least_waste_chunks`. Every wasted byte is a block the budget does not hold
    (Gemma 2 9B at 40 GiB: pages of 4 chunks hold 15,360 blocks, exact pages of 21 chunks
    15,600, vLLM's slots 15,602).
    """
    if min(layer_bytes, num_layers, chunk_bytes) <= 0:
        raise PlacementError(
            f"non-positive geometry: layer block {layer_bytes} B, {num_layers} layers, "
            f"chunk {chunk_bytes} B"
        )
    align = math.gcd(align, chunk_bytes)
    best: GroupPlacement | None = None
    for k in range(1, max_chunks + 1):
        page = k * chunk_bytes
        m = _largest_stride_count(page, layer_bytes, align)
        blocks = m // num_layers
        if blocks == 0:
            continue
        fit = GroupPlacement(layer_bytes, num_layers, chunk_bytes, k, page // m, blocks)
        if best is None or fit.tail_bytes / page < best.tail_bytes / best.page_bytes:
            best = fit
        within = best.tail_bytes <= epsilon * best.page_bytes
        if within and (k >= least_waste_chunks or best.tail_bytes == 0):
            return best
    if best is not None and best.tail_bytes <= epsilon * best.page_bytes:
        return best
    if best is None:
        raise PlacementError(
            f"one block of {num_layers} layers x {layer_bytes} B does not fit in "
            f"{max_chunks} chunks of {chunk_bytes} B"
        )
    return GroupPlacement(
        layer_bytes,
        num_layers,
        chunk_bytes,
        best.chunks_per_page,
        best.stride,
        best.blocks_per_page,
        within_epsilon=False,
    )
