"""Per-layer vLLM KV-cache specs of the model styles the integration is tested on.

Small stand-ins with the layer-kind patterns of the real models (dimensions scaled down
so a replay runs in seconds on a CPU): a Llama-style full-attention model, Gemma 2
(sliding and full alternating), Ministral (three sliding layers per full one) and a
Jamba-style hybrid (one attention layer per eight, Mamba elsewhere).

Cross attention (Llama 3.2 Vision style) has no case: vLLM 0.32 ships no ``mllama``
model and only schedules cross-attention blocks for encoder-decoder models, which the
jenga manager refuses (see `integrations.vllm.layout.SUPPORTED_SPECS`).
"""

from __future__ import annotations

from typing import Any

CASES = ("llama", "gemma2", "ministral", "jamba")


def layer_specs(case: str, *, block_size: int = 16, window: int = 64) -> dict[str, Any]:
    """``{layer name: vLLM KVCacheSpec}`` for one case."""
    import torch

    from integrations.vllm.compat import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    attn = {"block_size": block_size, "num_kv_heads": 8, "head_size": 128, "dtype": torch.float16}
    full = FullAttentionSpec(**attn)
    sliding = SlidingWindowSpec(**attn, sliding_window=window)
    if case == "llama":
        return {f"model.layers.{i}.self_attn.attn": full for i in range(4)}
    if case == "gemma2":
        return {
            f"model.layers.{i}.self_attn.attn": sliding if i % 2 == 0 else full for i in range(8)
        }
    if case == "ministral":
        return {
            f"model.layers.{i}.self_attn.attn": full if i % 4 == 3 else sliding for i in range(8)
        }
    if case == "jamba":
        mamba = MambaSpec(
            block_size=block_size,
            shapes=((3, 4096), (64, 64, 32)),
            dtypes=(torch.float16, torch.float16),
            mamba_cache_mode="align",
        )
        return {
            f"model.layers.{i}.{'self_attn.attn' if i % 8 == 4 else 'mixer'}": (
                full if i % 8 == 4 else mamba
            )
            for i in range(16)
        }
    raise KeyError(f"unknown case {case!r}; cases: {CASES}")
