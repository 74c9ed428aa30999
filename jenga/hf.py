"""Hugging Face ``config.json`` dict -> ModelSpec.

Rationale
    Engines know a model by its HF config; the allocator needs integers per layer (kind,
    KV heads, head dim, window, Mamba state bytes). Reading the config ourselves keeps
    `jenga` free of `transformers` and torch, and lets tests pin every number.

Approach
    A config is read from what it says, not from its name. transformers 5.x configs list
    every layer's ``layer_types``; each type maps to jenga kinds (`LAYER_TYPE_KINDS`)::

        full_attention -> FULL            linear_attention -> MAMBA (state from hf_states)
        sliding_attention -> SLIDING(w)   hybrid           -> FULL + MAMBA (one layer id)
        chunked_attention -> CHUNKED(c)   hybrid_sliding   -> SLIDING(w) + MAMBA
        moe / mlp / dummy -> no cache     anything else    -> SpecError naming it and the layer

    Without ``layer_types`` the kinds follow transformers' own inference (`sliding_window`
    set: sliding; `attention_chunk_size` set: chunked; else full). Cross-layer KV sharing
    (``num_kv_shared_layers``, Gemma 3n): the last N layers read the cache of the last
    earlier layer of their type and become that group's `readers` (no memory). Head dims:
    ``head_dim``, else ``attention_head_dim`` (Zamba2), else hidden / heads.

    Families whose older configs carry no ``layer_types`` keep a reader of their own
    (dispatch table `_READERS`) that returns ``(layer id, LayerSpec)`` pairs;
    `group_layers` turns them into KV groups. Per-layer kinds come from, in order of
    preference: an explicit ``layer_types`` list; else the family's own rule (Gemma 2:
    even layers slide; Gemma 3: every `sliding_window_pattern`-th layer is global;
    Mistral params-style per-layer `sliding_window` lists; Llama 4 `no_rope_layers`;
    Jamba `attn_layer_period/offset`; mllama `cross_attention_layers`;
    Qwen2 `use_sliding_window` + `max_window_layers`; LLaVA-OneVision adds a
    vision-embedding cache beside its Qwen2 decoder).
    A sliding window >= max_model_len is full attention and is reported as such.

    Mamba state per layer (what a serving engine keeps, vLLM's layout)::

        d_inner = mamba_expand * hidden_size
        conv    = (mamba_d_conv - 1) * d_inner * dtype_bytes      # rolling conv inputs
        ssm     = d_inner * mamba_d_state * ssm_dtype_bytes       # fp32 by default
        Jamba 1.5 Mini: (3 * 8192 * 2) + (8192 * 16 * 4) = 49152 + 524288 = 573440 B

    Multi-head latent attention (``kv_lora_rank`` set: DeepSeek-V2/V3, Kimi, GLM-4 MoE
    lite, ...): what is cached per token is the compressed latent, not a per-head K and
    V (transformers caches ``kv_nope`` [1 head x kv_lora_rank] as "keys" and the roped
    ``k_rot`` [1 head x qk_rope_head_dim] as "values"; vLLM caches the same latent), so a
    full-attention layer becomes `Kind.MLA` (a sliding one `Kind.SLIDING_WINDOW_MLA`) of
    1 head x (kv_lora_rank + qk_rope_head_dim). DeepSeek-V3: 512 + 64 = 576 per token.

Limitations
    K and V of one layer share a head dim: a config whose ``v_head_dim`` differs without
    ``kv_lora_rank`` is refused. A latent (MLA) model's chunked layers are refused (no
    jenga kind). Reads the fields that shape the KV cache; it does not validate the rest
    of a config.
    `weight_bytes` is computed for the dense families (llama, mistral, ministral, gemma2,
    gemma3 text, qwen2) from their shapes; for MoE / Mamba / vision models it is left 0 unless
    the caller passes the published figure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jenga.hf_states import linear_state
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec, SpecError, group_layers

Config = Mapping[str, Any]
LayerList = list[tuple[int, LayerSpec]]

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8": 1}
_LAYER_TYPE_KINDS = {
    "full_attention": Kind.FULL,
    "sliding_attention": Kind.SLIDING_WINDOW,
    "chunked_attention": Kind.CHUNKED_LOCAL,
}
LAYER_TYPE_KINDS: dict[str, tuple[Kind, ...]] = {
    **{name: (kind,) for name, kind in _LAYER_TYPE_KINDS.items()},
    "linear_attention": (Kind.MAMBA,),
    "hybrid": (Kind.FULL, Kind.MAMBA),
    "hybrid_sliding": (Kind.SLIDING_WINDOW, Kind.MAMBA),
}
NO_CACHE_LAYER_TYPES = frozenset({"moe", "mlp", "dummy"})
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


@dataclass(frozen=True)
class HfOptions:
    """How to size a model's cache beyond what its config says."""

    block_size: int = 16
    dtype_bytes: int | None = None  # None: from the config's torch_dtype / dtype (default 2)
    ssm_dtype_bytes: int = 4  # Mamba SSM state is kept in fp32 by the reference kernels
    max_model_len: int | None = None  # None: max_position_embeddings
    mamba_checkpoint_interval: int = 512
    # True: a conv state keeps all d_conv columns (transformers); False: d_conv - 1 (vLLM)
    conv_full_kernel: bool = False


def supported_model_types() -> tuple[str, ...]:
    """Model types with a family rule of their own; any other config is read from its
    ``layer_types`` (or transformers' inference from `sliding_window` / chunk fields)."""
    return tuple(sorted(_READERS))


def model_spec_from_config(
    config: Config,
    *,
    name: str | None = None,
    options: HfOptions | None = None,
    weight_bytes: int | None = None,
) -> ModelSpec:
    """Build a ModelSpec from a ``config.json`` dict (see module note for the rules)."""
    options = options or HfOptions()
    model_type = config.get("model_type")
    reader = _READERS.get(str(model_type), _read_layer_types)
    text = _text_config(config)
    max_len = options.max_model_len or _require_int(text, "max_position_embeddings")
    layers = reader(config, options, max_len)
    if weight_bytes is None:
        weight_bytes = _dense_weight_bytes(config, options)
    return ModelSpec(
        name=name or str(config.get("_name_or_path") or model_type),
        groups=_share_kv(text, layers),
        max_model_len=max_len,
        weight_bytes=weight_bytes,
    )


# ------------------------------------------------------------------------- helpers


def _text_config(config: Config) -> Config:
    """Multimodal configs (mllama, gemma3, llama4) nest the decoder in `text_config`."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _require_int(config: Config, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"config field {key!r} must be an int, got {value!r}")
    return value


def _dtype_bytes(config: Config, options: HfOptions) -> int:
    if options.dtype_bytes is not None:
        return options.dtype_bytes
    text = _text_config(config)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
    if dtype is None:
        return 2
    if str(dtype) not in _DTYPE_BYTES:
        raise SpecError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[str(dtype)]


@dataclass(frozen=True)
class _AttentionShape:
    num_kv_heads: int
    head_dim: int
    latent: bool = False  # MLA: one latent per token (1 "head" of the latent's width)


# a latent (MLA) model's layers: the kind a K/V layer of that type becomes
_LATENT_KINDS = {Kind.FULL: Kind.MLA, Kind.SLIDING_WINDOW: Kind.SLIDING_WINDOW_MLA}


def _attention_shape(text: Config) -> _AttentionShape:
    if text.get("kv_lora_rank") is not None:  # MLA: the compressed latent + its rope part
        width = _require_int(text, "kv_lora_rank") + _require_int(text, "qk_rope_head_dim")
        return _AttentionShape(1, width, latent=True)
    heads = _require_int(text, "num_attention_heads")
    kv_heads = text.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = text.get("head_dim")
    if head_dim is None:
        head_dim = text.get("attention_head_dim")  # Zamba2
    head_dim = _require_int(text, "hidden_size") // heads if head_dim is None else head_dim
    v_head_dim = text.get("v_head_dim")
    if v_head_dim is not None and v_head_dim != head_dim:
        raise SpecError(
            f"K head dim {head_dim} and V head dim {v_head_dim} differ (and no kv_lora_rank: "
            "not a latent cache): a LayerSpec stores one head_dim"
        )
    return _AttentionShape(int(kv_heads), int(head_dim))


def _attention_layer(
    kind: Kind, shape: _AttentionShape, dtype_bytes: int, options: HfOptions, **kwargs: Any
) -> LayerSpec:
    if shape.latent:
        if kind not in _LATENT_KINDS:
            raise SpecError(
                f"a {kind} layer of a latent-attention model (kv_lora_rank) has no jenga kind; "
                f"latent kinds: {sorted(str(k) for k in _LATENT_KINDS)}"
            )
        kind = _LATENT_KINDS[kind]
    return LayerSpec(
        kind,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype_bytes=dtype_bytes,
        block_size=options.block_size,
        **kwargs,
    )


def _layer_kinds_from_types(text: Config, num_layers: int) -> list[Kind] | None:
    layer_types = text.get("layer_types")
    if layer_types is None:
        return None
    if len(layer_types) != num_layers:
        raise SpecError(
            f"layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}"
        )
    unknown = sorted(set(layer_types) - set(_LAYER_TYPE_KINDS))
    if unknown:
        layers = [i for i, t in enumerate(layer_types) if t not in _LAYER_TYPE_KINDS]
        raise SpecError(
            f"unknown layer_types {unknown} (layers {layers}) for a "
            f"{text.get('model_type')!r} config; known: {sorted(_LAYER_TYPE_KINDS)}"
        )
    return [_LAYER_TYPE_KINDS[t] for t in layer_types]


def _decoder_layers(
    config: Config,
    options: HfOptions,
    max_len: int,
    kinds: Sequence[Kind | None],
    windows: list[int | None] | None = None,
) -> LayerList:
    """Attention layers of a decoder given each layer's kind (None: no attention cache)
    and per-layer windows."""
    text = _text_config(config)
    if all(kind is None for kind in kinds):
        return []
    shape = _attention_shape(text)
    dtype = _dtype_bytes(config, options)
    layers: LayerList = []
    for i, kind in enumerate(kinds):
        if kind is None:
            continue
        kwargs: dict[str, Any] = {}
        if kind is Kind.SLIDING_WINDOW:
            window = windows[i] if windows else _require_int(text, "sliding_window")
            if window is None or window >= max_len:
                kind = Kind.FULL  # a window that covers the whole context is full attention
            else:
                kwargs["window"] = window
        elif kind is Kind.CHUNKED_LOCAL:
            kwargs["chunk"] = _require_int(text, "attention_chunk_size")
        layers.append((i, _attention_layer(kind, shape, dtype, options, **kwargs)))
    return layers


def layer_types(text: Config) -> list[str]:
    """Every layer's type: ``layer_types`` if the config lists them, else transformers'
    inference (`sliding_window` set: sliding; `attention_chunk_size` set: chunked)."""
    n = _require_int(text, "num_hidden_layers")
    types = text.get("layer_types") or text.get("layers_block_type")
    if types is None and text.get("attn_layer_indices") is not None:  # Bamba
        attention = set(text["attn_layer_indices"])
        types = ["full_attention" if i in attention else "linear_attention" for i in range(n)]
    if types is None:
        if text.get("sliding_window") is not None:
            return ["sliding_attention"] * n
        if text.get("attention_chunk_size") is not None:
            return ["chunked_attention"] * n
        return ["full_attention"] * n
    if len(types) != n:
        raise SpecError(f"layer_types has {len(types)} entries, num_hidden_layers is {n}")
    return [_LEGACY_TYPES.get(str(t), str(t)) for t in types]


def _read_layer_types(config: Config, options: HfOptions, max_len: int) -> LayerList:
    """Any decoder, from its layer types (see module note); refuses a type it cannot store."""
    text = _text_config(config)
    types = layer_types(text)
    unknown = [(i, t) for i, t in enumerate(types) if t not in LAYER_TYPE_KINDS]
    unknown = [(i, t) for i, t in unknown if t not in NO_CACHE_LAYER_TYPES]
    if unknown:
        i, t = unknown[0]
        raise SpecError(
            f"layer {i}: layer type {t!r} has no jenga kind (layers {[j for j, _ in unknown]}); "
            f"storable: {sorted(LAYER_TYPE_KINDS)}, no cache: {sorted(NO_CACHE_LAYER_TYPES)}"
        )
    attention_kinds = [
        LAYER_TYPE_KINDS[t][0] if t in LAYER_TYPE_KINDS and t != "linear_attention" else None
        for t in types
    ]
    attention = dict(_decoder_layers(config, options, max_len, attention_kinds))
    layers: LayerList = []
    state: LayerSpec | None = None
    for i, t in enumerate(types):
        if i in attention:
            layers.append((i, attention[i]))
        if Kind.MAMBA in LAYER_TYPE_KINDS.get(t, ()):
            state = state or _state_spec(config, options)
            layers.append((i, state))
    return layers


def _state_spec(config: Config, options: HfOptions) -> LayerSpec:
    text = _text_config(config)
    if int(text.get("number_of_conv_states") or 1) != 1:
        raise SpecError(
            f"number_of_conv_states={text['number_of_conv_states']}: one state per layer only"
        )
    shape = linear_state(text)
    dtype = _dtype_bytes(config, options)
    return LayerSpec(
        Kind.MAMBA,
        state_bytes=shape.num_bytes(
            dtype, options.ssm_dtype_bytes, full_kernel=options.conv_full_kernel
        ),
        block_size=options.block_size,
        checkpoint_interval=options.mamba_checkpoint_interval,
    )


def kv_sharing_owners(text: Config) -> dict[int, int]:
    """``{reader layer: owner layer}`` for cross-layer KV sharing (Gemma 3n's last
    ``num_kv_shared_layers`` layers read the last earlier layer of their own type)."""
    shared = int(text.get("num_kv_shared_layers") or 0)
    if shared <= 0:
        return {}
    types = layer_types(text)
    first = len(types) - shared
    if first <= 0:
        raise SpecError(f"num_kv_shared_layers {shared} leaves no layer storing a cache")
    owners: dict[int, int] = {}
    for layer in range(first, len(types)):
        same = [i for i in range(first) if types[i] == types[layer]]
        if not same:
            raise SpecError(
                f"layer {layer} ({types[layer]!r}) shares KV but no earlier layer has its type"
            )
        owners[layer] = same[-1]
    return owners


def _share_kv(text: Config, layers: LayerList) -> tuple[KVGroup, ...]:
    """Group the layers; KV-sharing layers become readers of their owner's group."""
    owners = kv_sharing_owners(text)
    groups = group_layers([(i, spec) for i, spec in layers if i not in owners])
    if not owners:
        return groups
    return tuple(
        dataclasses.replace(g, readers=tuple((r, o) for r, o in owners.items() if o in g.layer_ids))
        for g in groups
    )


# ------------------------------------------------------------------------- readers


def _read_llama(config: Config, options: HfOptions, max_len: int) -> LayerList:
    n = _require_int(config, "num_hidden_layers")
    kinds = _layer_kinds_from_types(config, n) or [Kind.FULL] * n
    return _decoder_layers(config, options, max_len, kinds)


def _read_qwen2(config: Config, options: HfOptions, max_len: int) -> LayerList:
    """Qwen2 slides only with ``use_sliding_window``, and then from `max_window_layers` on."""
    text = _text_config(config)
    n = _require_int(text, "num_hidden_layers")
    kinds = _layer_kinds_from_types(text, n)
    if kinds is None:
        first_sliding = int(text.get("max_window_layers") or 0)
        slides = bool(text.get("use_sliding_window"))
        kinds = [
            Kind.SLIDING_WINDOW if slides and i >= first_sliding else Kind.FULL for i in range(n)
        ]
    return _decoder_layers(config, options, max_len, kinds)


def _read_llava_onevision(config: Config, options: HfOptions, max_len: int) -> LayerList:
    """Qwen2 decoder plus the vision-embedding cache: projector outputs (text hidden size
    wide) of one 384 px crop, ``(image_size // patch_size) ** 2`` = 729 tokens, kept under
    model ``"encoder"`` at layer id 0."""
    layers = _read_qwen2(config, options, max_len)
    text, vision = _text_config(config), config.get("vision_config") or {}
    per_image = (_require_int(vision, "image_size") // _require_int(vision, "patch_size")) ** 2
    embedding = LayerSpec(
        Kind.VISION_EMBEDDING,
        num_kv_heads=1,
        head_dim=_require_int(text, "hidden_size"),
        dtype_bytes=_dtype_bytes(config, options),
        block_size=options.block_size,
        tokens_per_image=per_image,
        model="encoder",
    )
    return [*layers, (0, embedding)]


def _read_mistral(config: Config, options: HfOptions, max_len: int) -> LayerList:
    """`sliding_window`: None (full), an int (every layer), or a per-layer pattern list
    (mistral params.json style, e.g. Ministral 8B ``[None, 32768, 32768, 32768]``)."""
    n = _require_int(config, "num_hidden_layers")
    kinds = _layer_kinds_from_types(config, n)
    if kinds is not None:
        return _decoder_layers(config, options, max_len, kinds)
    window = config.get("sliding_window")
    if isinstance(window, list):
        if not window:
            raise SpecError("sliding_window pattern list is empty")
        windows = [window[i % len(window)] for i in range(n)]
        kinds = [Kind.FULL if w is None else Kind.SLIDING_WINDOW for w in windows]
        return _decoder_layers(config, options, max_len, kinds, windows)
    kind = Kind.FULL if window is None else Kind.SLIDING_WINDOW
    return _decoder_layers(config, options, max_len, [kind] * n)


def _read_gemma2(config: Config, options: HfOptions, max_len: int) -> LayerList:
    n = _require_int(config, "num_hidden_layers")
    kinds = _layer_kinds_from_types(config, n) or [
        Kind.SLIDING_WINDOW if i % 2 == 0 else Kind.FULL for i in range(n)
    ]
    return _decoder_layers(config, options, max_len, kinds)


def _read_gemma3(config: Config, options: HfOptions, max_len: int) -> LayerList:
    text = _text_config(config)
    n = _require_int(text, "num_hidden_layers")
    kinds = _layer_kinds_from_types(text, n)
    if kinds is None:
        pattern = int(text.get("sliding_window_pattern") or 6)
        kinds = [Kind.FULL if (i + 1) % pattern == 0 else Kind.SLIDING_WINDOW for i in range(n)]
    return _decoder_layers(config, options, max_len, kinds)


def _read_llama4(config: Config, options: HfOptions, max_len: int) -> LayerList:
    """RoPE layers use chunked local attention; NoPE layers (``no_rope_layers[i] == 0``,
    default every 4th) attend globally."""
    text = _text_config(config)
    n = _require_int(text, "num_hidden_layers")
    kinds = _layer_kinds_from_types(text, n)
    if kinds is None:
        interval = int(text.get("no_rope_layer_interval") or 4)
        use_rope = text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        if len(use_rope) != n:
            raise SpecError(f"no_rope_layers has {len(use_rope)} entries, expected {n}")
        chunked = text.get("attention_chunk_size") is not None
        kinds = [Kind.CHUNKED_LOCAL if rope and chunked else Kind.FULL for rope in use_rope]
    return _decoder_layers(config, options, max_len, kinds)


def mllama_tokens_per_image(vision: Config) -> int:
    """Cross-attention tokens of one image: tiles x (patches + class token).

    Llama 3.2 Vision: 4 x ((560 // 14) ** 2 + 1) = 4 x 1601 = 6404.
    """
    patches = (_require_int(vision, "image_size") // _require_int(vision, "patch_size")) ** 2
    return _require_int(vision, "max_num_tiles") * (patches + 1)


def _read_mllama(config: Config, options: HfOptions, max_len: int) -> LayerList:
    text = _text_config(config)
    n = _require_int(text, "num_hidden_layers")
    cross = set(text.get("cross_attention_layers") or [])
    if not cross <= set(range(n)):
        raise SpecError(f"cross_attention_layers {sorted(cross)} outside 0..{n - 1}")
    layers = _decoder_layers(config, options, max_len, [Kind.FULL] * n)
    vision = config.get("vision_config") or {}
    per_image = mllama_tokens_per_image(vision) if vision else None
    shape, dtype = _attention_shape(text), _dtype_bytes(config, options)
    cross_spec = _attention_layer(
        Kind.CROSS_ATTENTION, shape, dtype, options, tokens_per_image=per_image
    )
    return [(i, cross_spec if i in cross else spec) for i, spec in layers]


def mamba_state_bytes(config: Config, dtype_bytes: int = 2, ssm_dtype_bytes: int = 4) -> int:
    """One layer's Mamba state: conv (d_conv - 1 columns) + SSM (d_state per channel)."""
    d_inner = _require_int(config, "mamba_expand") * _require_int(config, "hidden_size")
    conv = (_require_int(config, "mamba_d_conv") - 1) * d_inner * dtype_bytes
    return conv + d_inner * _require_int(config, "mamba_d_state") * ssm_dtype_bytes


def _jamba_is_attention(config: Config, n: int) -> list[bool]:
    block_types = config.get("layers_block_type")
    if block_types is not None:
        if len(block_types) != n:
            raise SpecError(f"layers_block_type has {len(block_types)} entries, expected {n}")
        return [t == "attention" for t in block_types]
    period = _require_int(config, "attn_layer_period")
    offset = _require_int(config, "attn_layer_offset")
    if not 0 <= offset < period:
        raise SpecError(f"attn_layer_offset {offset} not in [0, attn_layer_period {period})")
    return [i % period == offset for i in range(n)]


def _read_jamba(config: Config, options: HfOptions, max_len: int) -> LayerList:
    n = _require_int(config, "num_hidden_layers")
    is_attention = _jamba_is_attention(config, n)
    dtype = _dtype_bytes(config, options)
    attention = _attention_layer(Kind.FULL, _attention_shape(config), dtype, options)
    mamba = _state_spec(config, options)
    if not options.conv_full_kernel:  # the published vLLM-style figure, unpadded
        state_bytes = mamba_state_bytes(config, dtype, options.ssm_dtype_bytes)
        mamba = dataclasses.replace(mamba, state_bytes=state_bytes)
    return [(i, attention if attn else mamba) for i, attn in enumerate(is_attention)]


def _read_falcon_h1(config: Config, options: HfOptions, max_len: int) -> LayerList:
    """Falcon-H1 runs attention and Mamba2 side by side in every layer."""
    text = _text_config(config)
    if text.get("layer_types") is None:
        n = _require_int(text, "num_hidden_layers")
        config = {**config, "layer_types": ["hybrid"] * n}
    return _read_layer_types(config, options, max_len)


_READERS: dict[str, Callable[[Config, HfOptions, int], LayerList]] = {
    "llama": _read_llama,
    "mistral": _read_mistral,
    "ministral": _read_mistral,
    "gemma2": _read_gemma2,
    "gemma3": _read_gemma3,
    "gemma3_text": _read_gemma3,
    "llama4": _read_llama4,
    "llama4_text": _read_llama4,
    "mllama": _read_mllama,
    "jamba": _read_jamba,
    "falcon_h1": _read_falcon_h1,
    "qwen2": _read_qwen2,
    "llava_onevision": _read_llava_onevision,
}


# -------------------------------------------------------------------- weight bytes

_DENSE_FAMILIES = {"llama", "mistral", "ministral", "gemma2", "gemma3_text", "qwen2"}
_GEMMA_FAMILIES = {"gemma2", "gemma3_text"}
_DENSE_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")


def dense_parameter_count(config: Config) -> int | None:
    """Parameters of a dense decoder from its shapes; None for other families or when a
    shape field (vocab_size, intermediate_size, ...) is missing.

    embeddings (x2 unless tied) + per layer (q, k, v, o, gate/up/down, norms) + final
    norm. Gemma has four norms per layer (Gemma 3 adds q/k norms of head_dim each) and
    ties its embeddings by default; Qwen2 has q/k/v biases. Llama 3.1 8B: 8,030,261,248.
    """
    model_type = str(config.get("model_type"))
    if model_type not in _DENSE_FAMILIES or any(k not in config for k in _DENSE_SHAPE_KEYS):
        return None
    gemma = model_type in _GEMMA_FAMILIES
    hidden = _require_int(config, "hidden_size")
    heads = _require_int(config, "num_attention_heads")
    shape = _attention_shape(config)
    q_width, kv_width = heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    attention = 2 * hidden * q_width + 2 * hidden * kv_width
    if model_type == "qwen2":
        attention += q_width + 2 * kv_width  # q, k, v biases
    mlp = 3 * hidden * _require_int(config, "intermediate_size")
    norms = (4 if gemma else 2) * hidden + (
        2 * shape.head_dim if model_type == "gemma3_text" else 0
    )
    tied = bool(config.get("tie_word_embeddings", gemma))
    embeddings = _require_int(config, "vocab_size") * hidden * (1 if tied else 2)
    return (
        embeddings + _require_int(config, "num_hidden_layers") * (attention + mlp + norms) + hidden
    )


def _dense_weight_bytes(config: Config, options: HfOptions) -> int:
    params = dense_parameter_count(_text_config(config))
    return 0 if params is None else params * _dtype_bytes(config, options)
