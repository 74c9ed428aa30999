"""A transformers 5.x `Cache` whose storage is a jenga-driven vmm KV cache.

Rationale
    `model.generate(..., cache=VmmCache(model.config))` (``past_key_values=`` before
    transformers 5.24; `integrations.hf.compat.cache_kwargs`) should run any decoder
    whose layer kinds jenga stores, unchanged, while every layer's K/V (or recurrent
    state) lives in chunks mapped into per-layer virtual ranges, the jenga allocator
    deciding which chunks back which layer type (sliding-window and chunk blocks leave
    memory once no query reads them). Bitwise-identical logits against transformers' own
    cache show the storage is exact.

Approach
    Each batch row is one allocator request. The layer objects (`integrations.hf.layers`)
    follow transformers' own layer types (`compat.layer_types_and_kwargs`); the jenga
    ModelSpec comes from the config (`jenga.hf.model_spec_from_config`: layer types,
    windows, chunks, KV sharing, state shapes). The `KVCache` and its chunk pool are
    built on first use, when the batch size and the model's K/V dtype are known::

        first update ─► RowStore.open(dtype, rows) ─► spec (dtype bytes) ─► pool budget
                        = rows x (every group's blocks for `max_length` tokens, in pages)

    The first layer to see new tokens in a forward allocates them for every row (all
    groups at once: one jenga call, one vmm plan). If a row's live state moved to a new
    checkpoint block, every state layer's block is copied there and its views re-pointed.

    Beam search and batch expansion / selection (`reorder_cache`, `batch_repeat_interleave`,
    `batch_select_indices`) give each new row an allocator request: the first row that
    continues an old row takes its request, every other one forks it (`KVCache.fork`),
    so rows continuing one beam share its blocks and only the block the next token
    writes into is copied (on that row's next allocation); a row no one continues is
    freed. `generate` expands the prompt before the first forward, so rows start apart
    and share from the first reorder on.

    `crop` (assisted decoding) moves every layer's length back; the rows keep their slots
    and the next forward overwrites them. Assisted decoding first calls
    `activate_past_recording`: on a cache not yet opened, sliding-window groups are then
    stored as full attention (the layers still attend to their window only), so a crop
    can go back into positions a window had left, as transformers' own recording layers
    keep their past.

    Caches may share one chunk pool (``pool=``, one conversation each in a chat). A row
    grows on a pool other caches map into only when the most chunks it can map are free
    there (`RowStore.grow_row`); with a host tier (``tier_bytes``) the pool's idle caches
    are first offloaded to host memory, and a cache on the host is reloaded before its next
    forward (`integrations.hf.tier`).

Limitations
    `crop` only where every layer keeps every position (a window's released blocks and a
    state cannot go back: transformers refuses assisted decoding with a recurrent state
    too). Rows of a state model that share a state block after a reorder read a gathered
    copy of their states until their next allocation (`integrations.hf.layers`). Cross attention
    (mllama) needs the image token count up front (`image_tokens`), one image per row.
    Encoder caches (LLaVA-OneVision's vision embeddings) are not kept: transformers
    recomputes them in the prefill, so the cache holds the decoder's groups only. The
    gather copies the visible K/V each step, as `DynamicLayer`'s concatenation does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jenga.allocator import ImageSpan
from jenga.hf import HfOptions, model_spec_from_config
from jenga.hf_states import STATE_ALIGN, linear_state
from jenga.pages import vmm_page_table
from jenga.specs import Kind, KVGroup, ModelSpec
from transformers.cache_utils import Cache

import vmm
from integrations.hf.compat import DummyLayer, layer_types_and_kwargs
from integrations.hf.layers import (
    AttentionPart,
    UnsupportedLayer,
    VmmChunkedLayer,
    VmmCrossLayer,
    VmmHybridLayer,
    VmmHybridSlidingLayer,
    VmmLatentLayer,
    VmmLayer,
    VmmMambaLayer,
    VmmSlidingLayer,
)
from integrations.hf.tier import ConversationTier, Member, tier_for
from integrations.kvcache import KVCache, KVCacheConfig
from integrations.kvcache.tier import HostTierConfig

LAYER_CLASSES: dict[str, Callable[..., Any]] = {
    "full_attention": VmmLayer,
    "sliding_attention": VmmSlidingLayer,
    "chunked_attention": VmmChunkedLayer,
    "linear_attention": VmmMambaLayer,
    "hybrid": VmmHybridLayer,
    "hybrid_sliding": VmmHybridSlidingLayer,
    "dummy": lambda store, layer_idx, **kwargs: DummyLayer(),
}


def latent_layer_class(layer: int, kind: str, kinds: set[Kind]) -> Any:
    """`VmmLatentLayer` for a full-attention layer in an MLA group, None for a layer in no
    latent group; `UnsupportedLayer` for a latent layer of another type (transformers has
    no windowed latent cache)."""
    latent = kinds & {Kind.MLA, Kind.SLIDING_WINDOW_MLA}
    if not latent:
        return None
    if kind != "full_attention" or latent != {Kind.MLA}:
        raise UnsupportedLayer(
            f"layer {layer}: a {kind!r} layer in a {sorted(str(k) for k in latent)} group; "
            "latent (MLA) groups are served for full_attention layers only"
        )
    return VmmLatentLayer


def config_dict(config: Any, text: Any) -> dict[str, Any]:
    """``config.to_dict()`` with the decoder's ``layer_types`` written in: several configs
    compute them in a property (Bamba, Falcon-H1) that ``to_dict`` leaves out."""
    out = config.to_dict()
    types = getattr(text, "layer_types", None)
    if types is not None:
        target = out["text_config"] if isinstance(out.get("text_config"), dict) else out
        target["layer_types"] = list(types)
    return out


class RowStore:
    """The KV cache plus one allocator request per batch row, grown in lockstep.

    `open_kv(dtype, rows)` builds the `KVCache` on the first `ensure`. With
    ``image_tokens > 0`` each row is registered with one image of that many
    cross-attention tokens (an `ImageSpan` at position 0 of a placeholder prompt).

    Invariants: ``length == min(row_lengths)`` (0 before the first call), and
    ``row_lengths[r] == kv.num_tokens(r)``: a failed `ensure` may leave early rows grown
    (the allocator cannot shrink a request) but records it, so a retry only allocates what
    each row still lacks. `state_blocks[g]` are the rows' live blocks of state group g."""

    def __init__(
        self,
        open_kv: KVCache | Callable[[torch.dtype, int], KVCache],
        image_tokens: int = 0,
        conv_elements: int = 0,
    ) -> None:
        self._kv: KVCache | None = open_kv if isinstance(open_kv, KVCache) else None
        self._open_kv = open_kv
        self.image_tokens = image_tokens
        self._conv_elements = conv_elements
        self.recurrent_offset = 0  # byte offset of a recurrent state in its block (on open)
        self.num_rows = 0
        self.row_ids: list[int] = []  # the allocator request of each batch row
        self._next_id = 0
        self.length = 0  # tokens allocated in every row
        self.row_lengths: list[int] = []  # tokens allocated per row
        self.state_layers: list[Any] = []
        self.state_blocks: dict[int, list[int]] = {}
        self.state_moves = 0  # rows' state blocks copied to a new checkpoint block
        self.tokens_cropped = 0  # tokens `VmmCache.crop` made the layers forget
        self.tier: ConversationTier | None = None  # the host tier (`integrations.hf.tier`)
        self.member: Member | None = None  # this store's entry in it

    @property
    def is_open(self) -> bool:
        return self._kv is not None

    @property
    def kv(self) -> KVCache:
        if self._kv is None:
            raise RuntimeError("the cache is opened by the model's first forward")
        return self._kv

    def ensure(
        self, num_rows: int, length: int, dtype: torch.dtype | None = None, *,
        check_dtype: bool = True,
    ) -> None:  # fmt: skip
        """Allocate up to `length` tokens in each of `num_rows` rows (opening the cache
        with `dtype` first). Raises OutOfMemory when a row cannot grow; then `length` is
        unchanged and rows that did grow keep (and record) their tokens."""
        if self._kv is None:
            if dtype is None or isinstance(self._open_kv, KVCache):
                raise RuntimeError("the cache opens on the model's first K/V (its dtype)")
            conv_bytes = self._conv_elements * torch.empty((), dtype=dtype).element_size()
            self.recurrent_offset = -(-conv_bytes // STATE_ALIGN) * STATE_ALIGN
            self._kv = self._open_kv(dtype, num_rows)
        elif check_dtype and dtype is not None and dtype != self._kv.dtype:
            raise TypeError(f"the model hands {dtype} K/V, the cache stores {self._kv.dtype}")
        if self.num_rows == 0:
            self._add_rows(num_rows)
        if num_rows != self.num_rows:
            raise ValueError(
                f"batch has {num_rows} rows, this cache was started with {self.num_rows}"
            )
        self.resume(length - self.length)
        if length <= self.length:
            return
        for row in range(num_rows):
            missing = length - self.row_lengths[row]
            if missing > 0:
                self.grow_row(row, missing)
                self.row_lengths[row] = length
        self.length = length
        self._maybe_move_states()

    def resume(self, new_tokens: int = 0) -> None:
        """With a host tier: a forward adding ``new_tokens`` per row begins (a use; this
        store's rows come back from the host first, `ConversationTier.begin`)."""
        tier, member = self.tier, self.member
        if (
            tier is not None
            and member is not None
            and self.num_rows
            and (new_tokens > 0 or member.state != "gpu")
        ):
            tier.begin(member, new_tokens)

    def grow_row(self, row: int, missing: int) -> None:
        """Allocate `missing` more tokens in `row`. On a pool other caches map into too,
        the most chunks the allocation can map must be free first (with a host tier, idle
        caches are offloaded to make them free): else OutOfMemory, nothing allocated."""
        kv, rid = self.kv, self.row_ids[row]
        pool = kv.pool
        shared = pool.num_mapped != kv.allocator.usage().used_units
        if shared or self.tier is not None:
            need = kv.allocator.units_needed(rid, missing)
            if self.tier is not None and self.member is not None:
                self.tier.make_room(self.member, need)
            total = pool.budget_bytes // pool.granularity
            free = total - pool.num_mapped
            if need > free and pool.num_mapped != kv.allocator.usage().used_units:
                raise vmm.OutOfMemory(
                    f"KV cache full: row {row} needs {missing} more tokens (up to {need} "
                    f"chunks), {free} of {total} chunks of the shared pool free "
                    "(a larger pool, fewer caches on it, or VmmCache(tier_bytes=...))",
                    needed=need,
                    free=free,
                    total=total,
                )
        if kv.allocate(rid, missing) is None:
            usage = kv.allocator.usage()
            raise vmm.OutOfMemory(
                f"KV cache full: row {row} needs {missing} more tokens, "
                f"{usage.free_units} of {usage.total_units} chunks free "
                "(VmmCache(max_length=..., budget_bytes=...))",
                needed=missing,
                free=usage.free_units,
                total=usage.total_units,
            )

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
        self.row_ids, self._next_id = list(range(num_rows)), num_rows
        self.row_lengths = [0] * num_rows

    def request(self, row: int) -> int:
        """The allocator request of batch row `row`."""
        return self.row_ids[row]

    def table(self, row: int, group: int) -> list[int]:
        return self.kv.block_table(self.row_ids[row], group)

    def remap_rows(self, sources: Sequence[int]) -> None:
        """Row i continues old row ``sources[i]`` (beam reordering, batch expansion or
        selection). The first new row of each source takes its request over, the others
        fork it (`KVCache.fork`: every block shared; the block the next token writes into
        is copied by that row's next allocation); a source no row takes is freed.

        State layers: gathered state copies are written back first; afterwards rows that
        share a state block read gathered copies until their next allocation copies the
        block (`StatePart.flush_states`).

        Raises `ValueError` for no rows, `IndexError` for a source outside the rows;
        nothing changes then."""
        if self.num_rows == 0:
            return  # nothing stored yet: the first forward opens the rows it is given
        if not sources:
            raise ValueError(f"a batch of 0 rows selected from {self.num_rows}")
        bad = [s for s in sources if not 0 <= s < self.num_rows]
        if bad:
            raise IndexError(f"rows {bad} out of range [0, {self.num_rows})")
        self.resume()
        new_ids: list[int] = []
        children: dict[int, list[int]] = {}
        for s in sources:
            rid = self.row_ids[s]
            if rid in children:
                children[rid].append(self._next_id)
                new_ids.append(self._next_id)
                self._next_id += 1
            else:
                children[rid] = []
                new_ids.append(rid)
        for layer in self.state_layers:
            layer.flush_states()
        for rid, kids in children.items():
            if kids:
                self.kv.fork(rid, kids)
        for rid in self.row_ids:
            if rid not in children:
                self.kv.free(rid)
        self.row_lengths = [self.row_lengths[s] for s in sources]
        self.row_ids, self.num_rows = new_ids, len(new_ids)
        self.length = min(self.row_lengths)
        for g in self.state_blocks:
            self.state_blocks[g] = [self.table(r, g)[-1] for r in range(self.num_rows)]
        for layer in self.state_layers:
            layer.repoint()

    def attention_group(self, layer: int) -> int:
        return self.kv.group_of(layer).index

    def state_group(self, layer: int) -> int:
        for i, g in enumerate(self.kv.model.groups):
            if g.spec.kind is Kind.MAMBA and layer in g.layer_ids:
                return i
        raise UnsupportedLayer(f"layer {layer} has no state group in the jenga spec")

    def _maybe_move_states(self) -> None:
        """A row whose live state moved to a new checkpoint block: copy every layer's
        state block there (the old one is held until the next allocation) and re-point."""
        moved = False
        for g, group in enumerate(self.kv.model.groups):
            if group.spec.kind is not Kind.MAMBA:
                continue
            blocks = [self.table(r, g)[-1] for r in range(self.num_rows)]
            old = self.state_blocks.get(g)
            self.state_blocks[g] = blocks
            if old is None or old == blocks:
                continue
            moved = True
            geo = self.kv.geometries[g]
            size = geo.layer_block_bytes
            for layer in group.layer_ids:
                rng = self.kv.ranges[g][geo.range_index(layer)]
                base = geo.layer_offset(layer)
                for src, dst in zip(old, blocks, strict=True):
                    if src != dst:
                        self.state_moves += 1
                        target = rng.tensor(size, torch.uint8, base + geo.block_offset(dst))
                        target.copy_(rng.tensor(size, torch.uint8, base + geo.block_offset(src)))
        gathered = any(layer.has_gathered() for layer in self.state_layers)
        for layer in self.state_layers:
            layer.flush_states()  # gathered copies into the rows' live blocks
        if moved or gathered:
            for layer in self.state_layers:
                layer.repoint()


def _chunk_as_window(group: KVGroup) -> KVGroup:
    """A chunked-attention group kept as a window of `chunk` tokens. transformers aligns
    each row's chunks to its first unpadded token (left padding), which a cache cannot
    see; the last ``chunk - 1`` positions hold every alignment's chunk, which is what
    transformers' own cache keeps for these layers."""
    spec = group.spec
    if spec.kind is not Kind.CHUNKED_LOCAL:
        return group
    window = dataclasses.replace(spec, kind=Kind.SLIDING_WINDOW, window=spec.chunk, chunk=None)
    return dataclasses.replace(group, spec=window)


def _window_as_full(group: KVGroup) -> KVGroup:
    """A sliding-window group stored as full attention (every position kept)."""
    spec = group.spec
    if spec.kind is not Kind.SLIDING_WINDOW:
        return group
    full = dataclasses.replace(spec, kind=Kind.FULL, window=None)
    return dataclasses.replace(group, spec=full)


def default_budget_bytes(
    spec: ModelSpec,
    *,
    num_rows: int,
    max_length: int,
    chunk_bytes: int,
    image_tokens: int = 0,
    kv_split: bool = False,
    layout: str = "per_layer",
) -> int:
    """A pool budget that holds `num_rows` requests of `max_length` tokens: per group, the
    blocks a whole prompt may take at once (attention kinds allocate a prefill before
    releasing), a live and a previous state (Mamba), the image (cross attention), each
    rounded up to large pages plus one; chunks are only created as they are mapped."""
    table = vmm_page_table(spec, chunk_bytes=chunk_bytes, kv_split=kv_split, layout=layout)
    units = 0
    for g in spec.groups:
        row = table.group(g.name)
        t = g.spec.block_size
        if g.spec.kind is Kind.MAMBA:
            blocks = 2
        elif g.spec.kind is Kind.CROSS_ATTENTION:
            blocks = -(-max(image_tokens, 1) // t)
        else:
            blocks = -(-max_length // t) + 1
        pages = -(-blocks // row.blocks_per_large_page) + 1
        units += pages * row.units_per_large_page
    return num_rows * units * chunk_bytes


class VmmCache(Cache):
    """`transformers.Cache` over a `KVCache` (see module note).

    Args:
        config: the model's `PreTrainedConfig`.
        max_length: tokens per row the default budget holds (None: the config's
            ``max_position_embeddings``).
        budget_bytes: the chunk pool's budget (None: `default_budget_bytes`).
        chunk_bytes: host backend granularity (ignored by a given `pool`).
        block_size: tokens per block.
        dtype: storage dtype (None: the K/V dtype the model hands over; else they must match).
        pool: use this chunk pool instead of a new host one (the cache does not close it).
        kv_split / layout: see `KVCacheConfig`.
        image_tokens: cross-attention tokens per row (mllama: images x tiles x (patches+1)).
        checkpoint_interval: tokens per Mamba state block (the state moves to a new
            block every that many tokens).
        tier_bytes / tier_policy / tier_high_water: the host tier's options, as
            `EngineConfig`'s (bad values: `InvalidSize`, naming them). With
            ``tier_bytes``, the caches of one `pool` share a host tier of that many bytes
            (`integrations.hf.tier`): idle caches are offloaded when a forward needs
            chunks (above ``tier_high_water`` of the pool) and reloaded before their next
            forward; policy ``"lru"`` or ``"score"`` (CaR). Attention models only.
        name: how errors about this cache name it (default ``VmmCache #<n>``).
    """

    def __init__(
        self,
        config: Any,
        *,
        max_length: int | None = None,
        budget_bytes: int | None = None,
        chunk_bytes: int = 64 << 10,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        pool: vmm.ChunkPool | None = None,
        kv_split: bool = False,
        layout: str = "per_layer",
        image_tokens: int = 0,
        checkpoint_interval: int = 512,
        tier_bytes: int | None = None,
        tier_policy: str = "lru",
        tier_high_water: float = 0.9,
        name: str | None = None,
    ) -> None:
        _check_sizes(max_length=max_length, budget_bytes=budget_bytes, chunk_bytes=chunk_bytes)
        tier = _tier_config(tier_bytes, tier_policy, tier_high_water)
        if budget_bytes is not None and budget_bytes % chunk_bytes:
            raise ValueError(
                f"VmmCache budget_bytes {budget_bytes} is not a multiple of chunk_bytes "
                f"{chunk_bytes}"
            )
        text = config.get_text_config(decoder=True)
        self._config = config_dict(config, text)
        self._options = HfOptions(
            block_size=block_size,
            mamba_checkpoint_interval=checkpoint_interval,
            conv_full_kernel=True,  # transformers keeps all d_conv columns
        )
        self._dtype, self._pool, self._owns_pool = dtype, pool, pool is None
        self._budget, self._chunk_bytes = budget_bytes, chunk_bytes
        self._max_length = max_length or text.max_position_embeddings
        self._kv_config = KVCacheConfig(kv_split=kv_split, layout=layout)
        self._record_past = False  # windows kept whole for `crop` (`activate_past_recording`)
        structure = self._spec(2)
        conv = 0
        if any(g.spec.kind is Kind.MAMBA for g in structure.groups):
            state = linear_state(text.to_dict())
            conv = state.conv_channels * state.conv_kernel  # elements; bytes on open
        self.store = RowStore(self._open, image_tokens, conv)
        if tier is not None:
            _refuse_tier_groups(structure, image_tokens)
            self.store.tier = tier_for(pool, tier)
            self.store.member = self.store.tier.join(self.store, name)
        layer_types, per_layer_kwargs = layer_types_and_kwargs(text)
        layers = [
            self._make_layer(i, kind, kwargs, structure)
            for i, (kind, kwargs) in enumerate(zip(layer_types, per_layer_kwargs, strict=True))
        ]
        super().__init__(layers=layers)

    @property
    def kv(self) -> KVCache:
        return self.store.kv

    def _spec(self, itemsize: int) -> ModelSpec:
        """The decoder's groups (an encoder's cache is recomputed by transformers)."""
        options = dataclasses.replace(self._options, dtype_bytes=itemsize)
        spec = model_spec_from_config(self._config, options=options)
        groups = tuple(_chunk_as_window(g) for g in spec.groups if g.spec.model == "target")
        if self._record_past:
            groups = tuple(_window_as_full(g) for g in groups)
        return dataclasses.replace(spec, groups=groups)

    def _open(self, dtype: torch.dtype, num_rows: int) -> KVCache:
        if self._dtype is not None and dtype != self._dtype:
            raise TypeError(f"VmmCache(dtype={self._dtype}) but the model hands {dtype} K/V")
        spec = self._spec(torch.empty((), dtype=dtype).element_size())
        pool = self._pool
        if pool is None:
            cfg = self._kv_config
            budget = self._budget or default_budget_bytes(
                spec, num_rows=num_rows, max_length=self._max_length,
                chunk_bytes=self._chunk_bytes, image_tokens=self.store.image_tokens,
                kv_split=cfg.kv_split, layout=cfg.layout,
            )  # fmt: skip
            backend = vmm.get_backend("host", granularity=self._chunk_bytes)
            pool = self._pool = vmm.ChunkPool(backend, budget)
        return KVCache(spec, pool, dataclasses.replace(self._kv_config, dtype=dtype))

    def _make_layer(self, layer: int, kind: str, kwargs: dict[str, Any], spec: ModelSpec) -> Any:
        kinds = {g.spec.kind for g in spec.groups if layer in g.layer_ids}
        if Kind.CROSS_ATTENTION in kinds:
            return VmmCrossLayer(self.store, layer)
        make = latent_layer_class(layer, kind, kinds) or LAYER_CLASSES.get(kind)
        if make is None:
            raise UnsupportedLayer(
                f"layer {layer}: type {kind!r} is not stored by VmmCache "
                f"(stored: {sorted(LAYER_CLASSES)})"
            )
        return make(self.store, layer, **kwargs)

    # ---- batch rows: beam search, num_return_sequences (`RowStore.remap_rows`) ----------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues old row ``beam_idx[i]``. Rows that continue the same
        beam share its blocks (a fork), no K/V is copied but the block each row writes next
        while it is shared."""
        self._remap([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row (rows r..r+repeats-1 share row r's blocks)."""
        if repeats <= 0:
            raise ValueError(f"repeats must be > 0, got {repeats}")
        rows = range(self.store.num_rows)
        self._remap([r for r in rows for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` names (int positions or a bool mask), in that order."""
        rows = torch.arange(self.store.num_rows)[torch.as_tensor(indices)]
        self._remap([int(i) for i in rows.reshape(-1).tolist()])

    def _remap(self, sources: list[int]) -> None:
        store = self.store
        if store.num_rows and store.length != self.get_seq_length():
            raise UnsupportedLayer(
                f"the rows hold {store.length} token slots, the layers {self.get_seq_length()} "
                "tokens (a crop): a fork would share the block the next token writes"
            )
        store.remap_rows(sources)

    def activate_past_recording(self) -> None:
        """Keep what a `crop` may take back (transformers calls it before assisted
        decoding): sliding-window groups are stored whole. On a cache already opened with
        window groups, `UnsupportedLayer` (their released blocks cannot come back)."""
        if not self._record_past and self.store.is_open:
            windows = [g.name for g in self.kv.model.groups if g.spec.kind is Kind.SLIDING_WINDOW]
            if windows:
                raise UnsupportedLayer(
                    f"window groups {windows} already released blocks: record the past "
                    "(assisted decoding) only from a cache that has not run a forward yet"
                )
        self._record_past = True
        super().activate_past_recording()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a negative
        count; assisted decoding drops rejected candidates). The rows keep their slots (an
        allocator request does not shrink); the next forward overwrites them. Only when
        every layer keeps every position: a window's released blocks and a state cannot
        go back (`UnsupportedLayer`, nothing changed). ``crop(0)`` changes nothing."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative count of tokens to remove, got {tokens_to_remove}"
            )
        if tokens_to_remove == 0:
            return
        parts = [layer for layer in self.layers if isinstance(layer, AttentionPart)]
        whole: tuple[type, ...] = (VmmLayer, VmmCrossLayer, DummyLayer)
        if self._record_past:
            whole += (VmmSlidingLayer,)
        other = [i for i, layer in enumerate(self.layers) if not isinstance(layer, whole)]
        if other:
            raise UnsupportedLayer(
                f"layers {other} keep a window or a state: VmmCache crops only caches whose "
                "layers keep every position"
            )
        for layer in parts:
            layer.seen = max(0, layer.seen + tokens_to_remove)
            if isinstance(layer, VmmSlidingLayer):
                layer.cumulative_length = layer.seen
        self.store.tokens_cropped -= tokens_to_remove

    @property
    def tier(self) -> ConversationTier | None:
        """The host tier this cache is in (shared by the caches of its pool), or None."""
        return self.store.tier

    def tier_stats(self) -> dict[str, int]:
        """The tier's counters (``tier.*``, all its caches) and this cache's own
        (``cache.offloads``, ``cache.reloads``, ``cache.on_host``); {} without a tier."""
        tier, member = self.store.tier, self.store.member
        if tier is None or member is None:
            return {}
        out = tier.stats()
        out["cache.offloads"], out["cache.reloads"] = member.offloads, member.reloads
        out["cache.on_host"] = int(member.state == "host")
        return out

    def end_turn(self) -> None:
        """The conversation's turn completed (CaR's score policy: -``complete_loss``; no
        effect on LRU's order)."""
        if self.store.tier is not None and self.store.member is not None:
            self.store.tier.end_turn(self.store.member)

    def close(self) -> None:
        """Unmap everything; closes the pool if this cache created it."""
        if self.store.tier is not None and self.store.member is not None:
            self.store.tier.leave(self.store.member)
        if self.store.is_open:
            self.store.kv.close()
        if self._owns_pool and self._pool is not None:
            self._pool.close()


def _check_sizes(**sizes: int | None) -> None:
    """Each size given must be an int > 0 (None: the default); ValueError naming it."""
    for name, value in sizes.items():
        if value is not None and (type(value) is not int or value <= 0):
            raise ValueError(f"VmmCache {name} must be an int > 0, got {value!r}")


def _tier_config(size: int | None, policy: str, high_water: float) -> HostTierConfig | None:
    """The host tier options (None without ``tier_bytes``): a bad value is refused naming
    it (`InvalidSize`)."""
    from jenga.errors import InvalidSize
    from jenga.tier import TierRules

    try:
        if size is None:
            TierRules(policy=policy, high_water=high_water)  # type: ignore[arg-type]
            return None
        return HostTierConfig(size, policy, high_water)
    except InvalidSize as e:
        raise InvalidSize(f"VmmCache tier options: {e}") from None


def _refuse_tier_groups(spec: ModelSpec, image_tokens: int) -> None:
    """The host tier moves attention blocks only: state and cross-attention groups (and
    image tokens) are refused (ValueError naming them)."""
    odd = [
        g.name for g in spec.groups
        if g.spec.kind in (Kind.MAMBA, Kind.CROSS_ATTENTION)
    ]  # fmt: skip
    if odd or image_tokens:
        raise ValueError(
            f"VmmCache(tier_bytes=...) keeps attention groups only; groups {odd} "
            f"(image_tokens={image_tokens}) are not"
        )
