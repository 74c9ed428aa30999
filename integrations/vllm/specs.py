"""vLLM KV-cache specs → jenga `LayerSpec` s, and the memory budget vLLM's config gives.

Rationale
    vLLM describes each KV-cache group by a spec object (`FullAttentionSpec`,
    `SlidingWindowSpec`, `MambaSpec`, ...); jenga's allocator needs a `LayerSpec` whose
    page equals the spec's *unpadded* page. The translation, its refusals and the
    byte budget are one concern, kept apart from the page tables built on them
    (`integrations.vllm.page_tables`) and the layout that joins both
    (`integrations.vllm.layout`).

Approach
    Specs are recognised by class name (`SUPPORTED_SPECS`), so a spec vLLM adds later is
    refused by name (`UnsupportedLayerKind`), never mistaken for its base class. The
    budget is vLLM's single backing allocation (`kv_cache_memory_bytes`). Mamba groups
    follow vLLM's cache mode (`mamba_step_end_only`).

    MLA specs (one latent per token) become `Kind.MLA` / `Kind.SLIDING_WINDOW_MLA`
    (`Kind.REPLAY_SLIDING_WINDOW_MLA` with ``bounded_replay``: never cached, vLLM's
    scheduler recomputes a hit's last window), static-sink specs `Kind.SINK_FULL`; each
    kind's rules are its jenga policy class. A `CircularBufferSpec` (one ring block per
    request, DeepSeek-V4's compressor state) is `Kind.CIRCULAR_BUFFER`; an
    `MLAAttentionSpec` storing one state per ``tokens_per_state`` tokens (DeepSeek-V4's
    compressed MLA) is `Kind.COMPRESSED_MLA`, its page ``block_size // tokens_per_state``
    states.

    Decode context parallelism follows vLLM's manager: a ``dcp_sharded`` group's block
    spans ``block_size * dcp_world_size`` tokens, spread over the ranks, so its jenga spec
    has that block size and ``token_shards = dcp_world_size`` (one rank's page stays the
    spec's page); replicated groups (Mamba, a draft with ``dcp_sharded=False``) keep
    theirs. `check_context_parallel` refuses the groups vLLM's manager refuses.

Limitations
    HiSparse, encoder-only, R-SWA and uniform-type specs are refused, each with its
    reason (`REFUSED_SPECS`), and so are compressed pages (``tokens_per_state != 1``)
    of any spec but `MLAAttentionSpec` (whose compressed form is `Kind.COMPRESSED_MLA`).
    A HiSparse config is refused as a whole (`check_host_tier`): besides its resident and
    hot specs it has a host-resident source group and an indexer group whose specs are
    ordinary attention specs, told apart only by their role and ``host_resident``.
    A sliding window wider than ``max_model_len`` is clamped to it (it then behaves as
    full).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from jenga.specs import ONE_VECTOR_KINDS, Kind, LayerSpec

from integrations.vllm.errors import JengaVllmError, UnsupportedFeature, UnsupportedLayerKind

if TYPE_CHECKING:
    from integrations.vllm.compat import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

SUPPORTED_SPECS = (
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
    "MambaSpec",
    "CrossAttentionSpec",
    "MLAAttentionSpec",
    "SlidingWindowMLASpec",
    "SinkFullAttentionSpec",
    "HiddenStateCacheSpec",
    "CircularBufferSpec",
)
# vLLM's `FullAttentionSpec` and its subclasses: the groups decode context parallelism shards
FULL_ATTENTION_FAMILY = (
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SinkFullAttentionSpec",
    "HiddenStateCacheSpec",
)
# vLLM's `AttentionSpec` family among the supported specs (all but Mamba)
ATTENTION_SPECS = tuple(name for name in SUPPORTED_SPECS if name != "MambaSpec")
# specs with one latent vector per token (vLLM's MLA caches: ``head_size_v == 0``)
MLA_SPECS = {"MLAAttentionSpec": Kind.MLA, "HiddenStateCacheSpec": Kind.MLA}
# why a spec vLLM defines is refused (the message names it; others get the supported list)
HISPARSE_REASON = (
    "HiSparse keeps the sparse-MLA source KV in a host block pool and GPU resident/hot pages "
    "as a write-back cache of it, a second memory tier that vLLM's HiSparseConnector drives "
    "through vLLM's own HiSparseCoordinator, single-type managers and block pool (pages "
    "released but read until the pool reuses them, host pages published once their DMA "
    "completes); this manager does not build that tier"
)
HISPARSE_SPECS = ("HiSparseHotSpec", "HiSparseResidentSpec")
REFUSED_SPECS = {
    "HiSparseHotSpec": HISPARSE_REASON,
    "HiSparseResidentSpec": HISPARSE_REASON,
    "EncoderOnlyAttentionSpec": "encoder-only attention keeps no KV cache between steps; vLLM's "
    "worker builds it outside the KV-cache config, so a group of it is a misconfiguration",
    "RSWASpec": "reference sliding-window attention frees the gap between the prompt and the "
    "decode window, a rule no jenga kind has",
    "UniformTypeKVCacheSpecs": "one group of differently sized layers needs one page per layer",
}


def declared_page_bytes(spec: KVCacheSpec) -> int | None:
    """Bytes of one block of one layer as vLLM's spec declares them (padded), or None.

    None for a `MambaSpec` with no ``page_size_padded`` whose ``shapes`` are not a tuple
    of shapes (vLLM's own tests build ``MambaSpec(shapes=(1, 1))``): vLLM's manager never
    sizes a page, so such a spec is valid to it, and only the block slot sizes it.
    """
    if type(spec).__name__ == "MambaSpec":
        if spec.page_size_padded is not None:
            return int(spec.page_size_padded)
        if not all(isinstance(shape, tuple | list) for shape in spec.shapes):
            return None
    return int(spec.page_size_bytes)


def kv_cache_memory_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes vLLM would allocate for this config (its one backing buffer)."""
    tensors = kv_cache_config.kv_cache_tensors
    if tensors:
        return max(int(t.size) for t in tensors)
    sized = [
        (page, g)
        for g in kv_cache_config.kv_cache_groups
        if (page := declared_page_bytes(g.kv_cache_spec)) is not None
    ]
    if not sized:
        raise JengaVllmError(
            "the KV-cache config lists no tensors and no group's spec gives a page size "
            f"({[type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]})"
        )
    per_block = max(page * len(g.layer_names) for page, g in sized)
    return int(kv_cache_config.num_blocks) * per_block


def _mamba_state_bytes(
    spec: KVCacheSpec, where: str, slot_bytes: int | None, num_layers: int
) -> int:
    """One layer's Mamba state: the spec's unpadded size, else its padded page, else (on
    vLLM's shared slots, where every page is padded to the slot) the slot's share."""
    if all(isinstance(shape, tuple | list) for shape in spec.shapes):
        return int(spec.real_page_size_bytes)
    if spec.page_size_padded is not None:
        return int(spec.page_size_padded)
    if slot_bytes is not None:
        return slot_bytes // max(1, num_layers)
    raise JengaVllmError(
        f"{where}: shapes {spec.shapes!r} are not a tuple of state shapes and the spec has "
        "no page_size_padded, so the state size is unknown; pages='vmm' needs it"
    )


def check_spec_kind(spec: KVCacheSpec, group_index: int) -> None:
    """Raise `UnsupportedLayerKind` for a vLLM spec class this manager does not serve."""
    name = type(spec).__name__
    if name in REFUSED_SPECS:
        raise UnsupportedLayerKind(
            f"KV-cache group {group_index} ({name}): {name} is not supported: {REFUSED_SPECS[name]}"
        )
    if name not in SUPPORTED_SPECS:
        raise UnsupportedLayerKind(
            f"KV-cache group {group_index} ({name}): jenga-vmm's vLLM manager supports "
            f"{', '.join(SUPPORTED_SPECS)}; {name} is not supported"
        )


def _hisparse_group(group: KVCacheGroupSpec, index: int) -> str | None:
    """How a HiSparse group is named in a refusal (None: not part of HiSparse's tier).

    A group belongs to HiSparse's tier when its spec is a HiSparse spec, it lives in host
    memory (``host_resident``) or vLLM gives it a HiSparse role (``hisparse_source``,
    ``hisparse_indexer``; vLLM 0.32/0.33's `KVCacheGroupRole`, "default" otherwise).
    """
    name = type(group.kv_cache_spec).__name__
    role = getattr(group, "role", None)
    role = str(getattr(role, "value", role) or "default")
    host = bool(getattr(group, "host_resident", False))
    if name not in HISPARSE_SPECS and role == "default" and not host:
        return None
    notes = [name] + ([f"role {role}"] if role != "default" else [])
    return f"{index} ({', '.join(notes + (['host-resident'] if host else []))})"


def check_host_tier(kv_cache_config: KVCacheConfig) -> None:
    """Raise `UnsupportedLayerKind` naming every HiSparse group of the config.

    Checked for the whole config, before any group is translated: a host-resident source
    group is a `FullAttentionSpec` (or an MLA spec) that would otherwise pass as an
    ordinary GPU group, its blocks numbered in the GPU pool while vLLM's worker reads them
    from the host pool of ``hisparse_host_num_blocks`` blocks.
    """
    groups = kv_cache_config.kv_cache_groups
    named = [d for i, g in enumerate(groups) if (d := _hisparse_group(g, i)) is not None]
    host_blocks = getattr(kv_cache_config, "hisparse_host_num_blocks", None)
    if not named and host_blocks is None:
        return
    raise UnsupportedLayerKind(
        f"HiSparse KV-cache groups [{', '.join(named)}] "
        f"(hisparse_host_num_blocks={host_blocks}) are not supported: {HISPARSE_REASON}"
    )


def check_kinds(kv_cache_config: KVCacheConfig) -> None:
    """Refuse a HiSparse config as a whole (`check_host_tier`), then any group whose spec
    no jenga kind serves (`check_spec_kind`), before a group is translated."""
    check_host_tier(kv_cache_config)
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        check_spec_kind(g.kv_cache_spec, i)


def dcp_shards(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """Ranks decode context parallelism spreads one block of ``spec`` over (vLLM's rule:
    the world size for a ``dcp_sharded`` spec, 1 for a replicated one such as Mamba's or
    a draft's that opts out)."""
    return dcp_world_size if getattr(spec, "dcp_sharded", False) else 1


def check_context_parallel(
    vgroups: Sequence[KVCacheGroupSpec], dcp_world_size: int, pcp_world_size: int
) -> None:
    """vLLM's context-parallel rules for the groups, as `UnsupportedFeature` naming them.

    A positive world size is required. Under decode context parallelism every sharded
    group must be full attention (MLA and sink included: vLLM's `FullAttentionSpec`
    family); under prefill context parallelism every group must be full attention or a
    replicated attention group. Mamba and other replicated groups keep their block size.
    """
    if dcp_world_size < 1 or pcp_world_size < 1:
        raise UnsupportedFeature(
            f"context parallel world sizes must be >= 1, got dcp_world_size={dcp_world_size}, "
            f"pcp_world_size={pcp_world_size}"
        )
    for i, g in enumerate(vgroups):
        spec, name = g.kv_cache_spec, type(g.kv_cache_spec).__name__
        full = name in FULL_ATTENTION_FAMILY
        sharded = bool(getattr(spec, "dcp_sharded", False))
        if dcp_world_size > 1 and sharded and not full:
            raise UnsupportedFeature(
                f"decode context parallelism (dcp_world_size={dcp_world_size}) with KV-cache "
                f"group {i} ({name}, dcp_sharded=True): only full-attention groups (and "
                "replicated ones: Mamba, drafts with dcp_sharded=False) can be sharded"
            )
        attention = name in ATTENTION_SPECS
        if pcp_world_size > 1 and not (full or (attention and not sharded)):
            raise UnsupportedFeature(
                f"prefill context parallelism (pcp_world_size={pcp_world_size}) with KV-cache "
                f"group {i} ({name}, dcp_sharded={sharded}): only full-attention groups and "
                "replicated attention groups are served"
            )


def layer_spec_from_vllm(
    spec: KVCacheSpec,
    max_model_len: int,
    group_index: int,
    slot_bytes: int | None = None,
    num_layers: int = 1,
    dcp_world_size: int = 1,
) -> LayerSpec:
    """The jenga `LayerSpec` whose page equals the vLLM spec's unpadded page.

    ``slot_bytes``: vLLM's block slot when blocks live in its shared tensors (sizes a
    Mamba state its spec does not size, see `declared_page_bytes`). Under decode context
    parallelism a sharded group's block spans ``block_size * dcp_world_size`` tokens
    (vLLM's manager block), of which one rank's page holds ``block_size``.
    """
    name = type(spec).__name__
    where = f"KV-cache group {group_index} ({name})"
    check_spec_kind(spec, group_index)
    if name == "MambaSpec":
        return LayerSpec(
            Kind.MAMBA,
            state_bytes=_mamba_state_bytes(spec, where, slot_bytes, num_layers),
            checkpoint_interval=int(spec.block_size),
            block_size=int(spec.block_size),
            # a state per draft token after the running one (speculative decoding)
            speculative_states=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        )
    shards = dcp_shards(spec, dcp_world_size)
    layer = _attention_spec(spec, name, where, max_model_len)
    if shards == 1:
        return layer
    return replace(layer, block_size=layer.block_size * shards, token_shards=shards)


def _attention_kind(
    spec: KVCacheSpec, name: str, where: str, max_model_len: int
) -> tuple[Kind, int | None, int | None]:
    """(kind, window, chunk) of an attention spec; refuses what no kind serves."""
    # blocks below the window that multi-module MTP may re-prefill stay held too
    retained = int(getattr(spec, "extra_retained_tokens", 0))
    if name == "SlidingWindowSpec":
        return Kind.SLIDING_WINDOW, min(int(spec.sliding_window) + retained, max_model_len), None
    if name == "SlidingWindowMLASpec":
        window = min(int(spec.sliding_window) + retained, max_model_len)
        if getattr(spec, "bounded_replay", False):  # a hit recomputes the window
            return Kind.REPLAY_SLIDING_WINDOW_MLA, window, None
        return Kind.SLIDING_WINDOW_MLA, window, None
    if name == "CircularBufferSpec":  # one ring block per request, never cached
        return Kind.CIRCULAR_BUFFER, None, None
    if name == "ChunkedLocalAttentionSpec":
        return Kind.CHUNKED_LOCAL, None, int(spec.attention_chunk_size)
    if name == "CrossAttentionSpec":  # K/V of the encoder input, held for the whole request
        return Kind.CROSS_ATTENTION, None, None
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        raise UnsupportedLayerKind(
            f"{where}: a FullAttentionSpec carrying sliding_window/attention_chunk_size "
            "(hybrid manager disabled) is not supported; enable vLLM's hybrid KV-cache "
            "manager so such layers get SlidingWindowSpec/ChunkedLocalAttentionSpec"
        )
    if name == "SinkFullAttentionSpec":
        sink, block = spec.sink_len, int(spec.block_size)
        if sink is None or sink <= 0 or sink % block:
            raise UnsupportedLayerKind(
                f"{where}: sink_len {sink} must be > 0 and a multiple of block_size {block}"
            )
        return Kind.SINK_FULL, None, None
    return MLA_SPECS.get(name, Kind.FULL), None, None


def _attention_spec(spec: KVCacheSpec, name: str, where: str, max_model_len: int) -> LayerSpec:
    """The `LayerSpec` of an attention spec: K/V kinds split a cell into K and V halves of
    ``head_dim`` bytes; MLA kinds store the cell as one latent of ``head_dim`` bytes."""
    kind, window, chunk = _attention_kind(spec, name, where, max_model_len)
    tps = getattr(spec, "tokens_per_state", 1)
    if tps != 1:  # one state per tps tokens: DeepSeek-V4's compressed MLA only
        if name != "MLAAttentionSpec" or type(tps) is not int or tps < 1 or spec.block_size % tps:
            raise UnsupportedLayerKind(
                f"{where}: packed or compressed attention pages (tokens_per_state={tps}) "
                "are not supported: only MLAAttentionSpec compresses, by an integer "
                f"dividing block_size {spec.block_size}"
            )
        kind = Kind.COMPRESSED_MLA
    cell = int(spec.state_content_size_bytes)
    one_vector = kind in ONE_VECTOR_KINDS
    if not one_vector and cell % 2:
        raise UnsupportedLayerKind(
            f"{where}: a K/V cell of {cell} bytes does not split into K and V halves"
        )
    return LayerSpec(
        kind,
        num_kv_heads=int(spec.num_heads),
        head_dim=cell if one_vector else cell // 2,
        dtype_bytes=1,
        block_size=int(spec.block_size),
        window=window,
        chunk=chunk,
        sink_len=int(spec.sink_len) if kind is Kind.SINK_FULL else None,
        tokens_per_state=int(tps),
    )


def mamba_step_end_only(vgroups: Sequence[KVCacheGroupSpec]) -> bool:
    """Whether Mamba states exist only where a step ends (vLLM's "align" cache mode).

    With "none" (prefix caching off in a real engine; vLLM's own tests also build it with
    caching on) vLLM's manager treats every Mamba block as a state written and cacheable,
    as it treats attention blocks; jenga's Mamba policy then keeps every checkpoint.
    """
    modes = {
        str(getattr(g.kv_cache_spec, "mamba_cache_mode", "none"))
        for g in vgroups
        if type(g.kv_cache_spec).__name__ == "MambaSpec"
    }
    if len(modes) > 1:
        raise UnsupportedLayerKind(
            f"Mamba groups with different mamba_cache_mode values {sorted(modes)} "
            "(vLLM sets one mode per engine)"
        )
    return modes != {"none"}
