"""A transformers 5.x `Cache` whose storage is a jenga-driven vmm KV cache.

Rationale
    `model.generate(..., past_key_values=VmmCache(model.config))` should run any
    supported decoder unchanged while every layer's K/V lives in chunks mapped into
    per-layer virtual ranges, the jenga allocator deciding which chunks back which layer
    type (sliding-window blocks leave memory once out of the window). Bitwise-identical
    logits against `DynamicCache` show the storage is exact.

Approach
    Each batch row is one allocator request. The cache builds a `jenga` ModelSpec from
    the config (`jenga.hf.model_spec_from_config`), a `KVCache` over a host (or CUDA)
    chunk pool, and one layer object per decoder layer, chosen by transformers' own
    `get_layer_types_and_kwargs`:

        full_attention     -> VmmLayer            (subclass of DynamicLayer)
        sliding_attention  -> VmmSlidingLayer     (subclass of DynamicSlidingWindowLayer)
        linear_attention   -> VmmMambaLayer       (LinearAttentionLayer; Mamba group)
        cross-attn group   -> VmmCrossLayer       (mllama: image K/V in the group's blocks)

    The first layer to see new tokens in a forward allocates them for every row (all
    groups at once: one jenga call, one vmm plan). Each layer then writes its new K/V
    into its blocks and returns the same positions `DynamicLayer` /
    `DynamicSlidingWindowLayer` would (all tokens / the last ``window - 1`` plus the new
    ones), gathered from the blocks as one contiguous ``[B, H, L, D]`` tensor. The mask
    bookkeeping (`get_mask_sizes`, `cumulative_length`) is inherited unchanged.

Limitations
    No beam search / cropping (reorder, crop and batch selection raise). Vision-embedding
    and chunked-attention layers are not wired (`UnsupportedLayer`). Cross attention
    (mllama) needs the image token count up front (`image_tokens`), one image per row.
    Mamba states (Jamba) must stay in their first checkpoint block (sequences below the
    checkpoint interval, 512 tokens) and need evenly spaced row blocks (a fresh cache).
    The gather copies the visible K/V each step, as `DynamicLayer`'s concatenation does.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from jenga.allocator import ImageSpan
from jenga.hf import HfOptions, model_spec_from_config
from jenga.specs import Kind, KVGroup, ModelSpec
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

import vmm
from integrations.kvcache import KVCache, KVCacheConfig
from integrations.kvcache.access import read_kv, token_slots, write_kv

_SLIDING_TYPES = ("sliding_attention",)  # chunked: jenga releases whole chunks; not wired


class UnsupportedLayer(NotImplementedError):
    """The model has a layer type this cache does not store yet."""


class RowStore:
    """The KV cache plus one allocator request per batch row, grown in lockstep.

    With ``image_tokens > 0`` each row is registered with one image of that many
    cross-attention tokens (an `ImageSpan` at position 0 of a placeholder prompt), so the
    cross-attention group gets its blocks with the row's first allocation.

    Invariants: ``length == min(row_lengths)`` (0 before the first call), and
    ``row_lengths[r] == kv.num_tokens(r)``: a failed `ensure` may leave early rows grown
    (the allocator cannot shrink a request) but records it, so a retry only allocates what
    each row still lacks."""

    def __init__(self, kv: KVCache, image_tokens: int = 0) -> None:
        self.kv = kv
        self.image_tokens = image_tokens
        self.num_rows = 0
        self.length = 0  # tokens allocated in every row
        self.row_lengths: list[int] = []  # tokens allocated per row

    def ensure(self, num_rows: int, length: int) -> None:
        """Allocate up to `length` tokens in each of `num_rows` rows.

        Raises OutOfMemory when a row cannot grow; then `length` is unchanged and rows
        that did grow keep (and record) their tokens. Registering the rows is all-or-
        nothing."""
        if self.num_rows == 0:
            self._add_rows(num_rows)
        if num_rows != self.num_rows:
            raise ValueError(
                f"batch has {num_rows} rows, this cache was started with {self.num_rows}"
            )
        if length <= self.length:
            return
        for row in range(num_rows):
            missing = length - self.row_lengths[row]
            if missing <= 0:
                continue
            if self.kv.allocate(row, missing) is None:
                usage = self.kv.allocator.usage()
                raise vmm.OutOfMemory(
                    f"KV cache full: row {row} needs {missing} more tokens, "
                    f"{usage.free_units} of {usage.total_units} chunks free",
                    needed=missing,
                    free=usage.free_units,
                    total=usage.total_units,
                )
            self.row_lengths[row] = length
        self.length = length

    def _add_rows(self, num_rows: int) -> None:
        """Register one request per row; a failure frees the rows registered before it."""
        n = self.image_tokens
        added: list[int] = []
        try:
            for row in range(num_rows):
                images = (ImageSpan(0, n, content_hash=row + 1),) if n else ()
                self.kv.add_request(row, [0] * max(n, 1), images=images, use_cache=False)
                added.append(row)
        except BaseException:
            for row in added:
                self.kv.free(row)
            raise
        self.num_rows = num_rows
        self.row_lengths = [0] * num_rows


class _VmmLayerMixin:
    """Write new K/V into the row's blocks, return positions [start, stop) gathered."""

    store: RowStore
    layer_idx: int
    group: int

    def _store_and_gather(
        self, key_states: torch.Tensor, value_states: torch.Tensor, past: int, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, _, q, _ = key_states.shape
        stop = past + q
        self.store.ensure(rows, stop)
        kv = self.store.kv
        keys, values = [], []
        for row in range(rows):
            new = token_slots(kv, row, self.group, past, stop)
            write_kv(
                kv,
                self.layer_idx,
                new,
                key_states[row].transpose(0, 1),
                value_states[row].transpose(0, 1),
            )
            k, v = read_kv(kv, self.layer_idx, token_slots(kv, row, self.group, start, stop))
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return torch.stack(keys), torch.stack(values)

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("VmmCache does not support beam search, cropping or reindexing")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class VmmLayer(_VmmLayerMixin, DynamicLayer):
    """Full attention: every position stays and is returned."""

    def __init__(self, store: RowStore, layer_idx: int, group: int) -> None:
        super().__init__()
        self.store, self.layer_idx, self.group = store, layer_idx, group
        self.length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.length
        keys, values = self._store_and_gather(key_states, value_states, past, 0)
        self.length = past + key_states.shape[-2]
        return keys, values

    def get_seq_length(self) -> int:
        return self.length


class VmmSlidingLayer(_VmmLayerMixin, DynamicSlidingWindowLayer):
    """Sliding window w: returns the last ``w - 1`` cached positions plus the new ones."""

    def __init__(self, store: RowStore, layer_idx: int, group: int, sliding_window: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.store, self.layer_idx, self.group = store, layer_idx, group

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.cumulative_length
        start = max(0, past - (self.sliding_window - 1))
        keys, values = self._store_and_gather(key_states, value_states, past, start)
        self.cumulative_length = past + key_states.shape[-2]
        return keys, values


class VmmCrossLayer(_VmmLayerMixin, DynamicLayer):
    """Cross attention (mllama): the image K/V written once into the cross-attention
    group's blocks; `keys` / `values` gather them from there on every read (transformers
    reads them directly on decode steps)."""

    def __init__(self, store: RowStore, layer_idx: int, group: int) -> None:
        super().__init__()
        self.store, self.layer_idx, self.group = store, layer_idx, group
        self.length = 0

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor:
        return self._gather()[0]

    @keys.setter
    def keys(self, value: Any) -> None:  # storage is ours; transformers' assignments are dropped
        pass

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor:
        return self._gather()[1]

    @values.setter
    def values(self, value: Any) -> None:
        pass

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length == 0:
            return torch.empty(0), torch.empty(0)
        kv = self.store.kv
        keys, values = [], []
        for row in range(self.store.num_rows):
            k, v = read_kv(kv, self.layer_idx, token_slots(kv, row, self.group, 0, self.length))
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
        self.store.ensure(rows, max(self.store.length, 1))
        kv = self.store.kv
        for row in range(rows):
            slots = token_slots(kv, row, self.group, 0, n)
            write_kv(kv, self.layer_idx, slots, key_states[row].transpose(0, 1),
                     value_states[row].transpose(0, 1))  # fmt: skip
        self.length = n
        return self._gather()

    def get_seq_length(self) -> int:
        return self.length


class VmmMambaLayer(LinearAttentionLayer):
    """Mamba (Jamba): conv and SSM states are views over the row's live state block.

    Block bytes: ``conv [d_inner, d_conv]`` then ``ssm [d_inner, d_state]``. The batch
    dimension is a strided view across the rows' blocks, so it needs one uniform stride
    between consecutive rows' blocks (rows added in order on a fresh cache get pages
    0, 1, ...); transformers then updates the states in place, in our memory.
    """

    def __init__(self, store: RowStore, layer_idx: int, group: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store, self.layer_idx, self.group = store, layer_idx, group
        self._blocks: list[int] | None = None

    def _state_view(
        self, like: torch.Tensor, byte_offset: int, shape: tuple[int, ...]
    ) -> torch.Tensor:
        kv = self.store.kv
        geo = kv.geometries[self.group]
        rows = like.shape[0]
        self.store.ensure(rows, max(self.store.length, 1))
        blocks = [kv.block_table(r, self.group)[-1] for r in range(rows)]
        if self._blocks is not None and blocks != self._blocks:
            raise UnsupportedLayer(
                f"layer {self.layer_idx}: Mamba state moved to a new checkpoint block"
            )
        self._blocks = blocks
        offsets = [geo.block_offset(b) + byte_offset for b in blocks]
        steps = {b - a for a, b in itertools.pairwise(offsets)}
        if len(steps) > 1 or any(step <= 0 for step in steps):
            raise UnsupportedLayer(
                f"layer {self.layer_idx}: rows' state blocks {blocks} have no uniform stride"
            )
        itemsize = like.element_size()
        row_stride = (steps.pop() if steps else geo.page_bytes) // itemsize
        inner = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * shape[i + 1]
        rng = kv.ranges[self.group][geo.range_index(self.layer_idx)]
        view = rng.tensor((rows, *shape), like.dtype, offsets[0], (row_stride, *inner))
        view.zero_()
        return view

    def lazy_initialization(
        self,
        conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | None = None,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
    ) -> None:
        super().lazy_initialization(conv_states, recurrent_states, state_idx, conv_kernel_size)
        if conv_states is not None:
            shape = tuple(self.conv_states[state_idx].shape[1:])
            self.conv_states[state_idx] = self._state_view(conv_states, 0, shape)
            self._conv_bytes = conv_states.element_size() * shape[0] * shape[1]
        if recurrent_states is not None:
            shape = tuple(recurrent_states.shape[1:])
            offset = getattr(self, "_conv_bytes", 0)
            self.recurrent_states[state_idx] = self._state_view(recurrent_states, offset, shape)

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("VmmCache does not support beam search, cropping or reindexing")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


def _with_hf_mamba_state(spec: ModelSpec, text: Any, itemsize: int) -> ModelSpec:
    """transformers keeps ``conv [d_inner, d_conv]`` + ``ssm [d_inner, d_state]`` in the model
    dtype; size the Mamba group's state block for exactly that."""
    if not any(g.spec.kind is Kind.MAMBA for g in spec.groups):
        return spec
    d_inner = text.mamba_expand * text.hidden_size
    state = d_inner * (text.mamba_d_conv + text.mamba_d_state) * itemsize
    groups = tuple(
        KVGroup(g.name, dataclasses.replace(g.spec, state_bytes=state), g.layer_ids, g.readers)
        if g.spec.kind is Kind.MAMBA
        else g
        for g in spec.groups
    )
    return dataclasses.replace(spec, groups=groups)


class VmmCache(Cache):
    """`transformers.Cache` over a `KVCache` (see module note).

    Args:
        config: the model's `PreTrainedConfig`.
        budget_bytes: the chunk pool's budget (a multiple of `chunk_bytes`).
        chunk_bytes: host backend granularity (ignored by a given `pool`).
        block_size: tokens per block.
        dtype: storage dtype (must match the model's K/V dtype).
        pool: use this chunk pool instead of a new host one (the cache does not close it).
        kv_split / layout: see `KVCacheConfig`.
        image_tokens: cross-attention tokens per row (mllama: images x tiles x (patches+1)).
    """

    def __init__(
        self,
        config: Any,
        *,
        budget_bytes: int = 64 << 20,
        chunk_bytes: int = 64 << 10,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        pool: vmm.ChunkPool | None = None,
        kv_split: bool = False,
        layout: str = "per_layer",
        image_tokens: int = 0,
    ) -> None:
        text = config.get_text_config(decoder=True)
        itemsize = torch.empty((), dtype=dtype).element_size()
        spec = model_spec_from_config(
            config.to_dict(), options=HfOptions(block_size=block_size, dtype_bytes=itemsize)
        )
        spec = _with_hf_mamba_state(spec, text, itemsize)
        self._owns_pool = pool is None
        if pool is None:
            backend = vmm.get_backend("host", granularity=chunk_bytes)
            pool = vmm.ChunkPool(backend, budget_bytes)
        self.kv = KVCache(spec, pool, KVCacheConfig(dtype=dtype, kv_split=kv_split, layout=layout))
        self.store = RowStore(self.kv, image_tokens)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text)
        layers = [
            self._make_layer(i, kind, kwargs)
            for i, (kind, kwargs) in enumerate(zip(layer_types, per_layer_kwargs, strict=True))
        ]
        super().__init__(layers=layers)

    def _make_layer(self, layer_idx: int, kind: str, kwargs: dict[str, Any]) -> Any:
        group = self.kv.group_of(layer_idx).index
        if kind == "full_attention":
            return VmmLayer(self.store, layer_idx, group)
        if kind in _SLIDING_TYPES:
            return VmmSlidingLayer(self.store, layer_idx, group, kwargs["sliding_window"])
        if self.kv.model.groups[group].spec.kind is Kind.CROSS_ATTENTION:
            return VmmCrossLayer(self.store, layer_idx, group)
        if kind == "linear_attention" and self.kv.model.groups[group].spec.kind is Kind.MAMBA:
            return VmmMambaLayer(self.store, layer_idx, group, **kwargs)
        raise UnsupportedLayer(f"layer {layer_idx}: type {kind!r} is not supported by VmmCache")

    def close(self) -> None:
        """Unmap everything; closes the pool if this cache created it."""
        self.kv.close()
        if self._owns_pool:
            self.kv.pool.close()
