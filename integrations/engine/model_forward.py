"""The engine's forward: the model's own `forward`, one request at a time, over the KVCache.

Rationale
    Re-implementing a decoder's forward (norms, embedding scale, softcapping, rotary
    variants, MoE routing, Mamba mixers, KV sharing) for every family is where an engine
    goes wrong: a Llama-shaped loop gives Gemma 2 wrong tokens from the first step and
    cannot run Gemma 3's per-type rotary at all. Driving the model's own `forward` with a
    `Cache` whose layers read and write the engine's jenga blocks runs every family the
    HF cache stores, with the library's arithmetic, while the scheduler (continuous
    batching, chunked prefill, prefix hits, preemption) stays the engine's.

Approach
    Each scheduled segment [start, stop) of request r becomes one call
    ``model(ids[start:stop], cache=cache)`` (``past_key_values=`` before transformers
    5.24: `integrations.hf.compat.cache_kwargs`), where `cache` is a transformers
    `Cache` built from `integrations.hf` layer classes over `RequestStore`: batch row 0
    is request r, the block tables are the ones taken in `prepare` (before an overlapped
    allocation could release a block this step reads), nothing is allocated (the
    scheduler did), and every layer starts at ``seen = start`` so transformers computes
    positions and masks as for a cache holding ``start`` tokens::

        scheduler ── allocate ──► KVCache ◄── write/read K/V, states ── model.forward
                   prepare: tables, state copy-forward       (RequestStore, row 0 = r)

    Recurrent states (Mamba, gated delta-net): a segment never crosses a checkpoint
    boundary (the scheduler cuts it there), so the block of a finished checkpoint holds
    the state at exactly that position and serves prefix hits. When a segment starts on
    a new block, `prepare` copies the previous state block into it first; a continuing
    request's layers point at its live block (`resume`).

    Mamba (v1) (Jamba): transformers' `JambaMambaMixer` continues the conv state in a
    multi-token forward but its selective scan always starts from a zero SSM state
    (`mamba_selective_scan` allocates ``ssm_state = zeros``: "Initial hidden state is not
    supported by the kernel path"); only its one-token path (`mamba_selective_state_update`)
    reads the cached state. So a segment from position 0 runs in one forward, and a
    segment that continues a state (later prompt chunks, prefix hits, recomputation after
    preemption) runs one forward per token, exactly as `generate`'s decode steps do.

    Images (`images.py`): a request's prepared inputs give each segment its model inputs
    (spliced ``inputs_embeds`` for LLaVA-OneVision; token ids, ``cross_attention_mask``
    rows and, at position 0, ``cross_attention_states`` for Mllama). Cross-attention layers
    are `VmmCrossLayer`s over the request's cross-attention blocks: the first segment
    writes the image K/V, later ones (and prefix hits) read it.

Limitations
    One forward per request (no packed varlen kernel on CPU); the gather copies the
    visible K/V, as transformers' own cache does. A Jamba segment that continues a state
    costs one forward per token. Positions are passed explicitly (Bamba derives them from
    layer 0, a Mamba layer, and would restart at 0).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from jenga.specs import Kind
from transformers.cache_utils import Cache

from integrations.engine.forward import Segment
from integrations.engine.images import SEQUENCE_INPUTS, RequestImages
from integrations.hf.cache import LAYER_CLASSES, latent_layer_class
from integrations.hf.compat import cache_kwargs, layer_types_and_kwargs
from integrations.hf.layers import AttentionPart, StatePart, UnsupportedLayer, VmmCrossLayer
from integrations.kvcache import KVCache


class RequestStore:
    """One request as batch row 0 of a `RowStore`-like store, tables fixed at creation."""

    num_rows = 1
    image_tokens = 0

    def __init__(self, kv: KVCache, segment: Segment, tables: list[list[int]]) -> None:
        self.kv = kv
        self.segment = segment
        self.tables = tables
        self.length = segment.stop
        self.recurrent_offset = 0
        self.state_layers: list[Any] = []

    def request(self, row: int) -> Hashable:
        return self.segment.request_id

    def table(self, row: int, group: int) -> list[int]:
        return self.tables[group]

    def ensure(self, num_rows: int, length: int, dtype: Any = None, **kwargs: Any) -> None:
        if num_rows != 1 or length > self.segment.stop:
            raise ValueError(
                f"request {self.segment.request_id!r}: a forward of {num_rows} rows up to "
                f"{length} tokens, the engine allocated 1 row up to {self.segment.stop}"
            )

    def attention_group(self, layer: int) -> int:
        return self.kv.group_of(layer).index

    def state_group(self, layer: int) -> int:
        for i, g in enumerate(self.kv.model.groups):
            if g.spec.kind is Kind.MAMBA and layer in g.layer_ids:
                return i
        raise UnsupportedLayer(f"layer {layer} has no state group in the jenga spec")


class ModelForward:
    """Runs `model`'s own forward over scheduled segments, K/V and states in `kv`."""

    def __init__(self, model: Any, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = next(model.parameters()).device
        text = model.config.get_text_config(decoder=True)
        self.layer_types, self.layer_kwargs = layer_types_and_kwargs(text)
        unknown = [(i, t) for i, t in enumerate(self.layer_types) if t not in LAYER_CLASSES]
        if unknown:
            raise UnsupportedLayer(
                f"layers {[i for i, _ in unknown]}: types {sorted({t for _, t in unknown})} "
                f"are not served (served: {sorted(LAYER_CLASSES)})"
            )
        self.state_groups = [i for i, g in enumerate(kv.model.groups) if g.spec.kind is Kind.MAMBA]
        kinds: dict[int, set[Kind]] = {}
        for g in kv.model.groups:
            for layer in g.layer_ids:
                kinds.setdefault(layer, set()).add(g.spec.kind)
        self.layer_classes = [  # MLA layers: the latent pair (`VmmLatentLayer`)
            latent_layer_class(i, t, kinds.get(i, set())) or LAYER_CLASSES[t]
            for i, t in enumerate(self.layer_types)
        ]
        self.cross_layers = {
            layer
            for g in kv.model.groups
            if g.spec.kind is Kind.CROSS_ATTENTION
            for layer in g.layer_ids
        }
        itemsize = kv.itemsize
        self.recurrent_offset = 0
        self.stepwise_continuation = False
        if self.state_groups:
            from jenga.hf_states import STATE_ALIGN, linear_state

            state = linear_state(text.to_dict())
            # transformers' Mamba (v1) mixer starts every multi-token scan from a zero SSM
            # state; only its one-token path reads the cached state
            self.stepwise_continuation = state.family == "mamba"
            conv = state.conv_channels * state.conv_kernel * itemsize
            self.recurrent_offset = -(-conv // STATE_ALIGN) * STATE_ALIGN
        self._state_layouts: dict[int, Any] = {}
        self.stats = {"forward.state_copies": 0}

    @property
    def checkpoint_interval(self) -> int | None:
        """Tokens per state block, when the model has recurrent states (segments stop at
        its multiples)."""
        if not self.state_groups:
            return None
        return self.kv.model.groups[self.state_groups[0]].spec.checkpoint_interval

    def prepare(self, segments: Sequence[Segment]) -> dict[Hashable, list[list[int]]]:
        """Each request's block tables as they are now, state blocks copied forward."""
        tables: dict[Hashable, list[list[int]]] = {}
        for seg in segments:
            rid = seg.request_id
            tables[rid] = [
                list(self.kv.block_table(rid, g)) for g in range(len(self.kv.geometries))
            ]
            if seg.start > 0:
                for g in self.state_groups:
                    self._copy_state_forward(g, seg, tables[rid][g])
        return tables

    def _copy_state_forward(self, group: int, seg: Segment, table: list[int]) -> None:
        t = self.kv.model.groups[group].spec.checkpoint_interval
        src, dst = table[-(-seg.start // t) - 1], table[-1]
        if src == dst:
            return
        geo = self.kv.geometries[group]
        size = geo.layer_block_bytes
        for layer in self.kv.model.groups[group].layer_ids:
            rng = self.kv.ranges[group][geo.range_index(layer)]
            base = geo.layer_offset(layer)
            target = rng.tensor(size, torch.uint8, base + geo.block_offset(dst))
            target.copy_(rng.tensor(size, torch.uint8, base + geo.block_offset(src)))
        self.stats["forward.state_copies"] += 1

    def _cache_for(self, seg: Segment, tables: list[list[int]], cross_tokens: int) -> Cache:
        store = RequestStore(self.kv, seg, tables)
        store.recurrent_offset = self.recurrent_offset
        store.image_tokens = cross_tokens
        layers: list[Any] = []
        for i, kwargs in enumerate(self.layer_kwargs):
            if i in self.cross_layers:
                layers.append(self._cross_layer(store, i, seg))
                continue
            layer = self.layer_classes[i](store, i, **kwargs)
            if isinstance(layer, AttentionPart):
                layer.seen = seg.start
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = seg.start
            if isinstance(layer, StatePart) and seg.start > 0:
                layer.resume(self._state_layouts[i])
            layers.append(layer)
        if self.kv.tier is not None:
            return _ReloadGatedCache(self.kv.tier.wait_layer, layers=layers)
        return Cache(layers=layers)

    def _cross_layer(self, store: RequestStore, layer: int, seg: Segment) -> VmmCrossLayer:
        """A cross-attention layer; past position 0 it holds the request's image K/V (written
        by its first segment, or a prefix hit's)."""
        cross = VmmCrossLayer(store, layer)
        if seg.start > 0 and store.image_tokens:
            cross.length = store.image_tokens
            cross.is_initialized = True
            cross.dtype, cross.device = self.kv.dtype, self.device
        return cross

    @torch.no_grad()
    def __call__(
        self,
        segments: Sequence[Segment],
        token_ids: Sequence[int],
        tables: dict[Hashable, list[list[int]]] | None = None,
        images: Mapping[Hashable, RequestImages] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(segments), vocab]`` at each segment's last position; `images`: the
        image inputs of requests that have them."""
        tables = self.prepare(segments) if tables is None else tables
        images = images or {}
        out, offset = [], 0
        for seg in segments:
            ids = torch.tensor([token_ids[offset : offset + seg.num_tokens]], device=self.device)
            offset += seg.num_tokens
            request_images = images.get(seg.request_id)
            inputs = (
                {"input_ids": ids} if request_images is None else request_images.inputs(seg, ids)
            )
            # positions given: some models derive them from layer 0 (Bamba: a Mamba layer, 0)
            inputs["position_ids"] = torch.arange(seg.start, seg.stop, device=self.device)[None]
            cross_tokens = 0 if request_images is None else request_images.cross_tokens
            cache = self._cache_for(seg, tables[seg.request_id], cross_tokens)
            out.append(self._run(seg, inputs, cache))
            for i, layer in enumerate(cache.layers):
                if isinstance(layer, StatePart) and i not in self._state_layouts:
                    self._state_layouts[i] = layer.state_layout()
        return torch.stack(out)

    def _run(self, seg: Segment, inputs: dict[str, torch.Tensor], cache: Cache) -> torch.Tensor:
        """Logits at the segment's last position: one forward, or one per token where a
        Mamba (v1) state continues (the mixer's one-token path reads the cached state; its
        multi-token scan would restart from zeros)."""
        steps = [inputs]
        if self.stepwise_continuation and seg.start > 0 and seg.num_tokens > 1:
            steps = [
                {k: v[:, i : i + 1] if k in SEQUENCE_INPUTS else v for k, v in inputs.items()}
                for i in range(seg.num_tokens)
            ]
        for step in steps:
            given = cache_kwargs(cache, self.model.forward)
            logits = self.model(**step, **given, use_cache=True).logits
        return logits[0, -1]


class _ReloadGatedCache(Cache):
    """A `Cache` whose layer ``i`` waits for the host tier's open reload copies of layer
    ``i`` (`HostTier.wait_layer`) before it writes or reads K/V: a reload's later layers
    copy while the earlier ones compute."""

    def __init__(self, wait_layer: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._wait_layer = wait_layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
        *args: Any, **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        self._wait_layer(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
