"""Named model presets with real dimensions: ``presets.get(name)``, ``presets.names()``.

Rationale
    The allocator, the simulator and the docs need the same handful of heterogeneous
    models (the Jenga paper's Table 1 and the issue's list) without downloads. Keeping
    them as the models' own ``config.json`` fields, parsed by `jenga.hf`, means a preset
    and a real config can never disagree about how a model is read.

Approach
    `_HF_CONFIGS` holds the cache-shaping fields of each model's HF config (source in a
    comment beside each; values as published on the Hugging Face Hub, not downloaded
    here). Three kinds of presets are built in code: models the Hub has no config for
    (a character.ai-style and a Hymba-like model, described in their authors' posts),
    a PyramidKV-style variant of Llama 3.1 8B, and speculative-decoding pairs
    (`speculative_pair`: the draft's layers get ``model="draft"``).

    Weight bytes: dense families from their shapes (`hf.dense_parameter_count`, exact);
    MoE, Mamba and vision models from the model cards' published totals (rounded, so
    marked "published" below). All weights bf16 (2 bytes per parameter).

Limitations
    The character.ai-style, Hymba-like and PyramidKV-style presets are illustrative:
    their dimensions follow the public descriptions, not released checkpoints. Jenga's
    Table 1 could not be read here (only the paper's abstract was reachable); the list
    covers the model families the paper discusses (sliding window, cross attention,
    Mamba hybrids, vision embeddings, KV sharing, PyramidKV, speculative decoding) plus
    the issue's list.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from jenga.hf import HfOptions, dense_parameter_count, model_spec_from_config
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec, SpecError, group_layers

BF16 = 2

# ------------------------------------------------------------------ HF configs

# https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
_LLAMA_3_1_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
# https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
_LLAMA_3_1_70B = {
    **_LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64,
}  # fmt: skip
# https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
_LLAMA_3_2_1B = {
    **_LLAMA_3_1_8B, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64,
    "tie_word_embeddings": True,
}  # fmt: skip
# https://huggingface.co/google/gemma-2-9b/blob/main/config.json (served in bf16)
_GEMMA_2_9B = {
    "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
    "sliding_window": 4096, "torch_dtype": "bfloat16",
}  # fmt: skip
# https://huggingface.co/google/gemma-2-27b/blob/main/config.json
_GEMMA_2_27B = {
    **_GEMMA_2_9B, "hidden_size": 4608, "intermediate_size": 36864,
    "num_hidden_layers": 46, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128,
}  # fmt: skip
# https://huggingface.co/google/gemma-3-12b-it/blob/main/config.json (text_config)
_GEMMA_3_12B = {
    "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 262208, "max_position_embeddings": 131072,
        "sliding_window": 1024, "sliding_window_pattern": 6,
    },
    "mm_tokens_per_image": 256,
}  # fmt: skip
# https://huggingface.co/mistralai/Ministral-8B-Instruct-2410: config.json gives the shapes;
# its params.json gives the interleaved pattern [None, 32768, 32768, 32768] (1 full : 3
# sliding) and the model card the 128K context, which config.json (32768) does not carry.
_MINISTRAL_8B = {
    "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 131072,
    "sliding_window": [None, 32768, 32768, 32768], "torch_dtype": "bfloat16",
}  # fmt: skip
# https://huggingface.co/meta-llama/Llama-3.2-11B-Vision/blob/main/config.json
_LLAMA_3_2_11B_VISION = {
    "model_type": "mllama", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "mllama_text_model", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072,
        "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
    },
    "vision_config": {"image_size": 560, "patch_size": 14, "max_num_tiles": 4},
}  # fmt: skip
# https://huggingface.co/ai21labs/AI21-Jamba-1.5-Mini/blob/main/config.json
_JAMBA_1_5_MINI = {
    "model_type": "jamba", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
    "expert_layer_offset": 1, "num_experts": 16, "num_experts_per_tok": 2,
    "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
    "vocab_size": 65536, "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
}  # fmt: skip
# https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json
# (no_rope_layers left to its default: every 4th layer is NoPE / global attention)
_LLAMA_4_SCOUT = {
    "model_type": "llama4", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048,
        "max_position_embeddings": 10485760, "attention_chunk_size": 8192,
        "num_local_experts": 16, "interleave_moe_layer_step": 1,
    },
}  # fmt: skip

# https://huggingface.co/llava-hf/llava-onevision-qwen2-7b-ov-hf/blob/main/config.json
# (Qwen2-7B decoder; SigLIP 384 px / 14 px patches -> 729 embeddings per crop)
_LLAVA_ONEVISION_7B = {
    "model_type": "llava_onevision", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152128, "max_position_embeddings": 32768, "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    "vision_config": {"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 14},
}  # fmt: skip

# Published total parameter counts (model cards, rounded) for non-dense models.
_PUBLISHED_PARAMS = {
    "gemma-3-12b": 12_200_000_000,  # 12.2B incl. the SigLIP vision tower
    "llama-3.2-11b-vision": 10_700_000_000,  # 10.7B
    "jamba-1.5-mini": 51_600_000_000,  # 51.6B total, 12B active
    "llama-4-scout": 109_000_000_000,  # 109B total, 17B active
    "llava-onevision-7b": 8_030_000_000,  # 8.03B incl. the SigLIP tower and projector
}

_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.1-70b": _LLAMA_3_1_70B,
    "llama-3.2-1b": _LLAMA_3_2_1B,
    "gemma-2-9b": _GEMMA_2_9B,
    "gemma-2-27b": _GEMMA_2_27B,
    "gemma-3-12b": _GEMMA_3_12B,
    "ministral-8b": _MINISTRAL_8B,
    "llama-3.2-11b-vision": _LLAMA_3_2_11B_VISION,
    "jamba-1.5-mini": _JAMBA_1_5_MINI,
    "llama-4-scout": _LLAMA_4_SCOUT,
    "llava-onevision-7b": _LLAVA_ONEVISION_7B,
}


def config(name: str) -> dict[str, Any]:
    """A copy of the HF config fields a preset is built from."""
    if name not in _HF_CONFIGS:
        raise SpecError(f"preset {name!r} has no HF config; those that do: {sorted(_HF_CONFIGS)}")
    return copy.deepcopy(_HF_CONFIGS[name])


def _from_hf(name: str) -> ModelSpec:
    params = _PUBLISHED_PARAMS.get(name)
    weight = None if params is None else params * BF16
    return model_spec_from_config(_HF_CONFIGS[name], name=name, weight_bytes=weight)


# ------------------------------------------------------------- built in code


def character_ai_like() -> ModelSpec:
    """Character.AI's published recipe (research.character.ai, "Optimizing AI Inference
    at Character.AI", 2024): MQA (1 KV head), sliding window 1024 on 5 of every 6
    layers, and KV shared across 2-3 adjacent local layers and between pairs of global
    layers. Dimensions (36 layers, head dim 128, 32K context) are assumed.

    Per 6 layers b..b+5: locals b (read by b+1, b+2) and b+3 (read by b+4); global b+5.
    Globals pair up: 5 is read by 11, 17 by 23, 29 by 35.
    -> 12 local layers and 3 global layers store a cache; 21 layers read.
    """
    local = LayerSpec(Kind.SLIDING_WINDOW, num_kv_heads=1, head_dim=128, window=1024)
    full = LayerSpec(Kind.FULL, num_kv_heads=1, head_dim=128)
    local_owners, local_readers = [], []
    for base in range(0, 36, 6):
        local_owners += [base, base + 3]
        local_readers += [(base + 1, base), (base + 2, base), (base + 4, base + 3)]
    global_owners = (5, 17, 29)
    global_readers = tuple((owner + 6, owner) for owner in global_owners)
    shape = {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 1,
        "head_dim": 128, "vocab_size": 128256,
    }  # fmt: skip
    return ModelSpec(
        name="character-ai-like",
        groups=(
            KVGroup("sliding_window", local, tuple(local_owners), tuple(local_readers)),
            KVGroup("full", full, global_owners, global_readers),
        ),
        max_model_len=32768,
        weight_bytes=(dense_parameter_count(shape) or 0) * BF16,
    )


def hymba_like() -> ModelSpec:
    """Hymba-1.5B-shaped parallel hybrid (NVIDIA, arXiv 2411.13676; hub config
    nvidia/Hymba-1.5B-Base): every layer runs attention heads and Mamba heads side by
    side; layers 0, 15, 31 attend globally, the rest use a 1024-token window; consecutive
    local layers share KV in pairs. Hidden 1600, 25 heads, 5 KV heads (head dim 64),
    Mamba expand 2, d_state 16, d_conv 4; 8K context. Pairing and context are assumed.
    """
    window = LayerSpec(Kind.SLIDING_WINDOW, num_kv_heads=5, head_dim=64, window=1024)
    full = LayerSpec(Kind.FULL, num_kv_heads=5, head_dim=64)
    d_inner = 2 * 1600
    mamba = LayerSpec(Kind.MAMBA, state_bytes=3 * d_inner * BF16 + d_inner * 16 * 4)
    local_owners, local_readers = [], []
    for run in (range(1, 15), range(16, 31)):
        layers = list(run)
        for i in range(0, len(layers), 2):
            local_owners.append(layers[i])
            if i + 1 < len(layers):
                local_readers.append((layers[i + 1], layers[i]))
    return ModelSpec(
        name="hymba-1.5b-like",
        groups=(
            KVGroup("full", full, (0, 15, 31)),
            KVGroup("sliding_window", window, tuple(local_owners), tuple(local_readers)),
            KVGroup("mamba", mamba, tuple(range(32))),
        ),
        max_model_len=8192,
        weight_bytes=1_520_000_000 * BF16,  # published: 1.52B
    )


# PyramidKV (Cai et al., arXiv 2406.02069) keeps fewer tokens in deeper layers.
PYRAMID_FRACTIONS = ((1, 1), (3, 4), (1, 2), (1, 4))  # layers 0-7, 8-15, 16-23, 24-31


def pyramidkv_llama_3_1_8b() -> ModelSpec:
    """Llama 3.1 8B with a PyramidKV-style budget: the share of a request's tokens each
    layer keeps falls with depth, 1 -> 3/4 -> 1/2 -> 1/4 in quarters of the stack."""
    base = _from_hf("llama-3.1-8b")
    spec = base.groups[0].spec
    layers = [(i, replace(spec, token_fraction=PYRAMID_FRACTIONS[i // 8])) for i in range(32)]
    return replace(base, name="pyramidkv-llama-3.1-8b", groups=group_layers(layers))


def speculative_pair(target: ModelSpec, draft: ModelSpec, name: str | None = None) -> ModelSpec:
    """Target and draft in one ModelSpec; the draft's groups get ``model="draft"`` and a
    ``draft.`` name prefix. Context is the shorter of the two; weights add up."""
    draft_groups = tuple(
        replace(g, name=f"draft.{g.name}", spec=replace(g.spec, model="draft"))
        for g in draft.groups
    )
    return ModelSpec(
        name=name or f"{target.name}+{draft.name}",
        groups=target.groups + draft_groups,
        max_model_len=min(target.max_model_len, draft.max_model_len),
        weight_bytes=target.weight_bytes + draft.weight_bytes,
    )


def _pair(target: str, draft: str) -> Callable[[], ModelSpec]:
    return lambda: speculative_pair(_from_hf(target), _from_hf(draft))


def _hf(name: str) -> Callable[[], ModelSpec]:
    return lambda: _from_hf(name)


_BUILDERS: dict[str, Callable[[], ModelSpec]] = {
    **{name: _hf(name) for name in _HF_CONFIGS},
    "character-ai-like": character_ai_like,
    "hymba-1.5b-like": hymba_like,
    "pyramidkv-llama-3.1-8b": pyramidkv_llama_3_1_8b,
    "llama-3.1-8b+llama-3.2-1b": _pair("llama-3.1-8b", "llama-3.2-1b"),
    "llama-3.1-70b+llama-3.2-1b": _pair("llama-3.1-70b", "llama-3.2-1b"),
    "llama-3.1-70b+llama-3.1-8b": _pair("llama-3.1-70b", "llama-3.1-8b"),
}


def names() -> tuple[str, ...]:
    """Every preset name, in a stable order."""
    return tuple(_BUILDERS)


def get(name: str, *, options: HfOptions | None = None) -> ModelSpec:
    """A fresh ModelSpec for preset `name` (HF-derived presets honour `options`)."""
    if name not in _BUILDERS:
        raise SpecError(f"unknown preset {name!r}; presets: {', '.join(names())}")
    if options is not None and name in _HF_CONFIGS:
        params = _PUBLISHED_PARAMS.get(name)
        weight = None if params is None else params * BF16
        return model_spec_from_config(
            _HF_CONFIGS[name], name=name, options=options, weight_bytes=weight
        )
    return _BUILDERS[name]()
