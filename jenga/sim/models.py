"""Model specs for the simulator: `jenga.presets` when present, else a small local table.

Rationale
    The simulator needs real layer dimensions (kinds, KV heads, head dim, windows) and
    weight bytes. The project's preset module (`jenga.presets`, another branch) is the
    source of truth; until it is merged, this file carries the few models the paper's
    memory figures use, with dimensions from the models' Hugging Face configs.

Approach
    `get_model(name)` asks `jenga.presets.get` first and falls back to `LOCAL_PRESETS`.

Limitations
    The local table is deliberately short (no Mamba, no draft+target pairs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec


class UnknownModel(KeyError):
    """No preset of that name."""


def _groups_by_pattern(
    num_layers: int, kind_of_layer: Callable[[int], LayerSpec], names: dict[LayerSpec, str]
) -> tuple[KVGroup, ...]:
    spec_to_layers: dict[LayerSpec, list[int]] = {}
    for layer in range(num_layers):
        spec_to_layers.setdefault(kind_of_layer(layer), []).append(layer)
    return tuple(KVGroup(names[s], s, tuple(ids)) for s, ids in spec_to_layers.items())


def _interleaved(
    name: str, num_layers: int, heads: int, head_dim: int, window: int, full_every: int,
    full_offset: int, max_len: int, params: float,
) -> ModelSpec:
    """Full attention on layers with ``layer % full_every == full_offset``, sliding elsewhere."""
    full = LayerSpec(Kind.FULL, heads, head_dim)
    swa = LayerSpec(Kind.SLIDING_WINDOW, heads, head_dim, window=window)
    groups = _groups_by_pattern(
        num_layers,
        lambda i: full if i % full_every == full_offset else swa,
        {full: "full", swa: f"sliding_{window}"},
    )
    return ModelSpec(name, groups, max_len, weight_bytes=int(params * 2))


def llama_3_1_8b() -> ModelSpec:
    full = LayerSpec(Kind.FULL, 8, 128)
    return ModelSpec("llama-3.1-8b", (KVGroup("full", full, tuple(range(32))),), 131_072,
                     weight_bytes=int(8.03e9 * 2))


def gemma_2_9b() -> ModelSpec:
    # HF Gemma 2: even layers slide over 4,096 tokens, odd layers attend fully; context 8K.
    return _interleaved("gemma-2-9b", 42, 8, 256, 4096, 2, 1, 8192, 9.24e9)


def gemma_2_27b() -> ModelSpec:
    return _interleaved("gemma-2-27b", 46, 16, 128, 4096, 2, 1, 8192, 27.2e9)


def gemma_3_12b() -> ModelSpec:
    # Gemma 3: five local (1,024-token window) layers per global layer.
    return _interleaved("gemma-3-12b", 48, 8, 256, 1024, 6, 5, 131_072, 12.2e9)


def ministral_8b() -> ModelSpec:
    # Ministral-8B-Instruct-2410: interleaved windows [128K, 32K, 32K, 32K].
    return _interleaved("ministral-8b", 36, 8, 128, 32_768, 4, 0, 131_072, 8.02e9)


def llama_3_2_11b_vision() -> ModelSpec:
    # 40 text layers; cross attention to the image at layers 3, 8, 13, ..., 38.
    self_attn = LayerSpec(Kind.FULL, 8, 128)
    cross = LayerSpec(Kind.CROSS_ATTENTION, 8, 128)
    cross_ids = tuple(range(3, 40, 5))
    self_ids = tuple(i for i in range(40) if i not in cross_ids)
    groups = (KVGroup("self_attn", self_attn, self_ids), KVGroup("cross_attn", cross, cross_ids))
    return ModelSpec("llama-3.2-11b-vision", groups, 131_072, weight_bytes=int(10.67e9 * 2))


LOCAL_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "llama-3.1-8b": llama_3_1_8b,
    "gemma-2-9b": gemma_2_9b,
    "gemma-2-27b": gemma_2_27b,
    "gemma-3-12b": gemma_3_12b,
    "ministral-8b": ministral_8b,
    "llama-3.2-11b-vision": llama_3_2_11b_vision,
}


def _project_presets() -> object | None:
    try:
        return importlib.import_module("jenga.presets")
    except ImportError:
        return None


def get_model(name: str) -> ModelSpec:
    """The model called ``name`` from `jenga.presets`, else from the local table."""
    presets = _project_presets()
    if presets is not None:
        try:
            spec = presets.get(name)  # type: ignore[attr-defined]
        except (KeyError, ValueError):
            spec = None
        if isinstance(spec, ModelSpec):
            return spec
    if name in LOCAL_PRESETS:
        return LOCAL_PRESETS[name]()
    raise UnknownModel(f"unknown model {name!r}; local presets: {sorted(LOCAL_PRESETS)}")


def model_names() -> list[str]:
    presets = _project_presets()
    names = set(LOCAL_PRESETS)
    if presets is not None and hasattr(presets, "names"):
        names.update(presets.names())
    return sorted(names)
