"""Per-layer vLLM KV-cache specs of the model styles the integration is tested on.

Small stand-ins with the layer-kind patterns of the real models (dimensions scaled down
so a replay runs in seconds on a CPU): a Llama-style full-attention model, Gemma 2
(sliding and full alternating), Ministral (three sliding layers per full one) and a
Jamba-style hybrid (one attention layer per eight, Mamba elsewhere).

Real-scale geometries (`REAL_CASES`, scheduler side only: no tensor is allocated) with
the published configs' layer counts, KV heads, head dims, windows and, for the state
layers, the state shapes vLLM's own calculators derive from those configs
(`compat.mamba_state_calculators`): Gemma 2 9B, Ministral 8B, Jamba 1.5 Mini, a GPT-OSS
(20B)-like 1:1 sliding(128)/full model and a Qwen3-Next(80B-A3B)-like hybrid with three
gated-delta-net layers per full-attention layer. `vllm_gpu_block_size` gives, for the
state hybrids, the attention block size vLLM's platform code picks on a GPU (it makes
every page as large as the Mamba state); `layer_specs(..., vllm_gpu=True)` builds the
specs vLLM would then use (that block size, the state padded to the attention page).

Cross attention (Llama 3.2 Vision style) has no case: vLLM 0.32 ships no ``mllama``
model and only schedules cross-attention blocks for encoder-decoder models, which the
jenga manager refuses (see `integrations.vllm.specs.SUPPORTED_SPECS`).
"""

from __future__ import annotations

from typing import Any

CASES = ("llama", "gemma2", "ministral", "jamba")
LATENT_CASES = ("deepseek", "deepseek-swa", "deepseek-replay", "sink")
"""MLA (DeepSeek-V3 style: one 576-wide latent per token), MLA with sliding-window MLA
layers between its full ones (cached, or rebuilt by bounded replay after a hit: DeepSeek-V4
style), and static-sink full attention (openPangu style)."""
REAL_CASES = ("gemma2-9b", "ministral-8b", "jamba-1.5-mini", "gpt-oss-20b", "qwen3-next-80b")
ALL_CASES = CASES + REAL_CASES
STATE_CASES = ("jamba", "jamba-1.5-mini", "qwen3-next-80b")
"""Cases with Mamba / gated-delta-net state layers (vLLM raises their attention block size)."""
FLASH_ATTENTION_KERNEL_BLOCK = 16
"""FlashAttention's kernel block alignment in vLLM 0.32 (``MultipleOf(16)``)."""


def layer_specs(
    case: str, *, block_size: int = 16, window: int = 64, vllm_gpu: bool = False
) -> dict[str, Any]:
    """``{layer name: vLLM KVCacheSpec}`` for one case.

    ``vllm_gpu``: for a state hybrid of `REAL_CASES`, the specs vLLM builds on a GPU
    (attention block `vllm_gpu_block_size`, the state padded to the attention page);
    ``block_size`` is then ignored. Real cases ignore ``window`` (their own windows).
    """
    import torch

    if case in REAL_CASES:
        return _real_specs(case, block_size, vllm_gpu)
    if case in LATENT_CASES:
        return _latent_specs(case, block_size, window)

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


def _latent_specs(case: str, block_size: int, window: int) -> dict[str, Any]:
    """`LATENT_CASES`: MLA layers (DeepSeek-V3's latent: 512 + 64 rope), sliding-window
    MLA (cached or bounded-replay) every other layer, or full attention behind two blocks
    of static sink tokens."""
    import torch

    from integrations.vllm import compat

    latent = {"block_size": block_size, "num_kv_heads": 1, "head_size": 576}
    mla = compat.MLAAttentionSpec(**latent, dtype=torch.bfloat16)
    if case == "deepseek":
        return {f"model.layers.{i}.self_attn.attn": mla for i in range(6)}
    if case in ("deepseek-swa", "deepseek-replay"):
        replay = case == "deepseek-replay"  # a hit recomputes the window; never cached
        swa = compat.SlidingWindowMLASpec(
            **latent, dtype=torch.bfloat16, sliding_window=window, bounded_replay=replay
        )
        return {f"model.layers.{i}.self_attn.attn": swa if i % 2 else mla for i in range(6)}
    sink = compat.SinkFullAttentionSpec(
        block_size=block_size,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.float16,
        sink_len=2 * block_size,
    )
    return {f"model.layers.{i}.self_attn.attn": sink for i in range(4)}


# -- real-scale geometries ---------------------------------------------------------------
_REAL_ATTENTION = {  # layers, KV heads, head dim, sliding window, full-attention layer test
    "gemma2-9b": (42, 8, 256, 4096, lambda i: i % 2 == 1),  # google/gemma-2-9b
    "ministral-8b": (36, 8, 128, 32768, lambda i: i % 4 == 3),  # Ministral-8B-Instruct-2410
    "gpt-oss-20b": (24, 8, 64, 128, lambda i: i % 2 == 1),  # openai/gpt-oss-20b
}


def _state_specs(case: str, block_size: int, page_padded: int | None) -> Any:
    """The state layer spec of a state hybrid, from vLLM's own shape/dtype calculators."""
    import torch

    from integrations.vllm.compat import MambaSpec, mamba_state_calculators

    shape, dtype = mamba_state_calculators()
    if case == "jamba-1.5-mini":  # hidden 4096, mamba_expand 2, d_state 16, d_conv 4
        shapes = shape.mamba1_state_shape(1, 2 * 4096, 16, 4)
        dtypes = dtype.mamba1_state_dtype(torch.bfloat16, "auto", "auto")
    else:  # Qwen3-Next: 16 K heads, 32 V heads, head dims 128, conv kernel 4
        shapes = shape.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4)
        dtypes = dtype.gated_delta_net_state_dtype(torch.bfloat16, "auto", "auto")
    return MambaSpec(
        block_size=block_size,
        shapes=tuple(shapes),
        dtypes=tuple(dtypes),
        page_size_padded=page_padded,
        mamba_cache_mode="align",
    )


def _state_layout(case: str) -> tuple[int, int, int, Any]:
    """layers, KV heads, head dim of the attention layers, and the attention-layer test."""
    if case == "jamba-1.5-mini":  # 32 layers, attention every 8th from layer 4
        return 32, 8, 128, lambda i: i % 8 == 4
    return 48, 2, 256, lambda i: i % 4 == 3  # Qwen3-Next: full attention every 4th


def vllm_gpu_block_size(case: str) -> int:
    """The attention block size vLLM 0.32 picks for a state hybrid on a GPU.

    vLLM's ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py): the
    smallest multiple of the kernel block alignment (FlashAttention: 16) whose attention
    page is at least the state page, ``16 * cdiv(state_page, 16 * attention_page_per_token)``.
    """
    layers, heads, head_dim, _ = _state_layout(case)
    del layers
    per_token = heads * head_dim * 2 * 2  # K and V, 2-byte dtype
    state = _state_specs(case, 1, None).page_size_bytes
    align = FLASH_ATTENTION_KERNEL_BLOCK
    return align * -(-state // (align * per_token))


def _real_specs(case: str, block_size: int, vllm_gpu: bool) -> dict[str, Any]:
    import torch

    from integrations.vllm.compat import FullAttentionSpec, SlidingWindowSpec

    if case in _REAL_ATTENTION:
        layers, heads, head_dim, window, is_full = _REAL_ATTENTION[case]
        attn = {"block_size": block_size, "num_kv_heads": heads, "head_size": head_dim}
        full = FullAttentionSpec(**attn, dtype=torch.bfloat16)
        sliding = SlidingWindowSpec(**attn, dtype=torch.bfloat16, sliding_window=window)
        return {
            f"model.layers.{i}.self_attn.attn": full if is_full(i) else sliding
            for i in range(layers)
        }
    layers, heads, head_dim, is_attention = _state_layout(case)
    padded = None
    if vllm_gpu:
        block_size = vllm_gpu_block_size(case)
        padded = block_size * heads * head_dim * 2 * 2
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_dim, dtype=torch.bfloat16
    )
    state = _state_specs(case, block_size, padded)
    return {
        f"model.layers.{i}.{'self_attn.attn' if is_attention(i) else 'mixer'}": (
            full if is_attention(i) else state
        )
        for i in range(layers)
    }
