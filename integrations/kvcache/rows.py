"""per_request layout (vAttention / vTensor): one row of virtual memory per request.

Rationale
    Non-paged kernels (`flash_attn_with_kvcache(..., cache_batch_idx=...)`, plain SDPA)
    want each request's K/V as one contiguous run of tokens. Reserving, per layer, a
    ``[max_requests, max_tokens, H, D]`` range and mapping chunks into a request's row as
    it grows gives that with no block table at all; a shared prefix costs nothing extra
    because the same chunks are mapped into a second row.

Approach
    ::

        layer l, K range:  row 0 | c0 | c1 | c2 | -- | -- |      (c = one chunk of tokens)
                           row 1 | c0 | c1'| -- | -- | -- |      c0 shared with row 0
                           row 2 | -- | -- | -- | -- | -- |      free row

    * A row is ``chunks_per_row`` slots; token t of a request is at slot
      ``row * chunks_per_row + t // tokens_per_chunk``.
    * `share_prefix(dst, src, n)` maps src's chunks covering tokens [0, n) into dst's row
      (`VirtualRange.share_from`): full chunks and a partially filled last one alike.
    * Copy-on-write: before dst writes into a chunk it shares, the chunk is copied out,
      the slot unmapped (the other row keeps the chunk), a fresh chunk mapped, and the
      copy written back. Only the partially filled last shared chunk is ever written.
    * Every grow / share / free is one `vmm.MappingPlan` over all layers' ranges (atomic).

Limitations
    Attention layers of one shape only (no Mamba, no per-group mixing); sliding-window
    layers keep their whole history mapped (no window release, as in vAttention).
    ``tokens_per_chunk = chunk / (H * D * itemsize)`` must be an integer.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vmm.errors import OutOfMemory
from vmm.extras import require
from vmm.plan import MappingPlan
from vmm.pool import ChunkPool
from vmm.range import VirtualRange

from integrations.kvcache.geometry import LayoutError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RowShape:
    """Sizes of a per_request cache; `dtype` is a torch dtype."""

    num_layers: int
    max_requests: int
    max_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: Any


@dataclass
class _Row:
    index: int
    length: int = 0  # tokens with mapped slots
    shared: set[int] | None = None  # chunk indices mapped from another row (read-only)


class RowKVCache:
    """K and V ranges per layer, ``[max_requests, max_tokens, H, D]`` each."""

    def __init__(self, pool: ChunkPool, shape: RowShape) -> None:
        require("torch", "a per-request KV cache (integrations.kvcache.rows)")
        import torch

        self.pool = pool
        self.shape = shape
        itemsize = torch.empty((), dtype=shape.dtype).element_size()
        token_bytes = shape.num_kv_heads * shape.head_dim * itemsize
        chunk = pool.granularity
        if chunk % token_bytes:
            raise LayoutError(
                f"a {chunk}-byte chunk is not a whole number of {token_bytes}-byte tokens"
            )
        self.tokens_per_chunk = chunk // token_bytes
        self.chunks_per_row = -(-shape.max_tokens // self.tokens_per_chunk)
        self.row_tokens = self.chunks_per_row * self.tokens_per_chunk
        size = shape.max_requests * self.chunks_per_row * chunk
        self.ranges: list[tuple[VirtualRange, VirtualRange]] = [
            (pool.reserve(size, name=f"L{i}.k"), pool.reserve(size, name=f"L{i}.v"))
            for i in range(shape.num_layers)
        ]  # fmt: skip
        self._free_rows = list(range(shape.max_requests - 1, -1, -1))
        self._rows: dict[Hashable, _Row] = {}
        self.stats = {"rows.cow_chunks": 0, "rows.shared_chunks": 0}

    def _all_ranges(self) -> list[VirtualRange]:
        return [r for pair in self.ranges for r in pair]

    def _slots(self, row: _Row, first_chunk: int, stop_chunk: int) -> list[int]:
        base = row.index * self.chunks_per_row
        return list(range(base + first_chunk, base + stop_chunk))

    def _chunks_for(self, length: int) -> int:
        return -(-length // self.tokens_per_chunk)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: Hashable) -> int:
        """Give the request a free row; returns its index."""
        if request_id in self._rows:
            raise ValueError(
                f"request {request_id!r} already has row {self._rows[request_id].index}"
            )
        if not self._free_rows:
            raise OutOfMemory(f"all {self.shape.max_requests} rows are taken")
        row = _Row(self._free_rows.pop(), shared=set())
        self._rows[request_id] = row
        return row.index

    def row(self, request_id: Hashable) -> int:
        return self._row(request_id).index

    def _row(self, request_id: Hashable) -> _Row:
        if request_id not in self._rows:
            raise KeyError(f"unknown request {request_id!r} ({len(self._rows)} rows in use)")
        return self._rows[request_id]

    def grow(self, request_id: Hashable, length: int) -> None:
        """Map chunks so tokens [0, length) of the request have slots (all layers, atomic)."""
        row = self._row(request_id)
        if length > self.row_tokens:
            raise LayoutError(f"{length} tokens exceed the row of {self.row_tokens}")
        have, need = self._chunks_for(row.length), self._chunks_for(length)
        if need > have:
            plan = MappingPlan()
            for rng in self._all_ranges():
                plan.map(rng, self._slots(row, have, need))
            plan.apply(self.pool)
        row.length = max(row.length, length)

    def share_prefix(self, dst_id: Hashable, src_id: Hashable, num_tokens: int) -> None:
        """Map src's chunks holding tokens [0, num_tokens) into dst's (empty) row."""
        dst, src = self._row(dst_id), self._row(src_id)
        if dst.length or num_tokens > src.length:
            raise ValueError(
                f"share_prefix: dst has {dst.length} tokens (must be 0), src has {src.length} "
                f"< {num_tokens}"
            )
        n = self._chunks_for(num_tokens)
        plan = MappingPlan()
        for rng in self._all_ranges():
            plan.share(rng, self._slots(src, 0, n), rng, self._slots(dst, 0, n))
        plan.apply(self.pool)
        dst.length = num_tokens
        dst.shared = set(range(n))
        self.stats["rows.shared_chunks"] += n

    def free(self, request_id: Hashable) -> None:
        """Unmap the request's row (shared chunks stay mapped in the other rows)."""
        row = self._row(request_id)
        n = self._chunks_for(row.length)
        if n:
            plan = MappingPlan()
            for rng in self._all_ranges():
                plan.unmap(rng, self._slots(row, 0, n))
            plan.apply(self.pool)
        del self._rows[request_id]
        self._free_rows.append(row.index)

    # ---- tensors ---------------------------------------------------------------------------
    def row_view(self, layer: int, tensor: int) -> torch.Tensor:
        """``[max_requests, row_tokens, H, D]`` over layer's K (0) or V (1) range."""
        s = self.shape
        rng = self.ranges[layer][tensor]
        return rng.tensor((s.max_requests, self.row_tokens, s.num_kv_heads, s.head_dim), s.dtype)

    def write(
        self, layer: int, request_id: Hashable, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``[n, H, D]`` keys/values at positions [start, start + n) (grown first)."""
        row = self._row(request_id)
        stop = start + keys.shape[0]
        if stop > row.length:
            raise LayoutError(f"write up to {stop} but the row has {row.length} tokens mapped")
        self._unshare(row, start // self.tokens_per_chunk, self._chunks_for(stop))
        self.row_view(layer, 0)[row.index, start:stop] = keys
        self.row_view(layer, 1)[row.index, start:stop] = values

    def read(
        self, layer: int, request_id: Hashable, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy ``[stop, H, D]`` views of the request's K and V."""
        row = self._row(request_id)
        return self.row_view(layer, 0)[row.index, :stop], self.row_view(layer, 1)[row.index, :stop]

    def _unshare(self, row: _Row, first: int, stop: int) -> None:
        """Copy-on-write every shared chunk in [first, stop) of the row, in every layer."""
        todo = sorted(c for c in (row.shared or ()) if first <= c < stop)
        if not todo:
            return
        slots = self._slots(row, 0, self.chunks_per_row)
        targets = [slots[c] for c in todo]
        saved = [self._chunk_bytes(rng, targets) for rng in self._all_ranges()]
        plan = MappingPlan()
        for rng in self._all_ranges():
            plan.unmap(rng, targets).map(rng, targets)
        plan.apply(self.pool)
        for rng, data in zip(self._all_ranges(), saved, strict=True):
            for slot, chunk in zip(targets, data, strict=True):
                rng.tensor(self.pool.granularity, _uint8(), slot * self.pool.granularity).copy_(
                    chunk
                )
        assert row.shared is not None
        row.shared.difference_update(todo)
        self.stats["rows.cow_chunks"] += len(todo)

    def _chunk_bytes(self, rng: VirtualRange, slots: Sequence[int]) -> list[torch.Tensor]:
        gran = self.pool.granularity
        return [rng.tensor(gran, _uint8(), slot * gran).clone() for slot in slots]

    # ---- accounting ------------------------------------------------------------------------
    def live_bytes(self) -> int:
        """Bytes the requests' tokens need (a shared prefix counted in each request)."""
        per_token = 2 * self.shape.num_layers * self.pool.granularity // self.tokens_per_chunk
        return sum(row.length for row in self._rows.values()) * per_token

    def check_invariants(self) -> None:
        """Each range maps exactly the chunks covering every row's length."""
        self.pool.check_invariants(expensive=True)
        want = {
            s
            for row in self._rows.values()
            for s in self._slots(row, 0, self._chunks_for(row.length))
        }
        for rng in self._all_ranges():
            got = set(rng.slot_to_handle())
            assert got == want, f"range {rng.name!r}: slots {sorted(got)} != {sorted(want)}"

    def close(self) -> None:
        for rng in self._all_ranges():
            rng.close()


def _uint8() -> Any:
    import torch

    return torch.uint8
