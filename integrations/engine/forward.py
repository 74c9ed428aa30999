"""Packed (varlen) forward of a Llama/Mistral-architecture transformers model over a KVCache.

Rationale
    A continuous-batching engine runs one forward over the tokens of many requests at
    once (prefill chunks and decodes mixed), reading each request's past K/V from the
    paged cache. Re-using the transformers model's own modules (projections, norms,
    rotary embedding, MLP) keeps the arithmetic the library's; only the attention is
    ours: torch SDPA over the K/V gathered from our vmm tensors by block table.

Approach
    ::

        tokens  | r0: 5 prefill | r1: 1 decode | r2: 3 prefill |   (one packed row)
        per layer: q, k, v = proj(norm(h)); rope(q, k); write k, v into each request's
        slots; for each request: K, V = gather(blocks [start, stop)); SDPA(q_r, K, V, mask)

    The mask is causal with an offset (query i of a segment starting at position s sees
    keys <= s + i) and, for sliding-window layers, keys > s + i - window.

Limitations
    Llama-style decoders only (LlamaForCausalLM, MistralForCausalLM: q/k/v/o projections,
    RMSNorm, rotary, gated MLP). One SDPA call per request and layer (no varlen kernel on
    CPU). With `use_flash` the kernel is `flash_kernel()`'s choice:

    * ``"flash_attn"`` (the flash-attn package is installed; CUDA backend, kv_split, block
      size a multiple of 256): `flash_attn_with_kvcache` reads the block table itself;
      released window blocks (-1) are passed as block 0, outside the window.
    * ``"sdpa_flash"`` (no flash-attn): torch's own FlashAttention kernel (SDPA restricted
      to the flash backend; on CPU the math backend) over the gathered K/V, K/V heads
      repeated for GQA. Its mask is lower-right causal; a sliding-window layer whose chunk
      spans more than the window runs one query at a time over that query's window.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from integrations.hf.compat import layer_types_and_kwargs
from integrations.kvcache import KVCache
from integrations.kvcache.access import TokenSlots, read_kv, token_slots, write_kv


@dataclass(frozen=True)
class Segment:
    """Positions [start, stop) of request `request_id` computed in this forward."""

    request_id: Hashable
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


def layer_windows(model: Any) -> list[int | None]:
    """Per decoder layer: its sliding window (tokens attended) or None for full attention."""
    types, kwargs = layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return [
        kw["sliding_window"] if t == "sliding_attention" else None
        for t, kw in zip(types, kwargs, strict=True)
    ]


def causal_mask(
    start: int, stop: int, key_start: int, window: int | None, device: Any = "cpu"
) -> torch.Tensor:
    """Boolean ``[stop-start, stop-key_start]``: True where query may attend key."""
    queries = torch.arange(start, stop, device=device)[:, None]
    keys = torch.arange(key_start, stop, device=device)[None, :]
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return mask


def flash_attn_installed() -> bool:
    """Whether the flash-attn package is importable."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_kernel() -> str:
    """The kernel ``attention='flash'`` runs: ``"flash_attn"`` when the flash-attn package
    is installed, else ``"sdpa_flash"`` (torch's own FlashAttention through SDPA)."""
    return "flash_attn" if flash_attn_installed() else "sdpa_flash"


def sdpa_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, key_start: int,
    window: int | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Attention of queries at positions ``[start, start + n)`` over keys at
    ``[key_start, start + n)`` (``[1, H, n, D]`` and ``[1, Hkv, L, D]``) with torch's
    FlashAttention kernel on CUDA (an error, not a silent fallback, where it cannot run)
    and SDPA's math backend elsewhere; causal, and within `window` when given."""
    n, length = q.shape[2], k.shape[2]
    if q.shape[1] != k.shape[1]:  # GQA: each K/V head serves H / Hkv query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if q.device.type != "cuda":
        mask = causal_mask(start, start + n, key_start, window, q.device)
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        if n == 1:  # one query sees every key it was given
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        if window is None or length <= window:
            bias = causal_lower_right(n, length)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        outs = []
        for i in range(n):  # the chunk spans more than the window: each query its own span
            lo = max(key_start, start + i - window + 1) - key_start
            hi = start + i + 1 - key_start
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, i : i + 1], k[:, :, lo:hi], v[:, :, lo:hi], scale=scale
                )
            )
        return torch.cat(outs, dim=2)


class PackedForward:
    """Runs `model` over packed segments, storing and reading K/V in `kv`."""

    def __init__(self, model: Any, kv: KVCache, *, use_flash: bool = False) -> None:
        self.model = model
        self.kv = kv
        self.use_flash = use_flash
        self.flash_kernel = flash_kernel() if use_flash else None
        self.device = next(model.parameters()).device
        self.windows = layer_windows(model)
        inner = model.model
        self.layers = inner.layers
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = model.config.num_attention_heads
        self.num_kv_heads = model.config.num_key_value_heads
        self.scaling = attn.scaling

    def prepare(self, segments: Sequence[Segment]) -> dict[tuple[int, int, int], TokenSlots]:
        """Every token slot the forward will write or read, from the block tables as they
        are now (an allocation made before the forward may release blocks it reads)."""
        slots: dict[tuple[int, int, int], TokenSlots] = {}
        for index in range(len(self.layers)):
            group = self.kv.group_of(index).index
            window = self.windows[index]
            for i, seg in enumerate(segments):
                self._group_slots(slots, i, seg, group, seg.start)
                self._group_slots(slots, i, seg, group, _key_start(seg, window))
        return slots

    @torch.no_grad()
    def __call__(
        self,
        segments: Sequence[Segment],
        token_ids: Sequence[int],
        slots: dict[tuple[int, int, int], TokenSlots] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(segments), vocab]`` at each segment's last position."""
        inner = self.model.model
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(s.start, s.stop) for s in segments]).to(self.device)
        hidden = inner.embed_tokens(ids)[None]  # [1, T, hidden]
        cos, sin = inner.rotary_emb(hidden, positions[None])
        slots = self.prepare(segments) if slots is None else slots
        tier = self.kv.tier
        for index, layer in enumerate(self.layers):
            if tier is not None:
                tier.wait_layer(index)  # open reloads' copies of this layer (host tier)
            residual = hidden
            normed = layer.input_layernorm(hidden)
            hidden = residual + self._attention(index, layer, normed, cos, sin, segments, slots)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = inner.norm(hidden)[0]
        ends = torch.tensor([s.num_tokens for s in segments]).cumsum(0)
        last = ends - 1
        return self.model.lm_head(hidden[last])

    def _group_slots(
        self, cache: dict, seg_index: int, seg: Segment, group: int, start: int
    ) -> TokenSlots:
        key = (seg_index, group, start)
        found = cache.get(key)
        if found is None:
            found = cache[key] = token_slots(self.kv, seg.request_id, group, start, seg.stop)
        return found

    def _attention(
        self,
        index: int,
        layer: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Sequence[Segment],
        slots: dict,
    ) -> torch.Tensor:
        attn = layer.self_attn
        tokens = x.shape[1]
        q = attn.q_proj(x).view(1, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        group = self.kv.group_of(index).index
        window = self.windows[index]
        if self.flash_kernel == "flash_attn":
            merged = self._flash(index, group, window, q, k, v, segments)
            return attn.o_proj(merged.reshape(1, tokens, -1))
        outputs = []
        offset = 0
        for i, seg in enumerate(segments):
            n = seg.num_tokens
            new = self._group_slots(slots, i, seg, group, seg.start)
            write_kv(self.kv, index, new, k[0, :, offset : offset + n].transpose(0, 1),
                     v[0, :, offset : offset + n].transpose(0, 1))  # fmt: skip
            key_start = _key_start(seg, window)
            past = self._group_slots(slots, i, seg, group, key_start)
            keys, values = read_kv(self.kv, index, past)
            out = self._sdpa(q[:, :, offset : offset + n], keys, values, seg, key_start, window)
            outputs.append(out)
            offset += n
        merged = torch.cat(outputs, dim=2).transpose(1, 2).reshape(1, tokens, -1)
        return attn.o_proj(merged)

    def _sdpa(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seg: Segment,
        key_start: int, window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        """One segment's attention over its gathered K/V (``[L, Hkv, D]``)."""
        k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if self.flash_kernel == "sdpa_flash":
            return sdpa_flash(q, k, v, seg.start, key_start, window, self.scaling)
        mask = causal_mask(seg.start, seg.stop, key_start, window, self.device)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True
        )

    def _flash(
        self,
        index: int,
        group: int,
        window: int | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Sequence[Segment],
    ) -> torch.Tensor:
        """flash-attn over the paged cache (kv_split block views ``[blocks, T, H, D]``): the
        kernel appends each segment's K/V at ``cache_seqlens`` itself (GPU only)."""
        from flash_attn import flash_attn_with_kvcache

        k_cache, v_cache = self.kv.block_view(index, 0), self.kv.block_view(index, 1)
        window_size = (-1, -1) if window is None else (window - 1, 0)
        outputs, offset = [], 0
        for seg in segments:
            n = seg.num_tokens
            table = [max(b, 0) for b in self.kv.block_table(seg.request_id, group)]
            part = slice(offset, offset + n)
            out = flash_attn_with_kvcache(
                q[:, :, part].transpose(1, 2),
                k_cache,
                v_cache,
                k=k[:, :, part].transpose(1, 2),
                v=v[:, :, part].transpose(1, 2),
                cache_seqlens=torch.tensor([seg.start], dtype=torch.int32, device=self.device),
                block_table=torch.tensor([table], dtype=torch.int32, device=self.device),
                softmax_scale=self.scaling,
                causal=True,
                window_size=window_size,
            )
            outputs.append(out)  # [1, n, H, D]
            offset += n
        return torch.cat(outputs, dim=1)


def _key_start(seg: Segment, window: int | None) -> int:
    """First position a segment's queries read (its first query's window start)."""
    return 0 if window is None else max(0, seg.start - window + 1)
