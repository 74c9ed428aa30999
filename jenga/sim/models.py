"""Model specs for the simulator: the project's presets (`jenga.presets`) plus a Mamba-2 hybrid.

Rationale
    The simulator compares allocators on the models the Jenga paper and today's vLLM
    serve. The project's presets cover the paper's families; the simulator adds one
    model the presets do not have, a Mamba-2 hybrid as vLLM serves it today
    (NVIDIA Nemotron Nano 9B v2), because its page-size unification is where today's
    vLLM and Jenga part ways most. The prefill cost model also needs the query width of
    attention layers, which a `ModelSpec` (KV caches only) does not carry.

Approach
    `get_model(name)` returns a preset or a simulator model; `with_block_size` rewrites
    every attention group's tokens per block (``--block-size``). `ComputeShape` holds
    the query width (heads x head dim, from the model's HF config, else 4 x the KV
    width: the GQA ratio of Llama 3 / Mistral) and counts attention FLOPs of a step.

Limitations
    The Nemotron model is built from its published ``config.json`` fields (cited below),
    not parsed by `jenga.hf` (which has no ``nemotron_h`` reader); MLP layers store no
    cache and are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from jenga import presets
from jenga.sim.needs import group_length, role_of
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec, SpecError, group_layers


class UnknownModel(KeyError):
    """No preset of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# https://huggingface.co/nvidia/NVIDIA-Nemotron-Nano-9B-v2/blob/main/config.json
# ("M" Mamba-2, "*" attention, "-" MLP); 8.89B parameters (model card), bf16.
NEMOTRON_NANO_9B_V2: dict[str, Any] = {
    "model_type": "nemotron_h", "hidden_size": 4480, "intermediate_size": 15680,
    "num_hidden_layers": 56, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 131072,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "mamba_num_heads": 128, "mamba_head_dim": 80, "ssm_state_size": 128, "n_groups": 8,
    "conv_kernel": 4,
}  # fmt: skip
NEMOTRON_PARAMS = 8_890_000_000


def mamba2_state_bytes(config: dict[str, Any], dtype_bytes: int = 2, ssm_bytes: int = 4) -> int:
    """One Mamba-2 layer's state as vLLM stores it (``mamba2_state_shape``): a conv state of
    ``(conv_kernel - 1) x (heads x head_dim + 2 x n_groups x d_state)`` in the model dtype
    and an SSM state of ``heads x head_dim x d_state`` in fp32 (vLLM's NemotronH default)."""
    heads, head_dim = int(config["mamba_num_heads"]), int(config["mamba_head_dim"])
    d_state, groups = int(config["ssm_state_size"]), int(config["n_groups"])
    conv_dim = heads * head_dim + 2 * groups * d_state
    conv = (int(config["conv_kernel"]) - 1) * conv_dim * dtype_bytes
    return conv + heads * head_dim * d_state * ssm_bytes


def nemotron_nano_9b_v2() -> ModelSpec:
    """Nemotron Nano 9B v2: 27 Mamba-2 layers (5,316,608 B of state each) and 4 GQA
    attention layers (8 KV heads x 128), 128K context."""
    cfg = NEMOTRON_NANO_9B_V2
    attention = LayerSpec(Kind.FULL, num_kv_heads=8, head_dim=128)
    mamba = LayerSpec(Kind.MAMBA, state_bytes=mamba2_state_bytes(cfg))
    pattern = str(cfg["hybrid_override_pattern"])
    layers = [(i, attention if c == "*" else mamba) for i, c in enumerate(pattern) if c in "*M"]
    return ModelSpec(
        name="nemotron-nano-9b-v2",
        groups=group_layers(layers),
        max_model_len=int(cfg["max_position_embeddings"]),
        weight_bytes=NEMOTRON_PARAMS * 2,
    )


# The CaR paper's models (docs/reproduction.md, CaR): OPT-13B (facebook/opt-13b config.json:
# 40 layers, 40 heads x 128, 2,048 positions) and Llama-2 7B LongLoRA (Llama-2 7B's shape,
# 32 layers, 32 heads x 128, no GQA, with LongLoRA's 32K context). Both full attention, fp16.
OPT_13B: dict[str, Any] = {
    "num_hidden_layers": 40, "num_attention_heads": 40, "hidden_size": 5120,
    "max_position_embeddings": 2048,
}  # fmt: skip
LLAMA_2_7B_32K: dict[str, Any] = {
    "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
    "max_position_embeddings": 32768,
}  # fmt: skip


def _dense_mha(name: str, cfg: dict[str, Any], params: int) -> ModelSpec:
    """A decoder with every layer full multi-head attention (KV heads = query heads)."""
    heads = int(cfg["num_attention_heads"])
    layer = LayerSpec(Kind.FULL, num_kv_heads=heads, head_dim=int(cfg["hidden_size"]) // heads)
    return ModelSpec(
        name=name,
        groups=group_layers([(i, layer) for i in range(int(cfg["num_hidden_layers"]))]),
        max_model_len=int(cfg["max_position_embeddings"]),
        weight_bytes=params * 2,
    )


_SIM_MODELS: dict[str, Callable[[], ModelSpec]] = {
    "nemotron-nano-9b-v2": nemotron_nano_9b_v2,
    "opt-13b": lambda: _dense_mha("opt-13b", OPT_13B, 12_850_000_000),
    "llama-2-7b-32k": lambda: _dense_mha("llama-2-7b-32k", LLAMA_2_7B_32K, 6_740_000_000),
}
_SIM_CONFIGS: dict[str, dict[str, Any]] = {
    "nemotron-nano-9b-v2": NEMOTRON_NANO_9B_V2,
    "opt-13b": OPT_13B,
    "llama-2-7b-32k": LLAMA_2_7B_32K,
}


def get_model(name: str) -> ModelSpec:
    if name in _SIM_MODELS:
        return _SIM_MODELS[name]()
    try:
        return presets.get(name)
    except (KeyError, SpecError) as exc:
        raise UnknownModel(f"unknown model {name!r}; known: {model_names()}") from exc


def model_names() -> list[str]:
    return [*presets.names(), *_SIM_MODELS]


def with_block_size(model: ModelSpec, block_size: int) -> ModelSpec:
    """``model`` with every attention-kind group at ``block_size`` tokens per block
    (Mamba groups keep theirs: a state is not a token range)."""
    if block_size <= 0:
        raise SpecError(f"block_size must be > 0, got {block_size}")
    groups = tuple(
        g if g.spec.kind is Kind.MAMBA else replace(g, spec=replace(g.spec, block_size=block_size))
        for g in model.groups
    )
    return replace(model, groups=groups)


def _hf_text_config(name: str) -> dict[str, Any] | None:
    if name in _SIM_CONFIGS:
        return _SIM_CONFIGS[name]
    try:
        config = presets.config(name)
    except SpecError:
        return None
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


@dataclass(frozen=True)
class ComputeShape:
    """What the prefill cost model needs beyond the KV specs: the query width."""

    q_width: int  # query heads x head dim of an attention layer

    @classmethod
    def of(cls, model: ModelSpec) -> ComputeShape:
        text = _hf_text_config(model.name)
        if text is not None and "num_attention_heads" in text:
            heads = int(text["num_attention_heads"])
            hidden = int(text.get("hidden_size", 0))
            head_dim = int(text.get("head_dim") or hidden // heads)
            return cls(heads * head_dim)
        kv = [g.spec for g in model.groups if g.spec.kind is not Kind.MAMBA]
        return cls(4 * max((s.num_kv_heads * s.head_dim for s in kv), default=0))

    def attention_flops(self, model: ModelSpec, first: int, end: int, image_tokens: int) -> float:
        """FLOPs of every attention layer for sequence tokens ``[first, end)`` of a request."""
        total = 0
        for g in model.groups:
            pairs = _attended_pairs(g, model, first, end, image_tokens)
            total += pairs * len(g.all_layer_ids)
        return 4.0 * self.q_width * total


def _attended_pairs(g: KVGroup, model: ModelSpec, first: int, end: int, image: int) -> int:
    """(query, key) pairs one layer of ``g`` computes for sequence tokens ``[first, end)``."""
    spec = g.spec
    if spec.kind in (Kind.MAMBA, Kind.VISION_EMBEDDING):
        return 0
    if spec.kind is Kind.CROSS_ATTENTION:  # every text query attends the whole image
        return max(0, end - max(first, image)) * image
    role = role_of(spec, model)
    lo, hi = group_length(role, first, image), group_length(role, end, image)
    if spec.kind is Kind.SLIDING_WINDOW:
        assert spec.window is not None
        w = spec.window
        grow = _sum_range(lo + 1, min(hi, w) + 1) if lo < w else 0  # p + 1 keys while p < w
        return grow + w * max(0, hi - max(lo, w))
    if spec.kind is Kind.CHUNKED_LOCAL:
        assert spec.chunk is not None
        pairs, p = 0, lo
        while p < hi:
            chunk_end = min(hi, (p // spec.chunk + 1) * spec.chunk)
            start = p - (p // spec.chunk) * spec.chunk
            pairs += _sum_range(start + 1, start + 1 + chunk_end - p)
            p = chunk_end
        return pairs
    num, den = spec.token_fraction
    return _sum_range(lo + 1, hi + 1) * num // den


def _sum_range(a: int, b: int) -> int:
    """a + (a + 1) + ... + (b - 1)."""
    return (a + b - 1) * (b - a) // 2 if b > a else 0
