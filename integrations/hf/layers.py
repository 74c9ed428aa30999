"""`VmmCache` layer objects: one per decoder layer, storing in the rows' jenga blocks.

Rationale
    transformers' `Cache` is a list of layer objects, one per decoder layer, whose class
    follows the layer's type. Each class here subclasses the library's own layer of that
    type, so the mask bookkeeping (`get_mask_sizes`, `cumulative_length`) and the
    model's calls (`update`, `update_conv_state`, `get_conv_state`, ...) stay the
    library's, while the data lives in the chunks jenga mapped for the row.

Approach
    ::

        full_attention      VmmLayer            returns positions [0, stop)
        full_attention of   VmmLatentLayer      the latent pair transformers caches (see
          an MLA group                          below), positions [0, stop)
        sliding_attention   VmmSlidingLayer     returns [past - (w - 1), stop)
        chunked_attention   VmmChunkedLayer     same span as transformers (a sliding layer
                                                of w = chunk); positions before the current
                                                chunk were released by jenga: zeros, which
                                                the chunked mask never reads
        linear_attention    VmmMambaLayer       conv + recurrent state: views of the row's
                                                live state block (Mamba group)
        hybrid(_sliding)    VmmHybridLayer /    both: the attention part in the attention
                            VmmHybridSlidingLayer  group, the state in the Mamba group
        cross attention     VmmCrossLayer       mllama's image K/V, written once
        dummy (KV reader)   transformers' DummyLayer: the model hands the owner's K/V over

    Multi-head latent attention (DeepSeek-V3 and its kin): transformers caches the
    compressed latent, not a per-head K and V. Its ``update`` gets ``kv_nope``
    [rows, 1, q, kv_lora_rank] as keys and the roped ``k_rot`` [rows, 1, q, rope] as
    values, and up-projects what it gets back. The jenga group is `Kind.MLA` (one vector
    per token); `VmmLatentLayer` stores the two side by side as that vector and hands
    them back split, each contiguous as `DynamicLayer`'s concatenation would be.

    A state block holds ``conv [channels, kernel]`` then, at the next 16-byte boundary,
    the recurrent state. The batch dimension is a strided view over the rows' blocks (one
    uniform stride), so transformers' in-place updates land in our memory. When a row's
    live state moves to a new checkpoint block, the store (`RowStore`) copies every state
    block and the layers re-point their views (`repoint`). The store is typed by the
    `LayerStore` protocol (`integrations.hf.store`).

    Rows whose live state blocks have no uniform positive stride (after beam reordering:
    rows that continue one beam share its block until their next step copies it, and the
    copies land anywhere) get a gathered copy instead of a view (`index_select`, what
    transformers' own reorder makes). The copy is the rows' state until the store's next
    allocation, which writes it into each row's live block (`flush_states`) and points
    again: a view once the blocks are in order (a checkpoint move allocates the rows'
    new blocks in row order), else a new gathered copy.

Limitations
    Released positions of a chunked layer read as zeros, correct only under the chunked
    mask.
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import torch
from jenga.allocator import NULL_BLOCK
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from integrations.hf.store import LayerStore
from integrations.kvcache.access import (
    read_kv,
    read_latent,
    token_slots,
    write_kv,
    write_latent,
)


class UnsupportedLayer(NotImplementedError):
    """The model has a layer type, or a state layout, this cache does not store."""


def _unsupported(self: Any, *args: Any, **kwargs: Any) -> None:
    raise NotImplementedError(
        "a VmmCache layer is not cropped, reordered or reindexed alone: VmmCache reorders, "
        "expands and selects its batch rows as a whole, and does not crop"
    )


class AttentionPart:
    """Write new K/V into each row's blocks; return positions [start, stop) gathered."""

    store: LayerStore
    layer_idx: int
    seen: int = 0  # tokens written so far

    def _window_start(self, past: int) -> int:
        return 0

    def _attend(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        past = self.seen
        rows, _, q, _ = key_states.shape
        stop = past + q
        self.store.ensure(rows, stop, key_states.dtype)
        kv, group = self.store.kv, self.store.attention_group(self.layer_idx)
        self._check(key_states, value_states, group)
        keys, values = [], []
        for row in range(rows):
            rid, table = self.store.request(row), self.store.table(row, group)
            new = token_slots(kv, rid, group, past, stop, table)
            self._write(new, key_states[row].transpose(0, 1), value_states[row].transpose(0, 1))
            k, v = self._read(row, group, self._window_start(past), stop)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        self.seen = stop
        return torch.stack(keys), torch.stack(values)

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor, group: int) -> None:
        """Refuse K/V the group cannot store (the group's spec matched the model's)."""

    def _write(self, slots: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``[tokens, heads, dim]`` keys and values at ``slots``."""
        write_kv(self.store.kv, self.layer_idx, slots, keys, values)

    def _load(self, slots: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[tokens, heads, dim]`` at ``slots``."""
        return read_kv(self.store.kv, self.layer_idx, slots)

    def _read(self, row: int, group: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Positions [start, stop); those whose block jenga released read as zeros."""
        kv = self.store.kv
        table = self.store.table(row, group)
        t = kv.model.groups[group].spec.block_size
        first = start // t
        while first < len(table) and table[first] == NULL_BLOCK:
            first += 1
        live = max(start, first * t)
        slots = token_slots(kv, self.store.request(row), group, live, stop, table)
        k, v = self._load(slots)
        if live == start:
            return k, v
        pad = k.new_zeros((live - start, *k.shape[1:]))
        return torch.cat([pad, k]), torch.cat([pad, v])

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class FullAttentionPart(AttentionPart):
    """`update` of a layer whose attention keeps every position (plain or beside a state);
    the base's own `lazy_initialization` sets up K/V, whatever a state part overrides."""

    is_initialized: bool

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            DynamicLayer.lazy_initialization(cast(DynamicLayer, self), key_states, value_states)
        return self._attend(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen


class SlidingAttentionPart(AttentionPart):
    """`update` of a sliding-window attention (plain or beside a state): the last
    ``w - 1`` cached positions plus the new ones; transformers' mask reads
    ``cumulative_length``."""

    is_initialized: bool
    sliding_window: int
    cumulative_length: int

    def _window_start(self, past: int) -> int:
        return max(0, past - (self.sliding_window - 1))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            DynamicSlidingWindowLayer.lazy_initialization(
                cast(DynamicSlidingWindowLayer, self), key_states, value_states
            )
        out = self._attend(key_states, value_states)
        self.cumulative_length = self.seen
        return out


class VmmLayer(FullAttentionPart, DynamicLayer):
    """Full attention: every position stays and is returned."""

    def __init__(self, store: LayerStore, layer_idx: int, **kwargs: Any) -> None:
        super().__init__()
        self.store, self.layer_idx = store, layer_idx


class VmmLatentLayer(VmmLayer):
    """Full attention over an MLA group: the latent pair transformers caches (``kv_nope``
    as keys, ``k_rot`` as values, one head each) stored as one vector per token."""

    key_width: int = 0  # of the pair's keys (the rest of a stored vector is its values)

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor, group: int) -> None:
        spec = self.store.kv.model.groups[group].spec
        heads, self.key_width = key_states.shape[1], key_states.shape[-1]
        got = (heads, self.key_width + value_states.shape[-1])
        if value_states.shape[:3] != key_states.shape[:3] or got != (
            spec.num_kv_heads, spec.head_dim
        ):  # fmt: skip
            raise UnsupportedLayer(
                f"layer {self.layer_idx}: the model caches {tuple(key_states.shape)} keys and "
                f"{tuple(value_states.shape)} values, the {spec.kind} group stores "
                f"{spec.num_kv_heads} x {spec.head_dim} per token"
            )

    def _write(self, slots: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        write_latent(self.store.kv, self.layer_idx, slots, torch.cat([keys, values], dim=-1))

    def _load(self, slots: Any) -> tuple[torch.Tensor, torch.Tensor]:
        whole = read_latent(self.store.kv, self.layer_idx, slots)
        return whole[..., : self.key_width], whole[..., self.key_width :]


class VmmSlidingLayer(SlidingAttentionPart, DynamicSlidingWindowLayer):
    """Sliding window w: returns the last ``w - 1`` cached positions plus the new ones."""

    def __init__(self, store: LayerStore, layer_idx: int, sliding_window: int, **kwargs: Any):
        super().__init__(sliding_window=sliding_window)
        self.store, self.layer_idx = store, layer_idx


class VmmChunkedLayer(VmmSlidingLayer):
    """Chunked local attention (Llama 4): the span of transformers' own chunked layer (a
    sliding layer with w = chunk); jenga frees blocks before the current chunk."""


class StatePart:
    """Conv and recurrent states as views over each row's live block in the Mamba group."""

    store: LayerStore
    layer_idx: int
    conv_states: dict[int, torch.Tensor | None]
    recurrent_states: dict[int, torch.Tensor | None]
    # set by transformers' LinearAttentionCacheLayerMixin (typed there by inference)
    conv_kernel_size: dict[int, Any]
    is_conv_states_initialized: dict[int, Any]
    is_recurrent_states_initialized: dict[int, Any]
    has_previous_state: dict[int, Any]
    dtype: Any
    device: Any

    def _state_view(
        self, rows: int, dtype: torch.dtype, offset: int, shape: tuple[int, ...]
    ) -> torch.Tensor:
        store = self.store
        store.ensure(rows, max(store.length, 1), dtype, check_dtype=False)
        kv, group = store.kv, store.state_group(self.layer_idx)
        geo = kv.geometries[group]
        blocks = [self.store.table(r, group)[-1] for r in range(rows)]
        itemsize = torch.empty((), dtype=dtype).element_size()
        end = offset + itemsize * int(torch.tensor(shape).prod())
        if end > geo.layer_block_bytes:
            raise UnsupportedLayer(
                f"layer {self.layer_idx}: state {shape} {dtype} ends at byte {end}, the state "
                f"block holds {geo.layer_block_bytes}"
            )
        offsets = [geo.block_offset(b) + geo.layer_offset(self.layer_idx) + offset for b in blocks]
        steps = {b - a for a, b in itertools.pairwise(offsets)}
        rng = kv.ranges[group][geo.range_index(self.layer_idx)]
        if len(steps) > 1 or any(step <= 0 for step in steps):  # a gathered copy
            return torch.stack([rng.tensor(shape, dtype, off) for off in offsets])
        row_stride = (steps.pop() if steps else geo.page_bytes) // itemsize
        inner = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * shape[i + 1]
        return rng.tensor((rows, *shape), dtype, offsets[0], (row_stride, *inner))

    def flush_states(self) -> None:
        """Write every gathered copy (see module note) into the rows' live blocks."""
        for key in self._gathered():
            which, view = key[0], self._views()[key]
            for row in range(view.shape[0]):
                self._row_state(row, view.dtype, self._offset(which), view.shape[1:]).copy_(
                    view[row]
                )

    def _row_state(
        self, row: int, dtype: torch.dtype, offset: int, shape: tuple[int, ...]
    ) -> torch.Tensor:
        kv, group = self.store.kv, self.store.state_group(self.layer_idx)
        geo = kv.geometries[group]
        block = self.store.table(row, group)[-1]
        rng = kv.ranges[group][geo.range_index(self.layer_idx)]
        return rng.tensor(tuple(shape), dtype, geo.block_offset(block) + geo.layer_offset(
            self.layer_idx) + offset)  # fmt: skip

    def _views(self) -> dict[tuple[int, int], torch.Tensor]:
        """(0 conv / 1 recurrent, state index) -> the view of our blocks we handed out."""
        return self.__dict__.setdefault("_state_views", {})

    def has_gathered(self) -> bool:
        return bool(self._gathered())

    def _gathered(self) -> set[tuple[int, int]]:
        """Keys of `_views` that are gathered copies, not views of our blocks."""
        return self.__dict__.setdefault("_state_gathered", set())

    def _offset(self, which: int) -> int:
        return 0 if which == 0 else self.store.recurrent_offset

    def _point(self, which: int, idx: int, rows: int, dtype: torch.dtype, shape: tuple) -> None:
        view = self._state_view(rows, dtype, self._offset(which), tuple(shape))
        base = self.store.kv.ranges[self.store.state_group(self.layer_idx)]
        gathered = not any(r.va <= view.data_ptr() < r.va + r.size for r in base)
        (self._gathered().add if gathered else self._gathered().discard)((which, idx))
        (self.conv_states, self.recurrent_states)[which][idx] = view
        self._views()[(which, idx)] = view

    def _take_states(self, state_idx: int) -> None:
        """Replace transformers' fresh zero tensors of `state_idx` by zeroed views."""
        for which, states in enumerate((self.conv_states, self.recurrent_states)):
            fresh = states.get(state_idx)
            if fresh is None or fresh is self._views().get((which, state_idx)):
                continue
            self._point(which, state_idx, fresh.shape[0], fresh.dtype, fresh.shape[1:])
            self._views()[(which, state_idx)].zero_()

    def repoint(self) -> None:
        """Rebuild every state view over the rows' current live blocks (after a move)."""
        for which, states in enumerate((self.conv_states, self.recurrent_states)):
            for idx, old in list(states.items()):
                if old is not None:
                    self._point(which, idx, self.store.num_rows, old.dtype, old.shape[1:])

    def state_layout(self) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
        """(dtype, per-row shape) of the conv and recurrent states, once initialized."""
        out = []
        for states in (self.conv_states, self.recurrent_states):
            state = states.get(0)
            if state is None:
                raise UnsupportedLayer(f"layer {self.layer_idx}: state 0 was never initialized")
            out.append((state.dtype, tuple(state.shape[1:])))
        return tuple(out)

    def resume(self, layout: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> None:
        """Point state 0 at the rows' live blocks as they are (a request that continues:
        its state is in memory, transformers must read it, not start from zeros)."""
        for which, (dtype, shape) in enumerate(layout):
            self._point(which, 0, self.store.num_rows, dtype, shape)
        conv = self.conv_states[0]
        assert conv is not None
        self.conv_kernel_size[0] = conv.shape[-1]
        self.dtype, self.device = conv.dtype, conv.device
        for flags in (self.is_conv_states_initialized, self.is_recurrent_states_initialized,
                      self.has_previous_state):  # fmt: skip
            flags[0] = True

    def _init_states(self, base: Any, *args: Any, **kwargs: Any) -> None:
        base.lazy_initialization(self, *args, **kwargs)
        if not args:  # the state path (keyword arguments), not the attention one
            self._take_states(kwargs.get("state_idx", 0))

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class VmmMambaLayer(StatePart, LinearAttentionLayer):
    """Mamba / Mamba2 / gated delta-net: states in the row's live Mamba-group block."""

    def __init__(self, store: LayerStore, layer_idx: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store, self.layer_idx = store, layer_idx
        store.state_layers.append(self)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        self._init_states(LinearAttentionLayer, *args, **kwargs)


# transformers' hybrid layers mix a writable `is_croppable` (DynamicLayer) with a read-only
# property (LinearAttentionCacheLayerMixin); mypy flags the mix wherever it is subclassed
class VmmHybridLayer(  # type: ignore[override]
    StatePart, FullAttentionPart, LinearAttentionAndFullAttentionLayer
):
    """Attention and a state in one layer (Falcon-H1, Zamba2): two groups, one layer id."""

    def __init__(self, store: LayerStore, layer_idx: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store, self.layer_idx = store, layer_idx
        store.state_layers.append(self)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        self._init_states(LinearAttentionAndFullAttentionLayer, *args, **kwargs)


class VmmHybridSlidingLayer(  # type: ignore[override]
    StatePart, SlidingAttentionPart, LinearAttentionAndSlidingWindowAttentionLayer
):
    """A sliding-window attention part beside a state (``hybrid_sliding``)."""

    def __init__(self, store: LayerStore, layer_idx: int, sliding_window: int, **kwargs: Any):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.store, self.layer_idx = store, layer_idx
        store.state_layers.append(self)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        self._init_states(LinearAttentionAndSlidingWindowAttentionLayer, *args, **kwargs)


class VmmCrossLayer(DynamicLayer):
    """Cross attention (mllama): the image K/V written once into the cross-attention
    group's blocks; `keys` / `values` gather them from there on every read (transformers
    reads them directly on decode steps)."""

    dtype: Any  # set by `lazy_initialization` (or by the engine for a layer it resumes)
    device: Any

    def __init__(self, store: LayerStore, layer_idx: int, **kwargs: Any) -> None:
        super().__init__()
        self.store, self.layer_idx = store, layer_idx
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        return self._gather()[0]

    @keys.setter
    def keys(self, value: Any) -> None:  # storage is ours; transformers' assignments are dropped
        pass

    @property
    def values(self) -> torch.Tensor:
        return self._gather()[1]

    @values.setter
    def values(self, value: Any) -> None:
        pass

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length == 0:
            return torch.empty(0), torch.empty(0)
        kv, group = self.store.kv, self.store.attention_group(self.layer_idx)
        keys, values = [], []
        for row in range(self.store.num_rows):
            rid, table = self.store.request(row), self.store.table(row, group)
            k, v = read_kv(kv, self.layer_idx, token_slots(kv, rid, group, 0, self.length, table))
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return torch.stack(keys), torch.stack(values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, _, n, _ = key_states.shape
        if n != self.store.image_tokens:
            raise UnsupportedLayer(
                f"layer {self.layer_idx}: {n} cross-attention tokens, the cache was built for "
                f"{self.store.image_tokens} (VmmCache(image_tokens=...))"
            )
        self.store.ensure(rows, max(self.store.length, 1), key_states.dtype)
        kv, group = self.store.kv, self.store.attention_group(self.layer_idx)
        for row in range(rows):
            rid, table = self.store.request(row), self.store.table(row, group)
            slots = token_slots(kv, rid, group, 0, n, table)
            write_kv(kv, self.layer_idx, slots, key_states[row].transpose(0, 1),
                     value_states[row].transpose(0, 1))  # fmt: skip
        self.length = n
        return self._gather()

    def get_seq_length(self) -> int:
        return self.length

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported
